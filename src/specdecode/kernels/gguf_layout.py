"""The shape of a GGUF weight as the native gguf kernel reads it (`kernels/gguf.cpp`): rows
packed 16 to a tile, codes of `bits` bits in sub-blocks with their scales. A plain value type
that both the kernels' binding and the model's block decoder (`model/gguf_blocks.py`) import.
"""

from __future__ import annotations

from dataclasses import dataclass

ROWS = 16  # output rows per packed tile (kernels/gguf.cpp), one per 32-bit lane


@dataclass(frozen=True, slots=True)
class Layout:
    """The kernel's code shape: `bits` per code, `sub` values per sub-block, `subs` sub-blocks
    per superblock, `off` the codes' offset, `mins`: 0 -> no M, 1 -> M times an own int8 table
    mn, 2 -> M alone (mn = 1)."""

    bits: int
    sub: int
    subs: int
    off: int
    mins: int

    @property
    def superblock(self) -> int:
        """Values per superblock (one D and M per row); also the activations' block: 32 values
        per int8 scale with fp16 scales (llama.cpp's Q8_0 / Q8_1) or 256 with fp32 (Q8_K)."""
        return self.sub * self.subs

    @property
    def sub_bytes(self) -> int:
        """Code bytes of one tile's sub-block."""
        return ROWS * self.sub * self.bits // 8

    @property
    def header_bytes(self) -> int:
        """D and M (fp16), sc and mn (int8) of a tile's rows in one superblock."""
        tables = (self.subs if self.subs > 1 else 0) + (self.subs if self.mins == 1 else 0)
        return (2 if self.mins else 1) * ROWS * 2 + tables * ROWS

    @property
    def superblock_bytes(self) -> int:
        """Bytes of one packed tile's superblock: header and codes."""
        return self.header_bytes + self.subs * self.sub_bytes
