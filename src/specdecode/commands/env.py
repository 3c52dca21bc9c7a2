"""`specdecode env`: what this install runs on: versions, the CPU, and the kernel build in use."""

from __future__ import annotations

import argparse
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from specdecode import kernels
from specdecode.kernels import variants


def add_env_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode env`."""
    sub.add_parser(
        "env",
        help="versions, the CPU and the kernel build in use (SPECDECODE_CPU forces one)",
    )


def _cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name from /proc/cpuinfo, or platform.processor()."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware"):
            return value.strip()
    return platform.processor() or "unknown"


def run_env(args: argparse.Namespace) -> int:
    """Print one `key: value` line per fact; the kernel line names the variant loaded (a
    UserError, exit 2, if none loads: SPECDECODE_CPU names one that cannot run here)."""
    try:
        ours = version("specdecode")
    except PackageNotFoundError:  # run from a source tree that was never installed
        ours = "not installed"
    features = variants.cpu_features()
    runs = [v.name for v in variants.for_machine() if variants.runs_here(v, features)]
    wanted = os.environ.get(variants.ENV, "auto") or "auto"
    module = kernels.native()
    print(f"specdecode: {ours}")
    print(f"python: {platform.python_version()}, torch: {torch.__version__}")
    print(f"cpu: {_cpu_name()} ({platform.machine()}), {os.cpu_count()} logical cores")
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"kernel variants this CPU runs: {', '.join(runs)}")
    print(f"kernel variants installed: {', '.join(kernels.built())}")
    print(f"kernels in use: {module.variant} ({variants.ENV}={wanted}); {module.isa()}")
    return 0
