"""`speculative_config`, shaped like vLLM's: which drafter, how many tokens per draft."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specdecode.model.quant import parse_quantization

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 64  # the engine keeps this many spare cache slots for drafts
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "draft_model": {"method", "model", "num_speculative_tokens", "quantization"},
}


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """A validated speculative configuration.

    method: "ngram" (prompt lookup) or "draft_model" (a small model with the same vocabulary).
    num_speculative_tokens: K, the longest draft per step (1..64).
    model: the draft model (alias, folder or .gguf) for "draft_model".
    quantization: the draft model's weight format ("none", "int8", "int4"); None = the
        target's format.
    prompt_lookup_max / prompt_lookup_min: n-gram sizes tried, longest first, for "ngram".
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    quantization: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> SpecConfig:
        """Parse vLLM's forms: {"method": "ngram", "num_speculative_tokens": 8,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": "qwen2.5-coder-0.5b",
        "num_speculative_tokens": 4} (a "model" without "method" means "draft_model")."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(cfg).__name__}")
        method = cfg.get("method", "draft_model" if "model" in cfg else None)
        if method not in METHODS:
            raise ValueError(
                f"speculative_config method {method!r} is not supported; use one of "
                f"{', '.join(METHODS)} (or give 'model' for a draft model)"
            )
        unknown = sorted(set(cfg) - _KEYS[method])
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {unknown} for method {method!r}; "
                f"allowed: {sorted(_KEYS[method])}"
            )
        if "num_speculative_tokens" not in cfg:
            raise ValueError("speculative_config needs num_speculative_tokens (1..64)")
        if method == "draft_model" and not isinstance(cfg.get("model"), str):
            raise ValueError("a draft_model speculative_config needs 'model' (alias or path)")
        fields = {k: v for k, v in cfg.items() if k != "method"}
        return cls(method=method, **fields)

    def __post_init__(self) -> None:
        if self.quantization is not None:
            parse_quantization(self.quantization)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must be ints with "
                f"1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
