"""Several drafters behind one: each request drafts with the one its `SamplingParams.drafter`
names (the first when it names none), so one server offers, e.g., prompt lookup and a draft
model side by side (`specdecode serve --speculative-config A --speculative-config B`).

Every request of a step is still verified in the same target pass; only drafting is split by
drafter. At most one of the drafters may read the target's hidden states (the pass keeps one
set of layers for every row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specdecode.drafters.base import Drafter, DrafterBase, DrafterNeeds, SeqView
from specdecode.errors import UserError
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


class DrafterMux(DrafterBase):
    """Routes each sequence to one of `drafters` (name -> (drafter, its K)); the first is the
    default. A sequence drafts at most its drafter's K tokens per step."""

    def __init__(self, drafters: Mapping[str, tuple[Drafter, int]]) -> None:
        if not drafters:
            raise UserError("a DrafterMux needs at least one drafter")
        self.drafters = dict(drafters)
        self.default = next(iter(self.drafters))
        readers = {d.needs.hidden_layers for d, _ in self.drafters.values()} - {()}
        if len(readers) > 1:
            raise UserError(
                "at most one of the drafters served together may read the target's hidden "
                f"states (these ask for layers {sorted(readers)}); serve the others apart"
            )
        self.needs = DrafterNeeds(
            hidden_layers=next(iter(readers), ()),
            target_argmax=any(d.needs.target_argmax for d, _ in self.drafters.values()),
        )
        self.names = tuple(self.drafters)  # the default first (the engine checks requests)
        self.setup_s = 0.0  # the latest propose's one-time work, all drafters together

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """Each drafter drafts for its own sequences (in their order, their budgets cut to
        its K); the drafts come back in the order of `seqs`."""
        groups: dict[str, list[int]] = {}
        for row, seq in enumerate(seqs):
            groups.setdefault(self._name(seq), []).append(row)
        drafts: dict[int, Draft] = {}
        self.setup_s = 0.0
        for name, rows in groups.items():
            drafter, k = self.drafters[name]
            cut = [budgets[row].at_most(k) for row in rows]
            proposed = drafter.propose([seqs[row] for row in rows], cut)
            drafts.update(zip(rows, proposed, strict=True))
            self.setup_s += drafter.setup_s
        return [drafts[row] for row in range(len(seqs))]

    def catch_up(self, seq: SeqView) -> int:
        """The sequence's own drafter's catch-up (`Drafter.catch_up`)."""
        return self.drafters[self._name(seq)][0].catch_up(seq)

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """The sequence's own drafter syncs."""
        self.drafters[self._name(seq)][0].commit(seq, verdict, target)

    def release(self, request_id: str) -> None:
        """Every drafter forgets the request (those that never saw it ignore the call)."""
        for drafter, _ in self.drafters.values():
            drafter.release(request_id)

    def _name(self, seq: SeqView) -> str:
        return seq.params.drafter or self.default
