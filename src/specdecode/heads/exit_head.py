"""Exit heads: residual blocks + a reduced output head over one target state (Medusa, LayerSkip).

Two head kinds share this shape. Head k maps a state x of the target to draft logits:

    y_k = x + SiLU(W_k x + b_k)          (Medusa's residual block; W_k starts at zero)
    logits_k = lm_head(y_k)              (lm_head: [Vd, h] rows of the reduced draft vocabulary)

- "medusa" (Cai et al. 2024): K heads over the target's final-normed state after token t; head
  k (1-based) predicts token t + k + 1 (the target's own head predicts t + 1). One pass of all
  K heads drafts a whole chain, or the per-head top-k a tree.
- "layer_skip" (Elhoushi et al. 2024): one head (an exit adapter) over the input of block E,
  normed first (`norm.weight`, started from the target's final norm); the drafter runs the
  target's first E blocks on its own drafted tokens and exits here for each.

Folder: config.json (`specdecode_head_type`, `feature_layer`, `num_heads`, `draft_vocab_size`,
the target's sizes under `verifier`) and model.safetensors (`blocks.{k}.weight` [h, h],
`blocks.{k}.bias` [h], `norm.weight` [h] for layer_skip, `lm_head.weight` [Vd, h], `d2t` [Vd]).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.errors import UserError
from specdecode.heads.files import (
    check_draft_vocab_size,
    check_head_folder,
    d2t_to_draft_ids,
    read_head_tensors,
    save_head_folder,
    tensors_for_target,
)
from specdecode.model.config import ModelConfig, read_config_json
from specdecode.model.linear import make_linear
from specdecode.model.norm import RMSNorm
from specdecode.model.transformer import HEAD_FORMAT, Transformer

EXIT_KINDS = ("medusa", "layer_skip")


@dataclass(frozen=True, slots=True)
class ExitHeadConfig:
    """An exit head's shape (module docstring).

    kind: "medusa" or "layer_skip".
    feature_layer: the target state it reads: the input of this block, where the target's
        layer count means its final-normed output (Medusa's).
    num_heads: residual blocks (Medusa's K; 1 for layer_skip).
    hidden_size / vocab_size / rms_norm_eps: the target's.
    draft_vocab_size: rows of the output head (the reduced draft vocabulary).
    verifier / verifier_layers: the target's name and layer count.
    """

    kind: str
    feature_layer: int
    num_heads: int
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    verifier_layers: int
    rms_norm_eps: float = 1e-6
    verifier: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EXIT_KINDS:
            raise UserError(f"unknown exit head kind {self.kind!r}; allowed: {EXIT_KINDS}")
        if not 0 < self.feature_layer <= self.verifier_layers:
            raise UserError(
                f"feature_layer must be in 1..{self.verifier_layers} (the target's layers), "
                f"got {self.feature_layer}"
            )
        if self.kind == "layer_skip" and (
            self.num_heads != 1 or self.feature_layer == self.verifier_layers
        ):
            raise UserError(
                "a layer_skip head has one block and exits before the last layer "
                f"(exit layer 1..{self.verifier_layers - 1}), got {self.num_heads} blocks at "
                f"layer {self.feature_layer}"
            )
        if not 1 <= self.num_heads <= 64:
            raise UserError(f"num_heads must be in 1..64, got {self.num_heads}")
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)

    @property
    def normed_input(self) -> bool:
        """The head norms its input (a mid-stack state; the final state comes normed)."""
        return self.feature_layer < self.verifier_layers

    @classmethod
    def for_target(
        cls,
        kind: str,
        target: ModelConfig,
        draft_vocab_size: int,
        num_heads: int = 1,
        exit_layer: int | None = None,
        verifier: str = "",
    ) -> ExitHeadConfig:
        """The head `kind` for `target`: Medusa over the final state, layer_skip at block
        `exit_layer` (default: a quarter of the layers, at least 1)."""
        if kind == "medusa":
            layer = target.num_layers
        else:
            layer = exit_layer or max(1, target.num_layers // 4)
        return cls(
            kind,
            layer,
            num_heads,
            target.hidden_size,
            target.vocab_size,
            draft_vocab_size,
            target.num_layers,
            target.rms_norm_eps,
            verifier,
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of the head."""
        h = self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {}
        for k in range(self.num_heads):
            shapes |= {f"blocks.{k}.weight": (h, h), f"blocks.{k}.bias": (h,)}
        if self.normed_input:
            shapes["norm.weight"] = (h,)
        return shapes | {
            "lm_head.weight": (self.draft_vocab_size, h),
            "d2t": (self.draft_vocab_size,),
        }

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a target this head was not trained for, saying what differs."""
        problems = [
            f"{what}: head {ours}, target {theirs}"
            for what, ours, theirs in (
                ("hidden size", self.hidden_size, target.hidden_size),
                ("vocabulary", self.vocab_size, target.vocab_size),
                ("layers", self.verifier_layers, target.num_layers),
            )
            if ours != theirs
        ]
        if problems:
            name = f" ({self.verifier})" if self.verifier else ""
            raise UserError(
                f"this {self.kind} head was trained for another target{name}: "
                + "; ".join(problems)
            )

    def to_json(self, extra: dict[str, Any] | None = None) -> str:
        """config.json text (`extra` under "specdecode")."""
        cfg: dict[str, Any] = {
            "specdecode_head_type": self.kind,
            "architectures": ["MedusaModel" if self.kind == "medusa" else "LayerSkipExit"],
            "feature_layer": self.feature_layer,
            "num_heads": self.num_heads,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "verifier": {
                "name_or_path": self.verifier,
                "num_hidden_layers": self.verifier_layers,
                "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size,
            },
        }
        if extra:
            cfg["specdecode"] = extra
        return json.dumps(cfg, indent=2) + "\n"

    @classmethod
    def from_folder(cls, path: Path) -> ExitHeadConfig:
        """Read `path/config.json`."""
        return read_config_json(
            path,
            cls.from_dict,
            "an exit head folder holds config.json and model.safetensors "
            "(`specdecode train --method medusa|layer_skip` writes one)",
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ExitHeadConfig:
        """Build from a parsed config.json (KeyError for a missing required field)."""
        verifier = cfg["verifier"]
        return cls(
            str(cfg["specdecode_head_type"]),
            int(cfg["feature_layer"]),
            int(cfg["num_heads"]),
            int(cfg["hidden_size"]),
            int(cfg["vocab_size"]),
            int(cfg["draft_vocab_size"]),
            int(verifier["num_hidden_layers"]),
            float(cfg.get("rms_norm_eps", 1e-6)),
            str(verifier.get("name_or_path") or ""),
        )


class ExitHead(nn.Module):
    """An exit head at inference (module docstring).

    Args:
        cfg: the head's shape.
        weights: its tensors (`cfg.tensor_shapes()`), in the wanted dtype and device.
        quantization: the blocks' format (None, "int8" or "int4"; the output head is int8
            under both quantized formats, like the target's).
    """

    def __init__(
        self, cfg: ExitHeadConfig, weights: Mapping[str, Tensor], quantization: str | None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.blocks = nn.ModuleList(
            make_linear(weights[f"blocks.{k}.weight"], weights[f"blocks.{k}.bias"], quantization)
            for k in range(cfg.num_heads)
        )
        self.norm = RMSNorm(weights["norm.weight"], cfg.rms_norm_eps) if cfg.normed_input else None
        self.lm_head = make_linear(
            weights["lm_head.weight"], quantization=HEAD_FORMAT[quantization]
        )
        # draft row -> target id
        self.register_buffer("draft_to_target", d2t_to_draft_ids(weights["d2t"]))

    @property
    def device(self) -> torch.device:
        return self.draft_to_target.device

    @torch.inference_mode()
    def forward(self, states: Tensor, heads: int | None = None) -> Tensor:
        """Draft logits ([..., heads, Vd]) of the first `heads` blocks (None = all) over the
        target's states ([..., h])."""
        x = states if self.norm is None else self.norm(states)
        ys = [x + F.silu(block(x)) for block in self.blocks[:heads]]
        return self.lm_head(torch.stack(ys, dim=-2))


def load_exit_head(
    path: Path, target: Transformer, quantization: str | None, kind: str
) -> ExitHead:
    """Load the `kind` head in folder `path` for `target` (refused if it is another kind or
    was trained for another target), its blocks in `quantization`, the rest in the target's
    dtype."""
    check_head_folder(path, kind)
    cfg = ExitHeadConfig.from_folder(path)
    if cfg.kind != kind:
        raise UserError(f"{path} holds a {cfg.kind} head, not a {kind} head")
    cfg.check_target(target.config)
    shapes = cfg.tensor_shapes()
    weights = read_head_tensors(path, shapes, {}, cfg.vocab_size)
    cast = tensors_for_target(weights, shapes, target.device, target.dtype)
    return ExitHead(cfg, cast, quantization).eval()


def save_exit_head(
    path: Path,
    cfg: ExitHeadConfig,
    weights: Mapping[str, Tensor],
    extra: dict[str, object] | None = None,
) -> None:
    """Write `cfg` (config.json; `extra` under "specdecode") and `weights` into folder `path`."""
    save_head_folder(path, cfg.to_json(extra), weights, cfg.vocab_size)
