"""Convert a GGUF file (Llama, Qwen2, Qwen3, Gemma 2 and 3, Phi-3) once into a Hugging Face-style
folder.

The folder holds config.json, model.safetensors (bf16, HF tensor names), tokenizer.json,
tokenizer_config.json and generation_config.json, so both specdecode and Hugging Face
transformers load it, and later loads take well under two seconds.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from specdecode.errors import ModelNotFoundError, UserError
from specdecode.model.config import ARCHITECTURES, ModelConfig
from specdecode.model.gguf_tensors import GgufTensors
from specdecode.model.rope import LinearRope, LongRope, RopeScaling, Yarn, base_frequencies

# GGUF architecture -> the Hugging Face model_type we read it as (llama.cpp writes Mistral
# models as "llama").
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}
# What llama.cpp fixes for Gemma rather than writing it in the file: Gemma 2's every second
# layer attends globally, the others through the window; Gemma 3's every sixth, the others
# through the window with RoPE base 10,000. The 27B models (Gemma 2's 46 layers, Gemma 3's 62)
# scale the scores by (hidden_size / heads) ** -0.5, the others by head_dim's.
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Llama 3.1 / 3.2's RoPE scaling bands (Meta's low_freq_factor and high_freq_factor for every
# size): llama.cpp stores the frequencies' divisors (rope_freqs), not the parameters.
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's block norms its sublayers' outputs too; llama.cpp's ffn_norm is the MLP's input norm.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3 stores q|k|v as attn_qkv and gate|up as ffn_up (read split, `loading.split_fused`).
_UNFUSED = ("attn_q.", "attn_k.", "attn_v.", "ffn_gate.", "ffn_up.")
_FUSED_LAYER_NAMES = {
    **{gguf: hf for gguf, hf in _LAYER_NAMES.items() if not gguf.startswith(_UNFUSED)},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# LongRoPE's factors (Phi-3): read into the config's rope_scaling, not weights
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file, turning any parse failure into one clear error."""
    if not path.is_file():
        raise ModelNotFoundError(f"no such GGUF file: {path}")
    try:
        return GGUFReader(path)
    except Exception as err:  # the reader raises many kinds on a damaged file
        raise UserError(
            f"{path} is not a readable GGUF file (truncated or corrupted?): "
            f"{type(err).__name__}: {err}"
        ) from err


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays left out)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != GGUFValueType.ARRAY:
            meta[key] = field.contents()
    return meta


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, ...)."""
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise UserError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    model_type = GGUF_ARCHITECTURES[arch]
    try:
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        vocab = meta.get(f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        gemma = _gemma_fields(meta, arch, head_dim) if ARCHITECTURES[model_type].gemma else {}
        theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        divisors = next((t.data for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        phi3 = _phi3_fields(reader, meta, arch, head_dim) if model_type == "phi3" else {}
        llama3 = None if divisors is None else llama3_scaling(divisors, theta, head_dim)
        scaled = _scaling(meta, arch)
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_layers=int(meta[f"{arch}.block_count"]),
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            rope_theta=theta,
            max_position_embeddings=int(meta[f"{arch}.context_length"]),
            qkv_bias="blk.0.attn_q.bias" in names,
            tie_word_embeddings="output.weight" not in names,
            qk_norm=ARCHITECTURES[model_type].qk_norm,
            rope_scaling=phi3.pop("rope_scaling", llama3 or scaled),
            **gemma,
            **phi3,
        )
    except (KeyError, TypeError) as err:
        raise UserError(f"GGUF metadata lacks a required field: {err}") from err


def _scaling(meta: dict[str, Any], arch: str) -> LinearRope | Yarn | None:
    """The GGUF's RoPE scaling by `rope.scaling.type`: None for none (or a factor of 1),
    "linear" (`rope.scaling.factor`) or "yarn" (the factor, `rope.scaling.original_context_
    length`, llama.cpp's `yarn_beta_fast` / `yarn_beta_slow`, cos and sin times
    `yarn_attn_factor` * (0.1 ln factor + 1)); other types, and YaRN's DeepSeek variants
    (`yarn_log_multiplier`, an `yarn_ext_factor` other than 1), are refused. Llama 3.x's scaling
    comes as rope_freqs and Phi-3's LongRoPE as its factor tensors, not through this key."""
    key = f"{arch}.rope.scaling."
    kind = meta.get(f"{key}type")
    if kind in (None, "none"):
        return None
    factor = float(meta.get(f"{key}factor", 1.0))
    if kind not in ("linear", "yarn"):
        raise UserError(
            f"GGUF RoPE scaling {kind!r} is not supported yet; supported: none, linear, yarn, "
            "and Llama 3.x's (rope_freqs)"
        )
    if not factor > 0:
        raise UserError(f"GGUF {kind} RoPE scaling needs a factor > 0, got {factor}")
    if kind == "linear":
        return None if factor == 1.0 else LinearRope(factor)
    if meta.get(f"{key}yarn_log_multiplier") or meta.get(f"{key}yarn_ext_factor", 1.0) not in (
        -1.0,
        1.0,
    ):
        raise UserError(
            "GGUF yarn RoPE scaling with a yarn_log_multiplier or a yarn_ext_factor other than "
            "1 (DeepSeek's variants) is not supported"
        )
    original = meta.get(f"{key}original_context_length")
    if not original or factor < 1.0:
        raise UserError(
            f"GGUF yarn RoPE scaling needs a factor >= 1 and {key}original_context_length, got "
            f"factor {factor} and {original}"
        )
    attention = float(meta.get(f"{key}yarn_attn_factor", 1.0)) * (0.1 * math.log(factor) + 1.0)
    beta_fast = float(meta.get(f"{key}yarn_beta_fast", 32.0))
    return Yarn(
        factor, int(original), beta_fast, float(meta.get(f"{key}yarn_beta_slow", 1.0)), attention
    )


def _gemma_fields(meta: dict[str, Any], arch: str, head_dim: int) -> dict[str, Any]:
    """The Gemma 2 / 3 fields of a ModelConfig from GGUF metadata and llama.cpp's fixed
    choices (which layers slide, Gemma 3's local RoPE base, the 27B models' query scale)."""
    layers = int(meta[f"{arch}.block_count"])
    window = meta.get(f"{arch}.attention.sliding_window")
    slides = bool(window)  # Gemma 3's also take the local RoPE base: kept if it covers all
    table = ARCHITECTURES[GGUF_ARCHITECTURES[arch]]
    sliding = [i for i in range(layers) if (i + 1) % table.global_every]
    scale = None
    if layers == GEMMA_27B_LAYERS[arch]:
        hidden, heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
        per_head = int(hidden) // int(heads)
        scale = None if per_head == head_dim else per_head**-0.5

    def cap(key: str) -> float | None:
        value = meta.get(f"{arch}.{key}")
        return None if value is None else float(value)

    return {
        "gemma": True,
        "activation": "gelu_tanh",
        "sliding_window": int(window) if slides else None,
        "sliding_layers": tuple(sliding) if slides else (),
        "local_rope_theta": GEMMA3_LOCAL_ROPE_THETA if table.local_rope else None,
        "attention_scale": scale,
        "logit_softcap": cap("final_logit_softcapping"),
        "attn_softcap": cap("attn_logit_softcapping"),
    }


def _phi3_fields(
    reader: GGUFReader, meta: dict[str, Any], arch: str, head_dim: int
) -> dict[str, Any]:
    """Phi-3's sliding window (every layer; none when it covers the context) and LongRoPE
    (its factors are tensors, the original context and attention factor metadata)."""
    context, layers = int(meta[f"{arch}.context_length"]), int(meta[f"{arch}.block_count"])
    window = meta.get(f"{arch}.attention.sliding_window")
    slides = bool(window) and int(window) < context
    fields: dict[str, Any] = {
        "sliding_window": int(window) if slides else None,
        "sliding_layers": tuple(range(layers)) if slides else (),
    }
    factors = {t.name: t.data for t in reader.tensors if t.name in LONGROPE_TENSORS}
    if factors:
        if len(factors) != 2:
            raise UserError(f"a LongRoPE GGUF needs both {' and '.join(LONGROPE_TENSORS)}")
        rope = {
            "short_factor": np.asarray(factors[LONGROPE_TENSORS[0]], dtype=np.float64).tolist(),
            "long_factor": np.asarray(factors[LONGROPE_TENSORS[1]], dtype=np.float64).tolist(),
            "original_max_position_embeddings": meta[
                f"{arch}.rope.scaling.original_context_length"
            ],
            "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor"),
        }
        sizes = {"head_dim": head_dim, "max_position_embeddings": context}
        fields["rope_scaling"] = LongRope.from_hf_dict(rope, sizes)
    return fields


def llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> RopeScaling | None:
    """Llama 3.x's RoPE scaling from a GGUF's rope_freqs: the divisor of each of the
    head_dim / 2 frequencies, all llama.cpp keeps of the parameters. factor is the largest
    divisor, the bands Meta's (LLAMA3_*_FREQ_FACTOR), and the original context the one that
    puts the blended frequencies where they are (or, with none blended, the band between the
    kept and the scaled ones). Refused unless these parameters give back every divisor."""
    inv_freq = base_frequencies(theta, head_dim)
    div = torch.from_numpy(np.asarray(divisors, dtype=np.float64).reshape(-1))  # [D / 2]
    if div.shape != inv_freq.shape or not bool((div >= 1.0 - 1e-6).all()):
        raise UserError(
            f"GGUF rope_freqs must hold {inv_freq.numel()} divisors >= 1 (Llama 3.x's scaled "
            f"RoPE), got {div.numel()} values, smallest {float(div.min()):.4g}"
        )
    factor = float(div.max())
    if factor <= 1.0 + 1e-6:
        return None  # nothing scaled
    low, high = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    wavelength = 2 * math.pi / inv_freq  # [D / 2]
    blend = (1.0 / div - 1.0 / factor) / (1.0 - 1.0 / factor)  # 1: kept, 0: scaled
    blended = (blend > 1e-6) & (blend < 1.0 - 1e-6)
    kept = blend >= 1.0 - 1e-6
    if blended.any():  # blend = (context / wavelength - low) / (high - low)
        context = float((wavelength * (low + blend * (high - low)))[blended].median())
    else:
        context = math.ceil(high * float(wavelength[kept].max())) if kept.any() else 1.0
    scaling = RopeScaling(factor, low, high, max(1, round(context)))
    got = inv_freq / scaling.frequencies(inv_freq)  # [D / 2] divisors
    if not torch.allclose(got, div, rtol=1e-5, atol=0.0):
        raise UserError(
            "GGUF rope_freqs are not Llama 3.x's scaling (no factor, low/high frequency "
            f"factors {low:g}/{high:g} and original context give them back): {div.tolist()}"
        )
    return scaling


def layer_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")."""
    if ARCHITECTURES[cfg.architecture].fused:
        return _FUSED_LAYER_NAMES
    return _GEMMA_LAYER_NAMES if cfg.gemma else _LAYER_NAMES


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for Llama GGUFs.

    llama.cpp rotates adjacent pairs (x0,x1),(x2,x3)..., HF rotates halves (x0,x_{d/2}),...;
    its converter reorders each head's rows from [half0 | half1] to interleaved [h0[0], h1[0],
    h0[1], h1[1], ...]. Example with head_dim 4: GGUF rows (a0, b0, a1, b1) -> HF (a0, a1, b0, b1).
    """
    # w: [n_heads * head_dim, ...]
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, cfg: ModelConfig) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = layer_names(cfg)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    raise UserError(
        f"unexpected tensor {gguf_name!r} in GGUF file (not a tensor of {cfg.architecture})"
    )


def iter_hf_tensors(
    reader: GGUFReader | GgufTensors,
    cfg: ModelConfig,
    progress: bool = False,
    skip: Container[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize every tensor (but those whose Hugging Face name is in `skip`) to fp32,
    exactly, and yield it under its Hugging Face name."""
    for t in tqdm(reader.tensors, desc="convert", unit="tensor", disable=not progress):
        if t.name == "rope_freqs.weight" or t.name in LONGROPE_TENSORS:
            continue  # the config's rope_scaling (config_from_gguf)
        name = _hf_name(t.name, cfg)
        if name in skip:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        w = w.reshape(shape)
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rope(w, cfg.num_heads)
        elif cfg.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rope(w, cfg.num_kv_heads)
        elif cfg.gemma and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w; Hugging Face stores w
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config.json, bf16 model.safetensors and tokenizer files of `gguf_path` in `out_dir`."""
    from specdecode.model.tokenizer import tokenizer_from_gguf

    reader = open_gguf(gguf_path)
    cfg = config_from_gguf(reader)
    tokenizer = tokenizer_from_gguf(reader)
    tensors = {name: w.to(torch.bfloat16) for name, w in iter_hf_tensors(reader, cfg, progress)}
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt", "source": gguf_path.name})
    os.replace(tmp, out_dir / "model.safetensors")
    tokenizer.save(out_dir)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
