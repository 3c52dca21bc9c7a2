"""Suffix decoding: draft what followed the current suffix in this request and in earlier ones.

SuffixDecoding (Oliaro et al. 2024; Arctic Inference; vLLM's `suffix` method) keeps two
bounded-depth suffix tries with occurrence counts (`drafters.suffix_tree`): one per request over
its prompt and output, grown by the committed tokens (O(max_tree_depth) per token), and one
global trie over the outputs of the last `max_cached_requests` finished requests (the oldest
evicted first). Each step matches the context's suffixes in both tries, reads a draft off the
matched node (the most frequent continuation, or a best-first tree of frequent continuations),
of at most `max_spec_factor` x the match length tokens (a long match earns a long draft), with
every token's estimated probability >= `min_token_prob`, and proposes the best-scoring draft
(score: the expected number of accepted tokens). Drafts are deterministic (`probs=None`), so
the verifier keeps the output exact for greedy and sampled requests alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdecode.drafters.base import (
    MAX_SPECULATIVE_TOKENS,
    DrafterBase,
    DrafterContext,
    SeqView,
    draft_limits,
    is_positive_int,
)
from specdecode.drafters.suffix_tree import (
    EMPTY,
    Candidate,
    Cursor,
    Node,
    SuffixTree,
    best_candidate,
    match,
)
from specdecode.errors import UserError
from specdecode.tree.token_tree import TokenTree
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict

MAX_TREE_DEPTH = 256


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    """speculative_config of suffix decoding, method "suffix" (vLLM's keys).

    num_speculative_tokens: the most tokens a draft may have (a tree's nodes; 1..64); default
        min(suffix_decoding_max_tree_depth, 64). The draft of a step is usually shorter: it
        follows the match length.
    suffix_decoding_max_tree_depth: the tries' depth (1..256): a matched suffix plus its draft
        never exceed it.
    suffix_decoding_max_cached_requests: finished requests whose outputs the global trie keeps
        (oldest evicted first); 0 disables the global trie (each request's own trie remains).
        Default 256, not vLLM's 10000: this trie keeps up to depth nodes per token (~270 bytes
        each), ~0.8 GB for 256 outputs of 500 tokens at depth 24.
    suffix_decoding_max_spec_factor: a draft holds at most this factor x the matched suffix's
        length tokens (> 0).
    suffix_decoding_min_token_prob: draft only tokens whose estimated probability (the product
        of frequency ratios along their path) is at least this (0..1).
    tree_width: children per draft token (1 = a chain: the most frequent continuation; more
        = a best-first tree of continuations).
    """

    method: ClassVar[str] = "suffix"
    default_draft_length: ClassVar[str] = "fixed"

    num_speculative_tokens: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    tree_width: int = 1

    def __post_init__(self) -> None:
        depth = self.suffix_decoding_max_tree_depth
        if not is_positive_int(depth) or depth > MAX_TREE_DEPTH:
            raise UserError(
                f"suffix_decoding_max_tree_depth must be an int in 1..{MAX_TREE_DEPTH}, "
                f"got {depth!r}"
            )
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", min(depth, MAX_SPECULATIVE_TOKENS))
        k = self.num_speculative_tokens
        if not is_positive_int(k) or k > MAX_SPECULATIVE_TOKENS:  # type: ignore[operator]
            raise UserError(
                f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS} (the "
                f"most draft tokens), got {k!r}"
            )
        cached = self.suffix_decoding_max_cached_requests
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise UserError(
                "suffix_decoding_max_cached_requests must be an int >= 0 (0 = no global "
                f"trie), got {cached!r}"
            )
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise UserError(f"suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0 <= prob <= 1:
            raise UserError(f"suffix_decoding_min_token_prob must be in 0..1, got {prob!r}")
        width = self.tree_width
        if not is_positive_int(width) or width > MAX_SPECULATIVE_TOKENS:
            raise UserError(
                f"tree_width must be an int in 1..{MAX_SPECULATIVE_TOKENS} (1 = a chain), "
                f"got {width!r}"
            )


class _RequestState:
    """One request's own trie (over prompt + output), its place in the global trie, and how
    much of its history both have seen."""

    __slots__ = ("global_cursor", "num_prompt_tokens", "opened", "output", "seen", "tree")

    def __init__(self, max_depth: int, num_prompt_tokens: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.opened: list[Node] = []  # the own trie's nodes of the context's suffixes
        self.global_cursor = Cursor()
        self.num_prompt_tokens = num_prompt_tokens
        self.output: list[int] = []  # the generated tokens seen so far
        self.seen = 0  # tokens of token_ids both tries have followed


class SuffixDrafter(DrafterBase):
    """Drafts from suffix tries (module docstring); one state per request until `release`,
    when the request's output joins the global trie.

    Args:
        config: depth, cache size, draft length and probability limits.
        eos_token_ids: end-of-sequence ids; a draft never contains one.
    """

    def __init__(self, config: SuffixConfig, eos_token_ids: Collection[int]) -> None:
        self.config = config
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.global_tree = SuffixTree(config.suffix_decoding_max_tree_depth)
        self._cached: deque[list[int]] = deque()  # the outputs in the global trie, oldest first
        self._states: dict[str, _RequestState] = {}

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One deterministic draft per sequence, of at most min(K, `budgets[i].max_tokens`) tokens.

        Args:
            seqs: the sequences to draft for.
            budgets: per sequence, the most tokens its draft may have (`max_tokens`, 0 = no
                draft).

        Returns:
            drafts: `Draft(tokens [k_i] int64, probs=None)` per sequence (k_i may be 0); with
            tree_width > 1 also `tree=` the draft's shape.
        """
        max_tokens = draft_limits(seqs, budgets)
        width = self.config.tree_width
        drafts = []
        for seq, limit in zip(seqs, max_tokens, strict=True):
            state = self._sync(seq)
            k = min(limit, self.config.num_speculative_tokens)  # type: ignore[type-var]
            best = self._best((state.opened, state.global_cursor.nodes), k, width)
            tokens = torch.tensor(best.tokens, dtype=torch.long)
            drafts.append(Draft(tokens, tree=TokenTree(best.parents) if width > 1 else None))
        return drafts

    def continuation(self, seq: SeqView, extra: Sequence[int], k: int) -> list[int]:
        """At most k tokens to follow `seq.token_ids` + `extra` (tokens not committed, e.g. a
        draft so far): the best chain after that context's suffixes in both tries (matched
        from the root: O(max_tree_depth^2); `extra` joins neither trie)."""
        state = self._sync(seq)
        if not extra:
            matches = (state.opened, state.global_cursor.nodes)
        else:
            context = (seq.token_ids + list(extra))[-self.config.suffix_decoding_max_tree_depth :]
            matches = (match(state.tree, context), match(self.global_tree, context))
        return list(self._best(matches, k, 1).tokens)

    def _best(self, matches: Iterable[Sequence[Node]], k: int, width: int) -> Candidate:
        """The best-scoring draft of at most k tokens after any of the matched suffixes."""
        cfg = self.config
        best = EMPTY
        for nodes in matches:
            found = best_candidate(
                nodes,
                k,
                cfg.suffix_decoding_max_spec_factor,
                cfg.suffix_decoding_min_token_prob,
                width,
                self.eos_token_ids,
            )
            if found.score > best.score:
                best = found
        return best

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Follow the tokens of `verdict`, already appended to `seq.token_ids`."""
        self._sync(seq)

    def release(self, request_id: str) -> None:
        """Forget a finished request's own trie; its output joins the global trie (evicting
        the oldest cached output past `max_cached_requests`). Unknown ids are ignored."""
        state = self._states.pop(request_id, None)
        limit = self.config.suffix_decoding_max_cached_requests
        if state is None or limit == 0 or not state.output:
            return
        self.global_tree.add(state.output)
        self._cached.append(state.output)
        while len(self._cached) > limit:
            self.global_tree.remove(self._cached.popleft())

    def _sync(self, seq: SeqView) -> _RequestState:
        """The request's state, brought up to date with its history (built on first use)."""
        depth = self.config.suffix_decoding_max_tree_depth
        state = self._states.get(seq.request_id)
        tokens = seq.token_ids
        if state is None or len(tokens) < state.seen:  # new, or the history was rolled back
            state = self._states[seq.request_id] = _RequestState(depth, seq.num_prompt_tokens)
        new = len(tokens) - state.seen
        for token in tokens[state.seen :]:
            state.opened = state.tree.extend(state.opened, token)
        state.output += tokens[max(state.seen, state.num_prompt_tokens) :]
        if self.config.suffix_decoding_max_cached_requests:
            state.global_cursor.follow(self.global_tree, tokens, new)
        state.seen = len(tokens)
        return state


def build_suffix_drafter(config: SuffixConfig, context: DrafterContext) -> SuffixDrafter:
    """The registry's factory: a suffix drafter that never drafts the target's EOS tokens."""
    return SuffixDrafter(config, context.tokenizer.eos_token_ids)
