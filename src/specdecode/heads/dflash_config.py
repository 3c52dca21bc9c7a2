"""A DFlash block drafter's folder: its config (`DFlashHeadConfig`), tensor shapes and writer
(the drafter itself: `heads.dflash`).

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
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import Tensor

from specdecode.errors import UserError
from specdecode.heads.files import write_folder
from specdecode.model.config import ModelConfig, read_config_json

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBED = "mask_embed"  # a trained folder's learned mask embedding ([h])
BLOCK_INPUTS = ("embeddings", "anchored")  # what a block's entries start from (module docstring)


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


def save_dflash_head(
    path: Path,
    cfg: DFlashHeadConfig,
    weights: Mapping[str, Tensor],
    extra: Mapping[str, object] | None = None,
) -> None:
    """Write `cfg` (config.json; `extra` under "specdecode") and `weights` (model.safetensors)
    into folder `path`."""
    write_folder(path, cfg.to_json(extra), weights)
