"""Early-exit self-speculation (method "layer_skip"): the target's first E blocks draft.

Elhoushi et al. 2024, "LayerSkip". The draft model is the target itself cut after block E,
with a trained exit head (`specdecode.heads.exit_head`, kind "layer_skip": norm, one residual
block, the reduced draft vocabulary's output rows) in place of the remaining blocks. It shares
the target's weights (no second model in memory) and runs through the draft-model drafter
(`drafters.draft_model`: its own E-block KV cache, chains and dynamic trees, rollback after
each verdict), so an accepted draft token's first-E-block keys and values are reused by the
next draft; a drafted token costs about E / L of a target pass plus the head.

Exactness: the exit head's logits are -inf outside the draft vocabulary, so q is zero there;
verification reads the target's full distribution as for any drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import Drafter, DrafterContext, ModelDrafterConfig, spread_logits
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.heads.exit_head import ExitHead, load_exit_head
from specdecode.model.config import ModelConfig
from specdecode.model.transformer import Transformer, at_positions


@dataclass(frozen=True, slots=True)
class LayerSkipConfig(ModelDrafterConfig):
    """speculative_config of early-exit self-speculation, method "layer_skip".

    model: the exit head's folder (the `train` command's `--method layer_skip` writes one; the
        exit layer E is the head's).
    num_speculative_tokens: draft at most this many tokens per step (K, 1..64; a tree's nodes).
    quantization: the head's weight format ("none", "int8", "int4", "gguf"); None = the target's
        (the first E blocks are the target's own, in its format).
    tree_width: children per expanded node of a dynamic tree (1 = a chain).
    tree_depth: levels of the tree, one pass of the first E blocks each (default: K).
    """

    method: ClassVar[str] = "layer_skip"
    WHAT: ClassVar[str] = "a layer_skip config"


def build_layer_skip_drafter(config: LayerSkipConfig, context: DrafterContext) -> Drafter:
    """The registry's factory: load the exit head for the target (refused if trained for
    another) and draft with the target's first E blocks."""
    head = load_exit_head(
        Path(config.model).expanduser(),
        context.target,
        config.weight_format(context.target.quantization),
        "layer_skip",
    )
    return DraftModelDrafter(
        EarlyExit(context.target, head),
        config.num_speculative_tokens,
        context.target.config.vocab_size,
        config.tree_width,
        config.tree_depth,
    )


class EarlyExit:
    """The target's first E blocks and an exit head, as a draft model over the target's
    vocabulary (what `DraftModelDrafter` drives).

    Args:
        target: the target model (its blocks and embedding are shared, not copied).
        head: a layer_skip exit head trained for `target` (E = its feature_layer).
    """

    def __init__(self, target: Transformer, head: ExitHead) -> None:
        self.target = target
        self.head = head
        self.exit_layer = head.config.feature_layer
        self.config: ModelConfig = target.config
        self._draft_ids = head.draft_to_target  # [Vd] draft row -> target id

    @property
    def device(self) -> torch.device:
        return self.target.device

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache of the first E blocks for `batch_size` rows, its pool sized for
        `capacity` tokens per row to start with (it grows)."""
        cfg = self.config
        return KVCache(
            self.exit_layer,
            batch_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            capacity,
            self.target.dtype,
            self.device,
        )

    @torch.inference_mode()
    def __call__(
        self,
        tokens: Tensor,  # [B, T] int64
        meta: AttentionMetadata,
        cache: KVCache,
        logits_index: Tensor | None = None,  # [B, N] which of the T positions get logits
    ) -> tuple[Tensor, Tensor]:
        """Run the first E blocks over the new tokens (cached, lengths advanced) and exit.

        Returns (logits [B, N, V] over the target's vocabulary, -inf outside the draft
        vocabulary (N = T when logits_index is None), the residual after block E [B, T, h]).
        """
        x, _ = self.target.body(tokens, meta, cache, self.exit_layer)  # [B, T, h]
        reduced = self.head(at_positions(x, logits_index))[..., 0, :]  # [B, N, Vd]
        return spread_logits(reduced, self._draft_ids, self.config.vocab_size), x
