"""Replay a drafter over the target's own greedy text: the steps a greedy run would take,
without the target.

Under greedy decoding the target's output is known once it has been generated: a speculative
run emits the same text, and a step that drafts at position i accepts the longest path of its
draft (chain or tree) that matches the text from i, then emits one more token. So a drafter can
be replayed on that text alone: propose at i, walk the draft along the text, advance by the
accepted tokens + 1, commit, repeat. The result is the exact sequence of steps (draft sizes,
accepted lengths) that a real run with this drafter would take, and the drafter's own time per
step, for the cost of drafting only. `specdecode plan` replays each candidate shape this way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS, Drafter
from specdecode.sampling_params import SamplingParams
from specdecode.tree.token_tree import ROOT, TokenTree
from specdecode.types import (
    NO_TARGET_OUTPUTS,
    Draft,
    DraftBudget,
    TargetFeatures,
    TargetOutputs,
    Verdict,
)


@dataclass
class _Seq:
    """A SeqView over the replayed text."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass(frozen=True, slots=True)
class ReplayStats:
    """The steps a greedy run would take, summed over the replayed texts.

    num_tokens: tokens the steps emitted (accepted + 1 each; prefill's tokens left out).
    draft_sizes: per step, its draft's tokens (tree nodes; 0 = no draft).
    draft_s: seconds the drafter spent proposing (as the engine counts `draft_s`).
    """

    num_tokens: int
    draft_sizes: tuple[int, ...]
    draft_s: float

    @property
    def num_steps(self) -> int:
        return len(self.draft_sizes)

    @property
    def tokens_per_step(self) -> float:
        """tau: tokens emitted per step."""
        return self.num_tokens / self.num_steps if self.num_steps else 0.0


def accepted_path(draft: Draft, text: Sequence[int]) -> tuple[int, ...]:
    """The deepest draft path (node indices) whose tokens are the start of `text`; the first
    matching child wins where siblings repeat a token. Example: tokens [5, 6, 7], parents
    (-1, -1, 1), text [6, 7, 9] -> (1, 2)."""
    tokens = draft.tokens.tolist()
    tree = draft.tree or TokenTree.chain(len(tokens))
    path: list[int] = []
    node = ROOT
    while len(path) < len(text):
        kids = tree.children[node]
        node = next((c for c in kids if tokens[c] == text[len(path)]), ROOT)
        if node == ROOT:
            break
        path.append(node)
    return tuple(path)


def replay(
    drafter: Drafter,
    texts: Sequence[tuple[list[int], list[int]]],
    max_tokens: int | None = None,
    states: Callable[[list[int]], Tensor] | None = None,
) -> ReplayStats:
    """Replay `drafter` over (prompt ids, the target's greedy continuation ids) pairs, each
    generated with at most `max_tokens` new tokens (None: the continuation's own length).

    The first continuation token is the prefill's (no draft), as in a real run; every later
    step drafts at most min(64, max_tokens - generated - 1) tokens, like the engine (a text
    that ended on EOS before max_tokens still drafted up to that limit). A drafter that reads
    the target's states (`needs.hidden_layers`: a trained head, an MTP layer) gets them from
    `states` (ids -> [n, F], the states of those layers after each token of one pass over
    the whole text) as the engine hands them over: the prompt's after the prefill, then each
    step's kept tokens'.
    """
    if drafter.needs.hidden_layers and states is None:
        raise ValueError("this drafter reads the target's states: give replay `states`")
    tokens, sizes, spent = 0, [], 0.0
    for index, (prompt, continuation) in enumerate(texts):
        budget = len(continuation) if max_tokens is None else max_tokens
        params = SamplingParams(temperature=0.0, max_tokens=max(budget, 1))
        seq = _Seq(f"replay-{index}", [*prompt, *continuation[:1]], params)
        whole = None
        if drafter.needs.hidden_layers and states is not None:
            whole = states([*prompt, *continuation])  # [n, F]
            first = Verdict(0, torch.tensor(continuation[:1]))
            drafter.commit(seq, first, _kept(whole, 0, len(prompt)))
        done = 1
        while done < len(continuation):
            limit = min(MAX_SPECULATIVE_TOKENS, budget - done - 1)
            start = time.perf_counter()
            (draft,) = drafter.propose([seq], [DraftBudget(limit)])  # to the limit
            spent += time.perf_counter() - start
            path = accepted_path(draft, continuation[done:])
            emitted = continuation[done : done + len(path) + 1]
            before = len(seq.token_ids)
            seq.token_ids.extend(emitted)
            kept = path if draft.is_tree else None  # as the engine: chains have no path
            # the states of the last committed token before the step and the accepted ones
            target = NO_TARGET_OUTPUTS if whole is None else _kept(whole, before - 1, len(emitted))
            drafter.commit(seq, Verdict(len(path), torch.tensor(emitted), kept), target)
            tokens, done = tokens + len(emitted), done + len(emitted)
            sizes.append(int(draft.tokens.numel()))
        drafter.release(seq.request_id)
    return ReplayStats(tokens, tuple(sizes), spent)


def _kept(whole: Tensor, start: int, count: int) -> TargetOutputs:
    """The target's states of tokens start..start + count - 1 of a text, as a pass hands them
    to its drafter."""
    return TargetOutputs(hidden=TargetFeatures(start, whole[start : start + count]))
