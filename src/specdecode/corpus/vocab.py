"""The draft vocabulary: the target tokens a head can propose (EAGLE-3's reduced head)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def draft_vocabulary(
    answers: Iterable[Sequence[int]], size: int, vocab_size: int, always: Sequence[int] = ()
) -> Tensor:
    """The `size` most frequent tokens of `answers` (ties: lower id first), plus `always`
    (e.g. EOS), as sorted target ids ([size] int64). Where the answers use fewer distinct
    tokens, the lowest unused ids fill the rest."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    counts = Counter(t for ids in answers for t in ids)
    chosen = list(dict.fromkeys(t for t in always if 0 <= t < vocab_size))[:size]
    taken = set(chosen)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    for t in ranked:
        if len(chosen) == size:
            break
        if t not in taken:
            chosen.append(t)
            taken.add(t)
    filler = (t for t in range(vocab_size) if t not in taken)
    chosen += [next(filler) for _ in range(size - len(chosen))]
    return torch.tensor(sorted(chosen), dtype=torch.long)
