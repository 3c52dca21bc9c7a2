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
from torch import Tensor

from specdecode.heads.exit_head import ExitHeadConfig, save_exit_head
from specdecode.train.head_params import HeadParameters, rms_norm


class TrainableExitHead(HeadParameters):
    """Exit head parameters (the folder's names) and their forward over sequences.

    Args:
        cfg: the head's shape.
        weights: initial tensors (`cfg.tensor_shapes()`; "d2t" int64), copied as fp32.
    """

    def __init__(self, cfg: ExitHeadConfig, weights: Mapping[str, Tensor]) -> None:
        super().__init__(cfg.tensor_shapes(), weights)
        self.config = cfg
        self.shift = 1 if cfg.kind == "medusa" else 0
        self.gathers = False  # every output covers every column
        self.gathers_first = False

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the head reads."""
        return (self.config.feature_layer,)

    def forward(
        self,
        features: Tensor,
        tokens: Tensor,
        steps: int,
        starts: Tensor | None = None,
        columns: Tensor | None = None,
    ) -> list[Tensor]:
        """Per head k: y_k = x + SiLU(W_k x + b_k) over x = the (normed) target states
        (features [B, T, h]; tokens, steps, starts and columns are not read: the heads see no
        drafted token and no other column, and each is one cheap block over every column).
        Returns [B, T, h] per head; head j's column t predicts token t + j + shift + 1."""
        x = features.to(self.p("lm_head.weight").dtype)
        if self.config.normed_input:
            x = rms_norm(x, self.p("norm.weight"), self.config.rms_norm_eps)
        return [
            x + F.silu(F.linear(x, self.p(f"blocks.{k}.weight"), self.p(f"blocks.{k}.bias")))
            for k in range(self.config.num_heads)
        ]

    def logits(self, hidden: Tensor) -> Tensor:
        """The shared output head: [..., h] -> [..., Vd] logits."""
        return F.linear(hidden, self.p("lm_head.weight"))

    def save(self, path: Path, weights: Mapping[str, Tensor], extra: dict[str, object]) -> None:
        """Write the head folder with `weights` (`head_weights()`, cast) and `extra`."""
        save_exit_head(path, self.config, weights, extra)
