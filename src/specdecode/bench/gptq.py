"""A model folder written as a 4-bit GPTQ checkpoint, for peers that read 4-bit weights only in
that layout (vLLM's CPU build: `vllm:bits=4`).

The layout is the one of Qwen's own published `*-GPTQ-Int4` checkpoints and of AutoGPTQ /
GPTQModel: 4 bits, groups of 128 input columns (64 or 32 where 128 does not divide a layer's
width, e.g. SmolLM2's 576), symmetric (zero point 8), no act-order; every
linear layer of the decoder blocks is quantized, embeddings, norms and the output head stay as
they are. The values are chosen by round-to-nearest (GPTQ's own quantizer without its
Hessian-guided error feedback, which needs calibration data and hours of CPU): a 4-bit format
of the same weights at the same speed as a calibrated one, since a kernel's speed does not
depend on which 4-bit values it reads; its output is a little further from the bf16 model's.

Per group of G inputs of an output row: scale = 2 max|w| / 15, q = clamp(round(w / scale) +
8, 0, 15), w ~ scale (q - 8). Tensors, with `in` inputs and `out` outputs:
    qweight [in / 8, out] int32: 8 values of q along the input axis, the first in the low bits
    scales  [in / G, out] float16
    qzeros  [in / G, out / 8] int32: 8 zero points (stored as 8 - 1, the v1 format) per word
    g_idx   [in] int32: each input's group
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdecode.errors import UserError
from specdecode.model.registry import build_atomically

BITS = 4
GROUPS = (128, 64, 32)  # group sizes, the largest that divides every layer's inputs is used
PACK = 32 // BITS  # values per int32
ZERO = 2 ** (BITS - 1)  # the symmetric zero point
FOLDER = "gptq-int4"  # beside the model's own files
# The decoder blocks' linear layers (Llama, Qwen2, Mistral, Gemma and Phi-3 names).
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def quantization_config(group: int) -> dict[str, object]:
    """config.json's `quantization_config` for groups of `group` inputs."""
    return {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": group,
        "sym": True,
        "desc_act": False,
        "lm_head": False,
        "checkpoint_format": "gptq",
    }


def _pack(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] integers in 0..15 -> [...] int32 words, value j of a word in bits 4j..4j+3."""
    shifts = torch.arange(PACK, dtype=torch.int64) * BITS  # [8]
    packed = (values.to(torch.int64) << shifts).sum(-1)  # [...] in 0..2^32 - 1
    return packed.to(torch.uint32).view(torch.int32)


def _unpack(words: torch.Tensor) -> torch.Tensor:
    """`_pack` undone: [...] int32 -> [..., 8] int64 in 0..15."""
    shifts = torch.arange(PACK, dtype=torch.int64) * BITS  # [8]
    return (words.view(torch.uint32).to(torch.int64).unsqueeze(-1) >> shifts) & (2**BITS - 1)


def quantize(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """A linear layer's weight [out, in] as GPTQ's qweight, scales, qzeros and g_idx (module
    docstring) in groups of `group` inputs; `in` must be a multiple of `group`, `out` of 8."""
    out, width = weight.shape
    if width % group or out % PACK:
        raise UserError(
            f"GPTQ packs groups of {group} inputs and words of {PACK} outputs: a {out}x{width} "
            "weight does not split into them"
        )
    w = weight.float().reshape(out, width // group, group)  # [out, groups, group]
    scale = w.abs().amax(-1, keepdim=True) * 2 / (2**BITS - 1)  # [out, groups, 1]
    scale = scale.half().float().clamp_min(torch.finfo(torch.float16).tiny)  # as stored
    q = (torch.round(w / scale) + ZERO).clamp(0, 2**BITS - 1).reshape(out, width)
    groups = width // group
    per_word = q.t().reshape(width // PACK, PACK, out).transpose(1, 2)  # [in / 8, out, 8]
    zeros = torch.full((groups, out // PACK, PACK), ZERO - 1)  # [groups, out / 8, 8]
    return {
        "qweight": _pack(per_word),  # [in / 8, out]
        "scales": scale.reshape(out, groups).t().contiguous().half(),  # [groups, out]
        "qzeros": _pack(zeros),  # [groups, out / 8]
        "g_idx": torch.arange(width, dtype=torch.int32) // group,  # [in]
    }


def dequantize(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [out, in] that GPTQ tensors (`quantize`'s) stand for, in fp32."""
    q = _unpack(tensors["qweight"]).transpose(1, 2)  # [in / 8, 8, out]
    q = q.reshape(-1, q.shape[-1])  # [in, out]
    zero = _unpack(tensors["qzeros"]).flatten(1) + 1  # [groups, out]
    group = tensors["g_idx"].long()  # [in]
    return ((q - zero[group]) * tensors["scales"].float()[group]).t()


def _write(folder: Path, staging: Path) -> None:
    """`folder`'s model written into `staging` as a GPTQ checkpoint (module docstring)."""
    config = json.loads((folder / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as source:
        names = list(source.keys())
        widths = {source.get_slice(n).get_shape()[1] for n in names if QUANTIZED.match(n)}
        group = next((g for g in GROUPS if all(w % g == 0 for w in widths)), None)
        if group is None:
            raise UserError(f"{folder}'s layer widths {sorted(widths)} split into no GPTQ group")
        for name in names:
            tensor = source.get_tensor(name)
            if QUANTIZED.match(name):
                stem = name.removesuffix(".weight")
                for part, value in quantize(tensor, group).items():
                    tensors[f"{stem}.{part}"] = value
            else:
                tensors[name] = tensor
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(group)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, staging / name)


def exported(folder: Path) -> Path:
    """`folder` (a HF model folder with one model.safetensors) as a 4-bit GPTQ checkpoint:
    `folder/gptq-int4`, written on first use (about half a minute per billion parameters)
    into a hidden sibling and moved in place once complete (`build_atomically`)."""
    out = folder / FOLDER
    is_exported = (out / "model.safetensors").is_file
    if is_exported():
        return out
    if not (folder / "model.safetensors").is_file():
        raise UserError(f"{folder} has no model.safetensors to write as a GPTQ checkpoint")
    print(f"writing {folder} as a 4-bit GPTQ checkpoint ...", file=sys.stderr)
    build_atomically(
        out, lambda staging: _write(folder, staging), "GPTQ int4, round to nearest",
        ready=is_exported,
    )  # fmt: skip
    return out
