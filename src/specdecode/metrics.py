"""Speculative-decoding metrics: counters only; every rate is derived on read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpecCounters:
    """Counters of one request, or of many added together.

    num_steps: target verification passes (prefill's first token counts as one).
    num_drafts: steps that carried a draft of at least one token.
    num_draft_tokens: drafted tokens (a tree's nodes), summed over steps.
    num_tree_drafts: drafts that were trees with a branch (the rest were chains).
    num_draft_depth: the drafts' depths (a chain's is its length), summed.
    num_accepted_tokens: draft tokens the verifier kept (a tree's accepted path).
    num_output_tokens: tokens the steps emitted (accepted + recovered/bonus, as committed).
    accepted_per_position: [i] = drafts whose first i + 1 tokens (tree: path down to depth
        i + 1) were all accepted.
    draft_s: seconds the drafter spent proposing (a batch's time split evenly over its rows).
    """

    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_tree_drafts: int = 0
    num_draft_depth: int = 0
    num_accepted_tokens: int = 0
    num_output_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_s: float = 0.0

    def record(
        self,
        num_draft: int,
        num_accepted: int,
        num_emitted: int,
        depth: int | None = None,
        draft_s: float = 0.0,
    ) -> None:
        """Count one verification step of one sequence; `depth` is a tree draft's depth
        (None: a chain, whose depth is num_draft); `draft_s` the step's drafting seconds."""
        self.num_steps += 1
        self.draft_s += draft_s
        self.num_output_tokens += num_emitted
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_tree_drafts += int(depth is not None and depth < num_draft)
        self.num_draft_depth += num_draft if depth is None else depth
        self.num_accepted_tokens += num_accepted
        missing = num_accepted - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, missing))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def copy(self) -> SpecCounters:
        """An independent snapshot."""
        snapshot = SpecCounters()
        snapshot += self
        return snapshot

    def __iadd__(self, other: SpecCounters) -> SpecCounters:
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_tree_drafts += other.num_tree_drafts
        self.num_draft_depth += other.num_draft_depth
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_output_tokens += other.num_output_tokens
        self.draft_s += other.draft_s
        ours, theirs = self.accepted_per_position, other.accepted_per_position
        ours.extend([0] * max(0, len(theirs) - len(ours)))
        for i, count in enumerate(theirs):
            ours[i] += count
        return self

    @property
    def acceptance_rate(self) -> float:
        """num_accepted_tokens / num_draft_tokens (0 when nothing was drafted)."""
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_draft_size(self) -> float:
        """num_draft_tokens / num_drafts: tokens (tree nodes) per draft (0 without drafts)."""
        return _ratio(self.num_draft_tokens, self.num_drafts)

    @property
    def mean_draft_depth(self) -> float:
        """num_draft_depth / num_drafts: the drafts' mean depth (a chain's is its length)."""
        return _ratio(self.num_draft_depth, self.num_drafts)

    @property
    def mean_accepted_depth(self) -> float:
        """num_accepted_tokens / num_drafts: accepted tokens per draft (0 without drafts)."""
        return _ratio(self.num_accepted_tokens, self.num_drafts)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: output tokens per target verification step, recovered/bonus token included.

        Plain decoding has tau = 1.0; a step that accepts all K draft tokens emits K + 1.
        """
        return _ratio(self.num_output_tokens, self.num_steps)

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_tree_drafts": self.num_tree_drafts,
            "num_draft_depth": self.num_draft_depth,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_output_tokens": self.num_output_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_draft_size": self.mean_draft_size,
            "mean_draft_depth": self.mean_draft_depth,
            "mean_accepted_depth": self.mean_accepted_depth,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_position": list(self.accepted_per_position),
            "draft_s": self.draft_s,
        }


def _ratio(count: float, per: int) -> float:
    """count / per, 0 when per is 0 (a rate of nothing)."""
    return count / per if per else 0.0
