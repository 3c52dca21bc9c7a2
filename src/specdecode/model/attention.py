"""Grouped-query self-attention over the KV cache: the torch route (SDPA, or grouped matmuls
for a few queries over a long bf16 context, with masks and sliding windows) for PREFILL
passes, the native per-query kernel for DECODE and TREE passes of row-exact layers; RoPE,
q/k head norms, the query scale and Gemma 2's score soft-cap.

`pass_view` derives what every layer of one pass shares (`PassView`: the route and the masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode import kernels
from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.model.config import ModelConfig
from specdecode.model.gguf_linear import GgufWeight, cat_weights
from specdecode.model.linear import make_linear
from specdecode.model.norm import RMSNorm
from specdecode.model.rope import Rotary

# bf16/fp16 on the CPU: at most SHORT_QUERY new tokens over at least LONG_SPAN cached slots use
# `_grouped_attention` (decode and draft verification over a long context); the rest use SDPA.
# Where the crossover lies on the reference machine: docs/design.md, "Figures measured".
SHORT_QUERY = 16
LONG_SPAN = 256


def _grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, softcap: float | None = None
) -> Tensor:
    """softmax(q k^T / sqrt(D)) v with grouped heads, scores and softmax in fp32; with a
    `softcap` the scores become softcap * tanh(scores / softcap) first (Gemma 2).

    For a few queries in bf16 on the CPU, torch's SDPA kernel grows steeply with the cached
    length; one grouped matmul per KV head does not. Max error vs fp32 attention ~2e-3 either
    way. Query head h reads KV head h // G (G = H / Hkv), as in Hugging Face's `repeat_kv`.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, T, S] bool or None. Returns [B, H, T, D].
    """
    batch, heads, num_new, dim = q.shape
    kv_heads, span = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qg = q.reshape(batch, kv_heads, group * num_new, dim)  # rows ordered (g, t)
    scores = (qg @ k.transpose(-1, -2)).float() * dim**-0.5  # [B, Hkv, G*T, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.view(batch, kv_heads, group, num_new, span)
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # [B, 1, 1, T, S]
        scores = scores.view(batch, kv_heads, group * num_new, span)
    out = scores.softmax(-1).to(v.dtype) @ v  # [B, Hkv, G*T, D]
    return out.view(batch, heads, num_new, dim)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    softcap: float | None = None,
    causal: bool = False,
) -> Tensor:
    """Attention of q ([B, H, T, D]) over k, v ([B, Hkv, S, D]); mask [B, 1, T, S] or None;
    soft-capped scores (`softcap`: Gemma 2) take the grouped route, SDPA has no soft-cap.
    `causal`: mask is the square causal mask (T == S, query t sees slots 0..t), which SDPA then
    applies itself instead of reading it: the same bits (a masked score adds exact zeros), and
    it skips the key blocks past the diagonal (783 tokens: 0.7x the time, AMD EPYC Zen 4)."""
    short_over_long = q.shape[2] <= SHORT_QUERY and k.shape[2] >= LONG_SPAN
    cpu_short = q.device.type == "cpu" and q.dtype != torch.float32 and short_over_long
    if softcap is not None or cpu_short:
        return _grouped_attention(q, k, v, mask, softcap)
    gqa = q.shape[1] != k.shape[1]
    if causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _rowwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    rows: tuple[tuple[int, int], ...],
    softcap: float | None = None,
    causal: bool = False,
) -> Tensor:
    """`attend` of each row by itself, over its own new tokens and slots only, as its pass
    alone runs it: a row's bits then never depend on the other rows or the padded width.
    torch's SDPA does not promise that (its vector loops' tails, and which elements take the
    vector or the scalar exp, move with the width it is given). Padding queries get zeros.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, T, S] bool or None; rows: per row,
    (new tokens, slots read) = (num_new[b], starts[b] + num_new[b]); causal: mask is the
    square causal mask (every row from slot 0), and so is each row's part of it. Returns
    [B, H, T, D].
    Example: rows ((3, 3), (1, 5)): row 0 attends 3 queries over slots 0..2 under its causal
    mask; row 1 one query over slots 0..4 with no mask (it sees them all, unless a sliding
    window hides some), as alone.
    """
    out = torch.zeros_like(q)
    for r, (new, span) in enumerate(rows):
        if new == 0:
            continue
        row_mask = None if mask is None else mask[r : r + 1, :, :new, :span]
        if row_mask is not None and bool(row_mask.all()):
            row_mask = None  # as alone: no mask where the row's queries see every slot
        out[r : r + 1, :, :new] = attend(
            q[r : r + 1, :, :new],
            k[r : r + 1, :, :span],
            v[r : r + 1, :, :span],
            row_mask,
            softcap,
            causal and row_mask is not None,
        )
    return out


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE to x ([B, H, T, D]) with cos/sin ([B, 1, T, D] in x's dtype)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True, slots=True)
class PassView:
    """What every layer of one pass shares, derived once from its `AttentionMetadata`.

    per_query: each new token attends by itself with the native kernel (DECODE and TREE
        modes on row-exact layers); then no mask is built.
    mask: [B, 1, T, S] bool for batched attention, or None (per_query, or nothing to mask).
    window_mask: the same for the sliding-window layers (their window applied too; `mask`
        itself where the pass spans no more than the window).
    rows: per row, (new tokens, slots read), where each row attends by itself
        (`_rowwise_attention`: PREFILL passes of several rows on row-exact layers, so that a
        prompt's bits are those of its pass alone); None where the rows attend in one call.
    causal: `mask` is the square causal mask (no tree, every row from slot 0: query t sees
        slots 0..t), which SDPA applies itself (`attend`).
    """

    per_query: bool
    mask: Tensor | None
    window_mask: Tensor | None = None
    rows: tuple[tuple[int, int], ...] | None = None
    causal: bool = False


def pass_view(
    attn: Attention,
    rotary: Rotary,
    meta: AttentionMetadata,
    dtype: torch.dtype,
    window: int | None = None,
) -> tuple[PassView, Tensor, Tensor]:
    """What the layers of one pass share, for layers in `attn`'s format: the `PassView` (with
    the masks of layers that slide through `window`, if any) and the RoPE tables (see
    `Attention.forward`) of `meta`'s positions."""
    per_query = attn.per_query and meta.mode is not AttentionMode.PREFILL
    mask = None if per_query else meta.attention_mask()
    window_mask = mask
    if window is not None and not per_query and meta.span > window:
        window_mask = _window_mask(meta, mask, window)
    rows = None
    if attn.per_query and not per_query and meta.batch_size > 1:  # row-exact layers, PREFILL
        rows = tuple(zip(meta.num_new, meta.ends, strict=True))
    causal = mask is not None and meta.mode is not AttentionMode.TREE and meta.starts_empty
    cos, sin = attn.rope_tables(rotary, meta.positions, dtype)
    return PassView(per_query, mask, window_mask, rows, causal), cos, sin


def _window_mask(meta: AttentionMetadata, mask: Tensor | None, window: int) -> Tensor:
    """`mask` ([B, 1, T, S] bool, None: all visible) with the slots before each query's
    window hidden: a query at position p sees no slot s <= p - window. (A tree's own slots sit
    past its start, within the window of every node shallower than it.)"""
    slots = torch.arange(meta.span, device=meta.positions.device)  # [S]
    near = slots > meta.positions[:, None, :, None] - window  # [B, 1, T, S]
    return near if mask is None else mask & near


class Attention(nn.Module):
    """Grouped-query self-attention over the cache."""

    def __init__(
        self,
        cfg: ModelConfig,
        w: dict[str, Tensor | GgufWeight],
        prefix: str,
        quantization: str | None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        names = [f"{prefix}{n}_proj" for n in "qkv"]
        # One fused projection for q, k and v: one weight read per pass instead of three calls.
        weight = cat_weights([w[f"{n}.weight"] for n in names])  # [(H + 2 Hkv) D, hidden]
        biases = [w.get(f"{n}.bias") for n in names]
        bias = None if biases[0] is None else torch.cat(biases)  # [(H + 2 Hkv) D]
        self.qkv_proj = make_linear(weight, bias, quantization)
        self.qkv_sizes = (cfg.num_heads * cfg.head_dim, *[cfg.num_kv_heads * cfg.head_dim] * 2)
        # (an o bias where the checkpoint has one: Qwen3's and Llama's attention_bias)
        self.o_proj = make_linear(
            w[f"{prefix}o_proj.weight"], w.get(f"{prefix}o_proj.bias"), quantization
        )
        self.q_norm = self.k_norm = None  # Qwen3, Gemma 3: q and k heads RMS-normed before RoPE
        if cfg.qk_norm:
            eps, offset = cfg.rms_norm_eps, cfg.norm_offset
            self.q_norm = RMSNorm(w[f"{prefix}q_norm.weight"], eps, offset)  # [D]
            self.k_norm = RMSNorm(w[f"{prefix}k_norm.weight"], eps, offset)  # [D]
        self.window = window  # keys a query sees through a sliding window (None: all)
        self.softcap = cfg.attn_softcap  # scores -> cap * tanh(scores / cap) (None: as they are)
        # the scores' scale is head_dim ** -0.5 in every attention routine: another one
        # (Gemma's query_pre_attn_scalar) scales q first
        scale = cfg.attention_scale
        self.q_scale = 1.0 if scale is None else scale * cfg.head_dim**0.5
        # Projections that give a token the same bits whatever else is in the pass: with the
        # per-query attention kernel, the whole layer then does.
        row_exact = self.qkv_proj.row_exact and self.o_proj.row_exact
        self.per_query = row_exact and kernels.available()
        # RoPE in one native call, rounded as `rotate` rounds (the kernel takes fp32 / bf16)
        # (GGUF weights run with fp32 or bf16 activations only)
        dense = isinstance(weight, Tensor)
        native_dtype = not dense or weight.dtype in (torch.float32, torch.bfloat16)
        self.native_rope = self.per_query and native_dtype

    def forward(
        self,
        x: Tensor,  # [B, T, hidden]
        cos: Tensor,  # [B, T, D] fp32 (native RoPE) or [B, 1, T, D] in x's dtype
        sin: Tensor,  # like cos
        cache: KVCache,
        layer: int,
        meta: AttentionMetadata,
        view: PassView,
    ) -> Tensor:  # [B, T, hidden]
        batch, num_new, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        cache.write(layer, k, v)
        if view.per_query:
            # Each new token attends by itself, as a 1-token step would: exact verification.
            out = kernels.decode_attention(
                q,
                cache.k[layer],
                cache.v[layer],
                meta.starts,
                meta.tree_starts or (),
                meta.tree_mask,
                cache.block_table,
                self.window or 0,
                self.softcap or 0.0,
            )  # [B, H, T, D]
        else:
            keys, values = cache.read(layer, k, v)  # [B, Hkv, S, D]
            mask = view.mask if self.window is None else view.window_mask
            causal = view.causal and mask is view.mask
            if view.rows is None:
                out = attend(q, keys, values, mask, self.softcap, causal)  # [B, H, T, D]
            else:
                out = _rowwise_attention(q, keys, values, mask, view.rows, self.softcap, causal)
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x's queries (normed, rotated, scaled: [B, H, T, D]), keys (normed, rotated) and
        values ([B, T, Hkv, D] each), as `forward` attends with them; x [B, T, hidden], cos
        and sin as `forward` takes them."""
        batch, num_new, _ = x.shape
        qkv = self.qkv_proj(x)  # [B, T, (H + 2 Hkv) D]
        if self.q_norm is not None:
            self._norm_heads(qkv)
        if self.native_rope:
            kernels.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads)  # q and k heads
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)  # [B, T, (H|Hkv) * D]
        q = q.view(batch, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, num_new, self.num_kv_heads, self.head_dim)
        v = v.view(batch, num_new, self.num_kv_heads, self.head_dim)
        if not self.native_rope:
            q = rotate(q, cos, sin)  # [B, H, T, D]
            k = rotate(k.transpose(1, 2), cos, sin).transpose(1, 2)  # [B, T, Hkv, D]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, k, v

    def rope_tables(
        self, rotary: Rotary, positions: Tensor, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """`rotary`'s cos, sin at `positions` ([B, T]) as `forward` takes them: [B, T, D] fp32
        for the native RoPE kernel, else [B, 1, T, D] in the activations' `dtype`."""
        return rotary.tables(positions, None if self.native_rope else dtype)

    def _norm_heads(self, qkv: Tensor) -> None:
        """RMS-norm each q and k head of `qkv` ([B, T, (H + 2 Hkv) D]) in place."""
        batch, num_new, _ = qkv.shape
        start = 0
        for heads, norm in ((self.num_heads, self.q_norm), (self.num_kv_heads, self.k_norm)):
            assert norm is not None  # both or neither
            end = start + heads * self.head_dim
            part = qkv[..., start:end].reshape(batch, num_new, heads, self.head_dim)
            qkv[..., start:end] = norm(part.contiguous()).view(batch, num_new, -1)
            start = end
