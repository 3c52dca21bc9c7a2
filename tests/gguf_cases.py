"""GGUF blocks for tests: random valid blocks of any type, and a tiny model folder whose
model.gguf holds its projections quantized to a mix of block types."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

from specdecode.model.config import ModelConfig
from specdecode.model.convert import _GLOBAL_NAMES, layer_names
from specdecode.model.gguf_linear import gguf_projections

T = GGMLQuantizationType

# byte offsets of each type's fp16 scales inside its block
_HALVES = {
    T.Q4_0: (0,),
    T.Q5_0: (0,),
    T.Q8_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_1: (0, 2),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def random_blocks(tensor_type: GGMLQuantizationType, rows: int, cols: int, seed: int = 0):
    """[rows, row bytes] uint8: random bytes, each fp16 scale set to a finite value in +-0.02
    (any code, scale byte or bit pattern is a valid block)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    shape = (rows, cols // block_size)
    raw = rng.integers(0, 256, size=(*shape, type_size), dtype=np.uint8)
    for at in _HALVES[tensor_type]:
        scale = rng.uniform(-0.02, 0.02, size=shape).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(*shape, 2)
    return raw.reshape(rows, -1)


# each projection's type in the tiny GGUF: a fused q|k|v of three types, every simple format
# (Phi-3's file stores q|k|v as one attn_qkv, and gate|up as ffn_up)
TINY_TYPES = {
    "attn_q": T.Q4_0,
    "attn_k": T.Q8_0,
    "attn_v": T.Q5_0,
    "attn_qkv": T.Q5_0,
    "attn_output": T.Q4_1,
    "ffn_gate": T.Q5_1,
    "ffn_up": T.Q4_0,
    "ffn_down": T.Q8_0,
}


def _rope_permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama (the inverse of `convert._unpermute_rope`)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def build_tiny_gguf(model_dir: Path, out: Path) -> Path:
    """A copy of the tiny Hugging Face model folder `model_dir` in `out`, plus a model.gguf that
    holds its projections and head quantized to TINY_TYPES (head: Q8_0) and its other weights
    in fp32, in llama.cpp's names and q/k row order: what quantization="gguf" reads."""
    import json

    shutil.copytree(model_dir, out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["model_type"]
    weights = load_file(str(model_dir / "model.safetensors"))
    writer = GGUFWriter(out / "model.gguf", arch=arch)
    ours = ModelConfig.from_folder(model_dir)
    for i in range(cfg["num_hidden_layers"]):
        for name, projection in gguf_projections(ours).items():
            tensor_type = TINY_TYPES[name]
            w = weights[f"model.layers.{i}.{projection}.weight"].astype(np.float32)
            if arch == "llama" and name in ("attn_q", "attn_k"):
                heads = cfg["num_attention_heads" if name == "attn_q" else "num_key_value_heads"]
                w = _rope_permuted(w, heads)
            writer.add_tensor(
                f"blk.{i}.{name}.weight", quantize(w, tensor_type), raw_dtype=tensor_type
            )
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).astype(np.float32)
    name = "token_embd.weight" if cfg.get("tie_word_embeddings") else "output.weight"
    writer.add_tensor(name, quantize(head, T.Q8_0), raw_dtype=T.Q8_0)
    hf_names = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()} | {
        f"model.layers.{i}.{hf}": f"blk.{i}.{gguf}"
        for i in range(cfg["num_hidden_layers"])
        for gguf, hf in layer_names(ours).items()
    }
    for hf, w in weights.items():  # embedding (untied), norms, biases in fp32
        projection = hf.endswith(".weight") and hf.rsplit(".", 2)[-2].endswith("_proj")
        if not projection and hf_names[hf] != name:
            w = w.astype(np.float32)
            if ours.gemma and hf.endswith("norm.weight"):
                w = w + np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
            writer.add_tensor(hf_names[hf], w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
