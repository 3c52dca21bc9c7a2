"""ModelConfig: the shape of a Llama-family decoder, read from a HF config.json.

An architecture is a row of `ARCHITECTURES`: the choices that set it apart from Llama's
decoder (q/k/v biases, a norm of each q and k head). The rest (sizes, RoPE base and scaling,
a tied head) comes from the config itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from specdecode.errors import ModelNotFoundError, UserError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Architecture:
    """What one architecture's decoder block does differently from Llama's.

    hf_class: the Hugging Face model class (config.json `architectures`).
    qkv_bias: q, k and v always have biases (else `attention_bias` in config.json says).
    qk_norm: each q and k head is RMS-normed (its own weight [head_dim]) before RoPE.
    """

    hf_class: str
    qkv_bias: bool = False
    qk_norm: bool = False


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM"),  # Llama 2, 3.x (RoPE scaling "llama3"), SmolLM2
    "mistral": Architecture("MistralForCausalLM"),  # Llama's block (no sliding window here)
    "qwen2": Architecture("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Architecture("Qwen3ForCausalLM", qk_norm=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.x's RoPE frequency scaling (`rope_type` "llama3"): frequencies whose wavelength
    exceeds original_max_position_embeddings / low_freq_factor are divided by `factor`, those
    below original_max_position_embeddings / high_freq_factor kept, and the band between
    blended (`model.transformer.Rotary`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_hf_dict(cls, rope: dict[str, Any]) -> RopeScaling | None:
        """From config.json's `rope_scaling` / `rope_parameters` (None: the default RoPE);
        a kind of scaling other than "llama3" is refused."""
        kind = rope.get("rope_type", rope.get("type"))
        if kind in (None, "default"):
            return None
        if kind != "llama3":
            raise UserError(
                f"unsupported RoPE scaling {rope!r}; supported: the default RoPE and 'llama3'"
            )
        scaling = cls(
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
        if not scaling.factor > 0 or not scaling.high_freq_factor > scaling.low_freq_factor > 0:
            raise UserError(
                f"llama3 RoPE scaling needs factor > 0 and high_freq_factor > low_freq_factor > "
                f"0, got {rope!r}"
            )
        return scaling

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **asdict(self)}


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
    intermediate_size: int  # width of the SwiGLU MLP
    num_layers: int  # decoder blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads % num_kv_heads == 0)
    head_dim: int  # per-head width (usually hidden_size // num_heads)
    rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency
    max_position_embeddings: int = 2048  # context length the model was trained for
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias) add biases to q, k, v
    tie_word_embeddings: bool = False  # output head shares the embedding matrix
    qk_norm: bool = False  # Qwen3: RMSNorm of each q and k head before RoPE
    rope_scaling: RopeScaling | None = None  # Llama 3.x's frequency scaling, or None

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

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (model_type: a key of ARCHITECTURES)."""
        arch = cfg.get("model_type")
        if arch not in ARCHITECTURES:
            raise UserError(
                f"unsupported architecture {arch!r} (config.json model_type); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        window, context = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 2048)
        if cfg.get("use_sliding_window", window is not None) and window and window < context:
            raise UserError(
                f"sliding-window attention (sliding_window={window} < max_position_embeddings="
                f"{context}) is not supported yet; models whose window is null or covers the "
                "context (e.g. Mistral v0.3) run"
            )
        heads = cfg["num_attention_heads"]
        table = ARCHITECTURES[arch]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta") or cfg.get("rope_theta", 10000.0),
            max_position_embeddings=context,
            qkv_bias=table.qkv_bias or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=table.qk_norm,
            rope_scaling=RopeScaling.from_hf_dict(rope),
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
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }
        if not ARCHITECTURES[self.architecture].qkv_bias:
            cfg["attention_bias"] = self.qkv_bias
        if self.architecture in ("llama", "mistral"):
            cfg["mlp_bias"] = False
        if self.architecture in ("mistral", "qwen3"):
            cfg["sliding_window"] = None
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = self.rope_scaling.to_hf_dict()
        return cfg

    def describe(self) -> dict[str, Any]:
        """All fields, for logs and --json output."""
        return asdict(self)
