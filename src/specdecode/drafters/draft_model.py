"""Draft model: a small model with the target's vocabulary proposes K tokens autoregressively.

The classic speculative decoding drafter (Leviathan et al. 2023; Chen et al. 2023; vLLM's
`draft_model` method). q is the draft model's distribution after the sequence's own sampling
parameters (the same `probs_from_logits` path as the target's p), so greedy requests get a
one-hot q and the draft is the draft model's greedy continuation.

Each sequence owns a row of the draft model's KV cache (`drafters.draft_rows`: one pool, so a
chain's draft passes feed every sequence at once), kept under the same invariant as the
target's cache: it holds every committed token but the last. Worked example, K = 3, committed
tokens t0..t4 (row holds t0..t3, length 4):

    propose: feed [t4] at position 4 -> q1, d1; feed [d1] at 5 -> q2, d2; feed [d2] at 6 -> q3, d3
             cache now holds t0..t4 d1 d2 (length 7); d3 was never fed.
    verdict: accepted d1, recovered r -> committed t0..t4 d1 r (7 tokens)
    commit:  truncate to min(7, 7 - 1) = 6 -> t0..t4 d1 (still valid: d1 was accepted)
    propose: feeds the rest, [r] at position 6, and drafts on.

If every draft token is accepted plus a bonus b (committed t0..t4 d1 d2 d3 b, 9 tokens), the
truncation keeps length 7 and the next propose catches up by feeding [d3, b] at positions 7, 8.

With `tree_width` w > 1 the draft is EAGLE-2's dynamic tree (`drafters.dynamic_tree`): after the
catch-up, each of `tree_depth` - 1 TREE passes feeds the w frontier nodes at once (each sees the
committed tokens, its ancestors from earlier passes and itself: `tree_starts`), and the
`num_speculative_tokens` best nodes by cumulative draft probability form the draft
(deterministic nodes, `probs=None`). The tree's slots are dropped right after drafting (the
cache holds the committed tokens); the next propose feeds the accepted tokens and the bonus.

With `draft_vocab_size` the draft model's output head keeps only the rows of the most frequent
target tokens (FR-Spec, `drafters.trimmed_head`): its logits are -inf elsewhere, so q is exactly
0 there and nothing else here changes. With `confidence_threshold` a chain stops after a token
the draft model itself gives a lower probability (HF's assistant_confidence_threshold); without
one, a chain stops where the draft model's probability of the whole chain so far falls below
its budget's `chain_bounds` (what the "cost" draft-length policy gives each step).
`staged` (`drafters.staged`) and `ssd` (`drafters.overlap`) build on this drafter; the
registry's factory puts the pieces together (`drafters.draft_model_build`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import (
    DrafterBase,
    SeqView,
    check_draft_length,
    check_tree_shape,
    draft_limits,
)
from specdecode.drafters.draft_rows import DraftRows
from specdecode.drafters.dynamic_tree import DynamicTree, frontier_pass, log_confidence
from specdecode.errors import UserError
from specdecode.model.config import ModelConfig
from specdecode.sampling.argmax import argmax
from specdecode.sampling.probs import SamplingTensors, probs_from_logits, sample
from specdecode.tree.token_tree import ROOT
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


class DraftLM(Protocol):
    """What the drafter drives: a `Transformer`, or the target cut early (`layer_skip`)."""

    config: ModelConfig  # vocab_size and max_position_embeddings are read

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, batch_size: int, capacity: int) -> KVCache: ...

    def __call__(
        self,
        tokens: Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        logits_index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(logits [B, N, V], hidden) of the new tokens, cached (see `Transformer.forward`)."""
        ...


def feed(model: DraftLM, cache: KVCache, new: list[int], start: int, count: int = 1) -> Tensor:
    """Feed `new` at positions start.. of a one-row `cache`; the logits ([count, V]) after each
    of its last `count` tokens. The first feed (start 0) is a prefill; later feeds continue
    the cached prefix."""
    device = model.device
    tokens = torch.tensor([new], dtype=torch.long, device=device)  # [1, T]
    mode = AttentionMode.PREFILL if start == 0 else AttentionMode.DECODE
    meta = AttentionMetadata.contiguous(mode, [start], [len(new)], device)
    index = torch.arange(len(new) - count, len(new), device=device)[None]  # [1, count]
    logits, _ = model(tokens, meta, cache, logits_index=index)  # [1, count, V]
    return logits[0]


class DraftModelDrafter(DrafterBase):
    """Proposes up to K tokens per sequence by running a small draft model autoregressively.

    Chains are drafted for every sequence at once: each of the K draft passes feeds each
    sequence's newest token in one batched pass (`drafters.draft_rows`), so a step reads the
    draft model's weights K times whatever the batch size. Trees are grown one sequence after
    another. Each sequence keeps its row of the draft model's KV cache, keyed by `request_id`,
    until `release`.

    Args:
        model: the draft model (`DraftLM`); its vocabulary must be the target's (same ids,
            same size).
        num_speculative_tokens: draft at most this many tokens per step (K, 1..64).
        target_vocab_size: the target's vocabulary size, checked against the draft model's.
        tree_width: children per expanded node of a dynamic tree (1 = chains).
        tree_depth: levels of a tree (None = K).
        confidence_threshold: a chain stops after a token whose probability under the draft
            model (softmax of its logits) is below this (HF's assistant_confidence_threshold);
            None = always K tokens.

    Raises:
        UserError: K or the tree's shape is out of range, or the vocabulary sizes differ.
    """

    def __init__(
        self,
        model: DraftLM,
        num_speculative_tokens: int,
        target_vocab_size: int,
        tree_width: int = 1,
        tree_depth: int | None = None,
        confidence_threshold: float | None = None,
    ) -> None:
        check_draft_length(num_speculative_tokens)
        check_tree_shape(tree_width, tree_depth, num_speculative_tokens)
        if model.config.vocab_size != target_vocab_size:
            raise UserError(
                "the draft model's vocabulary size must equal the target's: draft model has "
                f"{model.config.vocab_size} tokens, target has {target_vocab_size}"
            )
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.tree_width = tree_width
        self.tree_depth = tree_depth or num_speculative_tokens
        self.confidence_threshold = confidence_threshold
        self._caches = DraftRows(model.new_cache)
        self.setup_s = 0.0  # seconds the latest propose spent feeding sequences alone

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One draft per sequence, of at most min(K, `budgets[i].max_tokens`) tokens.

        Args:
            seqs: the sequences to draft for.
            budgets: per sequence, the most tokens its draft may have (`max_tokens`, 0 = no
                draft), and where a chain stops (`chain_bounds`).

        Returns:
            drafts: per sequence, a sampled chain `Draft(tokens [k_i] int64, probs [k_i, V]
            float32)`, or with tree_width > 1 a tree `Draft(tokens [k_i], None, tree)`.
        """
        max_tokens = draft_limits(seqs, budgets)
        self.setup_s = 0.0
        with torch.inference_mode():
            if self.tree_width > 1:
                return [self._propose_tree(s, m) for s, m in zip(seqs, max_tokens, strict=True)]
            return self._propose_chains(seqs, budgets)

    def catch_up(self, seq: SeqView) -> int:
        """The tokens of `seq` a propose would feed alone before drafting (see
        `Drafter.catch_up`): its prompt when new, or a backlog of more than K + 1 tokens
        (fewer ride along with the first draft pass); else 0. A tree's first pass feeds them
        too, and times them as `setup_s` all the same. (Staged drafts feed them with their
        first pass, timed as drafting.)"""
        ids = seq.token_ids
        cached = min(self._caches.cached(seq.request_id), len(ids) - 1)
        return len(ids) - cached if ids and self._fed_alone(len(ids), cached) else 0

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Roll the cache back to the committed tokens but the last one.

        Draft tokens that were fed and then accepted stay cached (they are committed now);
        the rejected ones are cut off. The next `propose` feeds whatever is missing.
        """
        self._caches.truncate(seq.request_id, len(seq.token_ids) - 1)

    def release(self, request_id: str) -> None:
        """Drop the draft-model cache of a finished sequence (unknown ids are ignored)."""
        self._caches.release(request_id)

    def _propose_chains(
        self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]
    ) -> list[Draft]:
        """Catch every sequence up on its committed tokens, then draft token by token, one
        batched pass per draft position over the sequences still drafting."""
        sizes = [self._draft_size(s, b.max_tokens) for s, b in zip(seqs, budgets, strict=True)]
        vocab = self.model.config.vocab_size
        tokens: list[list[int]] = [[] for _ in seqs]
        probs = [torch.empty(k, vocab) for k in sizes]  # each [k_i, V]
        live = [i for i, k in enumerate(sizes) if k > 0]  # the sequences still drafting
        chains: list[list[float]] = [[] for _ in seqs]  # the draft model's token probabilities
        row_of, new, ready = self._catch_up_all(seqs, sizes, live)
        while live:
            feeding = [i for i in live if i not in ready]
            if feeding:
                batch = {row_of[i]: new[i] for i in feeding}
                fed = self._caches.feed_rows(self.model, batch, self._positions)  # [F', V]
                ready.update(zip(feeding, fed, strict=True))
            logits = torch.stack([ready.pop(i) for i in live])  # [F, V]
            st = SamplingTensors.from_params([seqs[i].params for i in live], self.model.device)
            q = probs_from_logits(logits, st).cpu()  # [F, V]
            drawn = self._draw(q, st, [seqs[i].generator for i in live])
            still = []
            for f, i in enumerate(live):
                probs[i][len(tokens[i])] = q[f]
                tokens[i].append(drawn[f])
                new[i] = [drawn[f]]
                if len(tokens[i]) < sizes[i] and self._goes_on(
                    budgets[i].chain_bounds, logits[f], drawn[f], chains[i]
                ):
                    still.append(i)
            live = still
        return [
            Draft(torch.tensor(t, dtype=torch.long), p[: len(t)])
            for t, p in zip(tokens, probs, strict=True)
        ]

    def _catch_up_all(
        self, seqs: Sequence[SeqView], sizes: list[int], live: list[int]
    ) -> tuple[dict[int, int], dict[int, list[int]], dict[int, Tensor]]:
        """Give the sequences `live` (indices into `seqs`, drafting sizes[i] tokens) their
        rows and catch them up (`_catch_up`). Returns, per live sequence, its row, and either
        the tokens its first batched pass feeds or the logits [V] after its last token."""
        if not live:
            return {}, {}, {}
        needed = max(self._room(seqs[i], sizes[i]) for i in live)
        rows = self._caches.place([seqs[i].request_id for i in live], needed)
        row_of = dict(zip(live, rows, strict=True))
        new: dict[int, list[int]] = {}
        ready: dict[int, Tensor] = {}
        for i in live:
            backlog = self._catch_up(seqs[i], row_of[i])
            if isinstance(backlog, Tensor):
                ready[i] = backlog
            else:
                new[i] = backlog
        return row_of, new, ready

    def _catch_up(self, seq: SeqView, row: int) -> list[int] | Tensor:
        """Roll `row` back to the committed tokens it holds but the last. Then either return
        the missing tokens (1..K + 1 of them) for the first batched pass, or, for a new
        sequence's prompt or a longer backlog, feed them alone (a prompt as a prefill) and
        return the logits [V] after the last."""
        ids = seq.token_ids
        cached = min(self._caches.length(row), len(ids) - 1)
        self._caches.truncate(seq.request_id, cached)
        backlog = ids[cached:]
        if not self._fed_alone(len(ids), cached):
            return backlog
        start = time.perf_counter()
        view = self._caches.view(row)
        logits = feed(self.model, view, backlog, cached)  # [1, V]
        self._caches.store(row, view)
        self.setup_s += time.perf_counter() - start
        return logits[0]

    def _fed_alone(self, length: int, cached: int) -> bool:
        """Whether a sequence of `length` tokens whose row holds `cached` of them is caught
        up alone (a prompt as a prefill, or a backlog of more than K + 1 tokens) rather than
        in the first batched draft pass."""
        short = length - cached <= self.num_speculative_tokens + 1
        return not (short and (cached > 0 or length == 1))

    @property
    def _positions(self) -> int:
        return self.model.config.max_position_embeddings

    def _goes_on(
        self, bounds: tuple[float, ...], logits: Tensor, token: int, chain: list[float]
    ) -> bool:
        """Whether a chain that has just drawn `token` (from `logits` [V]) drafts another
        token: with a confidence_threshold, if the draft model's own probability of `token`
        (softmax of its raw logits, whatever the sampling parameters) is at least that; else
        if the product of those probabilities over the chain (`chain`: the earlier tokens'
        probabilities, `token`'s appended here) is at least the sequence's bound for its
        length (`bounds`: its budget's `chain_bounds`; none: always)."""
        bound = self.confidence_threshold
        if bound is None and len(chain) >= len(bounds):
            return True
        chain.append(float(torch.softmax(logits.float(), -1)[token]))
        if bound is not None:
            return chain[-1] >= bound
        return math.prod(chain) >= bounds[len(chain) - 1]

    def _propose_tree(self, seq: SeqView, max_tokens: int) -> Draft:
        """Catch up on the committed tokens, then grow a dynamic tree (module docstring)."""
        ids = seq.token_ids
        k = self._draft_size(seq, max_tokens)
        if k == 0:
            return Draft(torch.zeros(0, dtype=torch.long))
        depth = min(self.tree_depth, k)
        row, cache, cached = self._rolled_back_cache(seq, len(ids) + self.tree_width * depth)
        tree = DynamicTree(self.tree_width, k)
        start = time.perf_counter()
        first = self._last_logits(cache, ids[cached:], cached)
        if self._fed_alone(len(ids), cached):  # a prompt or a long backlog: `catch_up`
            self.setup_s += time.perf_counter() - start
        tree.expand([ROOT], log_confidence(first))
        slots: dict[int, int] = {}  # fed candidate -> its slot, counted from len(ids)
        for _ in range(depth - 1):
            frontier = tree.frontier
            tree.expand(frontier, log_confidence(self._feed_frontier(cache, tree, slots, ids)))
        cache.truncate(len(ids))  # drop the tree's slots: the cache holds the committed tokens
        self._caches.store(row, cache)
        tokens, shape = tree.draft()
        return Draft(torch.tensor(tokens, dtype=torch.long), tree=shape)

    def _draft_size(self, seq: SeqView, max_tokens: int) -> int:
        """Tokens (tree: nodes) to draft for `seq`: at most `max_tokens` and K, and few enough
        that every fed draft token stays inside the context (a chain feeds d_j at position
        len(ids) - 2 + j, j < k; a tree its depth-d nodes at len(ids) - 1 + d, d < k);
        0 for an empty sequence."""
        ids = seq.token_ids
        room = self.model.config.max_position_embeddings - len(ids) + 1
        return min(max_tokens, self.num_speculative_tokens, max(room, 0)) if ids else 0

    def _room(self, seq: SeqView, k: int) -> int:
        """Cache slots a k-token draft for `seq` may write (a K + 1-token pass after the
        committed tokens); the rows grow by half when they must, so this is rarely a copy."""
        return len(seq.token_ids) + max(k, self.num_speculative_tokens) + 1

    def _rolled_back_cache(self, seq: SeqView, needed: int) -> tuple[int, KVCache, int]:
        """The sequence's row (room for `needed` slots), rolled back to the committed tokens
        it holds but the last: its index, a one-row view of it (`DraftRows.store` its length
        afterwards) and its length (the next feed starts there)."""
        (row,) = self._caches.place([seq.request_id], needed)
        self._caches.truncate(seq.request_id, len(seq.token_ids) - 1)
        cache = self._caches.view(row)
        return row, cache, cache.lengths[0]

    def _feed_frontier(
        self, cache: KVCache, tree: DynamicTree, slots: dict[int, int], ids: list[int]
    ) -> Tensor:
        """Feed the frontier's tokens in one TREE pass (each sees the committed tokens, its
        fed ancestors and itself); record their slots; return their logits [F, V]."""
        tokens, meta = frontier_pass(tree, slots, cache.lengths[0], len(ids), self.model.device)
        logits, _ = self.model(tokens, meta, cache)  # [1, F, V]
        return logits[0]

    def _last_logits(self, cache: KVCache, new: list[int], start: int) -> Tensor:
        """Feed `new` at positions start.. and return the logits ([1, V]) after the last."""
        return feed(self.model, cache, new, start)

    @staticmethod
    def _draw(
        q: Tensor, st: SamplingTensors, generators: Sequence[torch.Generator | None]
    ) -> list[int]:
        """The next draft token of each row of q ([F, V]): the argmax of a greedy (one-hot)
        row, else a sample with the row's generator."""
        drawn = argmax(q)  # [F]
        sampled = [f for f, greedy in enumerate(st.greedy) if not greedy]
        if sampled:
            drawn[sampled] = sample(q[sampled], [generators[f] for f in sampled])
        return drawn.tolist()
