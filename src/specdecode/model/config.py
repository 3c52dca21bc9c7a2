"""ModelConfig: the shape of a Llama-family decoder (Llama, Qwen2), read from a HF config.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from specdecode.errors import ModelNotFoundError, UserError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
T = TypeVar("T")


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

    architecture: str  # "llama" or "qwen2" (HF `model_type`)
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
        """Build from a Hugging Face config.json dict (model_type llama or qwen2)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"unsupported architecture {arch!r} (config.json model_type); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type")) not in (None, "default"):
            raise UserError(
                f"unsupported RoPE scaling {rope!r}; only the default RoPE is supported"
            )
        if cfg.get("use_sliding_window"):
            raise UserError("sliding-window attention (use_sliding_window=true) is not supported")
        heads = cfg["num_attention_heads"]
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
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
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
        arch_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        cfg = {
            "architectures": [arch_class[self.architecture]],
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
        if self.architecture == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        return cfg

    def describe(self) -> dict[str, Any]:
        """All fields, for logs and --json output."""
        return asdict(self)
