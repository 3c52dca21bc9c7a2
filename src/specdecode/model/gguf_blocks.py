"""GGUF block formats, read as they are and repacked for specdecode's GGUF kernel.

Every supported format is one case of a two-level block code (`Codes`):

    w[n, k] = D[n, s] * sc[n, j] * (q[n, k] - off) - M[n, s] * mn[n, j]

with q unsigned `bits`-bit codes, superblock s (D and M fp16) of `subs` sub-blocks j of `sub`
values each (sc, mn int8; 1 where the format has none), `off` a constant of the format. No value
or scale is rounded: e.g. Q4_0 (w = d (q - 8)) is D = d, off = 8 and no M; Q8_0 (w = d q, q
int8) stores q + 128 with off = 128; Q4_1 (w = d q + m) is D = d, M = -m; Q4_K is D = d,
M = dmin with its 6-bit scales and mins; Q6_K (w = d sc (q - 32)) is D = d, off = 32.
The kernel sums each superblock in integers as llama.cpp does (`kernels/gguf.cpp`). `pack` lays
the codes out the way the kernel reads them (its header has the byte layout; the codes are laid
out natively, `kernels.gguf_pack_codes`, the scale tables here); `unpack`, in numpy, inverts
it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specdecode import kernels
from specdecode.errors import UserError
from specdecode.kernels.gguf_layout import ROWS, Layout

T = GGMLQuantizationType
# Every GGUF type the kernel runs, with its layout.
LAYOUTS: dict[GGMLQuantizationType, Layout] = {
    T.Q4_0: Layout(4, 32, 1, 8, 0),
    T.Q4_1: Layout(4, 32, 1, 0, 2),
    T.Q5_0: Layout(5, 32, 1, 16, 0),
    T.Q5_1: Layout(5, 32, 1, 0, 2),
    T.Q8_0: Layout(8, 32, 1, 128, 0),
    T.Q4_K: Layout(4, 32, 8, 0, 1),
    T.Q5_K: Layout(5, 32, 8, 0, 1),
    T.Q6_K: Layout(6, 16, 16, 32, 0),
}


@dataclass(frozen=True, slots=True)
class Codes:
    """A weight in the two-level block code (see the module docstring).

    q: [N, K] uint8 codes. D: [N, K / superblock] fp16; M likewise, or None (layout.mins 0).
    sc, mn: [N, K / sub] int8 or None (None = 1).
    """

    layout: Layout
    q: np.ndarray
    D: np.ndarray
    M: np.ndarray | None
    sc: np.ndarray | None
    mn: np.ndarray | None

    def weights(self) -> np.ndarray:
        """The [N, K] fp32 weight the codes stand for (in fp32 as gguf's dequantize rounds)."""
        rows, cols = self.q.shape
        lay = self.layout
        ds = np.repeat(self.D.astype(np.float32), lay.subs, axis=1)  # [N, K / sub]
        if self.sc is not None:
            ds = ds * self.sc.astype(np.float32)
        q = self.q.astype(np.float32).reshape(rows, -1, lay.sub) - np.float32(lay.off)
        w = ds[..., None] * q
        if self.M is not None:
            ms = np.repeat(self.M.astype(np.float32), lay.subs, axis=1)
            if self.mn is not None:
                ms = ms * self.mn.astype(np.float32)
            w = w - ms[..., None]
        return w.reshape(rows, cols)

    def take(self, rows: np.ndarray) -> Codes:
        """The codes of the weight's rows `rows` ([n] int indices), in that order."""
        part = [None if a is None else a[rows] for a in (self.M, self.sc, self.mn)]
        return Codes(self.layout, self.q[rows], self.D[rows], *part)


def _half(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] fp16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are values 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> 6-bit scales and mins [..., 8] each."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.int8), mn.astype(np.int8)


class UnsupportedBlockType(UserError):
    """A GGUF tensor type that has no kernel here."""


def check_supported(tensor_type: GGMLQuantizationType) -> None:
    """A clear error (`UnsupportedBlockType`) for a type without a kernel."""
    if tensor_type not in LAYOUTS:
        names = ", ".join(t.name for t in LAYOUTS)
        raise UnsupportedBlockType(
            f"GGUF tensor type {tensor_type.name} has no kernel here; supported: {names} "
            "(load with quantization='int8' or 'none' instead)"
        )


def decode(tensor_type: GGMLQuantizationType, raw: np.ndarray, cols: int) -> Codes:
    """The codes of a GGUF tensor: raw [N, row bytes] uint8 blocks of `tensor_type`, `cols`
    values per row. A type without a kernel is a clear error."""
    check_supported(tensor_type)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(rows, cols // block_size, type_size)
    layout = LAYOUTS[tensor_type]
    sc = mn = big_m = None
    if tensor_type in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_1, T.Q5_1):
        d = _half(b[..., 0:2])
        offset = 4 if tensor_type in (T.Q4_1, T.Q5_1) else 2
        if tensor_type == T.Q8_0:
            q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        else:
            if tensor_type in (T.Q5_0, T.Q5_1):
                qh = np.ascontiguousarray(b[..., offset : offset + 4]).view(np.uint32)  # [.., 1]
                high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
                offset += 4
            else:
                high = 0
            q = _nibbles(b[..., offset : offset + 16]) | (high << 4)
            if tensor_type in (T.Q4_1, T.Q5_1):
                big_m = -_half(b[..., 2:4])
    elif tensor_type in (T.Q4_K, T.Q5_K):
        d, big_m = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        q = (qs & 0x0F).reshape(rows, -1, 256)
        if tensor_type == T.Q5_K:
            qh = b[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
            q = q | ((qh & 1) << 4).reshape(rows, -1, 256)
    else:  # Q6_K: ql [128], qh [64], scales int8 [16], d
        ql = b[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
        ql = (ql & 0x0F).reshape(rows, -1, 256)
        qh = (
            b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        )
        q = ql | ((qh & 0x03) << 4).reshape(rows, -1, 256)
        sc = b[..., 192:208].view(np.int8)
        d = _half(b[..., 208:210])
    q = q.reshape(rows, cols).astype(np.uint8)
    flat = [None if a is None else a.reshape(rows, -1) for a in (big_m, sc, mn)]
    return Codes(layout, q, d.reshape(rows, -1), *flat)


def pack(codes: Codes) -> np.ndarray:
    """Codes of an [N, K] weight -> the kernel's uint8 [Np / 16, K / superblock, superblock
    bytes] (rows zero-padded to a multiple of 16: zero scales, so zero outputs)."""
    lay = codes.layout
    rows, cols = codes.q.shape
    rows_p = -(-rows // ROWS) * ROWS
    blocks, nsb = rows_p // ROWS, cols // lay.superblock

    def padded(a: np.ndarray) -> np.ndarray:
        return np.pad(a, ((0, rows_p - rows), (0, 0)))

    def tile_major(a: np.ndarray) -> np.ndarray:  # [Np, nsb * n] -> [Nb, nsb, n * 16] bytes
        a = padded(a).reshape(blocks, ROWS, nsb, -1).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(a).view(np.uint8).reshape(blocks, nsb, -1)

    def pairs(a: np.ndarray) -> np.ndarray:  # [Np, nsb * subs] -> [Nb, nsb, subs / 2 * 16 * 2]
        a = padded(a).reshape(blocks, ROWS, nsb, lay.subs // 2, 2).transpose(0, 2, 3, 1, 4)
        return np.ascontiguousarray(a).view(np.uint8).reshape(blocks, nsb, -1)

    parts = [tile_major(codes.D)]
    if lay.mins:
        parts.append(tile_major(codes.M))
    if lay.subs > 1:
        parts.append(pairs(codes.sc))
    if lay.mins == 1:
        parts.append(pairs(codes.mn))
    q = torch.from_numpy(padded(codes.q))  # [Np, K]
    parts.append(kernels.gguf_pack_codes(q, lay.bits, lay.sub, lay.subs).numpy())
    out = np.concatenate(parts, axis=-1)
    assert out.shape[-1] == lay.superblock_bytes
    return out


def unpack(packed: np.ndarray, layout: Layout, rows: int) -> Codes:
    """The inverse of `pack`: uint8 [Nb, nsb, superblock bytes] -> the codes of its first
    `rows` rows."""
    lay = layout
    blocks, nsb, _ = packed.shape
    rows_p = blocks * ROWS

    def row_major(raw: np.ndarray, dtype: type) -> np.ndarray:  # [Nb, nsb, n * 16 * size]
        a = np.ascontiguousarray(raw).view(dtype).reshape(blocks, nsb, -1, ROWS)
        return a.transpose(0, 3, 1, 2).reshape(rows_p, -1)[:rows]

    def pair_major(raw: np.ndarray) -> np.ndarray:  # [Nb, nsb, subs / 2 * 16 * 2] int8
        a = np.ascontiguousarray(raw).view(np.int8).reshape(blocks, nsb, -1, ROWS, 2)
        return a.transpose(0, 3, 1, 2, 4).reshape(rows_p, -1)[:rows]

    d = row_major(packed[..., : 2 * ROWS], np.float16)
    at = 2 * ROWS
    big_m = sc = mn = None
    if lay.mins:
        big_m = row_major(packed[..., at : at + 2 * ROWS], np.float16)
        at += 2 * ROWS
    if lay.subs > 1:
        sc = pair_major(packed[..., at : at + lay.subs * ROWS])
        at += lay.subs * ROWS
    if lay.mins == 1:
        mn = pair_major(packed[..., at : at + lay.subs * ROWS])
        at += lay.subs * ROWS
    data = packed[..., at:].reshape(blocks, nsb, lay.subs, lay.sub_bytes)
    lead = data.shape[:3]
    if lay.bits == 8:
        q = data.reshape(*lead, -1, ROWS, 4).swapaxes(-3, -2)  # [.., lanes, quads, 4]
    else:  # low nibbles as 4-bit codes lay them out; 5, 6 bits: then the plane of high bits
        low = data[..., : ROWS * lay.sub // 2]
        nib = low.reshape(*lead, -1, ROWS, 4).swapaxes(-3, -2)  # [.., lanes, vectors, 4]
        q = np.stack([nib & 0x0F, nib >> 4], axis=-2).reshape(*lead, ROWS, -1, 4)
        if lay.bits > 4:
            high = lay.bits - 4
            plane = data[..., ROWS * lay.sub // 2 :].reshape(*lead, ROWS, 1, 4)
            shifts = (np.arange(lay.sub // 4, dtype=np.uint8) * high).reshape(-1, 1)
            q = q | (((plane >> shifts) & ((1 << high) - 1)) << 4)  # [.., lanes, quads, 4]
    q = q.reshape(*lead, ROWS, lay.sub).transpose(0, 3, 1, 2, 4)
    q = q.reshape(rows_p, -1)[:rows]
    return Codes(lay, np.ascontiguousarray(q), d, big_m, sc, mn)
