"""Lookahead decoding: Jacobi iterations in a 2-D window feed an n-gram pool; pooled n-grams
that start with the last token are the draft (Fu et al. 2024, "Break the Sequential Dependency
of LLM Inference Using Lookahead Decoding").

One target pass per step carries two branches, both parts of one token tree hanging from the
last committed token (the root), so the existing tree verifier checks them and the output
stays exact:

- the **verification branch**: up to G pooled n-grams whose first token is the last committed
  token; their other N - 1 tokens, merged into a trie;
- the **lookahead branch**: the window of N - 1 levels x W columns. Level 0 is a guess of the
  next W tokens (a chain, offsets 1..W after the root); the token of level l at offset o (l >= 1,
  o in l+1..l+W) was the target's prediction, in an earlier pass, for offset o after the path
  below it: its parent is level l - 1 at offset o - 1. So node (l, o) sees level 0 up to
  offset o - l, then one token of each level up to l: the trajectory of Jacobi iterations.

Worked example, W = 2, N = 3 (levels 0 and 1), last committed token t:

    level 0:  a1 a2          a1 = offset 1 (parent: root), a2 = offset 2 (parent a1)
    level 1:     b2 b3       b2 (parent a1) = the target's earlier guess after [t, a1]
                             b3 (parent a2) = its guess after [t, a1, a2]
    after the pass: the target's argmax after b2 -> c3, after b3 -> c4 (a new level)
    n-grams: (a1, b2, c3), (a2, b3, c4) join the pool under a1 and a2
    next window: level 0 = b2 b3, level 1 = c3 c4 (shifted by the tokens committed)

The drafter reads the target's argmax at its window nodes (`DrafterNeeds.target_argmax`).
Every draft is deterministic (`probs=None`), so sampled requests stay exact too (the window
follows the argmax whatever the sampling parameters). Committed tokens' n-grams also join the
pool (what prompt lookup would find).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdecode.drafters.base import (
    MAX_SPECULATIVE_TOKENS,
    DrafterBase,
    DrafterContext,
    DrafterNeeds,
    SeqView,
    draft_limits,
    is_positive_int,
)
from specdecode.errors import UserError
from specdecode.tree.token_tree import ROOT, TokenTree
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


@dataclass(frozen=True, slots=True)
class LookaheadConfig:
    """speculative_config of lookahead decoding, method "lookahead" (the paper's W, N, G).

    window_size: W, the window's columns (Jacobi guesses per level), >= 1.
    ngram_size: N, the n-grams' length (the window has N - 1 levels), >= 2.
    guess_set_size: G, the most pooled n-grams verified per step (and kept per first token).
    num_speculative_tokens: the most tree nodes per step; default (N - 1) x (W + G), which must
        be <= 64. Where a step's limit is lower, the window is left out (it waits) and the
        guesses fill the limit.
    """

    method: ClassVar[str] = "lookahead"
    default_draft_length: ClassVar[str] = "fixed"

    window_size: int = 4
    ngram_size: int = 3
    guess_set_size: int = 4
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        w, n, g = self.window_size, self.ngram_size, self.guess_set_size
        if not (is_positive_int(w) and is_positive_int(n) and is_positive_int(g) and n >= 2):
            raise UserError(
                "lookahead needs ints window_size (W) >= 1, ngram_size (N) >= 2 and "
                f"guess_set_size (G) >= 1, got W={w!r}, N={n!r}, G={g!r}"
            )
        full = (n - 1) * (w + g)
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", full)
        k = self.num_speculative_tokens
        if not is_positive_int(k) or k > MAX_SPECULATIVE_TOKENS:  # type: ignore[operator]
            raise UserError(
                f"lookahead's nodes per step, num_speculative_tokens (default (N - 1) x "
                f"(W + G) = {full}), must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}; "
                "use a smaller W, N or G"
            )


class _Trie:
    """Token paths from the root merged into a tree: (parent node, token) -> node."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._child: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int) -> int:
        """The node of `token` under `parent` (ROOT or a node), created if new."""
        node = self._child.get((parent, token))
        if node is None:
            node = self._child[(parent, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return node


class _Window:
    """One request's Jacobi window, n-gram pool and what its last draft held.

    levels[l][j]: the token of level l at offset l + 1 + j after the last committed token.
    pool: first token -> its n-grams' other N - 1 tokens (most recent last, at most G).
    nodes: the tree node of each window token in the last draft (None: the window was left out).
    """

    def __init__(self, config: LookaheadConfig, context: Sequence[int]) -> None:
        rng = random.Random(len(context))  # deterministic: outputs depend on nothing else
        self.levels = [
            [context[rng.randrange(len(context))] for _ in range(config.window_size)]
            for _ in range(config.ngram_size - 1)
        ]
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.nodes: list[list[int]] | None = None
        self.seen = 0  # committed tokens whose n-grams are in the pool


class LookaheadDrafter(DrafterBase):
    """Lookahead decoding (module docstring); one window per request until `release`.

    Args:
        config: W, N, G and the node budget.
        eos_token_ids: end-of-sequence ids; a guess never contains one.
    """

    needs = DrafterNeeds(target_argmax=True)  # the window advances on the target's argmax

    def __init__(self, config: LookaheadConfig, eos_token_ids: Collection[int]) -> None:
        self.config = config
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._windows: dict[str, _Window] = {}

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One deterministic tree per sequence, of at most min(K, `budgets[i].max_tokens`)
        nodes: the guesses, then the window if it fits whole.

        Returns:
            drafts: `Draft(tokens [k_i] int64, probs=None, tree=shape)` per sequence.
        """
        max_tokens = draft_limits(seqs, budgets)
        drafts = []
        for seq, limit in zip(seqs, max_tokens, strict=True):
            window = self._sync(seq)
            k = min(limit, self.config.num_speculative_tokens)  # type: ignore[type-var]
            trie = _Trie()
            window_nodes = sum(len(level) for level in window.levels)
            guesses = self._guesses(window, seq.token_ids[-1])
            room = k - window_nodes if k >= window_nodes else k
            for guess in guesses:
                if len(trie.tokens) + len(guess) > room:
                    break
                node = ROOT
                for token in guess:
                    node = trie.add(node, token)
            window.nodes = self._add_window(trie, window) if k >= window_nodes else None
            tokens = torch.tensor(trie.tokens, dtype=torch.long)
            drafts.append(Draft(tokens, tree=TokenTree(tuple(trie.parents))))
        return drafts

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Advance the window by the target's argmax at its newest level (harvesting the
        columns' n-grams), shift it past the committed tokens, pool the committed n-grams."""
        window = self._windows.get(seq.request_id)
        argmax = target.argmax
        if window is None:
            return
        moved = window.nodes is not None and argmax is not None
        if moved:
            self._advance(window, argmax)  # the levels move one offset closer
        window.nodes = None
        self._shift(window, len(verdict.tokens) - int(moved), seq.token_ids)
        self._sync(seq)

    def release(self, request_id: str) -> None:
        """Forget a finished request's window and pool (unknown ids are ignored)."""
        self._windows.pop(request_id, None)

    def _sync(self, seq: SeqView) -> _Window:
        """The request's window (made on first use); committed n-grams pooled."""
        tokens = seq.token_ids
        window = self._windows.get(seq.request_id)
        if window is None:
            window = self._windows[seq.request_id] = _Window(self.config, tokens)
        n = self.config.ngram_size
        for start in range(max(window.seen - n + 1, 0), len(tokens) - n + 1):
            self._pool(window, tokens[start : start + n])
        window.seen = len(tokens)
        return window

    def _guesses(self, window: _Window, last: int) -> list[tuple[int, ...]]:
        """The pooled n-grams after `last`, most recent first."""
        return list(reversed(window.pool.get(last, {})))

    def _pool(self, window: _Window, gram: Sequence[int]) -> None:
        """Pool one n-gram (none holding EOS after its first token), keeping the G most recent
        per first token."""
        rest = tuple(gram[1:])
        if any(t in self.eos_token_ids for t in rest):
            return
        entries = window.pool.setdefault(gram[0], OrderedDict())
        entries.pop(rest, None)
        entries[rest] = None
        if len(entries) > self.config.guess_set_size:
            entries.popitem(last=False)

    @staticmethod
    def _add_window(trie: _Trie, window: _Window) -> list[list[int]]:
        """Add the window's tokens to `trie` level by level (a level's parents are the level
        below, one offset earlier); returns each token's node."""
        nodes: list[list[int]] = []
        for level, tokens in enumerate(window.levels):
            row = []
            for j, token in enumerate(tokens):
                # level 0: the previous offset's token; above: the level below, one offset back
                parent = nodes[level - 1][j] if level else (row[j - 1] if j else ROOT)
                row.append(trie.add(parent, token))
            nodes.append(row)
        return nodes

    def _advance(self, window: _Window, argmax: Sequence[int]) -> None:
        """The newest level's predictions become a level; each column's trajectory (level 0
        at offset o, level 1 at o + 1, .., the new token at o + N - 1) is pooled."""
        assert window.nodes is not None
        newest = [argmax[node + 1] for node in window.nodes[-1]]  # after each newest token
        for j in range(self.config.window_size):
            gram = [level[j] for level in window.levels] + [newest[j]]
            self._pool(window, gram)
        window.levels = [*window.levels[1:], newest]

    def _shift(self, window: _Window, offsets: int, context: Sequence[int]) -> None:
        """Move the window `offsets` closer to the last committed token: drop that many
        leading tokens per level and refill the end with the level's last token."""
        if offsets <= 0:
            return
        for level in window.levels:
            kept = level[offsets:] or [context[-1]]
            level[:] = kept + [kept[-1]] * (len(level) - len(kept))


def build_lookahead_drafter(config: LookaheadConfig, context: DrafterContext) -> LookaheadDrafter:
    """The registry's factory: lookahead guesses never hold the target's EOS tokens."""
    return LookaheadDrafter(config, context.tokenizer.eos_token_ids)
