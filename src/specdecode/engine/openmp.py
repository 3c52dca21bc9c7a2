"""Release a thread's idle OpenMP workers, so that the thread that runs the model has the
only team.

GNU libgomp (PyTorch's OpenMP runtime on Linux) keeps a pool of worker threads for every
thread that ever ran a parallel region, and once it manages more threads than there are CPUs
it stops spinning between regions: each region then wakes its workers through the kernel. A
model loaded in one thread and stepped in another leaves two pools; on a 2-core machine an
int8 projection of the 1.5B took 584 us in the second thread against 519 us in the first,
and 515 us once the first had released its pool (docs/serving.md).
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what restarts them cheap


def release_idle_workers() -> bool:
    """Free the calling thread's OpenMP worker threads (OpenMP 5's `omp_pause_resource_all`,
    soft; a later parallel region in this thread starts new ones). Returns whether the runtime
    did so (False where it is not libgomp or has no such call)."""
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    return pause(OMP_PAUSE_SOFT) == 0
