"""RoPE: the base frequencies, the scalings a config may name (Llama 3.x's "llama3", Phi-3's
"longrope", "linear", "yarn"), and `Rotary`, the cos/sin tables a model's attention reads.

A scaling maps positions and the unscaled frequencies to angles (`angles`), and may multiply
cos and sin by a constant (`attention_factor`); `rope_scaling` reads one from config.json.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from specdecode.errors import UserError


def base_frequencies(theta: float, head_dim: int) -> Tensor:
    """RoPE's unscaled frequencies [head_dim / 2], float64: theta^(-2i / head_dim)."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.x's RoPE frequency scaling (`rope_type` "llama3"): frequencies whose wavelength
    exceeds original_max_position_embeddings / low_freq_factor are divided by `factor`, those
    below original_max_position_embeddings / high_freq_factor kept, and the band between
    blended (`Rotary`, below)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_hf_dict(cls, rope: dict[str, Any]) -> RopeScaling:
        """From config.json's `rope_scaling` / `rope_parameters` of rope_type "llama3"."""
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

    def frequencies(self, inv_freq: Tensor) -> Tensor:
        """The scaled RoPE frequencies ([D / 2]) of the unscaled ones: long wavelengths
        (beyond the original context / low_freq_factor) slowed down `factor` times, short ones
        (below the original context / high_freq_factor) kept, and the band between blended
        linearly in original context / wavelength."""
        context = self.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        low, high = self.low_freq_factor, self.high_freq_factor
        blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long
        return inv_freq * (blend + (1.0 - blend) / self.factor)

    def angles(self, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """RoPE's angles [P, D / 2] at `positions` ([P]) for the unscaled frequencies."""
        return positions[:, None] * self.frequencies(inv_freq)[None, :]

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (none here)."""
        return 1.0


@dataclass(frozen=True, slots=True)
class LongRope:
    """Phi-3's LongRoPE (`rope_type` "longrope"): each frequency divided by its short factor at
    positions below original_max_position_embeddings and by its long factor from there on,
    cos and sin multiplied by attention_factor (by default sqrt(1 + ln(s) / ln(original)),
    s = max_position_embeddings / original).

    Hugging Face picks one set for a whole pass by the sequence's length (and its `generate`
    recomputes the cache with the long set once the sequence outgrows the original context);
    a cache shared by speculation needs a token's rotation to depend on its position only, so
    here a cached token keeps the set of its position, as vLLM keeps cached keys. Within the
    original context both are the short set."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    @classmethod
    def from_hf_dict(cls, rope: dict[str, Any], cfg: dict[str, Any]) -> LongRope:
        """From `rope_scaling` / `rope_parameters` and config.json's own fields (Phi-3 keeps
        original_max_position_embeddings at the top level)."""
        original = rope.get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings"
        )
        if not original:
            raise UserError(
                f"longrope RoPE scaling needs original_max_position_embeddings: {rope!r}"
            )
        short, long = (
            tuple(map(float, rope["short_factor"])),
            tuple(map(float, rope["long_factor"])),
        )
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if len(short) != head_dim // 2 or len(long) != head_dim // 2:
            raise UserError(
                f"longrope needs {head_dim // 2} short and long factors (head_dim / 2), got "
                f"{len(short)} and {len(long)}"
            )
        factor = rope.get("factor") or cfg.get("max_position_embeddings", original) / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            )
        return cls(short, long, int(original), float(attention))

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "rope_type": "longrope",
            "short_factor": list(self.short_factor),
            "long_factor": list(self.long_factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "attention_factor": self.attention_factor,
        }

    def angles(self, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """RoPE's angles [P, D / 2] at `positions` ([P]): the short set below the original
        context, the long set from there on."""
        short = positions[:, None] * (inv_freq / inv_freq.new_tensor(self.short_factor))[None, :]
        long = positions[:, None] * (inv_freq / inv_freq.new_tensor(self.long_factor))[None, :]
        return short.where(positions[:, None] < self.original_max_position_embeddings, long)


@dataclass(frozen=True, slots=True)
class LinearRope:
    """Linear RoPE scaling (`rope_type` "linear", position interpolation): every frequency
    divided by `factor`, i.e. positions compressed `factor` times (Gemma 3 4B and larger on
    their global layers, factor 8)."""

    factor: float

    @classmethod
    def from_hf_dict(cls, rope: dict[str, Any]) -> LinearRope:
        """From config.json's `rope_scaling` / `rope_parameters` of rope_type "linear"."""
        factor = float(rope.get("factor", 0.0))
        if not factor > 0:
            raise UserError(f"linear RoPE scaling needs a factor > 0, got {rope!r}")
        return cls(factor)

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": "linear", "factor": self.factor}

    def angles(self, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """RoPE's angles [P, D / 2] at `positions` ([P]) for the unscaled frequencies."""
        return positions[:, None] * (inv_freq / self.factor)[None, :]

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (none here)."""
        return 1.0


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN (`rope_type` "yarn", Peng et al. 2023; Qwen2.5 / Qwen3 past their native context):
    a frequency that turns more than `beta_fast` times over the original context is kept, one
    that turns fewer than `beta_slow` times is divided by `factor`, and those between are
    blended linearly in their index (the bounds rounded outwards: `truncate`); cos and sin are
    multiplied by attention_factor (by default 0.1 ln(factor) + 1). As transformers and
    llama.cpp compute it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    @classmethod
    def from_hf_dict(cls, rope: dict[str, Any], cfg: dict[str, Any]) -> Yarn:
        """From `rope_scaling` / `rope_parameters` of rope_type "yarn" (the original context
        from the top level or max_position_embeddings where the dict has none, as
        transformers reads it)."""
        original = (
            rope.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings")
        )
        factor = rope.get("factor")
        if factor is None and original:
            factor = cfg.get("max_position_embeddings", original) / original
        if not original or factor is None or factor < 1.0:
            raise UserError(
                f"yarn RoPE scaling needs a factor >= 1 and original_max_position_embeddings: "
                f"{rope!r}"
            )
        if rope.get("mscale") or rope.get("mscale_all_dim"):
            raise UserError(
                f"yarn's mscale / mscale_all_dim (DeepSeek's) are not supported: {rope!r}"
            )
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0
        return cls(
            float(factor),
            int(original),
            float(rope.get("beta_fast") or 32.0),
            float(rope.get("beta_slow") or 1.0),
            float(attention),
            bool(rope.get("truncate", True)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": "yarn", **asdict(self)}

    def _bound(self, rotations: float, inv_freq: Tensor) -> float:
        """The (fractional) index of the frequency that turns `rotations` times over the
        original context, for frequencies base^(-i / (D / 2)) (i = 0 .. D / 2 - 1)."""
        turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
        return math.log(turns) / -math.log(float(inv_freq[1] / inv_freq[0]))

    def frequencies(self, inv_freq: Tensor) -> Tensor:
        """The scaled frequencies ([D / 2]) of the unscaled ones."""
        half = len(inv_freq)
        low, high = self._bound(self.beta_fast, inv_freq), self._bound(self.beta_slow, inv_freq)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, 2 * half - 1)
        span = high - low if high != low else 0.001
        ramp = ((torch.arange(half, dtype=inv_freq.dtype) - low) / span).clamp(0.0, 1.0)
        return inv_freq / self.factor * ramp + inv_freq * (1.0 - ramp)  # 0: kept, 1: divided

    def angles(self, positions: Tensor, inv_freq: Tensor) -> Tensor:
        """RoPE's angles [P, D / 2] at `positions` ([P]) for the unscaled frequencies."""
        return positions[:, None] * self.frequencies(inv_freq)[None, :]


Scaling = RopeScaling | LongRope | LinearRope | Yarn  # what a ModelConfig may hold


def rope_scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> Scaling | None:
    """config.json's RoPE scaling (`rope_scaling` / `rope_parameters`): None for the default
    RoPE, "llama3", "longrope", "linear" and "yarn" read, anything else (and a partial
    rotation) refused."""
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UserError(
            f"partial_rotary_factor {partial} is not supported; every dimension rotates"
        )
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling.from_hf_dict(rope)
    if kind == "longrope":
        return LongRope.from_hf_dict(rope, cfg)
    if kind == "linear":
        return LinearRope.from_hf_dict(rope)
    if kind == "yarn":
        return Yarn.from_hf_dict(rope, cfg)
    raise UserError(
        f"unsupported RoPE scaling {rope!r}; supported: the default RoPE, 'llama3', 'longrope', "
        "'linear' and 'yarn'"
    )


class Rotary(nn.Module):
    """RoPE (rotate-half convention) with cos/sin tables kept in fp32 whatever the model dtype."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        scaling: Scaling | None = None,
    ) -> None:
        super().__init__()
        inv_freq = base_frequencies(theta, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float64)  # [P]
        if scaling is None:
            angles = torch.outer(positions, inv_freq)  # [P, D / 2]
        else:
            angles = scaling.angles(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1).float()  # [P, D]
        cos, sin = angles.cos(), angles.sin()  # [P, D] fp32
        if scaling is not None and scaling.attention_factor != 1.0:  # LongRoPE's, in fp32
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: Tensor, dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        """cos, sin for `positions` ([B, T]): [B, T, D] fp32 for the native RoPE kernel
        (dtype None), or [B, 1, T, D] in `dtype` for `_rotate`."""
        cos, sin = self.cos[positions], self.sin[positions]  # [B, T, D] fp32
        if dtype is None:
            return cos, sin
        return cos[:, None].to(dtype), sin[:, None].to(dtype)
