"""A trainable MTP layer, for a target that ships none (`specdecode train --method mtp`).

The layer `heads.mtp` runs (DeepSeek-V3's form: x = eh_proj([enorm(e(t + 1)), hnorm(h_t)]),
one decoder block of the target's own kind, logits = the target's head over
shared_head.norm(y)), trained as an EAGLE-3 head is (`train.eagle3_model`'s TTT steps: step
j > 0 reads the step before's pre-norm y, as a chained draft does). It reads the target's
final-normed states; the output head stays the target's own (frozen: its rows of the draft
vocabulary score the logits). It is saved in DeepSeek-V3's names beside the target's
config.json, a folder `{"method": "mtp", "model": OUT}` drafts with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from specdecode.errors import UserError
from specdecode.heads.mtp import DEEPSEEK_V3, block_shapes, save_mtp_folder
from specdecode.model.config import ModelConfig
from specdecode.train.eagle3_model import TrainableStateHead
from specdecode.train.head_params import rms_norm
from specdecode.train.init import random_weights, read_tensors


def mtp_names(cfg: ModelConfig) -> tuple[str, dict[str, str]]:
    """(the block's prefix, part -> name) of the layer for a target of `cfg`'s layer count."""
    return DEEPSEEK_V3.names(cfg.num_layers)


def mtp_tensor_shapes(cfg: ModelConfig, draft_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the trainable layer has ("d2t": its draft vocabulary)."""
    block, parts = mtp_names(cfg)
    h = cfg.hidden_size
    shapes = {parts[p]: (h,) for p in ("embed_norm", "hidden_norm", "out_norm")}
    shapes[parts["proj"]] = (h, 2 * h)
    shapes |= {block + name: shape for name, shape in block_shapes(cfg).items()}
    return shapes | {"d2t": (draft_vocab_size,)}


def check_trainable(cfg: ModelConfig) -> None:
    """Refuse a target whose block the trainable layer does not compute (it has q, k and v,
    their biases, RMSNorms and a SwiGLU MLP)."""
    if cfg.qk_norm or cfg.gemma or cfg.activation != "silu":
        raise UserError(
            f"train --method mtp builds Llama-style blocks (llama, mistral, qwen2, mimo "
            f"targets); a {cfg.architecture} block also has q/k norms or Gemma's norms"
        )


def initial_mtp_weights(
    cfg: ModelConfig,
    target_path: Path,
    draft_ids: Tensor,
    init: str,
    seed: int,
    final_norm: Tensor,
) -> dict[str, Tensor]:
    """The layer's first weights (fp32; d2t from `draft_ids`, [Vd] sorted target ids).

    "random": N(0, 0.02) projections, unit norms, zero biases. "target": the block from the
    target's last layer, eh_proj the half-sum of the two normed inputs, shared_head.norm the
    target's final norm (`final_norm`, [h], as `train.init.target_output` reads it).
    """
    weights = random_weights(mtp_tensor_shapes(cfg, len(draft_ids)), draft_ids, init, seed)
    if init == "random":
        return weights
    block, parts = mtp_names(cfg)
    last = f"model.layers.{cfg.num_layers - 1}."
    names = list(block_shapes(cfg))
    own = read_tensors(target_path, [last + n for n in names])
    weights |= {block + n: own[last + n] for n in names}
    eye = torch.eye(cfg.hidden_size) * 0.5
    weights[parts["proj"]] = torch.cat([eye, eye], dim=1)
    weights[parts["out_norm"]] = final_norm
    return weights


class TrainableMtp(TrainableStateHead):
    """An MTP layer's parameters (DeepSeek-V3's names) and the TTT forward (module docstring).

    Args:
        cfg: the target's config.
        weights: initial tensors (`mtp_tensor_shapes` names), copied as fp32.
        embed: the target's token embedding ([V, h]; frozen, not saved).
        rows: the target's output rows of the draft vocabulary ([Vd, h]; frozen, not saved).
        config_json: the target's config.json (written beside the saved layer).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Tensor],
        embed: Tensor,
        rows: Tensor,
        config_json: Mapping[str, object],
    ) -> None:
        check_trainable(cfg)
        block, self.parts = mtp_names(cfg)
        shapes = mtp_tensor_shapes(cfg, len(rows))
        super().__init__(shapes, weights, embed, cfg, block)
        self.register_buffer("rows", rows.detach().float(), persistent=False)
        self.config_json = dict(config_json)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's final-normed states."""
        return (self.shape.num_layers,)

    def save(self, path: Path, weights: Mapping[str, Tensor], extra: dict[str, object]) -> None:
        """Write the layer (`weights` but d2t) and the target's config.json, `extra` under
        "specdecode", into folder `path`."""
        tensors = {name: t for name, t in weights.items() if name != "d2t"}
        save_mtp_folder(path, {**self.config_json, "specdecode": extra}, tensors)

    def _fuse(self, features: Tensor) -> Tensor:
        """The target's final states, as they are."""
        return features.to(self.p(self.parts["proj"]).dtype)

    def _inputs(
        self, token_embeds: Tensor, hidden: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """x = eh_proj([enorm(e), hnorm(h)]) (e zero at position 0, as DeepSeek-V3's layer
        reads it); q/k/v read the block's input norm of x, the residual is x."""
        eps = self.shape.rms_norm_eps
        token_embeds = token_embeds * (positions != 0)[..., None].to(token_embeds.dtype)
        embeds = rms_norm(token_embeds, self.p(self.parts["embed_norm"]), eps)
        normed = rms_norm(hidden, self.p(self.parts["hidden_norm"]), eps)
        x = self.linear(torch.cat([embeds.to(normed.dtype), normed], -1), self.parts["proj"])
        return rms_norm(x, self.p(f"{self.prefix}input_layernorm.weight"), eps), x

    def logits(self, hidden: Tensor) -> Tensor:
        """The target's head over shared_head.norm(y): [..., h] -> [..., Vd] logits."""
        normed = rms_norm(hidden, self.p(self.parts["out_norm"]), self.shape.rms_norm_eps)
        return normed @ self.rows.to(normed.dtype).T


def target_config_json(target_path: Path) -> dict[str, object]:
    """The target folder's config.json, as a dict."""
    return json.loads((target_path / "config.json").read_text())
