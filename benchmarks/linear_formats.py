"""Weight formats for one projection on this CPU: ms per matrix for 1 to 256 tokens per pass.

Each format is timed on `--matrices` distinct [out, in] weight matrices (default 24 of
8960 x 1536, Qwen2.5-1.5B's MLP up projection: ~660 MB in bf16, far past the L3 cache), so every
call streams its weights from memory as decoding does. The formats take turns within each
repeat (a noisy neighbour slows them all alike); per format and tokens-per-pass: the median
(and the min) over `--repeats` sweeps of (sweep seconds / matrices), after one untimed sweep.

Formats (the candidates `specdecode.model.linear` / `quant` were chosen from, and what they
built):
- bf16 `F.linear`; bf16 pre-packed for oneDNN (`PackedLinear`, the fallback); specdecode's
  native bf16 kernel (`Bf16Linear`, our default);
- int8 dynamic, per-token activation scales, `torch._int_mm` (int8 x int8 -> int32);
- int8 dynamic, one activation range per pass (`quantized::linear_dynamic`, x86 engine, as torch
  offers it): a row's result depends on the other rows;
- specdecode's native int8 kernel, per-token scales (`Int8DynamicLinear`, our "int8");
- int8 weight-only (`aten._weight_int8pack_mm`, bf16 activations);
- int4 weight-only, group 128 (`Int4Linear`, our "int4", bf16 activations).
Each format's error vs the fp32 product is printed too (max |y - y_fp32| / max |y_fp32|). A
format this CPU cannot run (oneDNN's packed bf16 without AVX-512 or AVX-NE-CONVERT) is left
out with torch's reason.

Usage: python benchmarks/linear_formats.py [--out 8960] [--in 1536] [--matrices 24]
       [--tokens 1,4,8,9,64,256]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.bench.machine import machine_facts, wait_until_quiet
from specdecode.model.linear import Bf16Linear, PackedLinear
from specdecode.model.quant import Int4Linear, Int8DynamicLinear

Kernel = Callable[[Tensor], Tensor]  # x [T, in] bf16 -> y [T, out]


def int8_per_token(weight: Tensor) -> Kernel:
    scale = weight.float().abs().amax(1).clamp(min=1e-8) / 127  # [out]
    wq_t = (weight.float() / scale[:, None]).round().to(torch.int8).t().contiguous()  # [in, out]

    def run(x: Tensor) -> Tensor:
        xf = x.float()
        xs = xf.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127  # [T, 1]
        xq = (xf / xs).round().to(torch.int8)
        return (torch._int_mm(xq, wq_t).float() * xs * scale).to(x.dtype)

    return run


def int8_per_pass(weight: Tensor) -> Kernel:
    """The x86 dynamic kernel as torch offers it: one activation range for the whole pass."""
    w = weight.float()
    scale = (w.abs().amax(1).clamp(min=1e-8) / 127).double()  # [out]
    zeros = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 flags quantized tensors as deprecated
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w, scale, zeros, 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x.float(), packed, False).to(x.dtype)


def int8_weight_only(weight: Tensor) -> Kernel:
    scale = weight.float().abs().amax(1).clamp(min=1e-8) / 127
    wq = (weight.float() / scale[:, None]).round().to(torch.int8)  # [out, in]
    scale = scale.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, wq, scale)


FORMATS: dict[str, Callable[[Tensor], Kernel]] = {
    "bf16 F.linear": lambda w: lambda x: F.linear(x, w),
    "bf16 oneDNN packed": PackedLinear,
    "bf16 native (ours: none)": Bf16Linear,
    "int8 dyn per-token (_int_mm)": int8_per_token,
    "int8 dyn per-pass scale (x86)": int8_per_pass,
    "int8 native per-token (ours: int8)": Int8DynamicLinear,
    "int8 weight-only": int8_weight_only,
    "int4 weight-only g128 (ours: int4)": Int4Linear,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=int, default=8960)
    ap.add_argument("--in", dest="in_f", type=int, default=1536)
    ap.add_argument("--matrices", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", default="1,4,8,9,64,256")
    args = ap.parse_args()
    widths = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(args.out, args.in_f, generator=gen) * 0.02).bfloat16()
        for _ in range(args.matrices)
    ]
    xs = {t: torch.randn(t, args.in_f, generator=gen).bfloat16() for t in widths}
    kernels = {}
    for name, build in FORMATS.items():
        try:
            kernels[name] = [build(w) for w in weights]
        except RuntimeError as error:  # e.g. oneDNN's packed bf16 needs AVX-512 or AVX-NE-CONVERT
            print(f"left out {name}: {str(error).splitlines()[0]}")
    times: dict[tuple[str, int], list[float]] = {(n, t): [] for n in kernels for t in widths}
    facts = machine_facts()
    print(f"{facts['cpu']}, {facts['torch_threads']} threads, torch {torch.__version__}")
    wait_until_quiet(10)
    with torch.inference_mode():
        for _ in range(args.repeats + 1):
            for t in widths:
                for name, built in kernels.items():
                    t0 = time.perf_counter()
                    for k in built:
                        k(xs[t])
                    times[name, t].append((time.perf_counter() - t0) / len(built) * 1e3)
    print(f"{args.matrices} matrices of {args.out} x {args.in_f}; ms per matrix, median (min)")
    print("| format | " + " | ".join(f"T={t}" for t in widths) + " | rel. error |")
    print("|---" * (len(widths) + 2) + "|")
    t = min(widths[-1], 8)
    exact = F.linear(xs[t].float(), weights[0].float())
    for name, built in kernels.items():
        runs = [times[name, w][1:] for w in widths]
        cells = [f"{statistics.median(r):.2f} ({min(r):.2f})" for r in runs]
        err = (built[0](xs[t]).float() - exact).abs().max() / exact.abs().max()
        print(f"| {name} | " + " | ".join(cells) + f" | {err:.4f} |", flush=True)


if __name__ == "__main__":
    main()
