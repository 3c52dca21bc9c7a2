"""A GGUF file's tensor table, read without its metadata.

`gguf.GGUFReader` parses every metadata field into numpy objects, the tokenizer's ~150k strings
included: ~11 s for Qwen2.5's GGUF on this machine. quantization="gguf" needs only the tensors,
so `read_tensors` steps over the metadata (lengths only) and maps the tensor data from the file
(numpy memmap, nothing copied). Little-endian GGUF v2 and v3, as llama.cpp writes them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from specdecode.errors import ModelNotFoundError, UserError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# bytes of each fixed-size metadata value type
_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of a GGUF file, as `gguf.ReaderTensor` gives the fields we use.

    shape: dims innermost first (GGUF's order). data: F32 / F16 as their dtype in the reversed
    shape; a block type as uint8 [..., row bytes].
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GgufTensors:
    """The tensor table of a GGUF file (`tensors`, in file order)."""

    tensors: list[GgufTensor]


class _Cursor:
    """Little-endian reads from a byte buffer, with the file's name for errors."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.at, self.path = buf, 0, path

    def take(self, fmt: str) -> int | float:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise UserError(f"{self.path} is not a readable GGUF file (truncated)")
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def string(self) -> str:
        size = int(self.take("<Q"))
        self.at += size
        return bytes(self.buf[self.at - size : self.at]).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        """Steps over one metadata value of type `kind`."""
        if kind == GGUFValueType.STRING:
            size = int(self.take("<Q"))  # (read first: `self.at += take()` would lose its step)
            self.at += size
        elif kind == GGUFValueType.ARRAY:
            item, count = int(self.take("<I")), int(self.take("<Q"))
            if item in _SIZES:
                self.at += count * _SIZES[GGUFValueType(item)]
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _SIZES:
            self.at += _SIZES[GGUFValueType(kind)]
        else:
            raise UserError(f"{self.path} has a metadata value of unknown type {kind}")


def read_tensors(path: Path) -> GgufTensors:
    """The tensor table of the GGUF file at `path`, its data mapped from the file; a clear error
    for a file that is missing, not GGUF, big-endian, of GGUF v1 or truncated."""
    if not path.is_file():
        raise ModelNotFoundError(f"no such GGUF file: {path}")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped), path)
    if bytes(cur.buf[:4]) != _MAGIC:
        raise UserError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.at = 4
    version = int(cur.take("<I"))
    if version not in (2, 3):
        raise UserError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = int(cur.take("<Q")), int(cur.take("<Q"))
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, kind = cur.string(), int(cur.take("<I"))
        if key == "general.alignment" and kind == GGUFValueType.UINT32:
            alignment = int(cur.take("<I"))
        else:
            cur.skip_value(kind)
    infos = []
    for _ in range(n_tensors):
        name, dims = cur.string(), int(cur.take("<I"))
        shape = tuple(int(cur.take("<Q")) for _ in range(dims))
        infos.append((name, shape, GGMLQuantizationType(int(cur.take("<I"))), int(cur.take("<Q"))))
    start = -(-cur.at // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        block, type_bytes = GGML_QUANT_SIZES[kind]
        values = int(np.prod(shape))
        nbytes = values // block * type_bytes
        at = start + offset
        if at + nbytes > len(mapped):
            raise UserError(f"{path} is not a readable GGUF file (truncated at tensor {name})")
        raw = mapped[at : at + nbytes]
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if kind == GGMLQuantizationType.F32 else np.float16
            data = raw.view(dtype).reshape(shape[::-1])
        else:
            data = raw.reshape(*shape[::-1][:-1], shape[0] // block * type_bytes)
        tensors.append(GgufTensor(name, kind, shape, data))
    return GgufTensors(tensors)
