"""Builds the kernels' native test driver (driver.cpp with the cores, no torch) once per variant
and runs it: `python tests/native/run.py` runs every variant this CPU executes;
`--arch aarch64` cross-compiles the ARM64 variants with Debian's g++-aarch64-linux-gnu and runs
them under qemu-user (`make test-arm64` installs both first). Exits non-zero if a build or a
check fails. Standard library only."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "src/specdecode/kernels"
CORES = ["matmul", "gguf", "attention", "pointwise", "peak"]
# as setup.py compiles the kernels (-ffp-contract=off: the references round as the kernels do)
FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-pthread"]
# per target architecture: the compiler, and how to run what it built (None: directly)
TOOLCHAINS = {
    "x86_64": ("g++", None),
    "aarch64": ("aarch64-linux-gnu-g++", ["qemu-aarch64", "-cpu", "max"]),
}


def _variants():
    """src/specdecode/kernels/variants.py, loaded by path (no torch, no install needed)."""
    spec = importlib.util.spec_from_file_location("_specdecode_variants", KERNELS / "variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# AMX's features: the kernels use its tiles only where the OS grants them at run time (the
# vector code of the same build serves otherwise), so a build that needs AMX runs on a CPU that
# has every other feature it needs, its tile code left out.
AMX = frozenset({"amx_tile", "amx_int8", "amx_bf16"})


def _runs(variants, variant, features: frozenset[str]) -> bool:
    """Whether this CPU runs the variant's driver: it has the features the variant needs,
    AMX's aside (see AMX)."""
    return variants.runs_here(variant, features | (variant.needs & AMX))


def build(variant, arch: str, out: Path) -> Path:
    """Compiles the driver and the cores for `variant` on `arch`; returns the program."""
    compiler, _ = TOOLCHAINS[arch]
    program = out / f"driver_{arch}_{variant.name}"
    static = ["-static"] if arch != platform.machine() else []  # qemu needs no target libs
    command = [
        compiler,
        *FLAGS,
        *variant.flags,
        variant.include(KERNELS),
        *static,
        "-o",
        str(program),
        str(ROOT / "tests/native/driver.cpp"),
        *(str(KERNELS / f"{name}.cpp") for name in CORES),
    ]
    subprocess.run(command, check=True)
    return program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=platform.machine(), choices=sorted(TOOLCHAINS))
    parser.add_argument("--variants", help="comma-separated variant names (default: all that run)")
    parser.add_argument("--out", type=Path, default=ROOT / "build/native")
    args = parser.parse_args(argv)

    variants = _variants()
    chosen = variants.for_machine(args.arch)
    features = variants.cpu_features() if args.arch == platform.machine() else frozenset()
    if args.arch == platform.machine():  # only what this CPU executes
        chosen = tuple(v for v in chosen if _runs(variants, v, features))
    if args.variants:
        names = set(args.variants.split(","))
        unknown = names - {v.name for v in chosen}
        if unknown:
            parser.error(
                f"{', '.join(sorted(unknown))}: not a variant that runs here for {args.arch}"
            )
        chosen = tuple(v for v in chosen if v.name in names)
    compiler, runner = TOOLCHAINS[args.arch]
    for tool in [compiler, *(runner or [])[:1]]:
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (make test-arm64 installs it)", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for variant in chosen:
        started = time.monotonic()
        print(f"== {args.arch} {variant.name}: building", flush=True)
        try:
            program = build(variant, args.arch, args.out)
        except subprocess.CalledProcessError:
            failed.append(variant.name)
            continue
        built = time.monotonic() - started
        result = subprocess.run([*(runner or []), str(program)], capture_output=True, text=True)
        lines = result.stdout.splitlines()
        wanted = os.environ.get("SPECDECODE_AMX") != "0"
        if variant.needs & AMX and not variant.needs - features and wanted:  # it must be used
            kernels = next((line for line in lines if line.startswith("kernels:")), "")
            if "int8: amx" not in kernels:
                print(
                    f"FAIL this CPU has AMX but the {variant.name} build does not use it: "
                    f"{kernels or 'no kernels line'}"
                )
                result.returncode = result.returncode or 1
        elif variant.needs & AMX:
            lacking = ", ".join(sorted(AMX - features))
            print(f"   (its AMX tile code not run: this CPU lacks {lacking})")
        for line in lines:
            if not line.startswith("ok "):
                print(line)
        print(
            f"== {args.arch} {variant.name}: {sum(line.startswith('ok ') for line in lines)} "
            f"checks passed, exit {result.returncode} (build {built:.0f} s, "
            f"run {time.monotonic() - started - built:.0f} s)",
            flush=True,
        )
        if result.stderr:
            print(result.stderr, file=sys.stderr)
        if result.returncode != 0:
            failed.append(variant.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or not chosen else 0


if __name__ == "__main__":
    sys.exit(main())
