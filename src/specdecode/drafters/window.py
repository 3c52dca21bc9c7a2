"""A draft model that reads only the end of each prompt (speculative_config "prompt_window").

A draft model catches up on a new sequence by prefilling its whole prompt: on a CPU that costs
a third to a half of the target's own prefill, which a short answer's drafts cannot repay
(docs/drafters.md, "A prompt window for a draft model", has the measurements).

`PromptWindow` wraps a drafter and hands it every sequence from a fixed offset on: the first
time it sees a sequence (the commit after its prefill: prompt + first token), the offset
leaves the last `tokens` of them, and it stays there as the sequence grows, so the wrapped
drafter's cache, positions and rollbacks stay consistent (its positions start at the window's
first token; RoPE attention depends on the distances alone). Its prefill then costs at most
`tokens` tokens whatever the prompt's length; its drafts see less of a long prompt (a draft
model copies less from it), never what verification accepts: the target checks every draft
token against the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.drafters.base import Drafter, DrafterBase, DrafterNeeds, SeqView
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


@dataclass(frozen=True, slots=True)
class WindowedSeq:
    """`seq` as a drafter behind a `PromptWindow` sees it: its tokens from `offset` on."""

    seq: SeqView
    offset: int

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.offset :]

    @property
    def num_prompt_tokens(self) -> int:
        return max(self.seq.num_prompt_tokens - self.offset, 0)

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator


class PromptWindow(DrafterBase):
    """`inner` (a drafter that needs nothing from the target's passes) fed each sequence's
    last `tokens` tokens as of its first commit, and everything after them (module docstring).

    Raises:
        ValueError: `tokens` < 1, or `inner` needs the target's hidden states or argmax (their
            positions are the whole sequence's).
    """

    def __init__(self, inner: Drafter, tokens: int) -> None:
        if tokens < 1:
            raise ValueError(f"a prompt window holds at least 1 token, got {tokens}")
        if inner.needs != DrafterNeeds():
            raise ValueError("a prompt window wraps drafters that need nothing from the target")
        self.inner = inner
        self.tokens = tokens
        self.needs = inner.needs
        self.names = inner.names
        self._offsets: dict[str, int] = {}  # request id -> its window's first token

    @property
    def setup_s(self) -> float:  # type: ignore[override]  (the wrapped drafter's)
        return self.inner.setup_s

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """The wrapped drafter's drafts for the windowed sequences."""
        return self.inner.propose([self._windowed(s) for s in seqs], budgets)

    def catch_up(self, seq: SeqView) -> int:
        """The wrapped drafter's catch-up on the windowed sequence (at most the window and
        the tokens generated since the window was fixed), fixing nothing."""
        offset = self._offsets.get(seq.request_id, self._first_offset(seq))
        return self.inner.catch_up(WindowedSeq(seq, offset))

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Fix the sequence's window the first time it is seen; forward the verdict."""
        self.inner.commit(self._windowed(seq), verdict, target)

    def release(self, request_id: str) -> None:
        """Forget the sequence's window, and the wrapped drafter its state."""
        self._offsets.pop(request_id, None)
        self.inner.release(request_id)

    def _windowed(self, seq: SeqView) -> WindowedSeq:
        offset = self._offsets.setdefault(seq.request_id, self._first_offset(seq))
        return WindowedSeq(seq, offset)

    def _first_offset(self, seq: SeqView) -> int:
        """The offset that leaves `seq`'s last `tokens` tokens (its window when first seen)."""
        return max(len(seq.token_ids) - self.tokens, 0)
