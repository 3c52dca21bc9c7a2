"""Trainable exit heads (Medusa, LayerSkip's exit): `specdecode.heads.exit_head` in plain torch.

Same names and maths as the inference module, fp32 master weights, run over whole sequences.
The TTT objective (`train.objective`) reads the outputs through `shift`: output j of column t
predicts token t + j + shift + 1. Medusa head j (0-based) over the final state after token t
predicts token t + j + 2 (shift 1, like EAGLE-3's steps); the layer_skip exit over block E's
input after token t predicts token t + 1 (shift 0), and it has one output.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.heads.exit_head import ExitHeadConfig, save_exit_head
from specdecode.train.eagle3_model import param_key, rms_norm


class TrainableExitHead(nn.Module):
    """Exit head parameters (the folder's names) and their forward over sequences.

    Args:
        cfg: the head's shape.
        weights: initial tensors (`cfg.tensor_shapes()`; "d2t" int64), copied as fp32.
    """

    def __init__(self, cfg: ExitHeadConfig, weights: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.config = cfg
        self.shift = 1 if cfg.kind == "medusa" else 0
        self.params = nn.ParameterDict(
            {
                param_key(name): nn.Parameter(weights[name].detach().float().clone())
                for name in cfg.tensor_shapes()
                if name != "d2t"
            }
        )
        self.register_buffer("d2t", weights["d2t"].long().clone())

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the head reads."""
        return (self.config.feature_layer,)

    def forward(self, features: Tensor, tokens: Tensor, steps: int) -> list[Tensor]:
        """Per head k: y_k = x + SiLU(W_k x + b_k) over x = the (normed) target states
        (features [B, T, h]; tokens and steps are not read: the heads see no drafted token).
        Returns [B, T, h] per head; head j's column t predicts token t + j + shift + 1."""
        x = features.to(self.params[param_key("lm_head.weight")].dtype)
        if self.config.normed_input:
            x = rms_norm(x, self.params[param_key("norm.weight")], self.config.rms_norm_eps)
        return [
            x
            + F.silu(
                F.linear(
                    x,
                    self.params[param_key(f"blocks.{k}.weight")],
                    self.params[param_key(f"blocks.{k}.bias")],
                )
            )
            for k in range(self.config.num_heads)
        ]

    def logits(self, hidden: Tensor) -> Tensor:
        """The shared output head: [..., h] -> [..., Vd] logits."""
        return F.linear(hidden, self.params[param_key("lm_head.weight")])

    def head_weights(self) -> dict[str, Tensor]:
        """The head's tensors under the folder's names (detached fp32, d2t int64)."""
        out = {
            name: self.params[param_key(name)].detach()
            for name in self.config.tensor_shapes()
            if name != "d2t"
        }
        out["d2t"] = self.d2t
        return out

    def save(self, path: Path, weights: Mapping[str, Tensor], extra: dict[str, object]) -> None:
        """Write the head folder with `weights` (`head_weights()`, cast) and `extra`."""
        save_exit_head(path, self.config, weights, extra)
