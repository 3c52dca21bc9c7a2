"""The engine owns the model, its cache and a drafter, and runs a batch of sequences to the end."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import Drafter
from specdecode.drafters.plain import EMPTY_DRAFT, PlainDrafter
from specdecode.engine.sequence import Sequence
from specdecode.engine.step import commit, speculative_step
from specdecode.model.transformer import Transformer
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import verdicts, verify_chain
from specdecode.spec_config import MAX_SPECULATIVE_TOKENS


class Engine:
    """Batched decoding over a `Transformer`, speculative when given a drafter."""

    def __init__(self, model: Transformer, drafter: Drafter | None = None) -> None:
        self.model = model
        self.drafter: Drafter = drafter if drafter is not None else PlainDrafter()

    def _prefill(self, seqs: list[Sequence]) -> tuple[Tensor, KVCache]:
        """Run every prompt (right-padded into one batch); return last-token logits and cache."""
        device = self.model.device
        lengths = [len(s.prompt_ids) for s in seqs]
        width = max(lengths)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, T], 0-padded
        for row, seq in enumerate(seqs):
            tokens[row, : lengths[row]] = torch.tensor(seq.prompt_ids)
        positions = torch.arange(width).expand(len(seqs), -1)  # [B, T]
        last = torch.tensor(lengths)[:, None] - 1  # [B, 1]
        # Spare slots: a short draft is padded to the batch's longest one (<= 64 tokens).
        capacity = max(s.length + s.max_new for s in seqs) + MAX_SPECULATIVE_TOKENS
        cache = self.model.new_cache(len(seqs), capacity)
        logits, _ = self.model(
            tokens.to(device), positions.to(device), cache, logits_index=last.to(device)
        )
        cache.truncate(lengths)  # padding slots are rolled back
        return logits, cache  # [B, 1, V]

    def _first_tokens(self, seqs: list[Sequence], logits: Tensor, st: SamplingTensors) -> list[str]:
        """Sample each sequence's first token from the prefill logits ([B, 1, V]); commit it."""
        device = self.model.device
        none = torch.zeros(len(seqs), 0, dtype=torch.long, device=device)  # [B, 0]
        num_accepted, out = verify_chain(
            probs_from_logits(logits, st),
            none,
            None,
            torch.zeros(len(seqs), dtype=torch.long, device=device),
            [s.generator for s in seqs],
        )
        return commit(seqs, [EMPTY_DRAFT] * len(seqs), verdicts(num_accepted, out), self.drafter)

    @torch.inference_mode()
    def stream(self, seqs: list[Sequence]) -> Iterator[tuple[Sequence, str]]:
        """Generate every sequence to completion, yielding (sequence, new text) as tokens land.

        Finished rows leave the batch; a sequence's final event has `seq.finished` True.
        """
        if not seqs:
            return
        logits, cache = self._prefill(seqs)
        active = list(seqs)
        st = SamplingTensors.from_params([s.params for s in active], self.model.device)
        texts = self._first_tokens(active, logits, st)
        while True:
            for seq, text in zip(active, texts, strict=True):
                if text or seq.finished:
                    yield seq, text
            keep = [row for row, seq in enumerate(active) if not seq.finished]
            for seq in active:
                if seq.finished:
                    self.drafter.release(seq.request_id)
            if not keep:
                return
            if len(keep) < len(active):
                cache.keep_rows(keep)
                active = [active[row] for row in keep]
                st = SamplingTensors.from_params([s.params for s in active], self.model.device)
            texts = speculative_step(self.model, cache, active, self.drafter, st)
