"""Prefill: the prompts of the rows still prefilling go into their cache rows, in arrival
order, and each prompt that is then all in draws its first token.

While other rows decode, a step prefills at most as many prompt tokens as they verify (at
least one block, within the step's budget), so their pace at most halves; a prompt left over
goes on next step and later prompts wait behind it. Prompts that cannot share a cached prefix
share a pass instead (`Prefiller.joins`), at most `PREFILL_PASS` tokens, padding included. A
prefill pass is a verification of empty drafts: its last logits are `settle`d and committed as
every later step's are (`engine/step.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.block_pool import BLOCK_TOKENS
from specdecode.drafters.base import Drafter
from specdecode.energy import cpu_seconds
from specdecode.engine.kv_manager import KVManager
from specdecode.engine.output import OutputProcessor
from specdecode.engine.request import Request, charge
from specdecode.engine.step import Fed, commit, settle
from specdecode.model.transformer import Transformer
from specdecode.sampling.probs import SamplingTensors
from specdecode.structured.drafts import constrain_drafts

# Prompts prefilled together fill passes of at most this many tokens (rows x the longest
# chunk, padding included): many short prompts then cost a few passes instead of one each
# (the per-pass overhead is what they cost on a small model), and padding stays bounded. On
# a CPU a real model's prefill costs about the same per token in any batch shape.
PREFILL_PASS = 256


class Prefiller:
    """Prefills `model`'s running requests into `kv`'s rows; `drafter` and `outputs` get
    each first token's commit, as a step's."""

    def __init__(
        self, model: Transformer, kv: KVManager, drafter: Drafter, outputs: OutputProcessor
    ) -> None:
        self.model = model
        self.kv = kv
        self.drafter = drafter
        self.outputs = outputs

    def run(self, running: Seq[Request], draft_tokens: int) -> list[tuple[Request, str]]:
        """Prefill the requests of `running` still prefilling (the rows after those that
        decode, each verifying up to `draft_tokens` + 1 tokens this step; module
        docstring); returns the requests that drew their first token, with its text."""
        decoding = sum(not r.prefilling for r in running)
        config = self.kv.config
        budget = None
        if decoding and config.chunked_prefill and not self.drafter.needs.hidden_layers:
            verify = decoding * (1 + draft_tokens)
            room = config.max_num_batched_tokens - verify
            budget = max(BLOCK_TOKENS, min(verify, room))
        firsts: list[tuple[Request, str]] = []
        batch: list[tuple[Request, int]] = []  # (request, chunk) of rows first, first + 1, ...
        first = decoding
        for row in range(decoding, len(running)):
            req = running[row]
            if batch and not self.joins(req, batch):
                firsts += self._pass(first, batch)
                first, batch = row, []
            left = self.kv.start(req, row)
            chunk = left if budget is None else min(left, budget)
            if chunk < 1:
                break  # the budget is spent: later prompts wait (they finish in order)
            if batch and max(chunk, *(c for _, c in batch)) * (len(batch) + 1) > PREFILL_PASS:
                firsts += self._pass(first, batch)
                first, batch = row, []
            batch.append((req, chunk))
            if budget is not None:
                budget -= chunk
            if chunk < left:
                break  # its prompt goes on next step; later prompts wait behind it
        if batch:
            firsts += self._pass(first, batch)
        return firsts

    def joins(self, req: Request, batch: Seq[tuple[Request, int]]) -> bool:
        """Whether `req` may be prefilled in one pass with the requests of `batch`: under
        per-token attention (`KVManager.exact_prefill`), and, where a prompt may start from
        the prefix cache (`KVManager.prefix_hits`), only when its first block of prompt
        tokens differs from each of theirs, so no earlier prompt of the pass could have
        given it a hit (those share a first block: they run one after another)."""
        if not self.kv.exact_prefill:
            return False
        head = req.prefill_ids[:BLOCK_TOKENS]
        if len(head) < BLOCK_TOKENS or not self.kv.prefix_hits:
            return True  # no full block, or no hit ever loaded: nothing to share
        return all(other.prefill_ids[:BLOCK_TOKENS] != head for other, _ in batch)

    def _pass(self, first: int, batch: Seq[tuple[Request, int]]) -> list[tuple[Request, str]]:
        """Prefill the next `chunk` tokens of each request's `prefill_ids` into cache rows
        `first`, `first` + 1, ... in one pass; each request whose prompt is then all in draws
        its first token (`settle` of an empty draft) and commits it. Nothing for a request
        with tokens left, or resuming after a preemption (its next step feeds its last
        token)."""
        cache = self.kv.cache
        assert cache is not None  # KVManager.add_rows made it
        start, cpu = time.perf_counter(), cpu_seconds()
        device = self.model.device
        reqs = [req for req, _ in batch]
        chunks = [chunk for _, chunk in batch]
        view = cache.rows(first, len(batch))
        done = view.lengths[:]  # == each request's num_computed_tokens
        width = max(chunks)
        rows = zip(reqs, done, chunks, strict=True)
        ids = [r.prefill_ids[d : d + c] + [0] * (width - c) for r, d, c in rows]
        tokens = torch.tensor(ids, device=device)  # [B, T], right-padded (padding: never kept)
        mode = AttentionMode.DECODE if self.kv.exact_prefill else AttentionMode.PREFILL
        meta = AttentionMetadata.contiguous(mode, done, chunks, device)
        needs = self.drafter.needs
        layers = needs.hidden_layers or None
        last = torch.tensor(chunks, device=device)[:, None] - 1  # [B, 1]
        logits, hidden = self.model(tokens, meta, view, logits_index=last, hidden_layers=layers)
        cache.take_lengths(view, first)
        ready = []  # batch indices of the requests that draw their first token now
        for index, (req, chunk) in enumerate(batch):
            req.num_computed_tokens += chunk
            self.kv.store(req.prefill_ids, view, index)
            if req.num_computed_tokens == len(req.prefill_ids) and not req.output_ids:
                ready.append(index)
        if not ready:
            charge(reqs, cpu)
            return []
        drawing = [reqs[i] for i in ready]
        picked = torch.tensor(ready, device=device)
        fed = Fed.prompts(drawing, [done[i] for i in ready], [chunks[i] for i in ready], device)
        masks = None
        if any(r.grammar is not None for r in drawing):  # the masks a step's empty drafts get
            grammars, vocab = [r.grammar for r in drawing], self.model.config.vocab_size
            _, masks = constrain_drafts(grammars, fed.drafts, [0] * len(drawing), vocab)
        st = SamplingTensors.from_params([r.params for r in drawing], device)
        hidden = None if hidden is None else hidden[picked]  # [R, T, F]
        verified, _ = settle(fed, logits[picked], hidden, st, needs, masks)  # [R, 1, V]
        seconds = time.perf_counter() - start
        charge(reqs, cpu)  # before commit: the output snapshot reads it
        texts = commit(drawing, fed.drafts, verified, self.drafter, self.outputs, 0.0, seconds)
        return list(zip(drawing, texts, strict=True))
