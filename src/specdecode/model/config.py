"""ModelConfig: the shape of a Llama-family decoder, read from a HF config.json.

An architecture is a row of `ARCHITECTURES`: the choices that set it apart from Llama's
decoder (q/k/v biases, a norm of each q and k head, Gemma's norms, activation and embedding
scale, which layers attend through a sliding window, fused projections). The rest (sizes, RoPE
bases and scaling, the window, a tied head, the soft-caps) comes from the config itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from specdecode.errors import ModelNotFoundError, UserError
from specdecode.model.rope import LongRope, Scaling, rope_scaling

if TYPE_CHECKING:
    pass

T = TypeVar("T")

ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate activation: SwiGLU, GeGLU (tanh GELU)


@dataclass(frozen=True, slots=True)
class Architecture:
    """What one architecture's decoder block does differently from Llama's.

    hf_class: the Hugging Face model class (config.json `architectures`).
    qkv_bias: q, k and v always have biases (else `attention_bias` in config.json says).
    qk_norm: each q and k head is RMS-normed (its own weight [head_dim]) before RoPE.
    gemma: Gemma's block: RMSNorm weights stored as w with the norm multiplying by 1 + w,
        norms around each sublayer's output too, a GeGLU MLP, embeddings times
        sqrt(hidden_size), a query scale (query_pre_attn_scalar) and soft-caps where the
        config gives them (Gemma 2's attention scores and logits).
    local_rope: the sliding-window layers take their own RoPE base (Gemma 3).
    windows: which layers attend through `sliding_window`: "none", "all" (Mistral, Phi-3),
        "from_max_window_layers" (Qwen2/3 with use_sliding_window) or "pattern" (Gemma:
        `layer_types`, else every layer but each `global_every`-th: Gemma 2's every second,
        Gemma 3's every sliding_window_pattern-th, 6 unless given).
    global_every: the "pattern" windows' default period (0: no pattern).
    fused: q|k|v and gate|up are stored as one weight each (`qkv_proj`, `gate_up_proj`:
        Phi-3), split when read.
    """

    hf_class: str
    qkv_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False
    local_rope: bool = False
    windows: str = "none"
    global_every: int = 0
    fused: bool = False


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM"),  # Llama 2, 3.x (RoPE scaling "llama3"), SmolLM2
    "mistral": Architecture("MistralForCausalLM", windows="all"),  # Llama's block
    "qwen2": Architecture("Qwen2ForCausalLM", qkv_bias=True, windows="from_max_window_layers"),
    # MiMo-7B: Qwen2's decoder, with an MTP layer (`heads.mtp`) the "mtp" method drafts with
    "mimo": Architecture("MiMoForCausalLM", qkv_bias=True, windows="from_max_window_layers"),
    "qwen3": Architecture("Qwen3ForCausalLM", qk_norm=True, windows="from_max_window_layers"),
    "gemma2": Architecture("Gemma2ForCausalLM", gemma=True, windows="pattern", global_every=2),
    "gemma3_text": Architecture(
        "Gemma3ForCausalLM",
        qk_norm=True,
        gemma=True,
        local_rope=True,
        windows="pattern",
        global_every=6,
    ),
    "phi3": Architecture("Phi3ForCausalLM", windows="all", fused=True),  # LongRoPE: LongRope
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def _activation(name: str) -> str:
    """Our name for a config's MLP activation (refused with what runs otherwise)."""
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if name not in names:
        raise UserError(f"unsupported MLP activation {name!r}; supported: silu, gelu_pytorch_tanh")
    return names[name]


def _sliding(
    table: Architecture, cfg: dict[str, Any], layers: int, context: int
) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that slide) as the architecture reads config.json. A window that
    covers the context is no window, except for Gemma ("pattern"), whose sliding layers also
    take another RoPE base."""
    window = cfg.get("sliding_window")
    if table.windows == "from_max_window_layers" and not cfg.get("use_sliding_window", False):
        window = None
    if not window or table.windows == "none":
        return None, ()
    if window >= context and table.windows != "pattern":
        return None, ()
    if table.windows == "all":
        sliding = range(layers)
    elif table.windows == "from_max_window_layers":
        sliding = range(cfg.get("max_window_layers", 28), layers)  # transformers' default
    elif cfg.get("layer_types"):
        types = cfg["layer_types"]
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if len(types) != layers or unknown:
            raise UserError(
                f"layer_types must name {layers} layers 'sliding_attention' or "
                f"'full_attention', got {types!r}"
            )
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    else:
        pattern = cfg.get("sliding_window_pattern", table.global_every)
        sliding = [i for i in range(layers) if (i + 1) % pattern]
    if not sliding:
        return None, ()
    return int(window), tuple(sliding)


def _rope_parameters(cfg: dict[str, Any], local: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the full-attention layers' RoPE parameters, the sliding layers' ({} : none given)).
    transformers >= 5 writes `rope_parameters` (for Gemma 3 one dict per layer type); older
    configs `rope_theta` + `rope_scaling`."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if local and "full_attention" in rope:
        return rope["full_attention"], rope.get("sliding_attention") or {}
    return rope, {}


def _local_theta(local: dict[str, Any], cfg: dict[str, Any]) -> float:
    """The RoPE base of Gemma 3's sliding layers (default RoPE only)."""
    if local.get("rope_type", "default") != "default":
        raise UserError(
            f"unsupported RoPE scaling {local!r} of the sliding layers; supported: the default"
        )
    return float(local.get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0))


def read_config_json(path: Path, build: Callable[[dict[str, Any]], T], layout: str) -> T:
    """`build(the parsed path/config.json)`, with clear errors for a missing file (`layout`
    says what the folder should hold), invalid JSON or a missing required field (KeyError)."""
    file = path / "config.json"
    if not file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json; {layout}")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{file} is not valid JSON: {err}") from err
    try:
        return build(cfg)
    except KeyError as err:
        raise UserError(f"{file} lacks the required field {err.args[0]!r}") from err


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder-only transformer."""

    architecture: str  # a key of ARCHITECTURES (HF `model_type`)
    vocab_size: int  # rows of the embedding / output matrices
    hidden_size: int  # d_model
    intermediate_size: int  # width of the gated MLP
    num_layers: int  # decoder blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads % num_kv_heads == 0)
    head_dim: int  # per-head width (usually hidden_size // num_heads)
    rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency
    max_position_embeddings: int = 2048  # context length the model was trained for
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias) add biases to q, k, v
    tie_word_embeddings: bool = False  # output head shares the embedding matrix
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm of each q and k head before RoPE
    rope_scaling: Scaling | None = None  # Llama 3.x's, Phi-3's, linear, or None
    gemma: bool = False  # Gemma's block (see Architecture.gemma)
    activation: str = "silu"  # the MLP's gate activation, one of ACTIVATIONS
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    sliding_layers: tuple[int, ...] = ()  # the layers that attend through the window
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    attention_scale: float | None = None  # scores' scale (None: head_dim ** -0.5)
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (None: none)
    attn_softcap: float | None = None  # attention scores, likewise (Gemma 2; None: none)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.activation not in ACTIVATIONS:
            raise UserError(
                f"unsupported MLP activation {self.activation!r}; supported: "
                f"{', '.join(ACTIVATIONS)}"
            )
        if self.sliding_layers and not (self.sliding_window and self.sliding_window > 0):
            raise UserError(f"sliding layers need a sliding_window > 0, got {self.sliding_window}")
        if not all(0 <= i < self.num_layers for i in self.sliding_layers):
            raise UserError(f"sliding layers must lie in 0..{self.num_layers - 1}")
        for name in ("logit_softcap", "attn_softcap"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise UserError(f"{name} must be > 0 (or None: no soft-cap), got {cap}")

    @property
    def embed_scale(self) -> float:
        """What the embeddings are multiplied by (Gemma: sqrt(hidden_size))."""
        return math.sqrt(self.hidden_size) if self.gemma else 1.0

    @property
    def norm_offset(self) -> float:
        """RMSNorm multiplies by offset + weight (Gemma stores w for 1 + w)."""
        return 1.0 if self.gemma else 0.0

    def stored_parts(self, projection: str) -> list[tuple[str, int]]:
        """The projections a stored weight (name after "model.layers.N.", less ".weight")
        holds, in row order, with their row counts: Phi-3's fused q|k|v and gate|up hold
        several, any other one itself (-1: all its rows)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if projection == "self_attn.qkv_proj":
            return [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)]
        if projection == "mlp.gate_up_proj":
            inter = self.intermediate_size
            return [("mlp.gate_proj", inter), ("mlp.up_proj", inter)]
        return [(projection, -1)]

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to every earlier token)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (model_type: a key of ARCHITECTURES)."""
        arch = cfg.get("model_type")
        if arch not in ARCHITECTURES:
            raise UserError(
                f"unsupported architecture {arch!r} (config.json model_type); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        table = ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        context = cfg.get("max_position_embeddings", 2048)
        window, sliding = _sliding(table, cfg, cfg["num_hidden_layers"], context)
        full, local = _rope_parameters(cfg, table.local_rope)
        scalar = cfg.get("query_pre_attn_scalar") if table.gemma else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=full.get("rope_theta") or cfg.get("rope_theta", 10000.0),
            max_position_embeddings=context,
            qkv_bias=table.qkv_bias or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", table.gemma)),
            qk_norm=table.qk_norm,
            rope_scaling=rope_scaling(full, cfg),
            gemma=table.gemma,
            activation=_activation(cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")),
            sliding_window=window,
            sliding_layers=sliding,
            local_rope_theta=_local_theta(local, cfg) if table.local_rope else None,
            attention_scale=None if scalar in (None, head_dim) else float(scalar) ** -0.5,
            logit_softcap=cfg.get("final_logit_softcapping") if table.gemma else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if table.gemma else None,
        )

    @classmethod
    def from_folder(cls, path: Path) -> ModelConfig:
        """Read `path/config.json`."""
        return read_config_json(
            path,
            cls.from_hf_dict,
            "a model folder needs config.json, *.safetensors and tokenizer.json "
            "(Hugging Face layout)",
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that Hugging Face transformers loads as the same model."""
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture].hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[self.activation],
            "torch_dtype": "bfloat16",
        }
        table = ARCHITECTURES[self.architecture]
        if not table.qkv_bias:
            cfg["attention_bias"] = self.qkv_bias
        if self.architecture in ("llama", "mistral"):
            cfg["mlp_bias"] = False
        if table.windows != "none":
            cfg["sliding_window"] = self.sliding_window
        if table.windows == "from_max_window_layers":
            cfg["use_sliding_window"] = bool(self.sliding_layers)
            cfg["max_window_layers"] = min(self.sliding_layers, default=self.num_layers)
        if table.gemma:
            cfg["hidden_activation"] = cfg.pop("hidden_act")
            cfg["query_pre_attn_scalar"] = (
                self.head_dim if self.attention_scale is None else self.attention_scale**-2
            )
            cfg["layer_types"] = [
                "sliding_attention" if self.window(i) else "full_attention"
                for i in range(self.num_layers)
            ]
            cfg["final_logit_softcapping"] = self.logit_softcap
            cfg["attn_logit_softcapping"] = self.attn_softcap
        if table.local_rope:
            cfg["rope_local_base_freq"] = self.local_rope_theta
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = self.rope_scaling.to_hf_dict()
        if isinstance(self.rope_scaling, LongRope):
            cfg["original_max_position_embeddings"] = (
                self.rope_scaling.original_max_position_embeddings
            )
        return cfg

    def describe(self) -> dict[str, Any]:
        """All fields, for logs and --json output."""
        return asdict(self)
