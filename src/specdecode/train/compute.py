"""Where a trainable head trains and in what dtype: bf16 on a GPU and where the CPU multiplies
bf16 natively.

Without native bf16 dot products (AVX-512 BF16, AMX, ARM64's BF16), oneDNN's bf16 matmul
converts as it goes and runs far below fp32: measured on an AMD EPYC Zen 3 (AVX2), one core,
[1024, 1536] x [1536, 8960]: fp32 54 GFLOP/s, bf16 9 GFLOP/s. Weights and optimizer state stay
fp32 either way.
"""

from __future__ import annotations

import torch

from specdecode.errors import UserError
from specdecode.kernels.variants import cpu_features

HEAD_DTYPES = ("auto", "bfloat16", "float32")
# /proc/cpuinfo's names of native bf16 dot products: AVX-512 BF16, AMX BF16, ARM64 BF16
NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def head_compute_dtype(
    name: str, features: frozenset[str] | None = None, device: torch.device | None = None
) -> torch.dtype:
    """The head's compute dtype for `name` ("auto", "bfloat16" or "float32"): "auto" is
    bfloat16 on a GPU (`device` other than the CPU) and where the CPU's `features` (default:
    this CPU's, `cpu_features()`) include a native bf16 dot product, else float32.

    Example: head_compute_dtype("auto", frozenset({"avx2", "fma"})) is torch.float32.
    """
    if name not in HEAD_DTYPES:
        raise ValueError(f"unknown head dtype {name!r}; allowed: {', '.join(HEAD_DTYPES)}")
    if name == "auto" and device is not None and device.type != "cpu":
        return torch.bfloat16
    if name == "auto":
        native = NATIVE_BF16 & (cpu_features() if features is None else features)
        return torch.bfloat16 if native else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def training_device(name: str) -> torch.device:
    """The device a head trains on ("cpu", "cuda", "cuda:1", "mps", ...), checked to exist.

    Example: training_device("cpu") is torch.device("cpu").
    """
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UserError(f"unknown device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: this torch sees no CUDA GPU (torch {torch.__version__})")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: this torch sees no Apple GPU")
    return device
