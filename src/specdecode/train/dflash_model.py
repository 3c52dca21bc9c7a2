"""A trainable DFlash block drafter (`specdecode train --method dflash`).

The drafter `heads.dflash` runs, in plain torch ops with fp32 master weights, over whole
sequences at once: column t is a block whose context is the target's states of its
sequence's tokens up to t (their fused features c, keys and values from each layer's own
k/v projections) and whose entries are token t + 1 (the anchor) at its position and K mask
entries after it, attending to that context and to each other, as the drafter's one pass
after committed tokens ..t + 1 holds them. The drafters it makes are "anchored": every entry
adds fc(column t's states), and mask entries token t + 1's embedding too (`heads.dflash`); a
config of z-lab's "embeddings" form trains as it is. Mask entry j (output j - 1) predicts token
t + j + 1: the objective's TTT convention (`train.objective`, shift 1), every output read
at the columns the loss needs (`gathers_first`). Logits are the target's own output rows of
the draft vocabulary over norm(the entry's state) (frozen; the saved drafter keeps the draft
vocabulary, `d2t`, and scores those rows of the target's head). Blocks are trained at
every answer position of a batch, not at a few sampled starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.errors import UserError
from specdecode.heads.dflash_config import (
    MASK_EMBED,
    DFlashHeadConfig,
    dflash_tensor_shapes,
    save_dflash_head,
)
from specdecode.model.config import ModelConfig
from specdecode.model.loading import layer_tensor_names
from specdecode.model.rope import base_frequencies
from specdecode.train.eagle3_model import rotate_half
from specdecode.train.head_params import HeadParameters, rms_norm
from specdecode.train.init import random_weights, read_tensors


def check_trainable(cfg: ModelConfig) -> None:
    """Refuse a target whose layers a drafter cannot start from (Gemma's norms, GeGLU)."""
    if cfg.gemma or cfg.activation != "silu":
        raise UserError(
            f"train --method dflash builds Qwen3-style layers with SwiGLU and plain RMSNorms; a "
            f"{cfg.architecture} target's layers differ (Gemma's norms or GeGLU)"
        )


def check_draft_vocabulary(cfg: DFlashHeadConfig, size: int) -> None:
    """Refuse a config whose draft vocabulary is not the `size` tokens a drafter trains over."""
    if cfg.draft_vocab_size != size:
        raise ValueError(
            f"a trainable DFlash drafter's config needs draft_vocab_size {size} (its draft "
            f"vocabulary), got {cfg.draft_vocab_size}"
        )


def initial_dflash_weights(
    cfg: DFlashHeadConfig,
    target: ModelConfig,
    target_path: Path,
    draft_ids: Tensor,
    init: str,
    seed: int,
    final_norm: Tensor,
    embed: Tensor,
) -> dict[str, Tensor]:
    """The drafter's first weights (fp32; d2t from `draft_ids`, [Vd] sorted target ids, Vd =
    cfg.draft_vocab_size).

    "random": N(0, 0.02) projections, unit norms, zero biases. "target": layer i from the
    target's layer L - n + i (its q/k norms, where it has them, else ones), fc passing the
    highest fused state on, the final norm the target's (`final_norm`), and the mask
    embedding the mean of the target's embedding rows (`embed`, [V, h]).
    """
    check_draft_vocabulary(cfg, len(draft_ids))
    weights = random_weights(dflash_tensor_shapes(cfg), draft_ids, init, seed)
    if init == "random":
        return weights
    layers, h = cfg.layers.num_layers, target.hidden_size
    names = layer_tensor_names(target)
    for i in range(layers):
        own = f"model.layers.{target.num_layers - layers + i}."
        t = read_tensors(target_path, [own + p for p in names])
        weights |= {f"layers.{i}.{p}": t[own + p] for p in names}
    fc = torch.zeros(h, len(cfg.target_layer_ids) * h)
    fc[:, -h:] = torch.eye(h)
    weights["fc.weight"] = fc
    weights["norm.weight"] = final_norm
    weights[MASK_EMBED] = embed.float().mean(0)
    return weights


class TrainableDFlash(HeadParameters):
    """A DFlash drafter's parameters (z-lab's names) and the block forward (module docstring).

    Args:
        cfg: the drafter's shape (mask_token_id None: a learned mask embedding).
        weights: initial tensors (`dflash_tensor_shapes` names and "d2t"), copied as fp32.
        embed: the target's token embedding ([V, h]; frozen, not saved).
        rows: the target's output rows of the draft vocabulary ([Vd, h]; frozen, not saved).
    """

    shift = 1  # output j of column t predicts token t + j + 2
    gathers = True
    gathers_first = True  # output 0 too is at `columns` only

    def __init__(
        self, cfg: DFlashHeadConfig, weights: Mapping[str, Tensor], embed: Tensor, rows: Tensor
    ) -> None:
        if cfg.mask_token_id is not None:
            raise UserError("a trainable DFlash drafter learns its mask embedding")
        check_draft_vocabulary(cfg, len(rows))
        super().__init__(dflash_tensor_shapes(cfg), weights)
        self.config = cfg
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("rows", rows.detach().float(), persistent=False)
        inv = base_frequencies(cfg.layers.rope_theta, cfg.layers.head_dim)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target states the drafter fuses."""
        return self.config.feature_layers

    def save(self, path: Path, weights: Mapping[str, Tensor], extra: dict[str, object]) -> None:
        """Write the drafter (`weights`, d2t included: it drafts over the vocabulary it was
        trained over) and config.json, `extra` under "specdecode", into folder `path`."""
        save_dflash_head(path, self.config, weights, extra)

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """RoPE of x ([B, heads, *P, D]) at positions ([B, *P])."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, *P, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, *P, D]
        return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)

    def _heads(self, x: Tensor, name: str, at: str, count: int) -> Tensor:
        """Projection `name` of x ([B, *P, h]) split into `count` heads, q/k normed:
        [B, count, *P, D]."""
        out = self.linear(x, f"{at}self_attn.{name}_proj.weight")
        out = out.view(*x.shape[:-1], count, self.config.layers.head_dim)
        if name in ("q", "k"):
            norm = self.p(f"{at}self_attn.{name}_norm.weight")
            out = rms_norm(out, norm, self.config.layers.rms_norm_eps)
        return out.movedim(-2, 1)

    def forward(
        self,
        features: Tensor,
        tokens: Tensor,
        steps: int,
        starts: Tensor | None = None,
        columns: Tensor | None = None,
    ) -> list[Tensor]:
        """States of the mask entries of blocks at `columns` (module docstring).

        features: [B, T, F] the target's concatenated states. tokens: [B, T] target ids.
        steps: mask entries per block (K). starts: [B, T] the column where each column's
            sequence begins (None: one sequence a row). columns: [B, A] the blocks to run
            (None: all T).
        Returns per mask entry j its final states [B, A, h]: column t's predicts token
        t + j + 2 (past its sequence's end no loss reads it).
        """
        batch, length, _ = features.shape
        lay, device = self.config.layers, features.device
        here = torch.arange(length, device=device)  # [T]
        if starts is None:
            starts = torch.zeros(batch, length, dtype=torch.long, device=device)
        if columns is None:
            columns = here.expand(batch, length)
        rows = torch.arange(batch, device=device)[:, None]  # [B, 1]
        first = starts[rows, columns]  # [B, A]: where each block's sequence begins
        eps = lay.rms_norm_eps
        fc = self.p("fc.weight")
        state = F.linear(features.to(fc.dtype), fc)  # [B, T, h]
        context = rms_norm(state, self.p("hidden_norm.weight"), eps)
        anchor = self.embed[tokens[rows, (columns + 1).clamp(max=length - 1)]]  # [B, A, h]
        masks = self.p(MASK_EMBED).to(anchor.dtype).expand(*columns.shape, steps, -1)
        anchored = self.config.block_inputs == "anchored"
        if anchored:
            masks = masks + anchor[:, :, None]
        x = torch.cat([anchor[:, :, None], masks], dim=2).to(context.dtype)  # [B, A, S, h]
        if anchored:  # every entry starts from its column's newest state (module docstring)
            x = x + state[rows, columns][:, :, None].to(x.dtype)
        block_pos = (columns - first + 1)[..., None] + torch.arange(steps + 1, device=device)
        context_pos = here - starts  # [B, T]
        seen = (here <= columns[..., None]) & (here >= first[..., None])  # [B, A, T]
        for i in range(lay.num_layers):
            x = self._layer(x, context, block_pos, context_pos, seen, f"layers.{i}.")
        return [x[:, :, j + 1] for j in range(steps)]

    def _layer(
        self,
        x: Tensor,
        context: Tensor,
        block_pos: Tensor,
        context_pos: Tensor,
        seen: Tensor,
        at: str,
    ) -> Tensor:
        """One layer over the blocks x ([B, A, S, h] at block_pos [B, A, S]); each entry
        attends to the context entries its block sees (`seen` [B, A, T]; context [B, T, h] at
        context_pos [B, T]) and to its own block."""
        lay = self.config.layers
        heads, kv_heads, dim = lay.num_heads, lay.num_kv_heads, lay.head_dim
        group = heads // kv_heads
        batch, blocks, size, _ = x.shape
        normed = rms_norm(x, self.p(f"{at}input_layernorm.weight"), lay.rms_norm_eps)
        q = self._rope(self._heads(normed, "q", at, heads), block_pos)  # [B, H, A, S, D]
        k = self._rope(self._heads(normed, "k", at, kv_heads), block_pos)  # [B, Hkv, A, S, D]
        v = self._heads(normed, "v", at, kv_heads)
        ck = self._rope(self._heads(context, "k", at, kv_heads), context_pos)  # [B, Hkv, T, D]
        cv = self._heads(context, "v", at, kv_heads)
        k, v, ck, cv = (t.repeat_interleave(group, dim=1) for t in (k, v, ck, cv))
        scale = 1.0 / math.sqrt(dim)
        flat = q.reshape(batch, heads, blocks * size, dim)
        outer = (flat @ ck.transpose(-1, -2)).float().view(batch, heads, blocks, size, -1)
        outer = outer.masked_fill(~seen[:, None, :, None, :], float("-inf"))  # [B,H,A,S,T]
        inner = (q @ k.transpose(-1, -2)).float()  # [B, H, A, S, S]
        probs = (torch.cat([outer, inner], dim=-1) * scale).softmax(-1).to(q.dtype)
        span = ck.shape[2]
        out = (probs[..., :span].reshape(batch, heads, blocks * size, span) @ cv).view(q.shape)
        out = out + probs[..., span:] @ v  # [B, H, A, S, D]
        out = out.movedim(1, -2).reshape(batch, blocks, size, heads * dim)
        x = x + self.linear(out, f"{at}self_attn.o_proj.weight")
        y = rms_norm(x, self.p(f"{at}post_attention_layernorm.weight"), lay.rms_norm_eps)
        gate = self.linear(y, f"{at}mlp.gate_proj.weight")
        up = self.linear(y, f"{at}mlp.up_proj.weight")
        return x + self.linear(F.silu(gate) * up, f"{at}mlp.down_proj.weight")

    def logits(self, hidden: Tensor) -> Tensor:
        """The target's rows of the draft vocabulary over norm(state): [..., h] -> [..., Vd]."""
        normed = rms_norm(hidden, self.p("norm.weight"), self.config.layers.rms_norm_eps)
        return normed @ self.rows.to(normed.dtype).T
