"""RMSNorm as the reference implementations compute it (fp32 inside), with Gemma's 1 + w."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specdecode import kernels


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like the reference implementations (one native
    call on the CPU, where `specdecode.kernels` builds; torch ops elsewhere).

    offset: Gemma's convention, the norm multiplies by offset + weight (1 + w); that factor is
    kept in fp32 and applied before rounding to x's dtype, as Gemma's reference does (Llama's
    rounds first, then multiplies by the weight in x's dtype).
    """

    def __init__(self, weight: Tensor, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        if offset:
            weight = weight.float() + offset  # [D] fp32
        self.weight = nn.Parameter(weight, requires_grad=False)  # [D]
        self.eps = eps
        self.round_first = not offset
        native_dtype = weight.dtype in (torch.float32, torch.bfloat16)
        self.native = weight.device.type == "cpu" and native_dtype and kernels.available()

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether the native kernel computes this norm for x of `dtype`: x in the weight's
        dtype, or bf16 x under an offset's fp32 weight (which the kernel applies before
        rounding, as below)."""
        offset_bf16 = not self.round_first and dtype == torch.bfloat16
        return self.native and (dtype == self.weight.dtype or offset_bf16)

    def forward(self, x: Tensor) -> Tensor:  # x: [..., D]
        if self.takes(x.dtype):
            return kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.round_first:
            return self.weight * x32.to(x.dtype)
        return (x32 * self.weight).to(x.dtype)
