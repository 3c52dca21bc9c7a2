"""The order of a later epoch: shuffled, with examples of similar length in one batch.

A batch's rows are as long as its longest sequence (`objective.packed_batch` packs shorter
ones together), and every padded column costs the head as much as a real one. Epochs after
the first read the feature store, which knows every example's length, so they group by
length: the stored examples are shuffled (seeded by the run's seed and the epoch), cut into
windows of `WINDOW` batches, each window sorted by length and cut into batches, and the
batches shuffled again, so that lengths do not become a curriculum. The order is a pure
function of its inputs: a resumed run finds it again and goes on at the same position.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

WINDOW = 16  # batches whose examples are sorted by length together


def epoch_batches(
    lengths: Mapping[int, int], seed: int, epoch: int, batch_size: int
) -> list[list[int]]:
    """The batches of epoch `epoch` (module docstring), as stream indices of `lengths`
    (index -> tokens); at most one batch per window is short.

    Example: epoch_batches({0: 5, 1: 90, 2: 7, 3: 88}, 0, 1, 2) pairs 0 with 2 and 1 with 3.
    """
    indices = sorted(lengths)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    shuffled = [indices[i] for i in torch.randperm(len(indices), generator=gen).tolist()]
    span = batch_size * WINDOW
    batches: list[list[int]] = []
    for start in range(0, len(shuffled), span):
        window = sorted(shuffled[start : start + span], key=lambda i: (lengths[i], i))
        batches += [window[i : i + batch_size] for i in range(0, len(window), batch_size)]
    return [batches[b] for b in torch.randperm(len(batches), generator=gen).tolist()]
