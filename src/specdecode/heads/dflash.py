"""The DFlash block drafter at inference: a few decoder layers that fill a block of masked
positions in one pass, conditioned on the target's fused states (DFlash, arXiv 2602.06036;
the folder format of z-lab's released drafters).

Per sequence the drafter keeps a context: per layer the keys and values of every committed
token whose target states are known. Token t's are k_norm(k_proj(c_t)) (RoPE at position t)
and v_proj(c_t), where c_t = hidden_norm(fc(the target's states after token t)) feeds every
layer alike (the context entries have no states of their own in the drafter). A block is
the last committed token (the anchor, at position a) and B = block_size - 1 mask entries at
a + 1..a + B (fewer only where the drafter's positions run out; a draft reads the first); its
states start from embeddings (the target's own, of the anchor and of the mask token) and run
through the layers, each block query attending to the whole context and to the whole block
(no causal mask inside it). Where the config's block_inputs is "anchored" (a drafter `specdecode
train` writes), every block entry adds fc(the newest context entry's target states), without
the hidden norm, to its embedding, and every mask entry the anchor's embedding as well: the
block starts from the target's newest state and the anchor token, as an EAGLE-3 entry does,
instead of from bare embeddings. Mask entry a + j predicts token a + j: logits = the target's
output rows over norm(its final state) (times `output_multiplier`, soft-capped where the
config says). The block's keys and values are never kept; the next block reads the context
grown by the states of the tokens the step kept.

The folder's format: `heads.dflash_config`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.errors import UserError
from specdecode.heads.dflash_config import (
    MASK_EMBED,
    DFlashHeadConfig,
    dflash_tensor_shapes,
)
from specdecode.heads.files import (
    check_head_folder,
    d2t_to_draft_ids,
    draft_ids_to_d2t,
    read_head_tensors,
    tensors_for_target,
)
from specdecode.model.attention import pass_view
from specdecode.model.linear import make_linear
from specdecode.model.norm import RMSNorm
from specdecode.model.rope import Rotary
from specdecode.model.transformer import Block, Transformer
from specdecode.model.trimmed_linear import check_kept, trimmed_linear


@dataclass(frozen=True, slots=True)
class BlockInput:
    """One sequence's block in a pass (`DFlashHead.blocks`): the anchor (its last committed
    token), its mask entries and fc(its newest context entry's states) ([h], `extend`'s; read
    where block_inputs is "anchored")."""

    anchor: int
    masks: int
    newest: Tensor


class DFlashHead(nn.Module):
    """A DFlash block drafter for one target (module docstring).

    Its layers are decoder `Block`s (Qwen3's), so a block pass is a TREE pass over the rows of
    the sequences drafting (every block entry sees its whole block): one native call per layer
    where the layer's projections have native kernels (`transformer.native_layer`), else the
    torch route.

    Args:
        cfg: the drafter's shape.
        weights: its tensors (`dflash_tensor_shapes`), in the target's dtype and on its device.
        target: the model it drafts for (its embedding and output rows, shared).
        quantization: the projections' format (None, "int8", "int4", a GGUF block type).
    """

    kind = "dflash"

    def __init__(
        self,
        cfg: DFlashHeadConfig,
        weights: Mapping[str, Tensor],
        target: Transformer,
        quantization: str | None,
    ) -> None:
        super().__init__()
        lay = cfg.layers
        self.config = cfg
        self.vocab_size = lay.vocab_size
        self.embed_tokens = target.embed_tokens
        if "d2t" in weights:  # draft row -> target id
            self.register_buffer("draft_to_target", d2t_to_draft_ids(weights["d2t"]))
            self.lm_head = trimmed_linear(target.lm_head, self.draft_to_target)
        else:
            self.register_buffer("draft_to_target", torch.arange(lay.vocab_size))
            self.lm_head = target.lm_head
        # (the raw output rows: the target's soft-cap not applied)
        self.fc = make_linear(weights["fc.weight"], quantization=quantization)
        self.hidden_norm = RMSNorm(weights["hidden_norm.weight"], lay.rms_norm_eps)
        named = {f"model.{n}": w for n, w in weights.items() if n.startswith("layers.")}
        self.layers = nn.ModuleList(
            Block(lay, named, i, quantization, target.dtype) for i in range(lay.num_layers)
        )
        self.norm = RMSNorm(weights["norm.weight"], lay.rms_norm_eps)
        if cfg.mask_token_id is None:
            self.mask_embed = weights[MASK_EMBED]  # [h]
        else:
            self.mask_embed = target.embed_tokens.weight[cfg.mask_token_id]
        self.rotary = Rotary(
            lay.head_dim, lay.rope_theta, lay.max_position_embeddings, lay.rope_scaling
        ).to(target.device)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target states the drafter reads."""
        return self.config.feature_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        """An empty cache of `rows` rows of context entries (every layer's keys and values),
        its pool sized for `capacity` entries a row to start with (it grows; rows are added
        with `KVCache.add_rows`)."""
        lay = self.config.layers
        return KVCache(
            len(self.layers),
            rows,
            lay.num_kv_heads,
            lay.head_dim,
            capacity,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def extend(self, cache: KVCache, features: Sequence[Tensor]) -> Tensor:
        """Append to each row r of `cache` the context entries of its next tokens' target
        states (features[r] [n_r, F], the target's concatenated states of `feature_layers`,
        n_r >= 1), every row in one pass: every layer's keys and values of
        hidden_norm(fc(features)) at the positions after the row's cached ones. Returns each
        row's newest entry's fc(states) ([R, h]; what an anchored block adds)."""
        sizes = [len(f) for f in features]
        width = len(self.feature_layers) * self.config.layers.hidden_size  # F
        x = torch.zeros(len(sizes), max(sizes), width, dtype=self.dtype, device=self.device)
        for r, f in enumerate(features):
            x[r, : len(f)] = f  # [n_r, F] into [W, F]; the rest is padding
        state = self.fc(x)  # [R, W, h]
        meta = AttentionMetadata.contiguous(
            AttentionMode.DECODE, cache.lengths, sizes, self.device, max_positions=self.positions
        )
        cache.prepare(meta)
        fused = self.hidden_norm(state)
        cos, sin = self.layers[0].self_attn.rope_tables(self.rotary, meta.positions, self.dtype)
        for index, layer in enumerate(self.layers):
            _, k, v = layer.self_attn.project(fused, cos, sin)  # [R, W, Hkv, D] each
            cache.write(index, k, v)
        cache.advance(meta)
        return state[torch.arange(len(sizes)), torch.tensor(sizes) - 1]  # [R, h]

    @torch.inference_mode()
    def blocks(self, cache: KVCache, inputs: Sequence[BlockInput]) -> list[Tensor]:
        """One pass over a block per row of `cache` (row r's [anchor, mask x masks] of
        inputs[r] after its context entries, the anchor at position cache.lengths[r]; the
        shorter blocks padded); returns each block's mask entries' final normed states
        ([masks, h]; `logits` scores them). The blocks' keys and values are written past the
        contexts and dropped after the pass."""
        width, hidden = 1 + max(i.masks for i in inputs), self.config.layers.hidden_size
        anchored = self.config.block_inputs == "anchored"
        x = torch.zeros(len(inputs), width, hidden, dtype=self.dtype, device=self.device)
        mask = torch.eye(width, dtype=torch.bool).repeat(len(inputs), 1, 1)  # [R, T, T]
        anchors = torch.tensor([i.anchor for i in inputs], device=self.device)
        embeds = self.embed_tokens(anchors)[:, None]  # [R, 1, h]
        for r, (i, embed) in enumerate(zip(inputs, embeds, strict=True)):
            masks = self.mask_embed.expand(i.masks, -1)  # [masks, h]
            if anchored:
                masks = masks + embed
            block = torch.cat([embed, masks])  # [1 + masks, h]
            if self.config.embedding_scale != 1.0:
                block = block * self.config.embedding_scale
            if anchored:
                block = block + i.newest
            x[r, : len(block)] = block
            mask[r, : len(block), : len(block)] = True  # a block's entries see each other
        starts = tuple(cache.lengths)
        positions = torch.tensor(starts)[:, None] + torch.arange(width)  # [R, T]
        meta = AttentionMetadata(
            AttentionMode.TREE,
            starts,
            tuple(1 + i.masks for i in inputs),
            positions.clamp(max=self.positions - 1).to(self.device),  # (padding past the end)
            mask.to(self.device),
        )
        cache.prepare(meta)
        view, cos, sin = pass_view(self.layers[0].self_attn, self.rotary, meta, self.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, meta, view)  # [R, T, h]
        cache.truncate(starts)
        return [self.norm(x[r, 1 : 1 + i.masks]) for r, i in enumerate(inputs)]

    @property
    def positions(self) -> int:
        """The positions the drafter's RoPE table covers."""
        return self.rotary.cos.shape[0]

    @torch.inference_mode()
    def logits(self, states: Tensor) -> Tensor:
        """Logits over the draft vocabulary of final normed states ([n, h] -> [n, Vd] fp32,
        row i: token draft_to_target[i]): one pass of the output rows for the blocks of
        every sequence a step drafts for."""
        logits = self.lm_head(states).float() * self.config.output_multiplier
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def load_dflash_head(
    path: Path, target: Transformer, quantization: str | None, draft_ids: Tensor | None = None
) -> DFlashHead:
    """The DFlash drafter in folder `path` for `target` (refused if made for another target),
    its projections in `quantization` and its other tensors in the target's dtype; its logits
    over `draft_ids` ([Vd] sorted target ids) where given (refused for a folder with a draft
    vocabulary of its own), else over the folder's draft vocabulary or the whole one."""
    check_head_folder(path, "DFlash")
    cfg = DFlashHeadConfig.from_folder(path)
    cfg.check_target(target.config)
    if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < target.config.vocab_size:
        raise UserError(
            f"{path}: mask_token_id {cfg.mask_token_id} is outside the target's vocabulary"
        )
    shapes = dflash_tensor_shapes(cfg)
    weights = read_head_tensors(path, shapes, {}, cfg.layers.vocab_size)
    if draft_ids is not None:
        if "d2t" in shapes:
            raise UserError(
                f"{path} has a draft vocabulary of its own ({len(weights['d2t'])} tokens, "
                "trained over): leave draft_vocab_size unset for it"
            )
        weights["d2t"] = draft_ids_to_d2t(draft_ids.cpu())
        shapes["d2t"] = (len(draft_ids),)
    if "d2t" in shapes:
        try:
            check_kept(d2t_to_draft_ids(weights["d2t"]), cfg.layers.vocab_size)
        except UserError as e:
            raise UserError(f"{path}: its d2t (draft row -> target id offsets): {e}") from None
    cast = tensors_for_target(weights, set(shapes), target.device, target.dtype)
    return DFlashHead(cfg, cast, target, quantization).eval()
