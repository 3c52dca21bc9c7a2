"""The empty drafter: proposes nothing, so every step is one plain decoding step (tau = 1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.drafters.base import DrafterBase, SeqView
from specdecode.types import Draft, DraftBudget

EMPTY_DRAFT = Draft(tokens=torch.empty(0, dtype=torch.long))


class PlainDrafter(DrafterBase):
    """Plain decoding expressed as a drafter with no drafts."""

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        return [EMPTY_DRAFT] * len(seqs)
