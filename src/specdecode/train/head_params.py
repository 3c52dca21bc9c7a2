"""The parameters every trainable head keeps: fp32 tensors under the head folder's names."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def param_key(name: str) -> str:
    """A tensor name as a ParameterDict key (no dots)."""
    return name.replace(".", "__")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in fp32, scaled by `weight`, back in x's dtype ([..., h] -> [..., h])."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class HeadParameters(nn.Module):
    """A head's trainable tensors (fp32 copies of `weights` for every name of `shapes` but
    "d2t") and its draft-to-target offsets (`d2t` buffer, int64).

    Args:
        shapes: the head's tensor names -> shapes (the folder's names, "d2t" included).
        weights: initial tensors under those names.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, Tensor]):
        super().__init__()
        self._names = [name for name in shapes if name != "d2t"]
        self.params = nn.ParameterDict(
            {
                param_key(name): nn.Parameter(weights[name].detach().float().clone())
                for name in self._names
            }
        )
        self.register_buffer("d2t", weights["d2t"].long().clone())

    def p(self, name: str) -> Tensor:
        """The parameter named `name` (the folder's name)."""
        return self.params[param_key(name)]

    def linear(self, x: Tensor, weight: str) -> Tensor:
        """x @ W^T (+ the bias where the head has one), W the parameter named `weight`."""
        bias = param_key(weight.removesuffix("weight") + "bias")
        return F.linear(x, self.p(weight), self.params.get(bias, None))

    def head_weights(self) -> dict[str, Tensor]:
        """The head's tensors under the folder's names (detached fp32, d2t int64)."""
        out = {name: self.p(name).detach() for name in self._names}
        out["d2t"] = self.d2t
        return out
