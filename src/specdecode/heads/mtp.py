"""MTP (multi-token prediction) layers shipped inside a checkpoint, read and run as a head.

DeepSeek-V3 (and GLM-4.5, MiMo, Qwen3-Next) train with an extra module after the last block
that predicts the token after next: it takes the model's final state h_t (final-normed, as
vLLM and SGLang hand it over) and the next token's embedding e(t + 1), and runs

    x = proj([norm_e(e(t + 1)), norm_h(h_t)])      (2h -> h; MiMo stores the halves the
                                                     other way round: [norm_h, norm_e])
    y = block(x)                                   (one decoder block of the model's own kind)
    logits(t + 2) = head(norm_out(y))              (the model's output head, or the layer's
                                                     own `shared_head.head` where it has one)

Chained drafting feeds the layer its own output in place of h: the pre-norm y (DeepSeek-V3's
layout) or norm_out(y) (MiMo's and Qwen3-Next's, whose layers return the normed state), as
vLLM does. DeepSeek-V3 and MiMo zero the embedding of the entry at position 0.

The checkpoints name the parts differently (`LAYOUTS`); each is read into one canonical form.
Only the first MTP layer is read, and drafts every step (as vLLM's MiMo drafts with the first
alone); a checkpoint with `num_nextn_predict_layers` > 1 has its others left unread.
Our decoder runs Llama-family blocks (`model.transformer.Block`), so the layer's block is of
the target's architecture: a DeepSeek-V3 or Qwen3-Next checkpoint itself (MLA, MoE, gated
attention) does not load here, while MiMo-7B (a Qwen2 decoder) does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.cache.kv_cache import KVCache
from specdecode.errors import ModelNotFoundError, UserError
from specdecode.model.attention import pass_view
from specdecode.model.config import ModelConfig
from specdecode.model.linear import make_linear
from specdecode.model.loading import layer_tensor_names
from specdecode.model.norm import RMSNorm
from specdecode.model.transformer import HEAD_FORMAT, Block, Transformer, at_positions

# canonical names of the layer's own parts (the block's are "model.layers.0.<its names>")
PARTS = ("embed_norm", "hidden_norm", "proj", "out_norm")
OWN_HEAD = "head"
BLOCK = "model.layers.0."
WEIGHTS = "model.safetensors"


@dataclass(frozen=True, slots=True)
class MtpLayout:
    """How one family of checkpoints names and wires its MTP layer.

    name: the layout's name (in messages and docs).
    models: the checkpoints that use it.
    prefix: where the layer's tensors sit; "{n}" stands for num_hidden_layers.
    parts: canonical part (`PARTS`, `OWN_HEAD`) -> its tensor's name under `prefix`.
    block: where the decoder block's tensors sit under `prefix`.
    hidden_first: the projection's input is [norm_h(h), norm_e(e)] (else [norm_e, norm_h]).
    zero_first: the entry at position 0 reads a zero embedding.
    feeds_normed: a chained step reads norm_out(y) (else the pre-norm y).
    """

    name: str
    models: str
    prefix: str
    parts: Mapping[str, str]
    block: str
    hidden_first: bool
    zero_first: bool
    feeds_normed: bool

    def names(self, num_layers: int) -> tuple[str, dict[str, str]]:
        """(the block's prefix, canonical part -> checkpoint name) for a model of
        `num_layers` blocks."""
        prefix = self.prefix.format(n=num_layers)
        return prefix + self.block, {part: prefix + name for part, name in self.parts.items()}


LAYOUTS = (
    MtpLayout(
        "deepseek_v3",
        "DeepSeek-V3/R1, GLM-4.5",
        "model.layers.{n}.",
        {
            "embed_norm": "enorm.weight",
            "hidden_norm": "hnorm.weight",
            "proj": "eh_proj.weight",
            "out_norm": "shared_head.norm.weight",
            OWN_HEAD: "shared_head.head.weight",
        },
        "",
        hidden_first=False,
        zero_first=True,
        feeds_normed=False,
    ),
    MtpLayout(
        "qwen3_next",
        "Qwen3-Next",
        "mtp.",
        {
            "embed_norm": "pre_fc_norm_embedding.weight",
            "hidden_norm": "pre_fc_norm_hidden.weight",
            "proj": "fc.weight",
            "out_norm": "norm.weight",
        },
        "layers.0.",
        hidden_first=False,
        zero_first=False,
        feeds_normed=True,
    ),
    MtpLayout(
        "mimo",
        "MiMo",
        "model.mtp_layers.0.",
        {
            "embed_norm": "token_layernorm.weight",
            "hidden_norm": "hidden_layernorm.weight",
            "proj": "input_proj.weight",
            "out_norm": "final_layernorm.weight",
        },
        "",
        hidden_first=True,
        zero_first=True,
        feeds_normed=True,
    ),
)


DEEPSEEK_V3 = LAYOUTS[0]  # the layout `train --method mtp` writes


def block_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One decoder block's tensor names (`model.loading.layer_tensor_names`) -> shapes."""
    h, inter, dim = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * dim, cfg.num_kv_heads * dim
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (dim,),
        "self_attn.k_norm.weight": (dim,),
        "pre_feedforward_layernorm.weight": (h,),
        "post_feedforward_layernorm.weight": (h,),
    }
    return {name: shapes[name] for name in layer_tensor_names(cfg)}


def save_mtp_folder(
    path: Path, config: Mapping[str, object], tensors: Mapping[str, Tensor]
) -> None:
    """Write an MTP layer as a folder method "mtp" reads (`"model": path`): `config` (the
    target's config.json, with `num_nextn_predict_layers` 1) and `tensors` (the layer's, under
    a layout's names) as model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(path / WEIGHTS))
    text = json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2)
    (path / "config.json").write_text(text + "\n")


def find_layout(names: set[str], num_layers: int) -> MtpLayout | None:
    """The layout whose projection `names` (a checkpoint's tensor names) hold, or None."""
    for layout in LAYOUTS:
        if layout.names(num_layers)[1]["proj"] in names:
            return layout
    return None


def _tensor_names(files: list[Path]) -> dict[str, Path]:
    """Tensor name -> the *.safetensors file holding it (UserError for an unreadable file)."""
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as tensors:
                where.update(dict.fromkeys(tensors.keys(), file))
        except (SafetensorError, OSError, ValueError) as err:
            raise UserError(f"cannot read weights from {file} (malformed?): {err}") from err
    return where


def read_mtp_weights(path: Path, cfg: ModelConfig) -> tuple[MtpLayout, dict[str, Tensor]]:
    """The first MTP layer of the checkpoint in folder `path` (of the model `cfg` describes):
    its layout and tensors under canonical names (`PARTS`, optional `OWN_HEAD`, the block's
    as `BLOCK` + its names), the projection's columns in [embedding, state] order, shapes
    checked. UserError where the folder holds no MTP layer or lacks a tensor of one."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weight files")
    where = _tensor_names(files)
    layout = find_layout(set(where), cfg.num_layers)
    if layout is None:
        looked = "; ".join(
            f"{lay.names(cfg.num_layers)[1]['proj']} ({lay.models})" for lay in LAYOUTS
        )
        raise UserError(
            f"{path} holds no MTP layer: none of {looked} is among its tensors (a model "
            "trained without multi-token prediction has none)"
        )
    block, parts = layout.names(cfg.num_layers)
    wanted = {checkpoint: canonical for canonical, checkpoint in parts.items()}
    wanted |= {block + name: BLOCK + name for name in layer_tensor_names(cfg)}
    missing = [
        name for name, canonical in wanted.items() if name not in where and canonical != OWN_HEAD
    ]
    if missing:
        raise UserError(
            f"{path}: its {layout.name} MTP layer lacks {len(missing)} tensor(s), e.g. "
            f"{missing[:3]}"
        )
    weights: dict[str, Tensor] = {}
    for name, canonical in wanted.items():
        if name in where:
            with safe_open(str(where[name]), framework="pt") as tensors:
                weights[canonical] = tensors.get_tensor(name)
    h = cfg.hidden_size
    expected = {part: (h,) for part in PARTS} | {"proj": (h, 2 * h), OWN_HEAD: (cfg.vocab_size, h)}
    expected |= {BLOCK + name: shape for name, shape in block_shapes(cfg).items()}
    named = {canonical: checkpoint for checkpoint, canonical in wanted.items()}
    wrong = [
        f"{named[part]} {tuple(weights[part].shape)} (needs {shape})"
        for part, shape in expected.items()
        if part in weights and tuple(weights[part].shape) != shape
    ]
    if wrong:
        raise UserError(f"{path}: MTP tensors of the wrong shape: {'; '.join(wrong)}")
    if layout.hidden_first:  # one order for every layout: [embedding, state]
        weights["proj"] = torch.cat([weights["proj"][:, h:], weights["proj"][:, :h]], dim=1)
    return layout, weights


class MtpHead(nn.Module):
    """A checkpoint's first MTP layer, run as a draft head over the target's final states
    (module docstring); the interface `drafters.eagle3`'s drafter drives.

    Args:
        layout: how the checkpoint wires the layer.
        cfg: the target's config (the block's kind and sizes).
        weights: the layer's tensors under canonical names (`read_mtp_weights`), in the
            target's dtype and on its device.
        target: the model it drafts for (its embedding, output head and RoPE tables, shared).
        quantization: the projections' format (None, "int8", "int4", a GGUF block type).
    """

    kind = "mtp"

    def __init__(
        self,
        layout: MtpLayout,
        cfg: ModelConfig,
        weights: Mapping[str, Tensor],
        target: Transformer,
        quantization: str | None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.feature_layers = (cfg.num_layers,)  # the target's final-normed states
        self.vocab_size = cfg.vocab_size
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.embed_tokens = target.embed_tokens
        self.embed_norm = RMSNorm(weights["embed_norm"], eps, offset)
        self.hidden_norm = RMSNorm(weights["hidden_norm"], eps, offset)
        self.proj = make_linear(weights["proj"], quantization=quantization)
        block = {n: w for n, w in weights.items() if n.startswith(BLOCK)}
        self.block = Block(cfg, block, 0, quantization, target.dtype)
        self.out_norm = RMSNorm(weights["out_norm"], eps, offset)
        self.own_head = None
        if OWN_HEAD in weights:
            self.own_head = make_linear(weights[OWN_HEAD], quantization=HEAD_FORMAT[quantization])
        self.target_head = target.head
        self.rotary = target.rotary
        vocab = torch.arange(cfg.vocab_size, device=target.device)
        self.register_buffer("draft_to_target", vocab)  # the whole vocabulary: row i = id i

    @property
    def dtype(self) -> torch.dtype:
        return self.out_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.out_norm.weight.device

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty one-layer cache for `batch_size` rows, its pool sized for `capacity`
        entries per row to start with (it grows)."""
        attn = self.block.self_attn
        return KVCache(
            1, batch_size, attn.num_kv_heads, attn.head_dim, capacity, self.dtype, self.device
        )

    def fuse(self, features: Tensor) -> Tensor:
        """The target's final states ([..., h]) as the layer reads them: as they are."""
        return features.to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [B, T] int64 target ids (entry t: token t + 1)
        hidden: Tensor,  # [B, T, h]: the target's final states, or the layer's own outputs
        meta: AttentionMetadata,
        cache: KVCache,
        logits_index: Tensor | None = None,  # [B, N] which of the T entries get logits
    ) -> tuple[Tensor, Tensor]:
        """Run the entries as `meta` lays them out (stored in `cache`, lengths advanced).

        Returns (logits [B, N, V] (N = T when logits_index is None), the states a chained
        next entry reads [B, T, h]: y or norm_out(y) by the layout).
        """
        cache.prepare(meta)
        attn = self.block.self_attn
        view, cos, sin = pass_view(attn, self.rotary, meta, self.dtype, attn.window)
        embeds = self.embed_tokens(tokens)  # [B, T, h]
        if self.layout.zero_first:
            embeds = embeds * (meta.positions != 0)[..., None].to(embeds.dtype)
        x = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2h]
        y = self.block(self.proj(x), cos, sin, cache, meta, view)  # [B, T, h]
        cache.advance(meta)
        normed = self.out_norm(y)  # [B, T, h]
        picked = at_positions(normed, logits_index)  # [B, N, h]
        logits = self.target_head(picked) if self.own_head is None else self.own_head(picked)
        return logits, normed if self.layout.feeds_normed else y


def load_mtp_head(path: Path, target: Transformer, quantization: str | None) -> MtpHead:
    """The first MTP layer of the checkpoint in folder `path`, for `target` (refused where the
    folder's config.json describes another model), its projections in `quantization`."""
    if not path.is_dir():
        raise ModelNotFoundError(f"no such model folder: {path}")
    cfg = ModelConfig.from_folder(path)
    mine, theirs = target.config, cfg
    fields = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads")
    differ = [f for f in fields if getattr(mine, f) != getattr(theirs, f)]
    if differ:
        said = ", ".join(f"{f} {getattr(theirs, f)} (target {getattr(mine, f)})" for f in differ)
        raise UserError(f"the MTP layer in {path} belongs to another model: {said}")
    layout, weights = read_mtp_weights(path, cfg)
    cast = {name: w.to(device=target.device, dtype=target.dtype) for name, w in weights.items()}
    return MtpHead(layout, target.config, cast, target, quantization).eval()
