"""A trainable EAGLE-3 head with training-time test (TTT) unrolling, on a base that a
checkpoint-style MTP layer shares (`train.mtp_model`).

The same layer as `specdecode.heads.eagle3.Eagle3Head`, in plain torch ops with fp32 master
weights, run over whole sequences. Step 0 reads the target's fused states: column t reads
(token t + 1, state t) at position t and predicts token t + 2. Step j > 0 reads the step
before's pre-norm output of the same column with token t + j + 1 at position t + j, and attends
to step 0's entries 0..t and to its own column's entries of steps 1..j (EAGLE-3's TTT mask):
exactly what the drafter's cache holds when it drafts its (j + 1)-th token after committed
entry t. So step j's loss trains the head on its own drafted features, as at inference.

A parallel head (`parallel_tokens` > 0) drafts all its tokens in one pass: its step j > 0
entries read level j's learned mask embedding (row j - 1 of `mask_embed`) in place of token
t + j + 1, and column t's fused feature plus level j's learned offset (row j - 1 of
`mask_hidden`) in place of step j - 1's output, with the same positions and the same mask,
which is what the drafter's one pass holds: the newest entry, then its mask entries.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.heads.eagle3 import LAYER, head_tensor_shapes, save_eagle3_head
from specdecode.heads.eagle3_config import Eagle3HeadConfig
from specdecode.model.config import ModelConfig
from specdecode.model.rope import base_frequencies
from specdecode.train.head_params import HeadParameters, rms_norm


def rotate_half(x: Tensor) -> Tensor:
    """RoPE's partner of x ([..., D]): [-x[D/2:], x[:D/2]]."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half) of x ([B, H, T, D]) with cos/sin ([T, D])."""
    return x * cos + rotate_half(x) * sin


class TrainableStateHead(HeadParameters, ABC):
    """One decoder layer over (token, state) entries with EAGLE-3's TTT unrolling (module
    docstring): the loop, the attention and the MLP that an EAGLE-3 head and an MTP layer
    share. A subclass says what the target's states become (`_fuse`), what an entry's q/k/v
    and residual read (`_inputs`), its logits, its saved form and the layers it reads.

    Args:
        shapes: the head's tensor names -> shapes ("d2t" included).
        weights: initial tensors under those names, copied as fp32.
        embed: the target's token embedding ([V, h]; frozen, not saved).
        shape: the layer's sizes (heads, key/value heads, head_dim, rms_norm_eps, rope_theta).
        prefix: where the layer's attention and MLP tensors sit among the names.
        parallel: a parallel head's levels (0: drafts token by token).
    """

    shift = 1  # step j of column t predicts token t + j + 2
    gathers = True  # steps j > 0 run only for the columns the loss reads
    gathers_first = False  # step 0 runs for every column (later steps attend to it)

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        weights: Mapping[str, Tensor],
        embed: Tensor,
        shape: ModelConfig,
        prefix: str,
        parallel: int = 0,
    ) -> None:
        super().__init__(shapes, weights)
        self.shape, self.prefix, self.parallel = shape, prefix, parallel
        self.register_buffer("embed", embed.detach(), persistent=False)
        inv = base_frequencies(shape.rope_theta, shape.head_dim)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    @abstractmethod
    def _fuse(self, features: Tensor) -> Tensor:
        """The target's states [B, T, F] -> the entries' features [B, T, h]."""

    @abstractmethod
    def _inputs(
        self, token_embeds: Tensor, hidden: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(what q, k and v read [B, N, *], the residual stream [B, N, h]) of entries with
        these token embeddings, features ([B, N, h]) and positions ([B, N])."""

    def forward(
        self,
        features: Tensor,
        tokens: Tensor,
        steps: int,
        starts: Tensor | None = None,
        columns: Tensor | None = None,
    ) -> list[Tensor]:
        """Pre-norm outputs of `steps` unrolled steps over a batch of rows (`logits` turns the
        rows that matter into logits: the output head is the largest matmul).

        features: [B, T, F] the target's concatenated states (F = len(aux layers) * h).
        tokens: [B, T] the rows' token ids (target ids).
        starts: [B, T] the column where each column's sequence begins (`objective.Batch`: a
            row holds sequences one after another, each at positions 0.. and seeing only
            itself); None: one sequence a row.
        columns: [B, A] the columns steps 1.. run for (None: all T): only the outputs a loss
            reads need them, and a column's later steps read nothing of other columns' but
            step 0's keys and values, which always cover all T.
        Returns step 0's outputs [B, T, h] and each later step's [B, A, h] (A = T without
        `columns`); column t's output of step j predicts token t + j + 2 (past its sequence's
        end a column reads the next sequence's tokens: no loss reads those outputs).
        """
        batch, length, _ = features.shape
        device = features.device
        here = torch.arange(length, device=device)  # [T]
        if starts is None:
            starts = torch.zeros(batch, length, dtype=torch.long, device=device)
        if columns is None:
            columns = here.expand(batch, length)
        rows = torch.arange(batch, device=device)[:, None]  # [B, 1]
        # step 0's entries see their own sequence's up to themselves (None: plain causal)
        causal = None
        if bool(starts.any()):
            causal = (here <= here[:, None]) & (here >= starts[..., None])  # [B, T, T]
        fused = self._fuse(features)  # [B, T, h]
        hidden = fused
        keys: list[Tensor] = []
        values: list[Tensor] = []
        outputs: list[Tensor] = []
        for step in range(steps):
            cols = here.expand(batch, length) if step == 0 else columns
            if step and self.parallel:  # mask entries of level `step`
                token_embeds = self.p("mask_embed")[step - 1].expand(*cols.shape, -1)
                offset = self.p("mask_hidden")[step - 1].to(fused.dtype)  # [h]
                hidden = fused[rows, cols] + offset  # [B, A, h]: anchored at column t's feature
            else:
                ahead = cols + step + 1  # column t reads token t + step + 1 (0 past the end)
                token_embeds = self.embed[
                    torch.where(ahead < length, tokens[rows, ahead.clamp(max=length - 1)], 0)
                ]
                if step == 1:
                    hidden = hidden[rows, columns]  # step 0's outputs at the columns
            first = starts[rows, cols]  # [B, N] where each entry's sequence begins
            # a later step's query at column c sees step 0's keys of its sequence up to c
            seen = causal if step == 0 else (here <= cols[..., None]) & (here >= first[..., None])
            x = self._layer(token_embeds, hidden, cols - first + step, keys, values, seen)
            hidden = x  # pre-norm: the next step's feature
            outputs.append(x)
        return outputs

    def _layer(
        self,
        token_embeds: Tensor,
        hidden: Tensor,
        positions: Tensor,
        keys: list[Tensor],
        values: list[Tensor],
        seen: Tensor | None,
    ) -> Tensor:
        """The decoder layer over one step's entries (token embeddings and features [B, N, h]
        at `positions` [B, N]), its keys and values appended to `keys` / `values`; the entries
        see step 0's entries where `seen` ([B, N, T] bool; None: step 0, plain causal) says,
        and a later step's entries also their own column's later steps (`_ttt_attention`)."""
        lay, at = self.shape, self.prefix
        batch, count, _ = hidden.shape
        heads, kv_heads, dim = lay.num_heads, lay.num_kv_heads, lay.head_dim
        x, residual = self._inputs(token_embeds, hidden, positions)  # [B, N, *], [B, N, h]
        q = self.linear(x, f"{at}self_attn.q_proj.weight")
        k = self.linear(x, f"{at}self_attn.k_proj.weight")
        v = self.linear(x, f"{at}self_attn.v_proj.weight")
        q = q.view(batch, count, heads, dim).transpose(1, 2)  # [B, H, N, D]
        k = k.view(batch, count, kv_heads, dim).transpose(1, 2)  # [B, Hkv, N, D]
        v = v.view(batch, count, kv_heads, dim).transpose(1, 2)
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, N, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, N, D]
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = heads // kv_heads
        keys.append(k.repeat_interleave(group, dim=1))  # [B, H, N, D]
        values.append(v.repeat_interleave(group, dim=1))
        attn = self._ttt_attention(q, keys, values, seen)  # [B, H, N, D]
        attn = attn.transpose(1, 2).reshape(batch, count, heads * dim)
        x = residual + self.linear(attn, f"{at}self_attn.o_proj.weight")
        y = rms_norm(x, self.p(f"{at}post_attention_layernorm.weight"), lay.rms_norm_eps)
        gate = self.linear(y, f"{at}mlp.gate_proj.weight")
        up = self.linear(y, f"{at}mlp.up_proj.weight")
        return x + self.linear(F.silu(gate) * up, f"{at}mlp.down_proj.weight")  # [B, N, h]

    @staticmethod
    def _ttt_attention(
        q: Tensor, keys: list[Tensor], values: list[Tensor], seen: Tensor | None
    ) -> Tensor:
        """Step j = len(keys) - 1's attention. Step 0: over its own entries where `seen`
        ([B, T, T] bool) says, or causal (None). Step j > 0: step 0's entries where `seen`
        ([B, N, T]) says, plus its own column's entries of steps 1..j. q: [B, H, N, D]; keys,
        values: step 0's [B, H, T, D], then per later step [B, H, N, D]."""
        if len(keys) == 1:
            if seen is None:
                return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
            return F.scaled_dot_product_attention(q, keys[0], values[0], seen[:, None])
        assert seen is not None, "a later step's entries see step 0's by `seen`"
        scale = 1.0 / math.sqrt(q.shape[-1])
        length = keys[0].shape[2]
        scores = (q @ keys[0].transpose(-1, -2)).float() * scale  # [B, H, N, T]
        scores = scores.masked_fill(~seen[:, None], float("-inf"))
        diag = torch.stack([(q * k).sum(-1).float() * scale for k in keys[1:]], -1)  # [B,H,N,j]
        probs = torch.cat([scores, diag], dim=-1).softmax(-1).to(q.dtype)
        out = probs[..., :length] @ values[0]
        for s, v in enumerate(values[1:]):
            out = out + probs[..., length + s, None] * v
        return out


class TrainableEagle3(TrainableStateHead):
    """EAGLE-3 head parameters (speculators' names) and the TTT forward.

    Args:
        cfg: the head's shape.
        weights: initial tensors (`head_tensor_shapes` names; "d2t" int64), copied as fp32.
        embed: the target's token embedding ([V, h]; frozen, not saved).
    """

    def __init__(self, cfg: Eagle3HeadConfig, weights: Mapping[str, Tensor], embed: Tensor):
        super().__init__(
            head_tensor_shapes(cfg), weights, embed, cfg.layer, LAYER, cfg.parallel_tokens
        )
        self.config = cfg

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the head fuses."""
        return self.config.aux_layers

    def save(self, path: Path, weights: Mapping[str, Tensor], extra: dict[str, object]) -> None:
        """Write the head folder with `weights` (`head_weights()`, cast) and `extra`."""
        save_eagle3_head(path, self.config, weights, extra)

    def _fuse(self, features: Tensor) -> Tensor:
        """fc over the target's concatenated states."""
        return self.linear(features.to(self.p("fc.weight").dtype), "fc.weight")

    def _inputs(
        self, token_embeds: Tensor, hidden: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """q/k/v read [norm(embedding), norm(feature)] (2h); the residual starts from the
        feature (or its norm)."""
        eps = self.shape.rms_norm_eps
        embeds = rms_norm(token_embeds, self.p(f"{LAYER}input_layernorm.weight"), eps)
        normed = rms_norm(hidden, self.p(f"{LAYER}hidden_norm.weight"), eps)
        residual = normed if self.config.norm_before_residual else hidden
        return torch.cat([embeds.to(normed.dtype), normed], dim=-1), residual  # [B, N, 2h]

    def logits(self, hidden: Tensor) -> Tensor:
        """The output head over pre-norm outputs: [..., h] -> [..., Vd] logits."""
        normed = rms_norm(hidden, self.p("norm.weight"), self.config.layer.rms_norm_eps)
        return self.linear(normed, "lm_head.weight")
