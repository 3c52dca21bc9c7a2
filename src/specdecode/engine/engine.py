"""The engine owns the target, a drafter and the output processor, and runs a batch of requests
to the end: prefill, then speculative steps until every request has finished."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS, Drafter
from specdecode.drafters.plain import EMPTY_DRAFT, PlainDrafter
from specdecode.engine.draft_length import DraftLength
from specdecode.engine.output import OutputProcessor
from specdecode.engine.request import Request
from specdecode.engine.step import commit, keep_features, speculative_step
from specdecode.model.attention_metadata import AttentionMetadata
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import verdicts, verify_chain


class Engine:
    """Batched decoding over a `Transformer`, speculative when given a drafter; with a
    `draft_length` policy, each request's draft limit is chosen per step (default: the
    drafter's own K, up to MAX_SPECULATIVE_TOKENS)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        drafter: Drafter | None = None,
        draft_length: DraftLength | None = None,
    ) -> None:
        self.model = model
        self.drafter: Drafter = drafter if drafter is not None else PlainDrafter()
        self.draft_length = draft_length or DraftLength("fixed", MAX_SPECULATIVE_TOKENS)
        self.outputs = OutputProcessor(tokenizer)

    def _prefill(self, reqs: list[Request]) -> tuple[Tensor, KVCache]:
        """Run every prompt (right-padded into one batch); return last-token logits and cache."""
        device = self.model.device
        lengths = [len(r.prompt_ids) for r in reqs]
        tokens = torch.zeros(len(reqs), max(lengths), dtype=torch.long)  # [B, T], 0-padded
        for row, req in enumerate(reqs):
            tokens[row, : lengths[row]] = torch.tensor(req.prompt_ids)
        last = torch.tensor(lengths)[:, None] - 1  # [B, 1]
        # Spare slots: a short draft is padded to the batch's longest one (<= 64 tokens).
        capacity = max(r.length + r.max_new for r in reqs) + MAX_SPECULATIVE_TOKENS
        cache = self.model.new_cache(len(reqs), capacity)
        meta = AttentionMetadata.prefill(lengths, device)
        layers = self.drafter.hidden_layers or None  # () asks for nothing too
        logits, hidden = self.model(
            tokens.to(device), meta, cache, logits_index=last.to(device), hidden_layers=layers
        )
        keep_features(reqs, meta.starts, lengths, hidden if layers else None)
        return logits, cache  # [B, 1, V]

    def _first_tokens(self, reqs: list[Request], logits: Tensor, st: SamplingTensors) -> list[str]:
        """Sample each request's first token from the prefill logits ([B, 1, V]); commit it."""
        device = self.model.device
        none = torch.zeros(len(reqs), 0, dtype=torch.long, device=device)  # [B, 0]
        num_accepted, out = verify_chain(
            probs_from_logits(logits, st),
            none,
            None,
            torch.zeros(len(reqs), dtype=torch.long, device=device),
            [r.generator for r in reqs],
            greedy=st.greedy,
        )
        drafts = [EMPTY_DRAFT] * len(reqs)
        return commit(reqs, drafts, verdicts(num_accepted, out), self.drafter, self.outputs)

    @torch.inference_mode()
    def stream(self, reqs: list[Request]) -> Iterator[tuple[Request, str]]:
        """Generate every request to completion, yielding (request, new text) as tokens land.

        Finished rows leave the batch; a request's final event has `request.finished` True.
        Read `self.outputs.output(request)` while handling an event: a finished request's
        text is released when the stream moves on.
        """
        if not reqs:
            return
        for req in reqs:
            self.outputs.add(req)
        live = {req.request_id for req in reqs}  # added and not yet released
        try:
            yield from self._run(reqs, live)
        finally:  # also when the consumer stops early or a step fails
            for request_id in list(live):
                self._release(request_id, live)

    def _release(self, request_id: str, live: set[str]) -> None:
        """The drafter and the output processor forget a request, once."""
        live.discard(request_id)
        self.drafter.release(request_id)
        self.draft_length.release(request_id)
        self.outputs.release(request_id)

    def _run(self, reqs: list[Request], live: set[str]) -> Iterator[tuple[Request, str]]:
        """The decode loop of `stream`; finished requests leave `live` as they are released."""
        logits, cache = self._prefill(reqs)
        active = list(reqs)
        st = SamplingTensors.from_params([r.params for r in active], self.model.device)
        texts = self._first_tokens(active, logits, st)
        while True:
            for req, text in zip(active, texts, strict=True):
                if text or req.finished:
                    yield req, text
            keep = [row for row, req in enumerate(active) if not req.finished]
            for req in active:
                if req.finished:
                    self._release(req.request_id, live)
            if not keep:
                return
            if len(keep) < len(active):
                cache.keep_rows(keep)
                active = [active[row] for row in keep]
                st = SamplingTensors.from_params([r.params for r in active], self.model.device)
            texts = speculative_step(
                self.model, cache, active, self.drafter, st, self.outputs, self.draft_length
            )
