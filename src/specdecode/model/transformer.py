"""A native Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3): RMSNorm,
RoPE (Llama 3's frequency scaling, Phi-3's LongRoPE; a local base for sliding layers), GQA with
optional sliding windows, SwiGLU or GeGLU, optional qkv bias, optional q/k head norms, Gemma's
norms around each sublayer, embedding scale and soft-capping of attention scores and logits.

`Transformer.forward` maps tokens to logits and hidden states. It never samples, never
tokenizes and never changes its own config; all generation state lives in the `KVCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode import kernels
from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.errors import UserError
from specdecode.model.config import ModelConfig
from specdecode.model.gguf_linear import REQUANTIZED, GgufWeight, cat_weights
from specdecode.model.linear import make_linear
from specdecode.model.quant import AUTO, parse_quantization
from specdecode.model.rope import Rotary


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like the reference implementations (one native
    call on the CPU, where `specdecode.kernels` builds; torch ops elsewhere).

    offset: Gemma's convention, the norm multiplies by offset + weight (1 + w); that factor is
    kept in fp32 and applied before rounding to x's dtype, as Gemma's reference does (Llama's
    rounds first, then multiplies by the weight in x's dtype).
    """

    def __init__(self, weight: Tensor, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        if offset:
            weight = weight.float() + offset  # [D] fp32
        self.weight = nn.Parameter(weight, requires_grad=False)  # [D]
        self.eps = eps
        self.round_first = not offset
        native_dtype = weight.dtype in (torch.float32, torch.bfloat16)
        self.native = weight.device.type == "cpu" and native_dtype and kernels.available()

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether the native kernel computes this norm for x of `dtype`: x in the weight's
        dtype, or bf16 x under an offset's fp32 weight (which the kernel applies before
        rounding, as below)."""
        offset_bf16 = not self.round_first and dtype == torch.bfloat16
        return self.native and (dtype == self.weight.dtype or offset_bf16)

    def forward(self, x: Tensor) -> Tensor:  # x: [..., D]
        if self.takes(x.dtype):
            return kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.round_first:
            return self.weight * x32.to(x.dtype)
        return (x32 * self.weight).to(x.dtype)


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


def _attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, softcap: float | None = None
) -> Tensor:
    """Attention of q ([B, H, T, D]) over k, v ([B, Hkv, S, D]); mask [B, 1, T, S] or None;
    soft-capped scores (`softcap`: Gemma 2) take the grouped route, SDPA has no soft-cap."""
    short_over_long = q.shape[2] <= SHORT_QUERY and k.shape[2] >= LONG_SPAN
    cpu_short = q.device.type == "cpu" and q.dtype != torch.float32 and short_over_long
    if softcap is not None or cpu_short:
        return _grouped_attention(q, k, v, mask, softcap)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
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
    """

    per_query: bool
    mask: Tensor | None
    window_mask: Tensor | None = None


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
    cos, sin = attn.rope_tables(rotary, meta.positions, dtype)
    return PassView(per_query, mask, window_mask), cos, sin


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
        self.o_proj = make_linear(w[f"{prefix}o_proj.weight"], quantization=quantization)
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
        # RoPE in one native call, rounded as `_rotate` rounds (the kernel takes fp32 / bf16)
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
            q = _rotate(q, cos, sin)  # [B, H, T, D]
            k = _rotate(k.transpose(1, 2), cos, sin).transpose(1, 2)  # [B, T, Hkv, D]
        if self.q_scale != 1.0:
            q = q * self.q_scale
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
            out = _attention(q, keys, values, mask, self.softcap)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))

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


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh GELU (GeGLU)."""

    def __init__(
        self,
        w: dict[str, Tensor | GgufWeight],
        prefix: str,
        quantization: str | None,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.activation = activation
        gate, up = w[f"{prefix}gate_proj.weight"], w[f"{prefix}up_proj.weight"]
        fused = cat_weights([gate, up])  # [2 * inter, hidden]
        self.gate_up_proj = make_linear(fused, quantization=quantization)
        self.down_proj = make_linear(w[f"{prefix}down_proj.weight"], quantization=quantization)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, hidden] -> [B, T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.activation == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)


def native_layer(
    attn: Attention,
    mlp: MLP,
    input_norm: RMSNorm | None,
    mlp_in_norm: RMSNorm,
    attn_out_norm: RMSNorm | None,
    mlp_out_norm: RMSNorm | None,
    eps: float,
    dtype: torch.dtype,
) -> Callable[..., Tensor] | None:
    """A decoder block of these parts as one native call for DECODE and TREE passes (`kernels.
    decoder_layer`: the same kernels in the same order, so the same bits, without ~12
    Python-level calls per layer) over activations of `dtype`, or None where a part has no
    native kernel. With `input_norm` None it starts from q|k|v's normed input and a residual
    (an EAGLE-3 head's layer)."""
    parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    projections = [getattr(part, "projection", None) for part in parts]
    optional = (input_norm, attn_out_norm, mlp_out_norm, attn.q_norm, attn.k_norm)
    norms = [mlp_in_norm, *[n for n in optional if n is not None]]
    if not attn.native_rope or None in projections or not all(n.takes(dtype) for n in norms):
        return None
    weights = [None if n is None else n.weight for n in optional]
    return kernels.decoder_layer(
        weights[0],
        mlp_in_norm.weight,
        *weights[1:],
        eps=eps,
        projections=projections,
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        gelu=mlp.activation == "gelu_tanh",
        q_scale=attn.q_scale,
        window=attn.window or 0,
        softcap=attn.softcap or 0.0,
    )


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)); Gemma's also norms
    each sublayer's output: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))).

    Norms by Hugging Face name: input_layernorm before attention; then Llama's
    post_attention_layernorm before the MLP, or Gemma's post_attention_layernorm after
    attention, pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        w: dict[str, Tensor | GgufWeight],
        layer: int,
        quantization: str | None,
    ) -> None:
        super().__init__()
        p = f"model.layers.{layer}."
        self.layer = layer
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.sliding = cfg.window(layer) is not None
        self.input_layernorm = RMSNorm(w[f"{p}input_layernorm.weight"], eps, offset)
        self.self_attn = Attention(cfg, w, f"{p}self_attn.", quantization, cfg.window(layer))
        self.attn_out_norm: RMSNorm | None = None  # Gemma: the attention output's norm
        self.mlp_out_norm: RMSNorm | None = None  # Gemma: the MLP output's norm
        if cfg.gemma:
            self.attn_out_norm = RMSNorm(w[f"{p}post_attention_layernorm.weight"], eps, offset)
            self.mlp_in_norm = RMSNorm(w[f"{p}pre_feedforward_layernorm.weight"], eps, offset)
            self.mlp_out_norm = RMSNorm(w[f"{p}post_feedforward_layernorm.weight"], eps, offset)
        else:
            self.mlp_in_norm = RMSNorm(w[f"{p}post_attention_layernorm.weight"], eps)
        self.mlp = MLP(w, f"{p}mlp.", quantization, cfg.activation)
        dtype = w["model.embed_tokens.weight"].dtype  # the activations' (Transformer.dtype)
        self.native = native_layer(
            self.self_attn,
            self.mlp,
            self.input_layernorm,
            self.mlp_in_norm,
            self.attn_out_norm,
            self.mlp_out_norm,
            cfg.rms_norm_eps,
            dtype,
        )

    def forward(
        self,
        x: Tensor,  # [B, T, hidden]
        cos: Tensor,  # see Attention.forward
        sin: Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        view: PassView,
    ) -> Tensor:  # [B, T, hidden]
        if view.per_query and self.native is not None:
            return self.native(
                x,
                cos,
                sin,
                cache.k,
                cache.v,
                self.layer,
                meta.starts,
                meta.tree_starts or (),
                meta.tree_mask,
                cache.block_table,
            )
        out = self.self_attn(self.input_layernorm(x), cos, sin, cache, self.layer, meta, view)
        x = x + (out if self.attn_out_norm is None else self.attn_out_norm(out))
        out = self.mlp(self.mlp_in_norm(x))
        return x + (out if self.mlp_out_norm is None else self.mlp_out_norm(out))


# The head's format under each model format (None = the weights' dtype).
HEAD_FORMAT: dict[str | None, str | None] = {
    None: None,
    "int8": "int8",
    "int4": "int8",
    "gguf": "gguf",
    **{name: name for name in REQUANTIZED},  # requantized: the head in the same block type
}


class Transformer(nn.Module):
    """Llama-family decoder built from Hugging Face-named weights.

    Weights must already have the wanted dtype and device; the RoPE tables stay fp32.
    quantization: None (every projection in the weights' dtype), "int8", "int4", "gguf" or a
    GGUF block type to requantize into ("q4_0", ...; see `specdecode.model.quant`). The
    embedding and norms stay in the weights' dtype; the head is int8 under int8 and int4
    (like llama.cpp's Q4_K_M, which keeps its output matrix at 6 bits).
    Under "gguf" the projections and the head are `GgufWeight`s (`model.gguf_linear`), the
    head under "lm_head.weight" even for tied embeddings; under a block type such as "q4_0"
    they come dense and are requantized, the head too.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, Tensor | GgufWeight],
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.quantization = parse_quantization(quantization)
        if self.quantization == AUTO:
            raise UserError("quantization 'auto' is resolved by load_model; give a format here")
        embed = weights["model.embed_tokens.weight"]  # [V, hidden]
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(
            Block(cfg, weights, i, self.quantization) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
        head = weights.get("lm_head.weight", embed)  # tied: may be absent
        self.lm_head = make_linear(head, quantization=HEAD_FORMAT[self.quantization])
        self.rotary = Rotary(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
        ).to(embed.device)
        # Gemma's sliding layers: their own RoPE base, unscaled
        self.local_rotary = self.rotary
        if cfg.local_rope_theta is not None:
            local = Rotary(cfg.head_dim, cfg.local_rope_theta, cfg.max_position_embeddings)
            self.local_rotary = local.to(embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch_size: int, capacity: int, max_tokens: int | None = None) -> KVCache:
        """An empty cache for `batch_size` rows, its pool sized for `capacity` tokens per row
        to start with (it grows), up to `max_tokens` tokens in all (None: no limit)."""
        cfg = self.config
        return KVCache(
            cfg.num_layers,
            batch_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            capacity,
            self.dtype,
            self.device,
            max_tokens,
        )

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [B, T] int64
        meta: AttentionMetadata,
        cache: KVCache,
        exit_layer: int | None = None,  # run only the first `exit_layer` blocks
        logits_index: Tensor | None = None,  # [B, N] which of the T positions get logits
        hidden_layers: tuple[int, ...] | None = None,  # whose inputs to return (see below)
    ) -> tuple[Tensor, Tensor]:
        """Run the new tokens through the model as `meta` lays them out; store their keys and
        values in `cache` and advance its lengths to `meta.ends`.

        Returns (logits [B, N, V] (N = T when logits_index is None), hidden). hidden is
        [B, T, hidden] by default: the final-normed output of the last block run. With
        `hidden_layers` = (i, j, ...) it is [B, T, len * hidden]: the inputs of blocks i, j, ...
        concatenated in that order, where index L (the number of blocks run) means the
        final-normed output (EAGLE-3 asks for (2, L // 2, L - 3)). Nothing extra is kept when
        hidden_layers is None.
        """
        num_layers = self.config.num_layers if exit_layer is None else exit_layer
        if not 0 < num_layers <= self.config.num_layers:
            raise ValueError(f"exit_layer must be in 1..{self.config.num_layers}, got {exit_layer}")
        if hidden_layers is not None and not all(0 <= i <= num_layers for i in hidden_layers):
            raise ValueError(f"hidden_layers must be in 0..{num_layers}, got {hidden_layers}")
        if tuple(tokens.shape) != (meta.batch_size, meta.width):
            raise ValueError(
                f"tokens {tuple(tokens.shape)} do not match the metadata's "
                f"[{meta.batch_size}, {meta.width}]"
            )
        x, captured = self.body(tokens, meta, cache, num_layers, hidden_layers or ())
        final = self.norm(x)  # [B, T, hidden]
        hidden = final
        if hidden_layers is not None:
            captured[num_layers] = final
            hidden = torch.cat([captured[i] for i in hidden_layers], dim=-1)
        return self.head(at_positions(final, logits_index)), hidden

    @torch.inference_mode()
    def head(self, final: Tensor) -> Tensor:  # [B, N, hidden] final-normed -> [B, N, V]
        """The output head: logits of final-normed states (soft-capped where the config says)."""
        logits = self.lm_head(final)
        cap = self.config.logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def body(
        self,
        tokens: Tensor,  # [B, T] int64
        meta: AttentionMetadata,
        cache: KVCache,
        num_layers: int,
        capture: tuple[int, ...] = (),
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run the first `num_layers` blocks (no final norm, no head) over the new tokens,
        storing their keys and values in `cache` (which may hold only those layers) and
        advancing its lengths. Returns the residual stream after them ([B, T, hidden]) and
        the inputs of the blocks in `capture` (block index -> [B, T, hidden])."""
        cache.prepare(meta)
        # every layer has the same format
        attn, window = self.layers[0].self_attn, self.config.sliding_window
        view, cos, sin = pass_view(attn, self.rotary, meta, self.dtype, window)
        tables = {False: (cos, sin), True: (cos, sin)}  # by whether the layer slides
        if self.local_rotary is not self.rotary:
            tables[True] = attn.rope_tables(self.local_rotary, meta.positions, self.dtype)
        x = self.embed_tokens(tokens)  # [B, T, hidden]
        if self.config.embed_scale != 1.0:  # Gemma: scaled in the embeddings' dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        captured: dict[int, Tensor] = {}
        for index, block in enumerate(self.layers[:num_layers]):
            if index in capture:
                captured[index] = x
            x = block(x, *tables[block.sliding], cache, meta, view)
        cache.advance(meta)
        return x, captured


def at_positions(x: Tensor, index: Tensor | None) -> Tensor:
    """Rows of `x` ([B, T, F]) at `index` ([B, N] positions per row) -> [B, N, F]; `x` itself
    when `index` is None. Example: index [[2], [0]] keeps row 0's position 2, row 1's 0."""
    if index is None:
        return x
    rows = torch.arange(x.shape[0], device=x.device)[:, None]  # [B, 1]
    return x[rows, index]
