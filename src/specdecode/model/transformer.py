"""A native Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3): RMSNorm,
RoPE (Llama 3's frequency scaling, Phi-3's LongRoPE; a local base for sliding layers), GQA with
optional sliding windows, SwiGLU or GeGLU, optional qkv bias, optional q/k head norms, Gemma's
norms around each sublayer, embedding scale and soft-capping of attention scores and logits.

Attention lives in `model.attention`, RMSNorm in `model.norm`. `Transformer.forward` maps
tokens to logits and hidden states. It never samples, never tokenizes and never changes its own
config; all generation state lives in the `KVCache`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode import kernels
from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.cache.kv_cache import KVCache
from specdecode.errors import UserError
from specdecode.model.attention import Attention, PassView, pass_view
from specdecode.model.config import ModelConfig
from specdecode.model.gguf_linear import REQUANTIZED, GgufWeight, cat_weights
from specdecode.model.linear import make_linear
from specdecode.model.norm import RMSNorm
from specdecode.model.quant import AUTO, parse_quantization
from specdecode.model.rope import Rotary


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


def run_native(
    layer: Callable[..., Tensor],
    inputs: tuple[Tensor, ...],
    cos: Tensor,
    sin: Tensor,
    cache: KVCache,
    index: int,
    meta: AttentionMetadata,
) -> Tensor:
    """Run a `native_layer` over a DECODE or TREE pass: `inputs` are (x,) for a block, (normed
    input, residual) for one built without an input norm; cos, sin [B, T, D] fp32; `index` the
    layer's place in `cache`. Returns [B, T, hidden]."""
    tree_starts = meta.tree_starts or ()
    return layer(
        *inputs,
        cos,
        sin,
        cache.k,
        cache.v,
        index,
        meta.starts,
        tree_starts,
        meta.tree_mask,
        cache.block_table,
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
        dtype: torch.dtype,
    ) -> None:
        """Layer `layer` of `w` (Hugging Face names), its projections in `quantization`, run
        over activations of `dtype` (`Transformer.dtype`: the embedding's)."""
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
            return run_native(self.native, (x,), cos, sin, cache, self.layer, meta)
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
            Block(cfg, weights, i, self.quantization, embed.dtype) for i in range(cfg.num_layers)
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
        # islice: a ModuleList slice builds a new ModuleList (30 add_module calls on SmolLM2)
        for index, block in enumerate(itertools.islice(self.layers, num_layers)):
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
