"""`quantization="gguf"`: projections that keep a GGUF file's own quantized blocks.

`read_gguf_weights` takes every projection (q/k/v, o, gate/up, down, the head) from the file as
raw blocks (`GgufWeight`), and the other weights dequantized exactly; `GgufLinear` repacks the
blocks once for the kernel (`model/gguf_blocks.py`, every value and scale kept) and multiplies
with int8 activations quantized as llama.cpp quantizes them for the type: per block of 32 for
Q4_0 .. Q8_0, of 256 for the K-quants (`kernels/gguf.cpp`). A fused projection (q|k|v, gate|up)
may mix types (Q4_K_M keeps some v projections in Q6_K): each run of rows of one type is a
segment, and one pass quantizes the activations once per block size for all of them. Row-exact:
a token's output does not depend on the other tokens of the pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from torch import Tensor, nn

from specdecode import kernels
from specdecode.errors import UserError
from specdecode.model.config import ARCHITECTURES, ModelConfig
from specdecode.model.convert import _unpermute_rope, iter_hf_tensors
from specdecode.model.gguf_blocks import Codes, check_supported, decode, pack, unpack
from specdecode.model.gguf_tensors import read_tensors

T = GGMLQuantizationType
# The formats a dense weight is requantized into as it loads (`quantization="q4_0"`, ...): the
# GGUF block types with a reference quantizer in the gguf package (llama.cpp's own rounding)
# and a kernel here. E.g. a draft model in "q4_0" reads 4.5 bits a weight, its head included.
REQUANTIZED: dict[str, GGMLQuantizationType] = {
    "q4_0": T.Q4_0,
    "q4_1": T.Q4_1,
    "q5_0": T.Q5_0,
    "q5_1": T.Q5_1,
    "q8_0": T.Q8_0,
}
_CHUNK_ROWS = 4096  # rows quantized at once (the quantizer slows down on very large arrays)


@dataclass(frozen=True, slots=True)
class GgufSegment:
    """Consecutive output rows of one GGUF type: raw [rows, row bytes] uint8 blocks."""

    tensor_type: GGMLQuantizationType
    raw: np.ndarray


@dataclass(frozen=True, slots=True)
class GgufWeight:
    """A projection's [out, in] weight as GGUF blocks, in row segments of one type each."""

    segments: tuple[GgufSegment, ...]
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(seg.raw.shape[0] for seg in self.segments)

    @staticmethod
    def cat(weights: Sequence[GgufWeight]) -> GgufWeight:
        """Rows of `weights` one after the other (like torch.cat of dense weights), adjacent
        segments of one type merged."""
        if len({w.in_features for w in weights}) != 1:
            raise UserError("fused GGUF projections must share their input width")
        merged: list[GgufSegment] = []
        for seg in (s for w in weights for s in w.segments):
            if merged and merged[-1].tensor_type == seg.tensor_type:
                rows = np.concatenate([merged[-1].raw, seg.raw])
                merged[-1] = GgufSegment(seg.tensor_type, rows)
            else:
                merged.append(seg)
        return GgufWeight(tuple(merged), weights[0].in_features)

    def dense(self) -> Tensor:
        """The [out, in] fp32 weight the blocks stand for (dequantized exactly)."""
        parts = [decode(s.tensor_type, s.raw, self.in_features).weights() for s in self.segments]
        return torch.from_numpy(np.concatenate(parts))


def requantize(weight: Tensor, tensor_type: GGMLQuantizationType) -> GgufWeight:
    """The dense [out, in] `weight` in GGUF blocks of `tensor_type` (one of `REQUANTIZED`'s),
    rounded as llama.cpp's reference quantizer rounds (`gguf.quants.quantize`, from fp32); a
    clear error where `in` is not a multiple of 32."""
    out, cols = weight.shape
    _check_width(cols)
    dense = weight.detach().float().cpu().numpy()  # [out, in]
    chunks = [
        quants.quantize(dense[i : i + _CHUNK_ROWS], tensor_type)  # [rows, row bytes]
        for i in range(0, out, _CHUNK_ROWS)
    ]
    return GgufWeight((GgufSegment(tensor_type, np.concatenate(chunks)),), cols)


def _check_width(in_features: int) -> None:
    """GGUF blocks hold 32 or 256 values of a row: a clear error for a width not a multiple
    of 32."""
    if in_features % 32:
        raise UserError(f"GGUF weights need in_features % 32 == 0, got {in_features}")


def cat_weights(weights: Sequence[Tensor | GgufWeight]) -> Tensor | GgufWeight:
    """The rows of dense weights (torch.cat) or of GGUF weights (`GgufWeight.cat`)."""
    if all(isinstance(w, GgufWeight) for w in weights):
        return GgufWeight.cat(weights)
    return torch.cat(weights)


class GgufLinear(nn.Module):
    """y = x @ W^T + b for W in GGUF blocks; x [..., in] fp32 or bf16 -> y in x's dtype.

    Args:
        codes: the weight's row segments, one block type each (`gguf_blocks.Codes`, e.g. from
            `decode`), stacked in order: [out, in] in all.
        bias: [out] or None.
    """

    row_exact = True

    def __init__(self, codes: Sequence[Codes], bias: Tensor | None = None) -> None:
        super().__init__()
        self.in_features = codes[0].q.shape[1]
        self.out_features = sum(c.q.shape[0] for c in codes)
        self.layouts = []  # per segment: (Layout, rows, first output column)
        offset = 0
        for index, seg in enumerate(codes):
            self.register_buffer(f"packed{index}", torch.from_numpy(pack(seg)))
            self.layouts.append((seg.layout, seg.q.shape[0], offset))
            offset += seg.q.shape[0]
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        # one native object over the segments (a clear error now if the kernels cannot build)
        self.projection = kernels.gguf_projection(
            [
                (getattr(self, f"packed{index}"), layout, rows, offset)
                for index, (layout, rows, offset) in enumerate(self.layouts)
            ],
            self.bias,
            self.out_features,
        )

    @classmethod
    def from_blocks(cls, weight: GgufWeight, bias: Tensor | None = None) -> GgufLinear:
        """The projection of a GGUF file's blocks (`weight`), every value and scale kept; a
        clear error where `weight.in_features` is not a multiple of 32 or a type has no
        kernel."""
        cols = weight.in_features
        _check_width(cols)
        return cls([decode(s.tensor_type, s.raw, cols) for s in weight.segments], bias)

    def rows(self, kept: Tensor) -> GgufLinear:
        """The projection of the output rows `kept` ([Vk] int64, sorted, distinct), their
        blocks unchanged: `rows(kept)(x) == self(x)[..., kept]` bit for bit (row-exact)."""
        wanted = kept.cpu().numpy()
        codes = []
        for seg, (_, rows, first) in zip(self.codes(), self.layouts, strict=True):
            local = wanted[(wanted >= first) & (wanted < first + rows)] - first
            if len(local):
                codes.append(seg.take(local))
        bias = None if self.bias is None else self.bias[kept]
        return GgufLinear(codes, bias)

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in] -> [..., out]
        return self.projection(x)

    def codes(self) -> list[Codes]:
        """Each segment's codes, recovered from the packed buffers."""
        return [
            unpack(getattr(self, f"packed{index}").numpy(), layout, rows)
            for index, (layout, rows, _) in enumerate(self.layouts)
        ]

    def dequantized(self) -> Tensor:
        """The [out, in] fp32 weight this module multiplies by."""
        return torch.from_numpy(np.concatenate([c.weights() for c in self.codes()]))

    @property
    def weight_bytes(self) -> int:
        """Bytes a pass reads: the packed blocks and the bias."""
        return sum(t.nbytes for t in self.buffers())


# GGUF name inside a block -> the projection it feeds (Hugging Face name after the layer prefix)
PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Phi-3's: q|k|v and gate|up stored fused (config.Architecture.fused)
FUSED_PROJECTIONS = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_projections(cfg: ModelConfig) -> dict[str, str]:
    """GGUF name inside a block -> the Hugging Face projection it is stored as."""
    return FUSED_PROJECTIONS if ARCHITECTURES[cfg.architecture].fused else PROJECTIONS


def _unpermuted(raw: np.ndarray, cfg: ModelConfig, projection: str) -> np.ndarray:
    """Llama GGUFs store q and k rows in llama.cpp's RoPE order; rows (whole blocks) are put
    back in Hugging Face's order (see `convert._unpermute_rope`)."""
    if cfg.architecture != "llama" or projection not in ("self_attn.q_proj", "self_attn.k_proj"):
        return raw
    heads = cfg.num_heads if projection == "self_attn.q_proj" else cfg.num_kv_heads
    return np.ascontiguousarray(_unpermute_rope(raw, heads))


def read_gguf_weights(path: Path, cfg: ModelConfig) -> dict[str, GgufWeight | Tensor]:
    """Every weight of the GGUF file at `path` under its Hugging Face name: each projection and
    the head ("lm_head.weight": `output.weight`, or the token embedding when tied) as a
    `GgufWeight`, the rest (embedding, norms, biases) dequantized exactly to fp32, as llama.cpp
    reads them."""
    reader = read_tensors(path)  # the tensor table alone: the metadata is not parsed
    tensors = {t.name: t for t in reader.tensors}
    names = {  # GGUF name -> (layer prefix of the Hugging Face name, projection)
        f"blk.{i}.{gguf}.weight": (f"model.layers.{i}.", hf)
        for i in range(cfg.num_layers)
        for gguf, hf in gguf_projections(cfg).items()
    }
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    names[head] = ("", "lm_head")
    out: dict[str, GgufWeight | Tensor] = {}
    stored: set[str] = set()  # the Hugging Face names of what is read here, fused ones too
    for gguf_name, (prefix, projection) in names.items():
        if gguf_name not in tensors:
            raise UserError(f"{path} lacks the tensor {gguf_name}")
        t = tensors[gguf_name]
        check_supported(t.tensor_type)
        cols, rows = (int(d) for d in t.shape)  # GGUF lists dims innermost first
        raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)  # [rows, row bytes]
        parts = cfg.stored_parts(projection)
        if parts[0][1] > 0 and sum(n for _, n in parts) != rows:
            raise UserError(f"{path}: {gguf_name} has {rows} rows, the config needs {parts}")
        first = 0
        for part, count in parts:
            part_raw = raw[first : first + count] if count > 0 else raw  # whole rows of blocks
            part_raw = _unpermuted(np.ascontiguousarray(part_raw), cfg, part)
            segment = GgufSegment(t.tensor_type, part_raw)
            out[f"{prefix}{part}.weight"] = GgufWeight((segment,), cols)
            first += count
        stored.add(f"{prefix}{projection}.weight")
    out.update(iter_hf_tensors(reader, cfg, skip=frozenset(stored | set(out))))
    return out
