"""The one seam for weight formats: every projection in the model is built by `make_linear`.

Quantized formats (int8, int4, ...) plug in here later without touching the model code: they
only need to turn a dense weight (and optional bias) into a module mapping
`[..., in_features] -> [..., out_features]`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class DenseLinear(nn.Module):
    """y = x @ W^T + b with the weight kept as given (fp32 or bf16)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [out]

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in] -> [..., out]
        return F.linear(x, self.weight, self.bias)


def make_linear(weight: Tensor, bias: Tensor | None = None) -> nn.Module:
    """Build the projection module for `weight` ([out, in]) and optional `bias` ([out])."""
    return DenseLinear(weight, bias)
