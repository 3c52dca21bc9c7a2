"""Starting weights of a draft head: random, or borrowed from the target (saves compute)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from specdecode.errors import UserError
from specdecode.heads.eagle3 import LAYER, head_tensor_shapes
from specdecode.heads.eagle3_config import Eagle3HeadConfig
from specdecode.heads.exit_head import ExitHeadConfig
from specdecode.heads.files import draft_ids_to_d2t
from specdecode.model.loading import LAYER_TENSORS

INIT_STD = 0.02  # Hugging Face's initializer_range
INITS = ("target", "random")


def read_tensors(path: Path, names: list[str]) -> dict[str, Tensor]:
    """Only the named tensors of a model folder's *.safetensors files (fp32)."""
    found: dict[str, Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in set(names) & set(f.keys()):
                found[name] = f.get_tensor(name).float()
    missing = sorted(set(names) - set(found))
    if missing:
        raise UserError(f"{path} lacks {missing[:3]}: cannot start the head from the target")
    return found


def target_output(target_path: Path, draft_ids: Tensor) -> tuple[Tensor, Tensor]:
    """The target's output rows for the draft vocabulary ([Vd, h]; the embedding's when tied)
    and its final norm ([h]), fp32."""
    names: set[str] = set()
    for file in target_path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
    t = read_tensors(target_path, [head, "model.norm.weight"])
    return t[head][draft_ids], t["model.norm.weight"]


def initial_exit_weights(
    cfg: ExitHeadConfig, target_path: Path, draft_ids: Tensor, init: str, seed: int
) -> dict[str, Tensor]:
    """An exit head's first weights (fp32; d2t from `draft_ids`, [Vd] sorted target ids).

    "target" (Medusa's start): zero blocks (each head starts as the identity) and the target's
    own output rows and final norm, so every head starts as the target's next-token head.
    "random": N(0, 0.02) blocks and output rows, a unit norm.
    """
    if init not in INITS:
        raise UserError(f"unknown head init {init!r}; allowed: {', '.join(INITS)}")
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, Tensor] = {}
    for name, shape in cfg.tensor_shapes().items():
        if name == "d2t":
            weights[name] = draft_ids_to_d2t(draft_ids)
        elif name == "norm.weight":
            weights[name] = torch.ones(shape)
        elif init == "target" or name.endswith(".bias"):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * INIT_STD
    if init == "target":
        rows, norm = target_output(target_path, draft_ids)
        weights["lm_head.weight"] = rows
        if cfg.normed_input:
            weights["norm.weight"] = norm
    return weights


def random_weights(
    shapes: dict[str, tuple[int, ...]], draft_ids: Tensor, init: str, seed: int
) -> dict[str, Tensor]:
    """A layer head's "random" start (fp32): N(0, 0.02) projections, unit norms, zero biases,
    d2t from `draft_ids` ([Vd] sorted target ids); UserError for an `init` not in INITS."""
    if init not in INITS:
        raise UserError(f"unknown head init {init!r}; allowed: {', '.join(INITS)}")
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        if name == "d2t":
            weights[name] = draft_ids_to_d2t(draft_ids)
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * INIT_STD
    return weights


def initial_weights(
    cfg: Eagle3HeadConfig, target_path: Path, draft_ids: Tensor, init: str, seed: int
) -> dict[str, Tensor]:
    """The head's first weights (fp32; d2t from `draft_ids`, [Vd] sorted target ids).

    "random": N(0, 0.02) projections, unit norms. "target": the output head from the target's
    own rows for the draft vocabulary and its final norm; the decoder layer from the target's
    last layer (q/k/v read the half-sum of the embedding and feature halves); fc passes the
    highest fused layer through unchanged.
    """
    weights = random_weights(head_tensor_shapes(cfg), draft_ids, init, seed)
    if init == "random":
        return weights
    if cfg.verifier_layers is None:
        raise UserError("init 'target' needs the target's layer count in the head config")
    last = f"model.layers.{cfg.verifier_layers - 1}."
    parts = LAYER_TENSORS
    t = read_tensors(target_path, [last + p for p in parts])
    weights["lm_head.weight"], weights["norm.weight"] = target_output(target_path, draft_ids)
    for p in parts:
        weights[LAYER + p] = t[last + p]
    weights[f"{LAYER}hidden_norm.weight"] = t[last + "input_layernorm.weight"]
    for p in ("q", "k", "v"):
        w = t[f"{last}self_attn.{p}_proj.weight"]
        weights[f"{LAYER}self_attn.{p}_proj.weight"] = torch.cat([w, w], dim=1) * 0.5
    fc = torch.zeros(cfg.hidden_size, cfg.feature_size)
    fc[:, -cfg.target_hidden_size :] = torch.eye(cfg.hidden_size)
    weights["fc.weight"] = fc
    return weights
