"""The engine owns the model and its cache and runs a batch of sequences to completion."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache
from specdecode.engine.sequence import Sequence
from specdecode.model.transformer import Transformer
from specdecode.sampling.probs import SamplingTensors, next_tokens


class Engine:
    """Plain (non-speculative) batched decoding over a `Transformer`."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

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
        cache = self.model.new_cache(len(seqs), max(s.length + s.max_new for s in seqs))
        logits, _ = self.model(
            tokens.to(device), positions.to(device), cache, logits_index=last.to(device)
        )
        cache.truncate(lengths)  # padding slots are rolled back
        return logits[:, 0], cache  # [B, V]

    @torch.inference_mode()
    def stream(self, seqs: list[Sequence]) -> Iterator[tuple[Sequence, str]]:
        """Generate every sequence to completion, yielding (sequence, new text) as tokens land.

        Finished rows leave the batch; a sequence's final event has `seq.finished` True.
        """
        if not seqs:
            return
        device = self.model.device
        logits, cache = self._prefill(seqs)
        active = list(seqs)
        st = SamplingTensors.from_params([s.params for s in active], device)
        while True:
            chosen = next_tokens(logits, st, [s.generator for s in active]).tolist()
            for seq, token in zip(active, chosen, strict=True):
                delta = seq.append([token])
                if delta or seq.finished:
                    yield seq, delta
            keep = [row for row, seq in enumerate(active) if not seq.finished]
            if not keep:
                return
            if len(keep) < len(active):
                cache.keep_rows(keep)
                active = [active[row] for row in keep]
                chosen = [chosen[row] for row in keep]
                st = SamplingTensors.from_params([s.params for s in active], device)
            tokens = torch.tensor(chosen, device=device)[:, None]  # [B, 1]
            positions = torch.tensor(cache.lengths, device=device)[:, None]  # [B, 1]
            logits = self.model(tokens, positions, cache)[0][:, 0]  # [B, V]
