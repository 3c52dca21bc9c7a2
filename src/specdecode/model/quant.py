"""Quantized weight formats for the model's projections (`make_linear(..., quantization=...)`).

- "int8": dynamic int8. Weights: symmetric int8, one scale per output channel. Activations:
  quantized on the fly, one scale (absmax / 127) per token. Kernel: specdecode's own
  (`specdecode.kernels`, integer dot products: AVX-512 VNNI, AVX2 or portable C++), whose
  integer sums are exact: each token gets bit for bit what a 1-token step gives it, whatever
  else is in the pass, so verifying K + 1 tokens is exact against plain decoding.
- "gguf": the GGUF file's own blocks (Q4_0 ... Q6_K), int8 activations quantized as llama.cpp
  quantizes them (per 32 or 256 values; `model/gguf_linear.py`, `kernels/gguf.cpp`); weights
  that come dense take int8. "auto" (`AUTO`, the default of `LLM` and the CLI) is resolved at
  load time (`model.loading.load_model`) to "gguf" or None.
- "q4_0", "q4_1", "q5_0", "q5_1", "q8_0" (`REQUANTIZED`): the dense weights requantized into
  GGUF blocks of that type as the model loads (llama.cpp's reference rounding), then run as
  "gguf" runs a file's blocks, the output head in the same type. What a cheap draft model
  takes: a 0.5B draft in "q4_0" reads 4.5 bits a weight where its GGUF file has Q5_0 blocks
  and a Q8_0 head.
- "int4": weight-only int4. Weights: 4-bit with a scale and an offset per group of `INT4_GROUP`
  input channels (asymmetric). Activations stay in the model's dtype; the kernel
  (`aten._weight_int4pack_mm_for_cpu`) dequantizes groups as it multiplies.

Their speed per matrix (`benchmarks/linear_formats.py`) is in
docs/history/formats-and-kernels-issues-5-17.md.

Every format is a module mapping [..., in] -> [..., out] in the activations' dtype, with
`dequantized()` (the [out, in] fp32 weight it stands for), `weight_bytes` (what one pass reads)
and `row_exact` (whether a token's output is independent of the rest of the pass). All the
kernels run on the CPU; another device gets a clear error.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specdecode import kernels
from specdecode.errors import UserError
from specdecode.model.gguf_linear import REQUANTIZED, GgufLinear, requantize

QUANTIZATIONS = ("int8", "int4", "gguf", *REQUANTIZED)
# The default: "gguf" for a model with a GGUF file whose block types all have kernels, on the
# CPU, in bfloat16 or float32 (the fastest format that keeps the file's quality); else None.
AUTO = "auto"
INT4_GROUP = 128  # input channels per int4 scale/offset (llama.cpp's Q4_K uses 32 per sub-block)
INT4_MIN_GROUP = 32
_INT4_TILES = 2  # `inner_k_tiles` of the CPU int4 packing
_TINY = 1e-8  # floor of a scale, so an all-zero row or group does not divide by zero


def parse_quantization(quantization: str | None) -> str | None:
    """None | "none" -> None (the model's dtype); "auto", "int8", "int4", "gguf" as they are."""
    if quantization is None or quantization == "none":
        return None
    if quantization in (AUTO, *QUANTIZATIONS):
        return quantization
    allowed = ", ".join([AUTO, "none", *QUANTIZATIONS])
    raise UserError(f"unknown quantization {quantization!r}; allowed: {allowed}")


def _check_cpu(weight: Tensor, quantization: str) -> None:
    if weight.device.type != "cpu":
        raise UserError(
            f"quantization {quantization!r} has CPU kernels only; the weights are on "
            f"{weight.device} (use device='cpu', or quantization=None there)"
        )


class Int8DynamicLinear(nn.Module):
    """y = int8(x / sx) @ int8(W / sw)^T * sx * sw + b: sx per token, sw per output channel."""

    row_exact = True

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        _check_cpu(weight, "int8")
        self.out_features, self.in_features = weight.shape
        w = weight.float()  # [out, in]
        scale = w.abs().amax(1).clamp(min=_TINY) / 127  # [out]
        q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # [out, in]
        packed = kernels.pack(q, kernels.INT8_PACK)  # [Np / 64, Kp / 4, 64, 4]
        rows = packed.shape[0] * kernels.ROWS
        self.register_buffer("packed", packed)
        self.register_buffer("scale", _pad(scale, rows))  # [Np] fp32
        self.register_buffer("row_sum", _pad(q.sum(1, dtype=torch.int32), rows))  # [Np] int32
        self.register_buffer("bias", None if bias is None else bias.float())  # [out] fp32
        # one native object over these buffers (a clear error now if the kernels cannot build)
        self.projection = kernels.int8_projection(
            self.packed, self.scale, self.row_sum, self.bias, self.out_features
        )

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in] -> [..., out]
        return self.projection(x)

    def dequantized(self) -> Tensor:
        """The [out, in] fp32 weight this module multiplies by."""
        q = kernels.unpack(self.packed, self.out_features, self.in_features)
        return q.float() * self.scale[: self.out_features, None]

    @property
    def weight_bytes(self) -> int:
        """Bytes a pass reads: packed int8 weights, scales, row sums and bias."""
        tensors = [self.packed, self.scale, self.row_sum]
        return sum(t.nbytes for t in tensors) + (0 if self.bias is None else self.bias.nbytes)


def _pad(values: Tensor, length: int) -> Tensor:
    """values [n] zero-padded to [length]."""
    return torch.cat([values, values.new_zeros(length - values.shape[0])])


def int4_group(in_features: int) -> int:
    """The group size for `in_features`: INT4_GROUP, or the largest smaller power of two
    (>= INT4_MIN_GROUP) dividing it; a clear error when none does."""
    group = INT4_GROUP
    while group >= INT4_MIN_GROUP:
        if in_features % group == 0:
            return group
        group //= 2
    raise UserError(
        f"int4 needs in_features divisible by {INT4_MIN_GROUP}, got {in_features}; "
        "use quantization='int8' or None for this model"
    )


class Int4Linear(nn.Module):
    """Weight-only int4: y = x @ W^T + b, W = q * scale + low per group of input channels."""

    row_exact = True  # the kernel computes each activation row by itself

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        _check_cpu(weight, "int4")
        out_features, in_features = weight.shape
        self.group = int4_group(in_features)
        w = weight.float().view(out_features, in_features // self.group, self.group)
        low = w.amin(-1, keepdim=True)  # [out, G, 1]
        scale = ((w.amax(-1, keepdim=True) - low) / 15).clamp(min=_TINY)  # [out, G, 1]
        q = ((w - low) / scale).round().clamp(0, 15).to(torch.int32).view(out_features, -1)
        # The kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale.
        scales_zeros = torch.cat([scale, low + 8 * scale], -1)  # [out, G, 2] fp32
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INT4_TILES)
        self.register_buffer("packed", packed)  # opaque uint8 layout of q
        # [G, out, 2] in the activations' dtype (the model's), as the kernel wants
        self.register_buffer(
            "scales_zeros", scales_zeros.transpose(0, 1).to(weight.dtype).contiguous()
        )
        self.register_buffer("bias", bias)  # [out] or None
        self.out_features, self.in_features = out_features, in_features

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [M, in], the model's dtype
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group, self.scales_zeros
        )
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def weight_bytes(self) -> int:
        """Bytes a pass reads: packed nibbles, scales and offsets, bias."""
        tensors = [self.packed, self.scales_zeros] + ([] if self.bias is None else [self.bias])
        return sum(t.nbytes for t in tensors)

    def dequantized(self) -> Tensor:
        """The [out, in] fp32 weight this module multiplies by (recovered through the kernel)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)  # [in, in]
        sz = self.scales_zeros.float().contiguous()
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, sz)
        return w_t.t().contiguous()  # [out, in]


def quantized_linear(weight: Tensor, bias: Tensor | None, quantization: str) -> nn.Module:
    """The module of format `quantization` ("int8" | "int4" | "gguf" | a `REQUANTIZED` block
    type such as "q4_0") for the dense `weight` ([out, in]). "gguf" runs a GGUF file's blocks
    (`model.gguf_linear`); a weight that comes dense (a trained head) takes int8 under it. A
    block type requantizes the weight into GGUF blocks of that type."""
    if quantization in REQUANTIZED:
        _check_cpu(weight, quantization)
        return GgufLinear.from_blocks(requantize(weight, REQUANTIZED[quantization]), bias)
    if quantization in ("int8", "gguf"):
        return Int8DynamicLinear(weight, bias)
    if quantization == "int4":
        return Int4Linear(weight, bias)
    raise UserError(f"unknown quantization {quantization!r}; allowed: {', '.join(QUANTIZATIONS)}")
