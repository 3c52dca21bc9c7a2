"""Roofline of plain decoding: the bytes one token reads, this machine's read bandwidth, and the
floor in ms/token they give.

Decoding one token reads every weight once (batch 1), so on a CPU its time is bounded below by
bytes / bandwidth. Bytes per token (`bytes_per_token`):
- every projection's stored weight in its format, as the module reports it (`weight_bytes`;
  bf16: 2 bytes per weight; int8: 1 byte plus a 4-byte scale per output channel; int4: half a
  byte plus a scale and an offset per group), and its bias;
- the norms' weights; one row of the embedding; two rows of the RoPE tables;
- the KV cache at `context` cached tokens (keys and values of every layer).
Bandwidth (`bandwidth_read`): a sum over a 1 GiB fp32 tensor, far beyond the caches (a
streaming read), timed by `bench.costs.bench_costs` in the same interleaved rounds as the
passes, so that the floor and the measured pass come from the same minutes (this machine's
bandwidth moves from minute to minute): the share of the floor is a same-run ratio of two
medians. fp32, not bf16: summing bf16 widens every value first, which can make the sum
compute-bound below what the kernels stream (figures for the reference machine:
docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from specdecode.model.rope import Rotary
from specdecode.model.transformer import Transformer

BANDWIDTH_BYTES = 1 << 30


def bytes_per_token(model: Transformer, context: int = 0) -> dict[str, int]:
    """Bytes one decoded token reads: {"weights", "kv_cache", "total"}.

    Example (SmolLM2-135M, bf16, tied head): 30 blocks of linears and norms, one embedding row,
    and the head ([49152, 576] bf16 = 56.6 MB, packed on its own), each as its own read.
    """
    reads: dict[int, int] = {}  # data_ptr -> bytes read (a tensor shared by modules: once)
    projections = 0
    for module in model.modules():
        if _is_projection(module):
            projections += module.weight_bytes
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for t in tensors:
            rows = isinstance(module, nn.Embedding | Rotary)  # one row per token (RoPE: cos, sin)
            read = t.nbytes // t.shape[0] if rows else t.nbytes
            reads[t.data_ptr()] = max(reads.get(t.data_ptr(), 0), read)
    weights = projections + sum(reads.values())
    cfg = model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * model.dtype.itemsize
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def madds_per_token(model: Transformer) -> int:
    """Multiply-adds one token costs in the model's projections (every linear layer, the
    output head included): the sum of in_features * out_features. A pass over T tokens does T
    times as many; attention's are left out (they grow with the context, not with the weights).
    """
    return sum(m.in_features * m.out_features for m in model.modules() if _is_projection(m))


def _is_projection(module: nn.Module) -> bool:
    """Whether `module` is a projection (a linear layer), in whatever format it is stored:
    every one reports its `weight_bytes`, `in_features` and `out_features`."""
    return hasattr(module, "weight_bytes")


def bandwidth_read(nbytes: int = BANDWIDTH_BYTES) -> Callable[[], None]:
    """A callable that sums `nbytes` of fp32 (allocated here) once: a streaming read far beyond
    the caches, whose seconds give the read bandwidth, nbytes / seconds."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)

    @torch.inference_mode()
    def read() -> None:
        x.sum()

    return read


def roofline(
    model: Transformer, context: int, bandwidth_gb_s: float, measured_ms: float
) -> dict[str, Any]:
    """The floor of one decode step at `context` cached tokens and how close `measured_ms`
    (a measured 1-token step) comes: share_of_floor = floor / measured (1.0 = at the floor)."""
    nbytes = bytes_per_token(model, context)
    floor_ms = nbytes["total"] / (bandwidth_gb_s * 1e9) * 1e3
    return {
        "format": model.quantization or str(model.dtype).removeprefix("torch."),
        "bytes_per_token": nbytes,
        "bandwidth_gb_s": bandwidth_gb_s,
        "floor_ms": floor_ms,
        "measured_ms": measured_ms,
        "share_of_floor": floor_ms / measured_ms,
    }


def roofline_text(roof: dict[str, Any]) -> str:
    """One line: the floor of a 1-token step and how close the measured pass comes."""
    nbytes = roof["bytes_per_token"]
    return (
        f"roofline ({roof['format']}): {nbytes['weights'] / 1e6:.0f} MB of weights + "
        f"{nbytes['kv_cache'] / 1e6:.1f} MB of KV cache per token at "
        f"{roof['bandwidth_gb_s']:.1f} GB/s = floor {roof['floor_ms']:.1f} ms; the 1-token pass "
        f"takes {roof['measured_ms']:.1f} ms ({roof['share_of_floor']:.0%} of the floor speed)"
    )
