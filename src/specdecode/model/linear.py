"""The one seam for weight formats: every projection in the model is built by `make_linear`.

bf16 weights on the CPU get `Bf16Linear` (specdecode's own kernel), or `PackedLinear` (oneDNN)
where that cannot be built; other dense weights get `DenseLinear`. Quantized formats
(`specdecode.model.quant`) turn the dense weight (and optional bias) into a module mapping
`[..., in_features] -> [..., out_features]` the same way, so the model code never changes.
Every module says whether it is `row_exact`: a token's output bit for bit independent of the
other tokens in the pass (what makes verification exact against 1-token decode steps).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode import kernels
from specdecode.model.gguf_linear import GgufLinear, GgufWeight
from specdecode.model.quant import quantized_linear


class DenseLinear(nn.Module):
    """y = x @ W^T + b with the weight kept as given (fp32, or bf16 off the CPU)."""

    row_exact = False  # BLAS may block a pass of several rows differently from one row

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [out]

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in] -> [..., out]
        return F.linear(x, self.weight, self.bias)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def weight_bytes(self) -> int:
        """Bytes a pass reads: the weight and the bias."""
        return sum(t.nbytes for t in self.parameters())


class PackedLinear(nn.Module):
    """bf16 y = x @ W^T + b with W pre-packed once into oneDNN's blocked layout (CPU).

    This is the kernel torch.compile's CPU weight-freezing pass uses; it is faster than
    `F.linear` for decode-sized passes with identical outputs (figures:
    docs/history/formats-and-kernels-issues-5-17.md).
    The dense weight is dropped after packing, so memory does not grow.
    """

    row_exact = False

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # opaque oneDNN [out, in]
        self.bias = bias  # [out] or None

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight_bytes(self) -> int:
        """Bytes a pass reads: the bf16 weight and the bias."""
        bias = 0 if self.bias is None else self.bias.nbytes
        return self.out_features * self.in_features * 2 + bias


class Bf16Linear(nn.Module):
    """bf16 y = x @ W^T + b with specdecode's CPU kernel (`specdecode.kernels`): products summed
    in fp32 in one fixed order per output, so it is row-exact. It reads the weights faster than
    oneDNN for passes of up to ~9 tokens and is ~10% slower for long (prefill) passes
    (docs/history/formats-and-kernels-issues-5-17.md has the figures).
    """

    row_exact = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = kernels.pack(weight, kernels.BF16_PACK)  # [Np / 64, Kp / 2, 64, 2] bf16
        self.bias = None if bias is None else bias.float()  # [out] fp32
        self.projection = kernels.bf16_projection(self.packed, self.bias, self.out_features)

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in] -> [..., out]
        return self.projection(x)

    @property
    def weight_bytes(self) -> int:
        """Bytes a pass reads: the packed bf16 weight and the bias."""
        return self.packed.nbytes + (0 if self.bias is None else self.bias.nbytes)


@cache
def _onednn_bf16() -> bool:
    """Whether this CPU build has oneDNN with bf16 support (AVX-512 BF16 / AMX machines)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def make_linear(
    weight: Tensor | GgufWeight, bias: Tensor | None = None, quantization: str | None = None
) -> nn.Module:
    """Build the projection module for `weight` ([out, in]) and optional `bias` ([out]): GGUF
    blocks run as they are; a dense weight in its dtype (`quantization` None) or a quantized
    format ("int8" | "int4" | "gguf", see `model.quant`)."""
    if isinstance(weight, GgufWeight):
        return GgufLinear.from_blocks(weight, bias)
    if quantization is not None:
        return quantized_linear(weight, bias, quantization)
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        if kernels.available():
            return Bf16Linear(weight, bias)
        if _onednn_bf16():
            return PackedLinear(weight, bias)
    return DenseLinear(weight, bias)
