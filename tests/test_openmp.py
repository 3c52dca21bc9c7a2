"""Releasing a thread's idle OpenMP workers (the server's engine thread keeps the only team)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from specdecode.engine.openmp import release_idle_workers


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(
    sys.platform != "linux" or "OpenMP" not in torch.__config__.parallel_info(),
    reason="needs Linux and PyTorch's OpenMP backend (GNU libgomp)",
)
def test_the_calling_threads_workers_are_freed() -> None:
    if torch.get_num_threads() < 2:
        pytest.skip("one OpenMP thread: no workers to free")
    x = torch.randn(1 << 22)
    (x * 2).sum()  # parallel regions: this thread now has its pool of workers
    before = _threads()
    assert release_idle_workers()
    assert _threads() < before
    (x * 2).sum()  # a new region starts new workers
    assert _threads() == before
