"""The empty drafter: proposes nothing, so every step is one plain decoding step (tau = 1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.drafters.base import SeqView
from specdecode.types import Draft, Verdict

EMPTY_DRAFT = Draft(tokens=torch.empty(0, dtype=torch.long))


class PlainDrafter:
    """Plain decoding expressed as a drafter with no drafts."""

    hidden_layers = None

    def propose(self, seqs: Sequence[SeqView], max_tokens: Sequence[int]) -> list[Draft]:
        return [EMPTY_DRAFT] * len(seqs)

    def commit(self, seq: SeqView, verdict: Verdict) -> None:
        """Nothing to sync."""

    def release(self, request_id: str) -> None:
        """Nothing to forget."""
