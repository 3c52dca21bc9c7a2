"""Releasing a thread's idle OpenMP workers (the server's engine thread keeps the only team)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from specdecode.engine.openmp import release_idle_workers


def _threads() -> set[str]:
    """The process's thread ids (other libraries' threads may start or end at any time: the
    test compares which ids leave and come, not only how many there are)."""
    return set(os.listdir("/proc/self/task"))


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
    freed = before - _threads()
    assert len(freed) >= torch.get_num_threads() - 1  # this thread's workers are gone
    (x * 2).sum()  # a new region starts new workers
    assert len(_threads() - (before - freed)) >= torch.get_num_threads() - 1
