"""Load a Hugging Face-layout folder (config.json + *.safetensors) into a `Transformer`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from specdecode.errors import ModelNotFoundError, UserError
from specdecode.model.config import ARCHITECTURES, ModelConfig
from specdecode.model.gguf_blocks import UnsupportedBlockType
from specdecode.model.gguf_linear import REQUANTIZED, GgufWeight, read_gguf_weights
from specdecode.model.quant import AUTO, parse_quantization
from specdecode.model.transformer import Transformer

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": torch.bfloat16,
}


# Each decoder block's tensors (Hugging Face names under `model.layers.<i>.`), biases aside.
LAYER_TENSORS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' | 'auto' (= bfloat16) or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise UserError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")


def required_tensors(cfg: ModelConfig) -> list[str]:
    """Hugging Face names of every tensor the model needs."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = layer_tensor_names(cfg)
    names += [f"model.layers.{i}.{n}" for i in range(cfg.num_layers) for n in per_layer]
    return names


def layer_tensor_names(cfg: ModelConfig) -> list[str]:
    """Names of one decoder block's tensors (under its `model.layers.<i>.`), biases included."""
    names = list(LAYER_TENSORS)
    if cfg.qkv_bias:
        names += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if cfg.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if cfg.gemma:
        names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    return names


def load_weights(
    path: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str,
) -> dict[str, Tensor]:
    """Read every *.safetensors file in `path`, check names and shapes, cast to `dtype`."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weight files")
    weights: dict[str, Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=device) as tensors:
                for name in tensors.keys():  # noqa: SIM118 (safe_open is not a dict)
                    weights[name] = tensors.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise UserError(f"cannot read weights from {file} (malformed?): {err}") from err
    if ARCHITECTURES[cfg.architecture].fused:
        weights = split_fused(weights, cfg)
    _check_weights(weights, cfg, path)
    return {
        name: w.to(dtype) for name, w in weights.items() if not name.endswith("rotary_emb.inv_freq")
    }


def split_fused(weights: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Phi-3's fused weights under the names every other architecture uses: each layer's
    `qkv_proj` ([(H + 2 Hkv) D, hidden]) as q_proj, k_proj, v_proj and `gate_up_proj`
    ([2 I, hidden], gate first) as gate_proj, up_proj (`ModelConfig.stored_parts`). The
    model fuses them again."""
    out = dict(weights)
    for i in range(cfg.num_layers):
        for fused in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            name = f"model.layers.{i}.{fused}.weight"
            if name not in out:
                continue
            weight = out.pop(name)
            parts = cfg.stored_parts(fused)
            sizes = [rows for _, rows in parts]
            if weight.shape[0] != sum(sizes):
                raise UserError(f"{name} has {weight.shape[0]} rows; the config needs {sum(sizes)}")
            for (part, _), rows in zip(parts, weight.split(sizes), strict=True):
                out[f"model.layers.{i}.{part}.weight"] = rows
    return out


def _check_weights(
    weights: Mapping[str, Tensor | GgufWeight], cfg: ModelConfig, source: Path
) -> None:
    """A clear error where the weights read from `source` lack a tensor the config needs or
    their embedding does not have the config's shape."""
    missing = [n for n in required_tensors(cfg) if n not in weights]
    if missing:
        raise UserError(
            f"{source} lacks {len(missing)} tensor(s) the {cfg.architecture} config needs, "
            f"e.g. {missing[:3]}"
        )
    embed = tuple(weights["model.embed_tokens.weight"].shape)  # a Tensor in every format
    if embed != (cfg.vocab_size, cfg.hidden_size):
        raise UserError(
            f"embedding shape {embed} does not match config "
            f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size})"
        )


def load_model(
    path: Path,
    dtype: str | torch.dtype = "bfloat16",
    device: str = "cpu",
    quantization: str | None = None,
) -> Transformer:
    """Build a `Transformer` from a Hugging Face folder, its projections in `dtype` or in a
    quantized format (`quantization`: None | "none" | "int8" | "int4" | "gguf" | "auto" | a
    GGUF block type such as "q4_0", see `model.quant`; "gguf" keeps the blocks of the folder's
    model.gguf; "auto" is "gguf" where that runs, on the CPU in bfloat16 or float32 with every
    block type supported, else None; a block type requantizes the dense weights, on the CPU in
    bfloat16 or float32)."""
    quantization = parse_quantization(quantization)  # a bad name fails before any reading
    if not path.is_dir():
        raise ModelNotFoundError(f"no such model folder: {path}")
    cfg = ModelConfig.from_folder(path)
    torch_dtype = parse_dtype(dtype)
    if quantization in REQUANTIZED and torch_dtype not in (torch.float32, torch.bfloat16):
        raise UserError(
            f"quantization {quantization!r} runs with dtype bfloat16 or float32, not {torch_dtype}"
        )
    auto = quantization == AUTO
    if auto:
        quantization = "gguf" if _gguf_problem(path, device, torch_dtype) is None else None
    weights: dict[str, Tensor | GgufWeight] | None = None
    if quantization == "gguf":  # every weight from the GGUF, none from its dense copy
        try:
            weights = read_gguf_weights(gguf_source(path, device, torch_dtype), cfg)
        except UnsupportedBlockType as err:
            if not auto:
                raise
            log.info("%s; loading the dense weights instead", err)
            quantization = None
    if weights is None:
        weights = load_weights(path, cfg, torch_dtype, device)
    else:
        _check_weights(weights, cfg, path / "model.gguf")
        weights = {
            n: w if isinstance(w, GgufWeight) else w.to(torch_dtype) for n, w in weights.items()
        }
    return Transformer(cfg, weights, quantization).eval()


def _gguf_problem(path: Path, device: str, dtype: torch.dtype) -> str | None:
    """Why quantization="gguf" cannot run the model folder at `path` here (None: it can; what
    "auto" asks)."""
    if torch.device(device).type != "cpu":
        return (
            f"quantization 'gguf' has CPU kernels only, not {device} (use quantization=None there)"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        return f"quantization 'gguf' runs with dtype bfloat16 or float32, not {dtype}"
    if not (path / "model.gguf").is_file():
        return (
            f"quantization 'gguf' runs a GGUF file's own blocks, and {path} has no model.gguf: "
            "give a pulled alias or a .gguf file (a .gguf converted before this version: delete "
            "its folder under the cache's gguf/ to convert it again), or use 'int8'"
        )
    return None


def gguf_source(path: Path, device: str, dtype: torch.dtype) -> Path:
    """The GGUF file behind a model folder (a pulled alias, or a converted .gguf file), whose
    blocks quantization="gguf" runs; a clear error where there is none, the device is not the
    CPU or the activations' `dtype` is neither fp32 nor bf16."""
    problem = _gguf_problem(path, device, dtype)
    if problem is not None:
        raise UserError(problem)
    return path / "model.gguf"
