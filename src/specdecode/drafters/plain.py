"""The empty drafter: proposes nothing, so every step is one plain decoding step (tau = 1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.drafters.base import DrafterBase, SeqView
from specdecode.types import Draft

EMPTY_DRAFT = Draft(tokens=torch.empty(0, dtype=torch.long))


class PlainDrafter(DrafterBase):
    """Plain decoding expressed as a drafter with no drafts."""

    def propose(self, seqs: Sequence[SeqView], max_tokens: Sequence[int]) -> list[Draft]:
        return [EMPTY_DRAFT] * len(seqs)
