"""Prompt lookup decoding: draft what followed the last earlier occurrence of the current suffix.

A deterministic drafter (q is one-hot, so `Draft.probs` is None), like vLLM's `ngram` method and
Hugging Face's `prompt_lookup_num_tokens`. Each sequence keeps an incremental index, so a propose
costs a few dictionary look-ups whatever the history's length. With `tree_width` > 1 the draft
is a tree: the continuations of several earlier occurrences (most recent first, longest suffix
first) merged into a trie, so one verification pass tries them all.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdecode.drafters.base import (
    DrafterBase,
    DrafterContext,
    SeqView,
    check_draft_length,
    check_tree_shape,
    draft_limits,
    is_positive_int,
)
from specdecode.errors import UserError
from specdecode.tree.token_tree import ROOT, TokenTree
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """speculative_config of the n-gram (prompt lookup) drafter, method "ngram".

    num_speculative_tokens: draft at most this many tokens per step (K, 1..64; a tree's
        nodes).
    prompt_lookup_max: the longest suffix (n-gram) looked up; tried first.
    prompt_lookup_min: the shortest suffix looked up; tried last (default min(2, max)).
    tree_width: continuations merged into a tree draft (1 = a chain, the one continuation).
    tree_depth: tokens per continuation (default: K).
    """

    method: ClassVar[str] = "ngram"
    default_draft_length: ClassVar[str] = "fixed"

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int | None = None
    tree_width: int = 1
    tree_depth: int | None = None

    def __post_init__(self) -> None:
        check_draft_length(self.num_speculative_tokens)
        check_tree_shape(self.tree_width, self.tree_depth, self.num_speculative_tokens)
        if self.prompt_lookup_min is None and is_positive_int(self.prompt_lookup_max):
            object.__setattr__(self, "prompt_lookup_min", min(2, self.prompt_lookup_max))
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (is_positive_int(lo) and is_positive_int(hi) and lo <= hi):
            raise UserError(
                "prompt_lookup_min and prompt_lookup_max must be ints with "
                f"1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )


class _SuffixIndex:
    """For one sequence: each n-gram (min <= n <= max) -> start of its last occurrence (and,
    with `keep_all`, the starts of all its occurrences).

    An n-gram is indexed only once the token after it is known, so the suffix of the history
    is never found as its own earlier occurrence. Worked example, min = max = 2:

        tokens = [5, 6, 7, 5, 6]      (positions 0..4)
        indexed: (5, 6) -> 0, (6, 7) -> 1, (7, 5) -> 2     continuations at positions 2, 3, 4
        not yet: (5, 6) at 3: its continuation (position 5) is not known yet
        suffix (5, 6) -> start 0 -> propose tokens[2:] = [7, 5, 6]

    After the token 7 is committed, tokens = [5, 6, 7, 5, 6, 7]: the continuation at position 5
    is now known, so (5, 6) -> 3 overwrites (5, 6) -> 0 (later wins: the most recent occurrence),
    and the new suffix (6, 7) -> 1 proposes tokens[3:] = [5, 6, 7].

    Attributes:
        last_start: n-gram tuple -> start position of its most recent occurrence that has a
            continuation (tuples of different n never collide, so one dict serves every n).
        all_starts: n-gram tuple -> starts of all its occurrences with a continuation, in
            increasing order; None unless `keep_all` (tree drafts, which read only this).
        num_indexed: length of the history already indexed (its continuations are all in).
    """

    __slots__ = ("all_starts", "last_start", "num_indexed")

    def __init__(self, keep_all: bool = False) -> None:
        self.last_start: dict[tuple[int, ...], int] = {}
        self.all_starts: dict[tuple[int, ...], list[int]] | None = {} if keep_all else None
        self.num_indexed = 0

    def occurrences(self, gram: tuple[int, ...], limit: int) -> list[int]:
        """The starts of `gram`'s last `limit` occurrences, the most recent first (an index
        built with `keep_all`)."""
        assert self.all_starts is not None, "occurrences need an index built with keep_all"
        return self.all_starts.get(gram, [])[-limit:][::-1] if limit > 0 else []

    def extend(self, tokens: list[int], min_n: int, max_n: int) -> None:
        """Index every n-gram whose continuation lies in `tokens[num_indexed:]`.

        The n-gram starting at s has its continuation at s + n, so the new starts of each n
        run from max(num_indexed - n, 0) to len(tokens) - n - 1. Their tuples are built by
        zipping n shifted slices (C speed), e.g. n = 2, tokens = [5, 6, 7, 5], all new:
        zip([5, 6], [6, 7]) -> (5, 6) at 0, (6, 7) at 1; (7, 5) at 2 waits for its continuation.
        Starts go in increasing order, so a later occurrence overwrites an earlier one.
        """
        if len(tokens) < self.num_indexed:  # the history was rolled back: start over
            self.last_start.clear()
            if self.all_starts is not None:
                self.all_starts.clear()
            self.num_indexed = 0
        end = len(tokens)
        for n in range(min_n, max_n + 1):
            first = max(self.num_indexed - n, 0)
            if first >= end - n:  # no new n-gram with a continuation (and no negative slices)
                continue
            grams = zip(*(tokens[first + j : end - n + j] for j in range(n)), strict=True)
            if self.all_starts is None:
                self.last_start.update(zip(grams, range(first, end - n), strict=True))
                continue
            for gram, start in zip(grams, range(first, end - n), strict=True):
                self.all_starts.setdefault(gram, []).append(start)
        self.num_indexed = end


class NgramDrafter(DrafterBase):
    """Drafts the tokens that followed the most recent earlier occurrence of the suffix.

    For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of
    `token_ids` (prompt + committed output) are looked up; the first n with an earlier
    occurrence wins and its continuation is proposed, at most
    min(max_tokens[i], num_speculative_tokens) tokens, never past the end of the history and
    cut just before the first EOS token. No match gives an empty draft. With
    `tree_width` w > 1, the continuations (of at most `tree_depth` tokens each) of the last w
    occurrences, longest suffix first, then the most recent, are merged into a trie of at most
    min(max_tokens[i], num_speculative_tokens) nodes (`tokens_tree`).

    Args:
        config: draft length and n-gram range.
        eos_token_ids: end-of-sequence ids; a draft never contains one.
    """

    def __init__(self, config: NgramConfig, eos_token_ids: Collection[int]) -> None:
        self.config = config
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._indexes: dict[str, _SuffixIndex] = {}

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One deterministic draft per sequence, of at most `budgets[i].max_tokens` tokens.

        Args:
            seqs: the sequences to draft for.
            budgets: per sequence, the most tokens its draft may have (`max_tokens`, 0 = no
                draft).

        Returns:
            drafts: `Draft(tokens [K_i] int64, probs=None)` per sequence, K_i may be 0; with
            tree_width > 1 also `tree=` the trie's shape.
        """
        max_tokens = draft_limits(seqs, budgets)
        drafts = []
        for seq, limit in zip(seqs, max_tokens, strict=True):
            k = min(limit, self.config.num_speculative_tokens)
            if self.config.tree_width == 1:
                tokens, tree = self._propose_one(seq, k), None
            else:
                tokens, tree = tokens_tree(self._continuations(seq, k), k)
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.long), tree=tree))
        return drafts

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Index the tokens of `verdict`, already appended to `seq.token_ids`."""
        self._sync(seq)

    def release(self, request_id: str) -> None:
        """Forget the index of a finished sequence (unknown ids are ignored)."""
        self._indexes.pop(request_id, None)

    def _sync(self, seq: SeqView) -> tuple[_SuffixIndex, list[int]]:
        """The sequence's index, brought up to date with its history (built on first use)."""
        index = self._indexes.get(seq.request_id)
        if index is None:
            index = _SuffixIndex(keep_all=self.config.tree_width > 1)
            self._indexes[seq.request_id] = index
        tokens = seq.token_ids
        if index.num_indexed != len(tokens):
            index.extend(tokens, self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return index, tokens

    def _propose_one(self, seq: SeqView, k: int) -> list[int]:
        """The chain draft of one sequence, at most k tokens (possibly none)."""
        return self.continuation(seq, (), k)

    def continuation(self, seq: SeqView, extra: Sequence[int], k: int) -> list[int]:
        """At most k tokens to follow `seq.token_ids` + `extra` (tokens not committed, e.g. a
        draft so far): the continuation, in the committed history, of the most recent earlier
        occurrence of the longest suffix of that context (the index holds only committed
        tokens, so `extra` is looked up but never indexed)."""
        index, tokens = self._sync(seq)
        context = tokens + list(extra) if extra else tokens
        length = len(context)
        if k == 0:
            return []
        for n in range(
            min(self.config.prompt_lookup_max, length), self.config.prompt_lookup_min - 1, -1
        ):
            start = index.last_start.get(tuple(context[length - n :]))
            if start is not None:
                return self._cut_at_eos(tokens[start + n : start + n + k])
        return []

    def _continuations(self, seq: SeqView, k: int) -> list[list[int]]:
        """Up to `tree_width` continuations of the current suffix (longest n first, then the
        most recent occurrence), each at most `tree_depth` (and k) tokens, cut at EOS."""
        index, tokens = self._sync(seq)
        width, length = self.config.tree_width, len(tokens)
        depth = min(k, self.config.tree_depth or self.config.num_speculative_tokens)
        found: list[list[int]] = []
        if k == 0:
            return found
        for n in range(
            min(self.config.prompt_lookup_max, length), self.config.prompt_lookup_min - 1, -1
        ):
            for start in index.occurrences(tuple(tokens[length - n :]), width):
                cont = self._cut_at_eos(tokens[start + n : min(start + n + depth, length)])
                if cont and cont not in found:
                    found.append(cont)
                if len(found) == width:
                    return found
        return found

    def _cut_at_eos(self, draft: list[int]) -> list[int]:
        """`draft` up to, not including, its first EOS token."""
        for i, token in enumerate(draft):
            if token in self.eos_token_ids:
                return draft[:i]
        return draft


def tokens_tree(branches: Sequence[Sequence[int]], budget: int) -> tuple[list[int], TokenTree]:
    """Merge token sequences into a trie of at most `budget` nodes, in order (a branch that
    does not fit is cut). Returns the node tokens and the tree's shape.

    Example: [[5, 6, 7], [5, 8], [9]], budget 4 -> tokens [5, 6, 7, 8], parents
    (-1, 0, 1, 0): 5 -> 6 -> 7 and 5 -> 8; [9] does not fit.
    """
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for branch in branches:
        node = ROOT
        for token in branch:
            nxt = child.get((node, token))
            if nxt is None:
                if len(tokens) == budget:
                    break
                nxt = child[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = nxt
    return tokens, TokenTree(tuple(parents))


def build_ngram_drafter(config: NgramConfig, context: DrafterContext) -> NgramDrafter:
    """The registry's factory: an n-gram drafter that never drafts the target's EOS tokens."""
    return NgramDrafter(config, context.tokenizer.eos_token_ids)
