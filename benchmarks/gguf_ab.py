"""The GGUF kernel of two checkouts against each other in one process, one thread: per block
type (Q4_K, Q6_K, Q4_0, Q8_0) and tokens per call, the new kernel's speed over the old one's
(the median and the 2nd-8th of 9 alternating timings) and its G multiply-adds a second, on an
[--out, --in] weight of random codes (the default [2048, 1536] stays in the L3 cache; prefill
widths such as --tokens 256,783 time the loop over many groups of tokens). Both builds sit in
one program (their namespaces renamed), so a minute of slower memory or a busy neighbour slows
both alike: on a shared 2-core machine the separate runs of `gguf_tokens.py` moved 30-50%
between minutes.

Builds the kernel (gguf.cpp and the variant's arch folder) of each checkout with g++ and the
variant's flags; no torch, no install.

Usage: python benchmarks/gguf_ab.py --old <checkout> [--new .] [--variant avx2]
       [--tokens 1,4,5,8,9,16] [--out 2048] [--in 1536]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "native"
FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off"]


def _variant(name: str):
    """The variant `name` of src/specdecode/kernels/variants.py (loaded by path)."""
    path = ROOT / "src/specdecode/kernels/variants.py"
    spec = importlib.util.spec_from_file_location("_specdecode_variants", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    by_name = {v.name: v for v in module.VARIANTS}
    if name not in by_name:
        raise SystemExit(f"--variant {name}: not a variant; allowed: {', '.join(by_name)}")
    return by_name[name]


def _objects(checkout: Path, side: str, variant, out: Path) -> list[str]:
    """The timer and the kernel of one checkout, compiled into namespace sd_<side>."""
    kernels = checkout / "src/specdecode/kernels"
    flags = [*FLAGS, *variant.flags, f"-Dspecdecode=sd_{side}", f"-I{kernels}"]
    flags.append(variant.include(kernels))
    objects = []
    for source, name in [(HERE / "gguf_ab_timer.cpp", "timer"), (kernels / "gguf.cpp", "gguf")]:
        target = out / f"{name}_{side}.o"
        subprocess.run(
            ["g++", *flags, f"-DTIMER=time_{side}", "-c", str(source), "-o", str(target)],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        objects.append(str(target))
    return objects


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the old checkout's root")
    ap.add_argument("--new", type=Path, default=ROOT, help="the new checkout's root")
    ap.add_argument("--variant", default="avx2", help="the kernel variant to build and time")
    ap.add_argument("--tokens", default="1,4,5,8,9,16", help="token counts per call")
    ap.add_argument("--out", type=int, default=2048, help="the weight's rows (a multiple of 16)")
    ap.add_argument("--in", dest="inp", type=int, default=1536, help="its columns (of 256)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.out % 16 or args.inp % 256 or min(tokens) < 1:
        raise SystemExit("--out must be a multiple of 16, --in of 256, --tokens at least 1")
    variant = _variant(args.variant)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        objects = _objects(args.old, "old", variant, out) + _objects(args.new, "new", variant, out)
        program = out / "gguf_ab"
        main_source = str(HERE / "gguf_ab_main.cpp")
        subprocess.run(["g++", "-O2", "-o", str(program), main_source, *objects], check=True)
        print(f"{variant.name} variant, one thread; new speed / old speed, median (2nd-8th of 9)")
        subprocess.run([str(program), str(args.out), str(args.inp), *map(str, tokens)], check=True)


if __name__ == "__main__":
    main()
