"""Staged drafting: speculation applied to the draft model itself (Spector & Re 2023, staged
speculative decoding; cascade drafting).

A draft model drafts token by token: K passes of the small model per step. Here a model-free
drafter (the n-gram or suffix drafter, the "stager") guesses how the draft goes on, and one
pass of the draft model checks the guesses with the same verifier the engine uses on the
target, with the draft model's q in the role of p: the draft keeps the guesses q accepts, then
q's recovered or bonus token. So every pass adds at least one draft token, and a copied span
costs one pass instead of one per token. Each draft token is still distributed exactly as q
given the tokens before it (greedy: it is q's argmax), so the draft, its q rows and the
engine's verification are exactly what plain draft-model drafting would give: the output is
unchanged, only the drafting time differs. Sequences are drafted one after another (plain
draft-model chains batch their passes across sequences; each staged pass checks one
sequence's own guesses), so staging pays for one stream, not under a server's load.

Worked example, K = 4, greedy, committed ... t, the stager guesses [a, b, c] after t:

    pass 1 feeds [t, a, b, c]: q's argmax after t = a, after a = b, after b = x (not c)
           -> draft a b x (x is the draft model's own token); the cache drops c
    pass 2 feeds [x], the stager guesses nothing after ... t a b x: q's argmax y -> draft a b x y
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import SeqView
from specdecode.drafters.draft_model import DraftLM, DraftModelDrafter, feed
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import verify_chain
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


class Stager(Protocol):
    """A model-free drafter that can continue a context that is not committed yet (the
    n-gram and suffix drafters)."""

    def continuation(self, seq: SeqView, extra: list[int], k: int) -> list[int]:
        """At most k tokens to follow `seq.token_ids` + `extra`."""
        ...

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None: ...

    def release(self, request_id: str) -> None: ...


class StagedDrafter(DraftModelDrafter):
    """A draft model whose own drafts are guessed by `stager` and checked in one pass each
    (module docstring); chains only.

    Args:
        model: the draft model.
        num_speculative_tokens: K, the draft's length.
        target_vocab_size: the target's vocabulary size (the draft model's must equal it).
        stager: guesses the draft model's continuation; follows the committed tokens too.
    """

    def __init__(
        self, model: DraftLM, num_speculative_tokens: int, target_vocab_size: int, stager: Stager
    ) -> None:
        super().__init__(model, num_speculative_tokens, target_vocab_size)
        self.stager = stager

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Roll the draft model's cache back (see `DraftModelDrafter.commit`); the stager
        follows the committed tokens."""
        super().commit(seq, verdict, target)
        self.stager.commit(seq, verdict, target)

    def release(self, request_id: str) -> None:
        """Forget a finished sequence here and in the stager."""
        super().release(request_id)
        self.stager.release(request_id)

    def _propose_chains(
        self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]
    ) -> list[Draft]:
        """One sequence after another: each pass checks that sequence's own guesses (to
        each budget's max_tokens: staged chains take no bounds)."""
        return [self._propose_one(s, b.max_tokens) for s, b in zip(seqs, budgets, strict=True)]

    def _propose_one(self, seq: SeqView, max_tokens: int) -> Draft:
        """Catch up on the committed tokens, then draft: each pass feeds the newest token and
        the stager's guesses and keeps what q accepts, plus q's own next token."""
        ids = seq.token_ids
        k = self._draft_size(seq, max_tokens)
        vocab = self.model.config.vocab_size
        if k == 0:
            return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, vocab))
        row, cache, cached = self._rolled_back_cache(seq, len(ids) + k)
        st = SamplingTensors.from_params([seq.params], self.model.device)
        tokens: list[int] = []
        probs = torch.empty(k, vocab)  # [k, V]
        new = ids[cached:]  # the last committed token, plus any not fed yet
        while len(tokens) < k:
            guess = self.stager.continuation(seq, tokens, k - len(tokens) - 1)
            q = self._probs_after(cache, new, guess, cached, st)  # [len(guess) + 1, V]
            kept, out = verify_chain(
                q[None],
                torch.tensor([guess], dtype=torch.long).reshape(1, len(guess)),
                None,
                torch.tensor([len(guess)]),
                [seq.generator],
                st.greedy,
            )
            accepted = int(kept[0])
            probs[len(tokens) : len(tokens) + accepted + 1] = q[: accepted + 1]
            tokens += out[0, : accepted + 1].tolist()
            cached += len(new) + accepted  # the guesses q rejected are dropped from the cache
            cache.truncate(cached)
            new = tokens[-1:]
        self._caches.store(row, cache)
        return Draft(torch.tensor(tokens, dtype=torch.long), probs)

    def _probs_after(
        self, cache: KVCache, new: list[int], guess: list[int], start: int, st: SamplingTensors
    ) -> Tensor:
        """Feed `new` + `guess` at positions start..; q ([len(guess) + 1, V] float32, on the
        host) after the last of `new` and after each guess."""
        logits = feed(self.model, cache, new + guess, start, len(guess) + 1)  # [G + 1, V]
        return probs_from_logits(logits[None], st)[0].cpu()
