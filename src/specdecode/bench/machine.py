"""The machine a benchmark runs on: what it is, and whether other processes are using it.

Machines are shared: another process on one of the cores slows a multi-threaded OpenMP decode
many times over (threads spin at barriers waiting for a descheduled partner; figures in
docs/design.md), so every timed run records the other processes' CPU load and a disturbed
group of runs is redone.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

import specdecode

QUIET_CORES = 0.2  # CPU (in cores) other processes may use while a run still counts as clean
_CLK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


def source_digest() -> str:
    """sha256 (first 16 hex digits) of the specdecode sources measured, in path order."""
    root = Path(specdecode.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def machine_facts() -> dict[str, Any]:
    """CPU model, core count, library versions and thread count of this run."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line),
        platform.processor() or "unknown",
    )
    try:
        import transformers

        hf_version: str | None = transformers.__version__
    except ImportError:
        hf_version = None
    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in cpuinfo,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": hf_version,
        "torch_threads": torch.get_num_threads(),
        "specdecode_sources_sha256": source_digest(),
    }


def descendants_cpu_s() -> float:
    """CPU seconds (user + system) that this process's living descendants have used: a
    peer's worker processes (vLLM's worker and its engine core), which run on our behalf."""
    children: dict[int, list[int]] = {}
    used: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                text = f.read()
        except OSError:  # it ended meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # state, ppid, ..., utime (11), stime (12)
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        used[pid] = (int(fields[11]) + int(fields[12])) / _CLK
    total, todo = 0.0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        total += used[pid]
        todo += children.get(pid, [])
    return total


class ForeignLoad:
    """CPU used by *other* processes, in cores, between `start()` and `stop()`: neither this
    process nor its descendants (`descendants_cpu_s`)."""

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        """(wall s, whole-machine busy s, this process's and its descendants' CPU s) now."""
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / _CLK  # minus idle and iowait
        own = os.times()  # children_*: descendants that ended and were waited for
        ours = own.user + own.system + own.children_user + own.children_system
        return time.perf_counter(), busy, ours + descendants_cpu_s()

    def start(self) -> None:
        """Begin a window."""
        self._t0 = self._sample()

    def stop(self) -> float:
        """End the window; return the other processes' mean load in cores."""
        t1 = self._sample()
        wall = max(t1[0] - self._t0[0], 1e-9)
        return max(0.0, (t1[1] - self._t0[1]) - (t1[2] - self._t0[2])) / wall


def with_foreign_load(run: Callable[[], T]) -> tuple[T, float]:
    """Call `run()`; return its result and the other processes' mean CPU load, in cores, while
    it ran."""
    load = ForeignLoad()
    load.start()
    result = run()
    return result, load.stop()


def wait_until_quiet(max_wait_s: float, window_s: float = 1.0) -> float:
    """Sleep in `window_s` steps until other processes use < QUIET_CORES (or time runs out).

    Returns the seconds waited.
    """
    load, waited = ForeignLoad(), 0.0
    while waited < max_wait_s:
        load.start()
        time.sleep(window_s)
        if load.stop() < QUIET_CORES:
            break
        waited += window_s
    return waited
