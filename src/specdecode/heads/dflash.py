"""The DFlash block drafter at inference: a few decoder layers that fill a block of masked
positions in one pass, conditioned on the target's fused states (DFlash, arXiv 2602.06036;
the folder format of z-lab's released drafters).

Per sequence the drafter keeps a context: per layer the keys and values of every committed
token whose target states are known. Token t's are k_norm(k_proj(c_t)) (RoPE at position t)
and v_proj(c_t), where c_t = hidden_norm(fc(the target's states after token t)) feeds every
layer alike (the context entries have no states of their own in the drafter). A block is
the last committed token (the anchor, at position a) and K mask entries at a + 1..a + K; its
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

config.json is a Qwen3 config of the drafter's layers (`num_hidden_layers` of them) with
`dflash_config`: block_size (the anchor plus the block_size - 1 tokens it drafts),
target_layer_ids (the target layers whose outputs are fused, Hugging Face's hidden_states
index minus 1: our `feature_layers`, the inputs of the layers after them), mask_token_id (the
token whose embedding a mask entry reads), and optionally output_multiplier,
final_logit_softcapping and input_embedding_scale. A folder `specdecode train --method
dflash` writes has a learned `mask_embed` tensor ([h]), mask_token_id null and block_inputs
"anchored" (z-lab's drafters: "embeddings", the default), and the draft
vocabulary it was trained over (`draft_vocab_size` and EAGLE-3's `d2t` offsets): its logits
then cover those tokens only, through the target's output rows of them in the target's format
(on the CPU the output matrix is most of a block's cost: 151,936 rows for Qwen2.5). Not read:
DFlash2's convolutions and candidate selector, causal or sliding-window drafter layers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.errors import UserError
from specdecode.heads.files import (
    check_head_folder,
    d2t_to_draft_ids,
    draft_ids_to_d2t,
    read_head_tensors,
    tensors_for_target,
)
from specdecode.model.attention import pass_view
from specdecode.model.config import ModelConfig, read_config_json
from specdecode.model.linear import make_linear
from specdecode.model.norm import RMSNorm
from specdecode.model.rope import Rotary
from specdecode.model.transformer import Block, Transformer
from specdecode.model.trimmed_linear import check_kept, trimmed_linear

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBED = "mask_embed"  # a trained folder's learned mask embedding ([h])
BLOCK_INPUTS = ("embeddings", "anchored")  # what a block's entries start from (module docstring)


@dataclass(frozen=True, slots=True)
class BlockInput:
    """One sequence's block in a pass (`DFlashHead.blocks`): the anchor (its last committed
    token), its mask entries and fc(its newest context entry's states) ([h]; read where
    block_inputs is "anchored")."""

    anchor: int
    masks: int
    newest: Tensor | None


@dataclass(frozen=True, slots=True)
class DFlashHeadConfig:
    """A block drafter's shape (module docstring).

    layers: its decoder layers' shape (num_layers: how many; vocab_size: the target's).
    target_layer_ids: the target layers whose outputs are fused (fc: len * h -> h).
    block_size: the anchor plus the most tokens one block drafts.
    mask_token_id: the token whose embedding a mask entry reads (None: a learned `mask_embed`).
    num_target_layers: the target's layer count it was trained for (None: not said).
    output_multiplier: the logits' scale. logit_softcap: cap * tanh(logits / cap) (None: none).
    embedding_scale: what the block's embeddings are multiplied by.
    draft_vocab_size: the tokens its logits cover (`d2t` in the folder; None: every token).
    block_inputs: "embeddings" (z-lab's: each entry its embedding) or "anchored" (those plus
        fc(the newest context entry's states), and on mask entries the anchor's embedding).
    """

    layers: ModelConfig
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int | None = None
    num_target_layers: int | None = None
    output_multiplier: float = 1.0
    logit_softcap: float | None = None
    embedding_scale: float = 1.0
    draft_vocab_size: int | None = None
    block_inputs: str = "embeddings"

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise UserError(
                f"a DFlash block_size must be >= 2 (anchor + drafts), got {self.block_size}"
            )
        if not self.target_layer_ids or min(self.target_layer_ids) < -1:
            raise UserError(
                "DFlash target_layer_ids must be layer indices (-1: the embeddings), got "
                f"{self.target_layer_ids}"
            )
        if self.layers.sliding_layers:
            raise UserError("DFlash drafters with sliding-window layers are not supported")
        if self.block_inputs not in BLOCK_INPUTS:
            raise UserError(
                f"unknown DFlash block_inputs {self.block_inputs!r}; allowed: "
                f"{', '.join(BLOCK_INPUTS)}"
            )

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target states the drafter reads (`Transformer.forward`'s `hidden_layers`: the
        inputs of the layers after target_layer_ids)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def max_draft(self) -> int:
        """The most tokens one block drafts."""
        return self.block_size - 1

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> DFlashHeadConfig:
        """From a drafter's config.json (`where` names it in errors)."""
        arch = list(raw.get("architectures") or [])
        if arch and ARCHITECTURE not in arch:
            raise UserError(
                f"{where} is a {arch[0]}, not a {ARCHITECTURE} (DFlash2's convolutions and "
                "candidate selector are not supported)"
            )
        extra = raw.get("dflash_config")
        if not isinstance(extra, Mapping) or "target_layer_ids" not in extra:
            raise UserError(f"{where}: config.json lacks dflash_config.target_layer_ids")
        if extra.get("is_causal", raw.get("is_causal")):
            raise UserError(f"{where}: causal DFlash layers are not supported (is_causal true)")
        softcap = extra.get("final_logit_softcapping")
        mask = extra.get("mask_token_id")
        target_layers = raw.get("num_target_layers", extra.get("num_target_layers"))
        return cls(
            ModelConfig.from_hf_dict(dict(raw)),
            tuple(int(i) for i in extra["target_layer_ids"]),
            int(extra.get("block_size", 16)),
            None if mask is None else int(mask),
            None if target_layers is None else int(target_layers),
            float(extra.get("output_multiplier", 1.0)),
            float(softcap) if softcap else None,
            float(extra.get("input_embedding_scale", 1.0)),
            None if raw.get("draft_vocab_size") is None else int(raw["draft_vocab_size"]),
            str(extra.get("block_inputs", "embeddings")),
        )

    @classmethod
    def from_folder(cls, path: Path) -> DFlashHeadConfig:
        """Read `path/config.json`."""
        return read_config_json(
            path,
            lambda raw: cls.from_json(raw, str(path)),
            "a DFlash drafter folder holds config.json and model.safetensors",
        )

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        num_layers: int,
        block_size: int,
        feature_layers: tuple[int, ...],
        draft_vocab_size: int | None = None,
        block_inputs: str = "anchored",
    ) -> DFlashHeadConfig:
        """A drafter of `num_layers` layers shaped as the target's (Qwen3-style: q/k norms;
        q/k/v/o biases where the target's q/k/v have them), reading `feature_layers`, with a
        learned mask embedding, logits over `draft_vocab_size` tokens (None: all) and blocks
        starting from `block_inputs`."""
        layers = replace(
            target,
            architecture="qwen3",
            num_layers=num_layers,
            qk_norm=True,
            tie_word_embeddings=False,
            sliding_window=None,
            sliding_layers=(),
        )
        ids = tuple(i - 1 for i in sorted(feature_layers))
        return cls(
            layers,
            ids,
            block_size,
            None,
            target.num_layers,
            draft_vocab_size=draft_vocab_size,
            block_inputs=block_inputs,
        )

    def to_json(self, extra: Mapping[str, object] | None = None) -> str:
        """config.json: a Qwen3 config of the layers with dflash_config (`extra` under
        "specdecode")."""
        lay = self.layers
        raw: dict[str, object] = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": lay.hidden_size,
            "intermediate_size": lay.intermediate_size,
            "num_hidden_layers": lay.num_layers,
            "num_attention_heads": lay.num_heads,
            "num_key_value_heads": lay.num_kv_heads,
            "head_dim": lay.head_dim,
            "hidden_act": lay.activation,
            "rms_norm_eps": lay.rms_norm_eps,
            "rope_theta": lay.rope_theta,
            "max_position_embeddings": lay.max_position_embeddings,
            "attention_bias": lay.qkv_bias,
            "vocab_size": lay.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "block_size": self.block_size,
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "block_inputs": self.block_inputs,
            },
        }
        if lay.rope_scaling is not None:
            raw["rope_scaling"] = lay.rope_scaling.to_hf_dict()
        if extra:
            raw["specdecode"] = dict(extra)
        return json.dumps(raw, indent=2) + "\n"

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a target other than the one the drafter was made for."""
        lay = self.layers
        wrong = [
            f"{name} {mine} (target {theirs})"
            for name, mine, theirs in (
                ("hidden_size", lay.hidden_size, target.hidden_size),
                ("vocab_size", lay.vocab_size, target.vocab_size),
                ("num_target_layers", self.num_target_layers, target.num_layers),
            )
            if mine is not None and mine != theirs
        ]
        if max(self.feature_layers) > target.num_layers:
            ids = list(self.target_layer_ids)
            wrong.append(f"target_layer_ids {ids} (target has {target.num_layers} layers)")
        if wrong:
            raise UserError(f"this DFlash drafter was made for another target: {', '.join(wrong)}")


def dflash_tensor_shapes(cfg: DFlashHeadConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the drafter needs (z-lab's names; `mask_embed` where
    mask_token_id is None, `d2t` where draft_vocab_size is set)."""
    lay = cfg.layers
    h, inter, dim = lay.hidden_size, lay.intermediate_size, lay.head_dim
    q, kv = lay.num_heads * dim, lay.num_kv_heads * dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(lay.num_layers):
        at = f"layers.{i}."
        shapes |= {
            f"{at}input_layernorm.weight": (h,),
            f"{at}post_attention_layernorm.weight": (h,),
            f"{at}self_attn.q_proj.weight": (q, h),
            f"{at}self_attn.k_proj.weight": (kv, h),
            f"{at}self_attn.v_proj.weight": (kv, h),
            f"{at}self_attn.o_proj.weight": (h, q),
            f"{at}self_attn.q_norm.weight": (dim,),
            f"{at}self_attn.k_norm.weight": (dim,),
            f"{at}mlp.gate_proj.weight": (inter, h),
            f"{at}mlp.up_proj.weight": (inter, h),
            f"{at}mlp.down_proj.weight": (h, inter),
        }
        if lay.qkv_bias:  # Qwen3's attention_bias: q, k, v and o all have one
            pairs = (("q", q), ("k", kv), ("v", kv), ("o", h))
            shapes |= {f"{at}self_attn.{p}_proj.bias": (n,) for p, n in pairs}
    if cfg.mask_token_id is None:
        shapes[MASK_EMBED] = (h,)
    if cfg.draft_vocab_size is not None:
        shapes["d2t"] = (cfg.draft_vocab_size,)
    return shapes


class DFlashHead(nn.Module):
    """A DFlash block drafter for one target (module docstring).

    Its layers are decoder `Block`s (Qwen3's), so a block pass is a TREE pass over a
    sequence's cache (every block entry sees the whole block): one native call per layer
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
        for r, i in enumerate(inputs):
            embed = self.embed_tokens(torch.tensor([i.anchor], device=self.device))  # [1, h]
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


def save_dflash_head(
    path: Path,
    cfg: DFlashHeadConfig,
    weights: Mapping[str, Tensor],
    extra: Mapping[str, object] | None = None,
) -> None:
    """Write `cfg` (config.json; `extra` under "specdecode") and `weights` (model.safetensors)
    into folder `path`."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.detach().contiguous().cpu() for n, t in weights.items()},
        str(path / "model.safetensors"),
    )
    (path / "config.json").write_text(cfg.to_json(extra))
