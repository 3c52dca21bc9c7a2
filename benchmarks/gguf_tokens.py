"""The GGUF kernel's arithmetic speed per block type and tokens per pass, on one core.

Each block type's projection ([--out, --in], random valid blocks, 1-3 MB) stays in the L3
cache, so the calls time the kernel's arithmetic (and a call's ~10-20 us of overhead), not the
memory: what a verification pass of T tokens costs once a type's weights are compute-bound (on
AVX2 every type is, beyond a few tokens). Per type and T: GMAC/s (out x in x T multiply-adds
per second), the median of `--repeats` timings of `--calls` calls each, after a warm-up; the
types and token counts take turns, so a slower minute slows them all alike. The variant the
kernels run is printed first (`SPECDECODE_CPU` picks another).

Usage: python benchmarks/gguf_tokens.py [--types q4_0,q5_0,q8_0,q4_k,q5_k,q6_k]
       [--tokens 1,2,4,8,9,16] [--out 2048] [--in 1536] [--calls 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from specdecode import kernels
from specdecode.bench.machine import machine_facts
from specdecode.model.gguf_blocks import decode
from specdecode.model.gguf_linear import GgufLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_cases import random_blocks  # the tests' random valid blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q4_0,q5_0,q8_0,q4_k,q5_k,q6_k")
    ap.add_argument("--tokens", default="1,2,4,8,9,16")
    ap.add_argument("--out", type=int, default=2048)
    ap.add_argument("--in", dest="inp", type=int, default=1536)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(machine_facts(), f"kernels: {kernels.isa()}, 1 thread", sep="\n")
    widths = [int(t) for t in args.tokens.split(",")]
    layers = {}
    for name in args.types.split(","):
        kind = GGMLQuantizationType[name.upper()]
        raw = random_blocks(kind, args.out, args.inp)
        layers[name] = GgufLinear([decode(kind, raw, args.inp)])
    inputs = {t: torch.randn(t, args.inp) for t in widths}
    seconds: dict[tuple[str, int], list[float]] = {(n, t): [] for n in layers for t in widths}
    with torch.inference_mode():
        for layer in layers.values():  # warm-up
            for x in inputs.values():
                layer(x)
        for _ in range(args.repeats):
            for (name, t), times in seconds.items():
                layer, x = layers[name], inputs[t]
                start = time.perf_counter()
                for _ in range(args.calls):
                    layer(x)
                times.append((time.perf_counter() - start) / args.calls)
    print(f"\nGMAC/s, [{args.out}, {args.inp}] in the L3 cache, median of {args.repeats}")
    print("| type | " + " | ".join(f"T={t}" for t in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for name in layers:
        macs = [args.out * args.inp * t / statistics.median(seconds[name, t]) / 1e9 for t in widths]
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in macs) + " |")


if __name__ == "__main__":
    main()
