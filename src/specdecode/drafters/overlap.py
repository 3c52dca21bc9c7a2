"""Speculative-speculative decoding (SSD; Saguaro): draft the next step while the target
verifies this one.

`OverlapDrafter` wraps a drafter. After each `propose`, a background thread asks the wrapped
drafter, for every greedy sequence, to draft on from the most likely verification outcome: the
whole draft accepted and the bonus token the drafter itself predicts. It does so by proposing
K + 1 tokens after `token_ids + draft`: the first is the predicted bonus b, the other K are the
next step's draft. When the verdict comes (`commit` waits for the thread first), the next
`propose` checks the hypothesis: if the committed tokens are exactly `token_ids + draft + [b]`
(a hit), the prepared draft is returned without drafting; otherwise the sequence is drafted as
usual. Either way the output is unchanged: only the draft's timing differs.

The wrapped drafter must tolerate a propose over a context that then does not happen (the
draft model keeps the tokens its cache holds and re-feeds from the first that differs).
Sampled sequences are not prepared: their drafts draw from the sequence's generator, which the
verifier uses meanwhile. On a CPU the thread competes with the verification pass for the same
cores and memory bandwidth, so a hit saves less than a draft's time and a miss costs some:
the bench command says which wins on a given machine.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from specdecode.drafters.base import Drafter, DrafterBase, SeqView, draft_limits
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


@dataclass(frozen=True, slots=True)
class _Hypothesis:
    """A sequence as it would be after the most likely verdict (a `SeqView`)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A draft prepared for `context`, the committed tokens of the hypothesised verdict."""

    context: list[int]
    draft: Draft


class OverlapDrafter(DrafterBase):
    """Drafts the next step on a background thread during verification (module docstring).

    Args:
        inner: the drafter that drafts (its own and the prepared drafts).
        num_speculative_tokens: K, the prepared draft's length.

    Attributes:
        num_hits: proposes answered by a prepared draft.
        num_prepared: drafts prepared.
        needs, names: the wrapped drafter's.
        setup_s: the one-time work of the wrapped drafter's latest propose for this step's
            drafts (read before the preparing thread starts; what it spends there is hidden
            behind verification and not billed).
    """

    def __init__(self, inner: Drafter, num_speculative_tokens: int) -> None:
        self.inner = inner
        self.needs = inner.needs
        self.names = inner.names
        self.num_speculative_tokens = num_speculative_tokens
        self.num_hits = self.num_prepared = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdecode-ssd")
        weakref.finalize(self, self._pool.shutdown, wait=False)  # its thread ends with us
        self._job: Future[None] | None = None
        self._prepared: dict[str, _Prepared] = {}

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """The prepared drafts where the hypothesis came true (cut to `budgets[i].max_tokens`),
        the wrapped drafter's for the rest; then start preparing the next step's."""
        self._wait()
        self.setup_s = 0.0
        drafts: list[Draft | None] = []
        missed = []
        for i, (seq, limit) in enumerate(zip(seqs, draft_limits(seqs, budgets), strict=True)):
            ready = self._prepared.pop(seq.request_id, None)
            if ready is not None and ready.context == seq.token_ids and limit > 0:
                self.num_hits += 1
                tokens = ready.draft.tokens[:limit]
                probs = None if ready.draft.probs is None else ready.draft.probs[:limit]
                drafts.append(Draft(tokens, probs))
            else:
                drafts.append(None)
                missed.append(i)
        if missed:
            fresh = self.inner.propose([seqs[i] for i in missed], [budgets[i] for i in missed])
            self.setup_s = self.inner.setup_s
            for i, draft in zip(missed, fresh, strict=True):
                drafts[i] = draft
        done = [d for d in drafts if d is not None]
        hypotheses = [
            _Hypothesis(
                seq.request_id,
                seq.token_ids + draft.tokens.tolist(),
                seq.num_prompt_tokens,
                seq.params,
            )
            for seq, draft in zip(seqs, done, strict=True)
            if seq.params.greedy and draft.tree is None and draft.tokens.numel() > 0
        ]
        if hypotheses:
            self._job = self._pool.submit(self._prepare, hypotheses)
        return done

    def catch_up(self, seq: SeqView) -> int:
        """The wrapped drafter's catch-up (`Drafter.catch_up`), once the background draft is
        done with its cache."""
        self._wait()
        return self.inner.catch_up(seq)

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Wait for the preparing thread, then sync the wrapped drafter."""
        self._wait()
        self.inner.commit(seq, verdict, target)

    def release(self, request_id: str) -> None:
        """Wait for the preparing thread; forget the request here and in the wrapped drafter."""
        self._wait()
        self._prepared.pop(request_id, None)
        self.inner.release(request_id)

    def _prepare(self, hypotheses: list[_Hypothesis]) -> None:
        """Draft K + 1 tokens after each hypothesis: the predicted bonus, then the draft (to
        the limit, without bounds: cut when proposed)."""
        limits = [DraftBudget(self.num_speculative_tokens + 1)] * len(hypotheses)
        with torch.inference_mode():
            drafts = self.inner.propose(hypotheses, limits)
        for hyp, draft in zip(hypotheses, drafts, strict=True):
            if draft.tokens.numel() >= 2:
                bonus = draft.tokens[:1].tolist()
                rest = Draft(draft.tokens[1:], None if draft.probs is None else draft.probs[1:])
                self._prepared[hyp.request_id] = _Prepared(hyp.token_ids + bonus, rest)
                self.num_prepared += 1

    def _wait(self) -> None:
        """Block until the preparing thread is done (re-raising its error)."""
        if self._job is not None:
            job, self._job = self._job, None
            job.result()
