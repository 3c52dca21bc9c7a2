"""Native CPU kernels, built at install (setup.py) once per instruction-set level: matmuls for
the projections (`matmul.cpp`; `gguf.cpp` for weights in GGUF's block formats), attention for
decode / verification passes (`attention.cpp`), RMSNorm and RoPE (`pointwise.cpp`): each one
call where torch needs several, and each row-exact. `layer.cpp` holds a projection of any
native format as one object (`*_projection`) and runs a whole decoder block of a decode or
verification pass in one call (`decoder_layer`).

`native()` loads the best build this CPU runs (`variants.py`: AMX, AVX-512, AVX-VNNI, AVX2,
portable C++; SPECDECODE_CPU=<variant> forces one) and returns its module; nothing compiles
at run time.
`pack` lays a weight out the way the kernels read it. int8 and gguf give the same bits on
every variant (integer sums); bf16 may differ in the last bit between variants but never
between passes of one. `set_amx(False)` (or SPECDECODE_AMX=0) keeps the AMX variant's matmuls
off the tiles, e.g. to compare the paths in one run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from specdecode.errors import UserError
from specdecode.kernels import variants

if TYPE_CHECKING:
    from specdecode.kernels.gguf_layout import Layout as GgufLayout


ROWS = 64  # output rows per tile (matmul.cpp's ROWS)
INT8_PACK = 4  # int8 values of a row per 32-bit lane
BF16_PACK = 2  # bf16 values of a row per 32-bit lane
REBUILD = "pip install -e . --no-build-isolation (or `make install`)"


class GgufActivations(NamedTuple):
    """A pass's activations as the GGUF matmul reads them (kernels/gguf.cpp): per token, int8
    values x8 [M, K], scales dx [M, K / block] (and sx, block 32 only), int16 sums of x8 per 16
    and per 32 values."""

    x8: Tensor
    dx: Tensor
    sx: Tensor
    bsum16: Tensor
    bsum32: Tensor


class NativeKernelsUnavailable(UserError):
    """No build of the C++ kernels that this CPU runs (not built at install, or a build of
    other sources), or SPECDECODE_CPU names one that cannot run here."""


def built() -> tuple[str, ...]:
    """The variants installed with the package (best first)."""
    return tuple(
        v.name
        for v in variants.VARIANTS
        if importlib.util.find_spec(f"{__name__}.{v.module}") is not None
    )


def choose(wanted: str, features: frozenset[str], installed: Sequence[str]) -> str:
    """The variant to load: `wanted` (SPECDECODE_CPU's value) if it is installed and this CPU
    runs it, or for "auto" the best installed one it runs; NativeKernelsUnavailable says why
    none is."""
    if wanted not in ("auto", *variants.NAMES):
        raise NativeKernelsUnavailable(
            f"{variants.ENV}={wanted} is not a kernel variant; allowed: auto, "
            + ", ".join(variants.NAMES)
        )
    candidates = (
        variants.VARIANTS
        if wanted == "auto"
        else [v for v in variants.VARIANTS if v.name == wanted]
    )
    for variant in candidates:
        if variant.name not in installed:
            continue
        if variants.runs_here(variant, features):
            return variant.name
        if wanted != "auto":
            raise NativeKernelsUnavailable(
                f"{variants.ENV}={wanted}: this CPU cannot run that variant (it lacks "
                f"{', '.join(variants.missing(variant, features)) or 'its architecture'}); "
                f"set {variants.ENV}=auto"
            )
    what = "none installed runs on this CPU" if wanted == "auto" else f"{wanted} is not installed"
    raise NativeKernelsUnavailable(
        f"specdecode's CPU kernels: {what} (installed: {', '.join(installed) or 'none'}): they "
        f"are built at install, which needs a C++ compiler (g++); reinstall with {REBUILD}, or "
        f"set {variants.ENV} to an installed one"
    )


@cache
def native() -> ModuleType:
    """The loaded kernels (see the module's doc); NativeKernelsUnavailable if there are none
    this CPU runs, or if they were built from other sources than the package holds."""
    wanted = os.environ.get(variants.ENV, "auto").strip().lower() or "auto"
    name = choose(wanted, variants.cpu_features(), built())
    module = importlib.import_module(f"{__name__}._cpu_{name}")
    expected = variants.source_hash(Path(__file__).parent)
    if module.source_hash != expected:
        raise NativeKernelsUnavailable(
            f"specdecode's CPU kernels ({module.__file__}) were built from other sources than "
            f"those in {Path(__file__).parent}: rebuild them with {REBUILD}"
        )
    return module


@cache
def available() -> bool:
    """Whether `native()` loads here."""
    try:
        native()
    except NativeKernelsUnavailable:
        return False
    return True


def variant() -> str:
    """The name of the loaded variant (native() must load)."""
    return native().variant


def pack(weight: Tensor, per_lane: int) -> Tensor:
    """[N, K] -> [Np / ROWS, Kp / per_lane, ROWS, per_lane], zero-padded to a multiple of ROWS
    rows and of per_lane columns: a tile of ROWS rows is one sequential stream in which each
    64-byte vector holds `per_lane` consecutive columns of 16 rows."""
    out_features, in_features = weight.shape
    rows_p = -(-out_features // ROWS) * ROWS
    cols_p = -(-in_features // per_lane) * per_lane
    padded = weight.new_zeros(rows_p, cols_p)  # [Np, Kp]
    padded[:out_features, :in_features] = weight
    blocked = padded.view(rows_p // ROWS, ROWS, cols_p // per_lane, per_lane)
    return blocked.transpose(1, 2).contiguous()


def unpack(packed: Tensor, out_features: int, in_features: int) -> Tensor:
    """The inverse of `pack`: [Np / ROWS, Kp / per_lane, ROWS, per_lane] -> [N, K]."""
    blocks, chunks, rows, per_lane = packed.shape
    full = packed.transpose(1, 2).reshape(blocks * rows, chunks * per_lane)
    return full[:out_features, :in_features]


def int8_linear(
    x: Tensor, packed: Tensor, scale: Tensor, row_sum: Tensor, bias: Tensor | None, n: int
) -> Tensor:
    """x [..., K] -> [..., n]; see matmul.cpp `int8_linear`."""
    return native().int8_linear(x, packed, scale, row_sum, bias, n)


def bf16_linear(x: Tensor, packed: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """x [..., K] bf16 -> [..., n] bf16; see matmul.cpp `bf16_linear`."""
    return native().bf16_linear(x, packed, bias, n)


def gguf_quantize(x: Tensor, block: int) -> GgufActivations:
    """x [..., K] (K % block == 0) -> the int8 activations of the GGUF matmul in blocks of
    `block` (32: llama.cpp's Q8_0 / Q8_1, 256: its Q8_K); see gguf.cpp."""
    return GgufActivations(*native().gguf_quantize(x, block))


def gguf_pack_codes(q: Tensor, bits: int, sub: int, subs: int) -> Tensor:
    """Codes q uint8 [Np, K] (Np % 16 == 0) in the GGUF kernel's tile layout: uint8
    [Np / 16, K / (sub * subs), subs * 16 * sub * bits / 8]; see gguf.cpp."""
    return native().gguf_pack_codes(q, bits, sub, subs)


def int8_projection(
    packed: Tensor, scale: Tensor, row_sum: Tensor, bias: Tensor | None, n: int
) -> Callable[[Tensor], Tensor]:
    """x [..., K] -> [..., n] by `int8_linear` with these tensors (held, not copied)."""
    return native().Projection.int8(packed, scale, row_sum, bias, n)


def bf16_projection(packed: Tensor, bias: Tensor | None, n: int) -> Callable[[Tensor], Tensor]:
    """x [..., K] bf16 -> [..., n] by `bf16_linear` with these tensors (held, not copied)."""
    return native().Projection.bf16(packed, bias, n)


def gguf_projection(
    segments: Sequence[tuple[Tensor, GgufLayout, int, int]], bias: Tensor | None, n: int
) -> Callable[[Tensor], Tensor]:
    """x [..., K] -> [..., n] for a GGUF weight in row segments (packed, layout, rows, first
    output column): activations quantized once per block size (as `gguf_quantize`), then the
    GGUF matmul per segment into its columns; bias fp32 [n] or None. The segments are checked
    here (a clear error for a layout without a kernel or shapes that do not fit), x's width
    at each call."""
    specs = [
        (packed, lo.bits, lo.sub, lo.subs, lo.off, lo.mins, rows, offset)
        for packed, lo, rows, offset in segments
    ]
    return native().Projection.gguf(specs, bias, n)


def decoder_layer(
    input_norm: Tensor | None,
    mlp_in_norm: Tensor,
    attn_out_norm: Tensor | None,
    mlp_out_norm: Tensor | None,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    *,
    eps: float,
    projections: Sequence[Callable[[Tensor], Tensor]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    gelu: bool = False,
    q_scale: float = 1.0,
    window: int = 0,
    softcap: float = 0.0,
) -> Callable[..., Tensor]:
    """One decoder block in one native call (see layer.cpp).

    The norms' weights: before attention and before the MLP ([hidden]); Gemma's norms of the
    attention's and the MLP's outputs ([hidden] or None); Qwen3's and Gemma 3's q and k head
    norms ([head_dim] or None, both or neither). A weight in the activations' dtype multiplies
    after rounding, an fp32 weight under bf16 activations before (`rms_norm`). The q|k|v, o,
    gate|up and down projections (from `*_projection`), the head counts, GeGLU (`gelu`) or
    SwiGLU, q's factor before attention, the sliding window (0: none) and the attention
    scores' soft-cap (Gemma 2's cap * tanh(score / cap); 0: none). Called as
    `layer(x [B, T, hidden], cos, sin ([B, T, D] fp32), k_pool, v_pool ([L, blocks, Hkv,
    block_size, D]), layer_index, starts, tree_starts, tree_mask, block_table ([B, max_blocks]
    int64))` for a DECODE or TREE pass; returns the block's output [B, T, hidden].

    With `input_norm` None, the block starts from q|k|v's input already normed: called as
    `layer(input [B, T, W], x [B, T, hidden], cos, sin, ...)` (the rest as above), x the
    residual (an EAGLE-3 head's layer: input = [norm(embedding), norm(feature)], W = 2 hidden)."""
    qkv, o, gate_up, down = projections
    layer = native().DecoderLayer(
        input_norm=input_norm,
        mlp_in_norm=mlp_in_norm,
        attn_out_norm=attn_out_norm,
        mlp_out_norm=mlp_out_norm,
        q_norm=q_norm,
        k_norm=k_norm,
        eps=eps,
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        gelu=gelu,
        q_scale=q_scale,
        window=window,
        softcap=softcap,
    )
    return layer if input_norm is not None else layer.normed


def set_amx(wanted: bool) -> bool:
    """Use AMX for the matmuls where it can be (True) or never (False); returns whether AMX is
    now used (False where the CPU, the compiler or the OS does not offer it)."""
    return native().set_amx(wanted)


def isa() -> str:
    """What the matmuls run on, per format, e.g. "int8: amx, bf16: amx"."""
    return native().isa()


def int8_peak(iterations: int = 4_000_000, repeats: int = 3) -> float:
    """G int8 multiply-adds a second (1e9) that the loaded variant's int8 vector instruction
    reaches from registers on every thread of torch's pool (`core.h: int8_peak`): the best of
    `repeats` runs of `iterations` rounds a thread. The compute roof of the int8 and GGUF
    matmuls; AMX's tiles are not measured (the GGUF matmuls do not use them)."""
    if iterations < 1 or repeats < 1:
        raise ValueError(f"iterations and repeats must be >= 1, got {iterations}, {repeats}")
    return max(native().int8_peak(iterations) for _ in range(repeats))


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    starts: Sequence[int],
    tree_starts: Sequence[int] = (),
    tree_mask: Tensor | None = None,
    block_table: Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Per-query attention: q [B, H, T, D]; k and v [B, Hkv, S, D], or with `block_table`
    ([B, max_blocks] int64) pools of blocks [blocks, Hkv, block_size, D] where row b's slot s
    is slot s % block_size of block block_table[b, s // block_size] (a paged cache). Query t
    of row b reads slots 0 .. starts[b] + t; with `tree_mask` ([B, T, M] bool) and
    `tree_starts` ([B]) it reads slots 0 .. tree_starts[b] - 1 and tree_starts[b] + r where
    tree_mask[b, t, r]. `window` > 0: a query at position p reads no slot before
    p - window + 1 (sliding-window attention; trees shallower than the window). `softcap` > 0:
    each score becomes softcap * tanh(score / softcap) before the softmax (Gemma 2). Returns
    [B, H, T, D]; see attention.cpp."""
    return native().decode_attention(
        q, k, v, list(starts), list(tree_starts), tree_mask, block_table, window, softcap
    )


def argmax(x: Tensor) -> Tensor:
    """torch.argmax(x, -1) for x [..., N] (fp32 or bf16, N >= 1): [...] int64, the first largest
    value's index (a NaN counts as the largest); one pass, where torch's bf16 reduction is
    ~20x slower over a 150k-token vocabulary."""
    return native().argmax(x)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / rms(x) for x [..., D] (fp32 or bf16), weight [D]: in x's dtype (applied
    after rounding x / rms(x)), or fp32 under bf16 x (applied before); see pointwise.cpp."""
    return native().rms_norm(x, weight, eps)


def rope_(x: Tensor, cos: Tensor, sin: Tensor, heads: int) -> None:
    """RoPE in place on the first `heads` heads of each token of x [B, T, W] (contiguous);
    cos, sin fp32 [B, T, D]. Rounds as `x * cos + rotate_half(x) * sin` in x's dtype does."""
    native().rope_(x, cos, sin, heads)
