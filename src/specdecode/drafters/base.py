"""The Drafter protocol: propose a draft per sequence, then stay in sync with each verdict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdecode.types import Draft, SamplingParams, Verdict


class SeqView(Protocol):
    """What a drafter may read of a sequence (the engine's `Sequence` satisfies it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> list[int]:
        """Committed tokens: prompt + generated, in order."""
        ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator | None:
        """The sequence's random generator (None = torch's default)."""
        ...


def check_draft_limits(seqs: Sequence[SeqView], max_tokens: Sequence[int]) -> None:
    """Refuse `propose` arguments that are not one limit >= 0 per sequence."""
    if len(max_tokens) != len(seqs):
        raise ValueError(
            f"max_tokens needs one entry per sequence: got {len(max_tokens)} entries "
            f"for {len(seqs)} sequences"
        )
    for seq, limit in zip(seqs, max_tokens, strict=True):
        if limit < 0:
            raise ValueError(f"max_tokens must be >= 0, got {limit} for {seq.request_id!r}")


class Drafter(Protocol):
    """Proposes tokens; the engine never asks which kind of drafter it holds."""

    def propose(self, seqs: Sequence[SeqView], max_tokens: Sequence[int]) -> list[Draft]:
        """One draft per sequence, of at most `max_tokens[i]` tokens (0 allowed: no draft).

        A drafter that samples (q not one-hot) must compute q with
        `specdecode.sampling.probs.probs_from_logits` and the sequence's own `params`, and draw
        with the sequence's `generator`.
        """
        ...

    def commit(self, seq: SeqView, verdict: Verdict) -> None:
        """Sync own state (cache, index) after `verdict`; `seq.token_ids` already includes it."""
        ...

    def release(self, request_id: str) -> None:
        """Forget everything about a finished sequence."""
        ...
