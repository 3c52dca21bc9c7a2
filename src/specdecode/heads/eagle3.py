"""The EAGLE-3 draft head at inference: one decoder layer over [token embedding, feature].

Li et al. 2025, "EAGLE-3": the head reads the inputs of a low, a middle and a high layer of
the target, fuses them (`fc`: len(layers) * h -> h), and runs one decoder layer whose q/k/v
see [norm(embed(token)), norm(feature)] (2h wide); its residual stream starts from the
feature. The output head covers a reduced draft vocabulary; `draft_to_target` maps its rows
to target ids. Entry t of a sequence reads (token t + 1, the target's state after token t) at
position t and predicts token t + 2; a drafted entry reads the head's own pre-norm output in
place of the target's state.

The head's projections use the model's weight formats (`make_linear`: int8 by default under an
int8 target) and the native per-query attention over its own one-layer `KVCache`, so a draft
is the same whether its request runs alone or in a batch; in DECODE and TREE passes its layer
after the input norms is one native call (`transformer.native_layer`: the same kernels in the
same order).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.cache.kv_cache import KVCache
from specdecode.heads.eagle3_config import Eagle3HeadConfig
from specdecode.heads.files import (
    check_head_folder,
    d2t_to_draft_ids,
    read_head_tensors,
    save_head_folder,
    tensors_for_target,
)
from specdecode.model.attention import Attention, pass_view
from specdecode.model.linear import make_linear
from specdecode.model.norm import RMSNorm
from specdecode.model.rope import Rotary
from specdecode.model.transformer import (
    HEAD_FORMAT,
    MLP,
    Transformer,
    at_positions,
    native_layer,
    run_native,
)

LAYER = "layers.0."


def mask_token(level: int) -> int:
    """The token id of a parallel head's mask entry for draft level `level` (1..P-1): -level;
    its embedding and feature are row level - 1 of `mask_embed` / `mask_hidden`."""
    return -level


def head_tensor_shapes(cfg: Eagle3HeadConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an EAGLE-3 head needs (speculators' names)."""
    lay = cfg.layer
    h, q_out, kv_out = (
        lay.hidden_size,
        lay.num_heads * lay.head_dim,
        lay.num_kv_heads * lay.head_dim,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.feature_size),
        f"{LAYER}input_layernorm.weight": (h,),
        f"{LAYER}hidden_norm.weight": (h,),
        f"{LAYER}self_attn.q_proj.weight": (q_out, 2 * h),
        f"{LAYER}self_attn.k_proj.weight": (kv_out, 2 * h),
        f"{LAYER}self_attn.v_proj.weight": (kv_out, 2 * h),
        f"{LAYER}self_attn.o_proj.weight": (h, q_out),
        f"{LAYER}post_attention_layernorm.weight": (h,),
        f"{LAYER}mlp.gate_proj.weight": (lay.intermediate_size, h),
        f"{LAYER}mlp.up_proj.weight": (lay.intermediate_size, h),
        f"{LAYER}mlp.down_proj.weight": (h, lay.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
    }
    if cfg.parallel_tokens:  # per drafted level 1..P-1 a mask token embedding and feature offset
        levels = max(cfg.parallel_tokens - 1, 1)
        shapes |= {"mask_embed": (levels, h), "mask_hidden": (levels, h)}
    if lay.qkv_bias:
        shapes |= {
            f"{LAYER}self_attn.q_proj.bias": (q_out,),
            f"{LAYER}self_attn.k_proj.bias": (kv_out,),
            f"{LAYER}self_attn.v_proj.bias": (kv_out,),
        }
    return shapes


class Eagle3Head(nn.Module):
    """An EAGLE-3 head built from speculators-named weights, for one target.

    Args:
        cfg: the head's shape.
        weights: its tensors (`head_tensor_shapes`; "fc.bias" optional), in the wanted dtype.
        embed: the target's token embedding (shared, frozen).
        quantization: the projections' format (None, "int8" or "int4").
        max_positions: RoPE table length (the target's context).
    """

    def __init__(
        self,
        cfg: Eagle3HeadConfig,
        weights: Mapping[str, Tensor],
        embed: nn.Embedding,
        quantization: str | None,
        max_positions: int,
    ) -> None:
        super().__init__()
        self.config = cfg
        eps = cfg.layer.rms_norm_eps
        self.embed_tokens = embed
        self.fc = make_linear(weights["fc.weight"], weights.get("fc.bias"), quantization)
        self.input_layernorm = RMSNorm(weights[f"{LAYER}input_layernorm.weight"], eps)
        self.hidden_norm = RMSNorm(weights[f"{LAYER}hidden_norm.weight"], eps)
        self.self_attn = Attention(cfg.layer, dict(weights), f"{LAYER}self_attn.", quantization)
        self.post_attention_layernorm = RMSNorm(
            weights[f"{LAYER}post_attention_layernorm.weight"], eps
        )
        self.mlp = MLP(dict(weights), f"{LAYER}mlp.", quantization)
        self.norm = RMSNorm(weights["norm.weight"], eps)
        self.lm_head = make_linear(
            weights["lm_head.weight"], quantization=HEAD_FORMAT[quantization]
        )
        # draft row -> target id
        self.register_buffer("draft_to_target", d2t_to_draft_ids(weights["d2t"]))
        # a parallel head's mask entries: per level 1..P-1 a token embedding and a feature offset
        self.mask_embed: Tensor | None = weights.get("mask_embed")
        self.mask_hidden: Tensor | None = weights.get("mask_hidden")
        device = weights["norm.weight"].device
        layer = cfg.layer
        self.rotary = Rotary(
            layer.head_dim, layer.rope_theta, max_positions, layer.rope_scaling
        ).to(device)
        # the layer after the input norms as one native call (None: no native kernel)
        self.native = native_layer(
            self.self_attn,
            self.mlp,
            input_norm=None,  # q|k|v read [norm(embedding), norm(feature)], normed here
            mlp_in_norm=self.post_attention_layernorm,
            attn_out_norm=None,
            mlp_out_norm=None,
            eps=eps,
            dtype=self.norm.weight.dtype,
        )

    kind = "eagle3"

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the head reads (`Transformer.forward`'s
        `hidden_layers`)."""
        return self.config.aux_layers

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size."""
        return self.config.layer.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty one-layer cache for `batch_size` rows, its pool sized for `capacity` entries
        per row to start with (it grows)."""
        lay = self.config.layer
        return KVCache(
            1, batch_size, lay.num_kv_heads, lay.head_dim, capacity, self.dtype, self.device
        )

    @torch.inference_mode()
    def fuse(self, features: Tensor) -> Tensor:
        """The target's concatenated states ([..., len(layers) * h]) -> the head's input
        feature ([..., h])."""
        return self.fc(features.to(self.dtype))

    def mask_features(self, newest: Tensor, levels: int) -> Tensor:
        """A parallel head's mask entries 1..levels after an entry whose fused feature is
        `newest` ([h]): their features, `newest` plus each level's learned offset ([levels, h])."""
        assert self.mask_hidden is not None, "only a parallel head has mask entries"
        return newest + self.mask_hidden[:levels]

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [B, T] int64 target ids (entry t: token t + 1); < 0: mask_token(j)
        hidden: Tensor,  # [B, T, h]: fused target states, the head's own pre-norm outputs,
        # or (mask entries) `mask_features`
        meta: AttentionMetadata,
        cache: KVCache,
        logits_index: Tensor | None = None,  # [B, N] which of the T entries get logits
    ) -> tuple[Tensor, Tensor]:
        """Run the entries as `meta` lays them out (stored in `cache`, lengths advanced).

        Returns (logits [B, N, Vd] over the draft vocabulary (N = T when logits_index is
        None), pre-norm outputs [B, T, h]: the feature a drafted next entry reads).
        """
        cache.prepare(meta)
        view, cos, sin = pass_view(self.self_attn, self.rotary, meta, self.dtype)
        embeds = self.embed_tokens(tokens.clamp(min=0))  # [B, T, h]
        if self.mask_embed is not None:
            masks = self.mask_embed[(-tokens - 1).clamp(min=0)]  # [B, T, h]
            embeds = torch.where((tokens < 0)[..., None], masks, embeds)
        embeds = self.input_layernorm(embeds)
        normed = self.hidden_norm(hidden)  # [B, T, h]
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([embeds, normed], dim=-1)  # [B, T, 2h]
        if view.per_query and self.native is not None:
            x = run_native(self.native, (x, residual), cos, sin, cache, 0, meta)  # [B, T, h]
        else:
            x = residual + self.self_attn(x, cos, sin, cache, 0, meta, view)
            x = x + self.mlp(self.post_attention_layernorm(x))  # [B, T, h]
        cache.advance(meta)
        return self.lm_head(self.norm(at_positions(x, logits_index))), x  # [B, N, Vd], [B, T, h]


def read_head_weights(path: Path, cfg: Eagle3HeadConfig) -> dict[str, Tensor]:
    """The head's tensors from `path`'s *.safetensors, checked against `cfg` (names, shapes,
    a draft-to-target map inside the target's vocabulary); "midlayer." names (the original
    EAGLE-3 layout) are read as "layers.0."."""
    return read_head_tensors(
        path,
        head_tensor_shapes(cfg),
        {"fc.bias": (cfg.hidden_size,)},
        cfg.layer.vocab_size,
        lambda name: name.replace("midlayer.", LAYER),
    )


def load_eagle3_head(path: Path, target: Transformer, quantization: str | None) -> Eagle3Head:
    """Load the head in folder `path` for `target` (refused if trained for another target),
    its projections in `quantization` and its other tensors in the target's dtype."""
    check_head_folder(path, "EAGLE-3")
    cfg = Eagle3HeadConfig.from_folder(path, target.config.num_layers)
    cfg.check_target(target.config)
    weights = read_head_weights(path, cfg)
    used = {*head_tensor_shapes(cfg), "fc.bias"}
    cast = tensors_for_target(weights, used, target.device, target.dtype)
    head = Eagle3Head(
        cfg, cast, target.embed_tokens, quantization, target.config.max_position_embeddings
    )
    return head.eval()


def save_eagle3_head(
    path: Path,
    cfg: Eagle3HeadConfig,
    weights: Mapping[str, Tensor],
    extra: dict[str, object] | None = None,
) -> None:
    """Write `cfg` (config.json, speculators' keys; `extra` under "specdecode") and `weights`
    (model.safetensors, with the derived `t2d` mask) into folder `path`."""
    save_head_folder(path, cfg.to_json(extra=extra), weights, cfg.layer.vocab_size)
