"""Draft model: a small model with the target's vocabulary proposes K tokens autoregressively.

The classic speculative decoding drafter (Leviathan et al. 2023; Chen et al. 2023; vLLM's
`draft_model` method). q is the draft model's distribution after the sequence's own sampling
parameters (the same `probs_from_logits` path as the target's p), so greedy requests get a
one-hot q and the draft is the draft model's greedy continuation.

Each sequence owns a one-row KV cache of the draft model, kept under the same invariant as the
target's cache: it holds every committed token but the last. Worked example, K = 3, committed
tokens t0..t4 (cache holds t0..t3, length 4):

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
the draft model itself gives a lower probability (HF's assistant_confidence_threshold).
`staged` (`drafters.staged`) and `ssd` (`drafters.overlap`) build on this drafter; the
registry's factory puts the pieces together (`drafters.draft_model_build`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import (
    MAX_SPECULATIVE_TOKENS,
    ModelDrafterConfig,
    SeqView,
    cache_with_room,
    check_draft_length,
    check_draft_limits,
    check_tree_shape,
    is_positive_int,
)
from specdecode.drafters.dynamic_tree import DynamicTree, frontier_pass, log_confidence
from specdecode.errors import UserError
from specdecode.model.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.model.config import ModelConfig
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling.probs import SamplingTensors, probs_from_logits, sample
from specdecode.tree.token_tree import ROOT
from specdecode.types import Draft, Verdict

STAGERS = (None, "ngram", "suffix")  # the model-free drafters that can stage a draft model


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


@dataclass(frozen=True, slots=True)
class DraftModelConfig(ModelDrafterConfig):
    """speculative_config of a draft model, method "draft_model" (vLLM's form: a "model" key).

    model: the draft model (alias, Hugging Face folder or .gguf), with the target's vocabulary.
    num_speculative_tokens: draft at most this many tokens per step (K, 1..64; a tree's nodes).
    quantization: the draft model's weight format ("none", "int8", "int4"); None = the target's.
    tree_width: children per expanded node of a dynamic tree (1 = a chain of sampled tokens).
    tree_depth: levels of the tree, one draft pass each (default: K).
    draft_vocab_size: keep only this many of the draft model's output rows, those of the most
        frequent target tokens (FR-Spec, `drafters.trimmed_head`): an int in 1..vocabulary, at
        least tree_width; None = the whole head.
    staged: "ngram" or "suffix": that model-free drafter guesses the draft model's own drafts,
        checked in one draft-model pass each (staged drafting, `drafters.staged`; chains);
        None = token by token.
    ssd: draft the next step on a second thread while the target verifies (speculative-
        speculative decoding, `drafters.overlap`; chains, greedy requests, K <= 63).
    confidence_threshold: stop a chain after a token the draft model gives a probability below
        this (0..1; HF's assistant_confidence_threshold); None = always K tokens.
    """

    WHAT: ClassVar[str] = "a draft_model"

    draft_vocab_size: int | None = None
    staged: str | None = None
    ssd: bool = False
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        ModelDrafterConfig.__post_init__(self)  # (slots dataclasses break a bare super())
        if self.staged not in STAGERS:
            raise UserError(
                f"staged must be one of {', '.join(repr(s) for s in STAGERS)}, got {self.staged!r}"
            )
        if not isinstance(self.ssd, bool):
            raise UserError(f"ssd must be true or false, got {self.ssd!r}")
        bound = self.confidence_threshold
        if bound is not None and (
            isinstance(bound, bool) or not isinstance(bound, int | float) or not 0 <= bound <= 1
        ):
            raise UserError(f"confidence_threshold must be None or in 0..1, got {bound!r}")
        if bound is not None and (self.staged or self.tree_width > 1):
            raise UserError(
                "confidence_threshold stops a token-by-token chain: it takes neither staged "
                "nor tree_width > 1"
            )
        for name, on in (("staged drafting", self.staged), ("ssd", self.ssd)):
            if on and self.tree_width > 1:
                raise UserError(
                    f"{name} prepares chains: use tree_width 1, got tree_width {self.tree_width}"
                )
        if self.ssd and self.num_speculative_tokens >= MAX_SPECULATIVE_TOKENS:
            raise UserError(
                f"ssd needs num_speculative_tokens <= {MAX_SPECULATIVE_TOKENS - 1} (it drafts "
                f"the predicted bonus token too), got {self.num_speculative_tokens}"
            )
        size = self.draft_vocab_size
        if size is not None and not is_positive_int(size):
            raise UserError(
                "draft_vocab_size must be None (the whole head) or an int in 1..vocabulary "
                f"size, got {size!r}"
            )
        if size is not None and size < self.tree_width:
            raise UserError(
                f"draft_vocab_size {size} is smaller than tree_width {self.tree_width}: each "
                "tree node's children are tree_width distinct kept tokens"
            )


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Refuse a draft model whose tokens differ from the target's, saying what differs."""
    ours, theirs = target.vocab(), draft.vocab()
    if ours == theirs:
        return
    differ = sorted(
        (t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t)),
        key=lambda t: (ours.get(t, -1), t),
    )
    examples = ", ".join(f"{t!r}: target {ours.get(t)}, draft {theirs.get(t)}" for t in differ[:3])
    raise UserError(
        f"draft model {draft_name!r} has a different vocabulary from the target "
        f"({len(theirs)} vs {len(ours)} tokens, {len(differ)} differ, e.g. {examples}); "
        "a draft model must share the target's tokenizer; for a draft model with its own "
        'tokenizer use "method": "cross_tokenizer"'
    )


class DraftModelDrafter:
    """Proposes up to K tokens per sequence by running a small draft model autoregressively.

    Sequences are drafted one after another (no batching across sequences yet); each keeps
    its own draft-model KV cache, keyed by `request_id`, until `release`.

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

    hidden_layers = None  # needs no hidden states of the target

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
        self._caches: dict[str, KVCache] = {}

    def propose(self, seqs: Sequence[SeqView], max_tokens: Sequence[int]) -> list[Draft]:
        """One draft per sequence, of at most min(K, `max_tokens[i]`) tokens.

        Args:
            seqs: the sequences to draft for.
            max_tokens: per sequence, the most tokens its draft may have (0 = no draft).

        Returns:
            drafts: per sequence, a sampled chain `Draft(tokens [k_i] int64, probs [k_i, V]
            float32)`, or with tree_width > 1 a tree `Draft(tokens [k_i], None, tree)`.
        """
        check_draft_limits(seqs, max_tokens)
        propose = self._propose_one if self.tree_width == 1 else self._propose_tree
        with torch.inference_mode():
            return [propose(seq, m) for seq, m in zip(seqs, max_tokens, strict=True)]

    def commit(self, seq: SeqView, verdict: Verdict) -> None:
        """Roll the cache back to the committed tokens but the last one.

        Draft tokens that were fed and then accepted stay cached (they are committed now);
        the rejected ones are cut off. The next `propose` feeds whatever is missing.
        """
        cache = self._caches.get(seq.request_id)
        if cache is not None:
            cache.truncate(min(cache.lengths[0], len(seq.token_ids) - 1))

    def release(self, request_id: str) -> None:
        """Drop the draft-model cache of a finished sequence (unknown ids are ignored)."""
        self._caches.pop(request_id, None)

    def _propose_one(self, seq: SeqView, max_tokens: int) -> Draft:
        """Catch up on the committed tokens, then draft token by token."""
        ids = seq.token_ids
        k = self._draft_size(seq, max_tokens)
        vocab = self.model.config.vocab_size
        if k == 0:
            return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, vocab))
        cache, cached = self._rolled_back_cache(seq, len(ids) + k)
        st = SamplingTensors.from_params([seq.params], self.model.device)
        tokens = torch.empty(k, dtype=torch.long)  # [k]
        probs = torch.empty(k, vocab)  # [k, V]
        new = ids[cached:]  # the last committed token, plus any not fed yet
        for j in range(k):
            logits = self._last_logits(cache, new, cached)  # [1, V]
            q = probs_from_logits(logits, st)[0].cpu()  # [V]
            token = self._draw(q, st, seq.generator)
            tokens[j], probs[j] = token, q
            cached += len(new)
            new = [token]
            if self._unsure(logits[0], token):
                return Draft(tokens[: j + 1], probs[: j + 1])
        return Draft(tokens, probs)

    def _unsure(self, logits: Tensor, token: int) -> bool:
        """With a confidence_threshold: the draft model's own probability of `token`
        (softmax of its raw logits [V], whatever the sampling parameters) is below it."""
        bound = self.confidence_threshold
        return bound is not None and float(torch.softmax(logits.float(), -1)[token]) < bound

    def _propose_tree(self, seq: SeqView, max_tokens: int) -> Draft:
        """Catch up on the committed tokens, then grow a dynamic tree (module docstring)."""
        ids = seq.token_ids
        k = self._draft_size(seq, max_tokens)
        if k == 0:
            return Draft(torch.zeros(0, dtype=torch.long))
        depth = min(self.tree_depth, k)
        cache, cached = self._rolled_back_cache(seq, len(ids) + self.tree_width * depth)
        tree = DynamicTree(self.tree_width, k)
        tree.expand([ROOT], log_confidence(self._last_logits(cache, ids[cached:], cached)))
        slots: dict[int, int] = {}  # fed candidate -> its slot, counted from len(ids)
        for _ in range(depth - 1):
            frontier = tree.frontier
            tree.expand(frontier, log_confidence(self._feed_frontier(cache, tree, slots, ids)))
        cache.truncate(len(ids))  # drop the tree's slots: the cache holds the committed tokens
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

    def _rolled_back_cache(self, seq: SeqView, needed: int) -> tuple[KVCache, int]:
        """The sequence's cache (room for `needed` slots), rolled back to the committed tokens
        it holds but the last; returns it and its length (the next feed starts there)."""
        cache = self._cache_for(seq, needed)
        cached = min(cache.lengths[0], len(seq.token_ids) - 1)
        cache.truncate(cached)
        return cache, cached

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
    def _draw(q: Tensor, st: SamplingTensors, generator: torch.Generator | None) -> int:
        """The next draft token: argmax of a greedy (one-hot) q, else a sample with `generator`."""
        if st.all_greedy:
            return int(q.argmax())
        return int(sample(q[None], [generator])[0])

    def _cache_for(self, seq: SeqView, needed: int) -> KVCache:
        """The sequence's cache, allocated or grown so that it holds at least `needed` slots
        (`cache_with_room`: room for a K-token draft beyond the whole `max_tokens`)."""
        cache = cache_with_room(
            self._caches.get(seq.request_id),
            seq,
            needed,
            self.num_speculative_tokens + 1,
            lambda capacity: self.model.new_cache(1, capacity),
        )
        self._caches[seq.request_id] = cache
        return cache
