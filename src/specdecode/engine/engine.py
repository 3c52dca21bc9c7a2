"""The engine owns the target, a drafter, the scheduler and the output processor, and runs
requests with continuous batching: `add` queues a request, `abort` cancels one, and each
`step` lets waiting requests join (each into its own cache row; short prompts that share no
cached block may share a prefill pass) and then drafts, verifies and commits once for every
running request.

Losslessness per request: a prefill pass attends each row's tokens by themselves (DECODE
mode; with prefix caching and chunked prefill both off, each prompt is one PREFILL pass
alone), and so does a verification pass (DECODE / TREE mode), so in fp32 a request's
greedy output is the same alone or in a busy batch; in bf16 and int8 it is too wherever the
projections are row-exact (the native CPU kernels; docs/formats.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.block_pool import BLOCK_TOKENS
from specdecode.cache.kv_cache import KVCache
from specdecode.cache.prefix_cache import PrefixCache
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS, Drafter
from specdecode.drafters.plain import EMPTY_DRAFT, PlainDrafter
from specdecode.energy import cpu_seconds
from specdecode.engine.costs import seed_rows
from specdecode.engine.draft_length import DraftLength
from specdecode.engine.output import OutputProcessor
from specdecode.engine.request import Request
from specdecode.engine.scheduler import Scheduler, SchedulerConfig
from specdecode.engine.stats import EngineStats
from specdecode.engine.step import (
    VerifyOutput,
    commit,
    score,
    speculative_step,
    target_outputs,
    token_logprobs,
)
from specdecode.errors import UserError, context_overflow, prompt_too_long
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer
from specdecode.sampling.decide import decide, pad_tokens
from specdecode.sampling.probs import SamplingTensors
from specdecode.structured.grammars import Grammars
from specdecode.structured.state import all_allowed
from specdecode.types import RequestOutput

# Prompts prefilled together fill passes of at most this many tokens (rows x the longest
# chunk, padding included): many short prompts then cost a few passes instead of one each
# (the per-pass overhead is what they cost on a small model), and padding stays bounded. On
# a CPU a real model's prefill costs about the same per token in any batch shape.
PREFILL_PASS = 256


@dataclass(frozen=True, slots=True)
class Event:
    """New text of one request after a step, with a snapshot of its output.

    request: the engine's request (read its counters; do not change it).
    text: the text released by this step ("" when only the finish state changed).
    output: the cumulative `RequestOutput` after this step.
    """

    request: Request
    text: str
    output: RequestOutput


class Engine:
    """Continuous batching over a `Transformer`, speculative when given a drafter; with a
    `draft_length` policy, each request's draft limit is chosen per step (default: the
    drafter's own K, up to MAX_SPECULATIVE_TOKENS); `scheduler` sets the batch's limits."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        drafter: Drafter | None = None,
        draft_length: DraftLength | None = None,
        scheduler: SchedulerConfig | None = None,
    ) -> None:
        self.model = model
        self.drafter: Drafter = drafter if drafter is not None else PlainDrafter()
        most = MAX_SPECULATIVE_TOKENS if drafter is not None else 0
        self.draft_length = draft_length or DraftLength("fixed", most)
        self.outputs = OutputProcessor(tokenizer)
        self.grammars = Grammars(tokenizer, model.config.vocab_size)
        self.scheduler = Scheduler(scheduler or SchedulerConfig())
        self.prefix_cache = _prefix_cache(self.scheduler.config)
        self.cache: KVCache | None = None  # rows = scheduler.running, in order
        self.num_preemptions = 0  # requests preempted so far (`_preempt`)
        self._ids: set[str] = set()  # requests added and not yet released

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def configure(self, scheduler: SchedulerConfig) -> None:
        """Set the running batch's limits; refused while a request is in flight."""
        if self.has_unfinished():
            raise UserError("the scheduler's limits change only while no request is in flight")
        self.scheduler = Scheduler(scheduler)
        self.prefix_cache = _prefix_cache(scheduler)
        self.cache = None  # the next one has the new limits

    def kv_cache_usage(self) -> float:
        """The share of the KV cache the running requests' rows hold (0..1): blocks held over
        the blocks `kv_cache_tokens` allows, or over the pool's blocks without a limit."""
        if self.cache is None:
            return 0.0
        limit = self.scheduler.max_blocks or self.cache.pool.num_blocks
        return self.cache.num_blocks / limit if limit else 0.0

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def stats(self) -> EngineStats:
        """The running and waiting counts, KV cache usage, preemptions and the latest step's
        mean draft limit (what a server's gauges show)."""
        limits = self.draft_length.last_limits
        return EngineStats(
            running=self.num_running,
            waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache_usage(),
            num_preemptions=self.num_preemptions,
            draft_limit=sum(limits) / len(limits) if limits else 0.0,
            running_ids=frozenset(r.request_id for r in self.scheduler.running),
        )

    def room(self, num_prompt: int) -> int:
        """The most tokens a request of `num_prompt` prompt tokens could generate alone (0:
        none): what the model's context and the KV cache's whole blocks (less the slots of
        its drafts, MAX_SPECULATIVE_TOKENS: `Scheduler.check_fits`) leave after its prompt."""
        context = self.model.config.max_position_embeddings - num_prompt
        kv = self.scheduler.config.kv_cache_tokens
        if kv is None:
            return max(context, 0)
        slots = kv // BLOCK_TOKENS * BLOCK_TOKENS
        return max(min(context, slots - num_prompt - MAX_SPECULATIVE_TOKENS), 0)

    def check_context(self, num_prompt: int, max_tokens: int | None = None) -> None:
        """Refuse a prompt of `num_prompt` tokens that alone fills the model's context, and
        `max_tokens` (when given) beyond what the context leaves after it: one text for the
        server's 400 and the command line (`LLM.generate` instead caps a request's tokens at
        what the context leaves)."""
        context = self.model.config.max_position_embeddings
        if num_prompt >= context:
            raise prompt_too_long(num_prompt, context)
        if max_tokens is not None and max_tokens > context - num_prompt:
            raise context_overflow(context, num_prompt, max_tokens)

    def add(self, request: Request) -> None:
        """Queue a request; it joins the running batch at a later `step`. Refuses a request id
        already in flight and what `check` refuses."""
        if request.request_id in self._ids:
            raise UserError(f"request id {request.request_id!r} is already in flight")
        self.check(request)
        self.scheduler.add(request)
        self.outputs.add(request)
        self._ids.add(request.request_id)

    def check(self, request: Request) -> None:
        """Refuse a request that could not run here (`add` calls it; a server calls it first,
        to answer a bad request before any stream starts): one that could never fit the KV
        cache alone (`Scheduler.check_fits`), a drafter name not served here, logit-bias
        token ids outside the vocabulary. Its constraint is compiled into its grammar here
        (once: a checked request keeps it)."""
        self.scheduler.check_fits(request)
        self.check_drafter_name(request.params.drafter)
        bias, vocab = request.params.logit_bias, self.model.config.vocab_size
        if bias and bias[-1][0] >= vocab:
            raise UserError(
                f"logit_bias names token {bias[-1][0]}, outside the vocabulary [0, {vocab})"
            )
        constraint = request.params.structured_outputs
        if constraint is not None and request.grammar is None:
            request.grammar = self.grammars.start(constraint, request.eos_ids)

    def check_drafter_name(self, name: str | None) -> None:
        """Refuse a request's `drafter` name that this engine's drafter does not answer to
        (`Drafter.names`)."""
        names = self.drafter.names
        if name is None or name in names:
            return
        if names:
            raise UserError(f"drafter {name!r} is not served here; choose one of {names}")
        raise UserError(
            f"drafter {name!r} was asked for, but this engine has one drafter and no names; "
            "leave 'drafter' out (a server given several --speculative-config names them)"
        )

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request (its row leaves at the next step); False when
        the id is not in flight."""
        if request_id not in self._ids:
            return False
        waiting = self.scheduler.remove_waiting(request_id)
        if waiting is not None:
            waiting.finish("abort", None)
            self._release(request_id)
            return True
        for request in self.scheduler.running:
            if request.request_id == request_id and not request.finished:
                request.finish("abort", None)
        return True

    def abort_all(self) -> None:
        """Cancel every request in flight and drop the cache (e.g. after a step failed midway,
        when rows may hold half a step)."""
        for request in [*self.scheduler.waiting, *self.scheduler.running]:
            if not request.finished:
                request.finish("abort", None)
            self._release(request.request_id)
        self.scheduler.waiting.clear()
        self.scheduler.running = []
        self.cache = None

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Drop finished rows, admit waiting requests, prefill (their first tokens; a chunk of
        a long prompt while others decode, `_prefill_chunks`), then one speculative step over
        every request past its prefill; return the events in order (a request's last event
        has `output.finished` True)."""
        self._drop_finished()
        self._preempt()
        admitted = self.scheduler.admit(self.draft_length.max_tokens)
        self._new_rows(admitted)
        events = self._prefill_chunks()
        self._drop_finished()  # requests done at their first token
        running = self.scheduler.running
        decoding = sum(not r.prefilling for r in running)  # the first rows: prefills are FIFO
        assert not any(r.prefilling for r in running[:decoding])
        if decoding:
            rows = running[:decoding]
            self.warm_up(decoding)
            cpu = cpu_seconds()
            st = SamplingTensors.from_params([r.params for r in rows], self.model.device)
            assert self.cache is not None
            cache = self.cache if decoding == len(running) else self.cache.rows(0, decoding)
            texts = speculative_step(
                self.model, cache, rows, self.drafter, st, self.outputs, self.draft_length
            )
            self.cache.take_lengths(cache)
            _charge(rows, cpu)
            events += [self._event(r, t) for r, t in zip(rows, texts, strict=True)]
        return [e for e in events if e.text or e.output.finished]

    def _prefill_chunks(self) -> list[Event]:
        """Prefill the requests still prefilling, in order (each row after the ones that
        decode); a request whose prompt is all in is given its first token. While other rows
        decode, the step prefills at most as many prompt tokens as they verify (at least one
        block, within the step's budget): their pace at most halves. A drafter that reads the
        target's hidden states gets each prompt whole. Prompts that cannot share a cached
        prefix share a pass instead (`_joins`; at most `PREFILL_PASS` tokens, padding
        included)."""
        running = self.scheduler.running
        decoding = sum(not r.prefilling for r in running)
        config = self.scheduler.config
        budget = None
        if decoding and config.chunked_prefill and not self.drafter.needs.hidden_layers:
            verify = decoding * (1 + self.draft_length.max_tokens)
            room = config.max_num_batched_tokens - verify
            budget = max(BLOCK_TOKENS, min(verify, room))
        events: list[Event] = []
        batch: list[tuple[Request, int]] = []  # (request, chunk) of rows first, first + 1, ...
        first = decoding
        for row in range(decoding, len(running)):
            req = running[row]
            if batch and not self._joins(req, batch):
                events += self._prefill(first, batch)
                first, batch = row, []
            left = self._start_prefill(req, row)
            chunk = left if budget is None else min(left, budget)
            if chunk < 1:
                break  # the budget is spent: later prompts wait (they finish in order)
            if batch and max(chunk, *(c for _, c in batch)) * (len(batch) + 1) > PREFILL_PASS:
                events += self._prefill(first, batch)
                first, batch = row, []
            batch.append((req, chunk))
            if budget is not None:
                budget -= chunk
            if chunk < left:
                break  # its prompt goes on next step; later prompts wait behind it
        if batch:
            events += self._prefill(first, batch)
        return events

    def _joins(self, req: Request, batch: list[tuple[Request, int]]) -> bool:
        """Whether `req` may be prefilled in one pass with the requests of `batch`: under
        per-token attention (`_exact_prefill`), and, where a prompt may start from the prefix
        cache (`_prefix_hits`), only when its first block of prompt tokens differs from each
        of theirs, so no earlier prompt of the pass could have given it a hit (those share a
        first block: they run one after another)."""
        if not self._exact_prefill:
            return False
        head = req.prefill_ids[:BLOCK_TOKENS]
        if len(head) < BLOCK_TOKENS or not self._prefix_hits:
            return True  # no full block, or no hit ever loaded: nothing to share
        return all(other.prefill_ids[:BLOCK_TOKENS] != head for other, _ in batch)

    @property
    def _prefix_hits(self) -> bool:
        """Whether a prompt may start from the prefix cache: a cache is kept and the drafter
        does not need the target's states at every prompt token (a head's catch-up does)."""
        return self.prefix_cache is not None and not self.drafter.needs.hidden_layers

    @property
    def _exact_prefill(self) -> bool:
        """Under prefix caching or chunked prefill, a prefill attends per token (DECODE), as
        decoding does: a token's keys and values then have the same bits however the
        sequence was split into passes and whichever prompts shared the pass, so a hit, a
        chunked prefill and a batch of prompts give exactly what one cold pass gives
        (row-exact formats). Else a prompt is one batched attention (PREFILL), alone."""
        return self.prefix_cache is not None or self.scheduler.config.chunked_prefill

    def _preempt(self) -> None:
        """Take the newest running requests back to the queue while the batch would outgrow
        the KV cache in the next step (`Scheduler.preempt`); their full blocks stay in the
        prefix cache, so most of their prefill again is a hit."""
        running = len(self.scheduler.running)
        taken = self.scheduler.preempt(self.draft_length.max_tokens)
        self.num_preemptions += len(taken)
        if not taken or self.cache is None:
            return
        if self._prefix_hits:  # newest first: the batch's last rows
            for row, req in zip(range(running - 1, -1, -1), taken, strict=False):
                self.prefix_cache.store(req.token_ids, self.cache, row)
        self.cache.keep_rows(range(running - len(taken)))

    def warm_up(self, max_rows: int) -> dict[tuple[int, int], float]:
        """Under the "cost" draft-length policy, measure the passes batches of up to
        `max_rows` rows may run before the rule first prices them (`PassCosts.unseeded`,
        `seed_rows`: at K = 3, 4 widths x 4 passes for each new row count), so it does not
        read the costs of widths it has not run off the one it has. A step does this for its
        batch size; a server, for all it may run, before it serves. Returns the seeded table,
        (rows, tokens per row) -> seconds (empty under the other policies)."""
        policy = self.draft_length
        if policy.policy != "cost":
            return {}
        if missing := policy.passes.unseeded(max_rows):
            seed_rows(self.model, policy.passes, policy.max_tokens, missing)
        return dict(policy.passes.seeded)

    def stream(self, reqs: list[Request]) -> Iterator[Event]:
        """Add `reqs` and step until every one has finished, yielding their events (and those
        of other requests in flight). Requests the consumer leaves unfinished (it stopped
        early, or a step failed) are aborted."""
        for req in reqs:
            self.add(req)
        try:
            while any(not r.finished for r in reqs):
                yield from self.step()
        finally:
            for req in reqs:
                if not req.finished:
                    self.abort(req.request_id)
            self._drop_finished()

    def _new_rows(self, admitted: list[Request]) -> None:
        """Give each admitted request an empty cache row (its blocks come as it fills). The
        pool may hold the scheduler's `kv_cache_tokens` for the running requests and
        `prefix_cache_tokens` of idle cached blocks beside them."""
        if not admitted:
            return
        if self.cache is None:
            config = self.scheduler.config
            limit = config.kv_cache_tokens
            if limit is not None:
                limit += config.prefix_cache_tokens
            self.cache = self.model.new_cache(0, 0, limit)
        self.cache.add_rows(len(admitted))

    def _start_prefill(self, req: Request, row: int) -> int:
        """Before a request's first prefill pass, load the prefix cache's hit into its cache
        row (its tokens count as computed); returns the prompt tokens still to prefill."""
        assert self.cache is not None  # _new_rows made it
        prompt = req.prefill_ids
        if req.num_computed_tokens == 0:
            hit = 0
            if self._prefix_hits:
                view = self.cache.row(row)
                hit = self.prefix_cache.load(prompt, view)
                self.cache.set_length(row, view.lengths[0])
            if not req.num_preemptions:
                req.num_cached_tokens = hit  # of the prompt, as the usage reports it
            req.num_computed_tokens = hit
        return len(prompt) - req.num_computed_tokens

    def _prefill(self, first: int, batch: list[tuple[Request, int]]) -> list[Event]:
        """Prefill the next `chunk` tokens of each request's `prefill_ids` into cache rows
        `first`, `first` + 1, ... in one pass; each request whose prompt is then all in draws
        its first token (`decide`, with an empty draft), commits it and gets an event. No
        event for a request with tokens left, or resuming after a preemption (its next step
        feeds its last token)."""
        assert self.cache is not None  # _new_rows made it
        start, cpu = time.perf_counter(), cpu_seconds()
        device = self.model.device
        reqs = [req for req, _ in batch]
        chunks = [chunk for _, chunk in batch]
        view = self.cache.rows(first, len(batch))
        done = view.lengths[:]  # == each request's num_computed_tokens
        width = max(chunks)
        rows = zip(reqs, done, chunks, strict=True)
        ids = [r.prefill_ids[d : d + c] + [0] * (width - c) for r, d, c in rows]
        tokens = torch.tensor(ids, device=device)  # [B, T], right-padded (padding: never kept)
        mode = AttentionMode.DECODE if self._exact_prefill else AttentionMode.PREFILL
        meta = AttentionMetadata.contiguous(mode, done, chunks, device)
        needs = self.drafter.needs
        layers = needs.hidden_layers or None
        last = torch.tensor(chunks, device=device)[:, None] - 1  # [B, 1]
        logits, hidden = self.model(tokens, meta, view, logits_index=last, hidden_layers=layers)
        self.cache.take_lengths(view, first)
        ready = []  # batch indices of the requests that draw their first token now
        for index, (req, chunk) in enumerate(batch):
            req.num_computed_tokens += chunk
            if self._prefix_hits:
                self.prefix_cache.store(req.prefill_ids, view, index)
            if req.num_computed_tokens == len(req.prefill_ids) and not req.output_ids:
                ready.append(index)
        if not ready:
            _charge(reqs, cpu)
            return []
        reqs = [reqs[i] for i in ready]
        picked = torch.tensor(ready, device=device)
        logits = logits[picked]  # [R, 1, V]
        drafts = [EMPTY_DRAFT] * len(reqs)
        masks: list[torch.Tensor | None] | None = None
        if any(r.grammar is not None for r in reqs):
            masks = [self._first_mask(r) for r in reqs]
        raw = score(logits, reqs, drafts, masks)  # [R, 1, V] ready for the decision
        st = SamplingTensors.from_params([r.params for r in reqs], device)
        none, zero = pad_tokens(drafts, device)  # [R, 0], [R]
        generators = [r.generator for r in reqs]
        decision = decide(logits, drafts, none, zero, None, st, generators, needs.target_argmax)
        kept = [chunks[i] for i in ready]
        starts = [done[i] for i in ready]
        hidden = None if hidden is None else hidden[picked]  # [R, T, F]
        targets = target_outputs(needs, starts, kept, hidden, decision, [0] * len(reqs))
        seconds = time.perf_counter() - start
        _charge([req for req, _ in batch], cpu)  # before commit: the output snapshot reads it
        verdicts = decision.verdicts
        verified = VerifyOutput(verdicts, targets, token_logprobs(raw, reqs, verdicts))
        texts = commit(reqs, drafts, verified, self.drafter, self.outputs, 0.0, seconds)
        return [self._event(r, t) for r, t in zip(reqs, texts, strict=True)]

    def _first_mask(self, req: Request) -> torch.Tensor | None:
        """The [1, W] grammar mask of `req`'s first token (None: unconstrained)."""
        if req.grammar is None:
            return None
        mask = all_allowed(1, self.model.config.vocab_size)
        req.grammar.fill(mask, 0)
        return mask

    def _event(self, req: Request, text: str) -> Event:
        return Event(req, text, self.outputs.output(req))

    def _drop_finished(self) -> None:
        """Free the rows of finished (and aborted) requests and release them."""
        running = self.scheduler.running
        keep = [row for row, req in enumerate(running) if not req.finished]
        if len(keep) == len(running):
            return
        for row, req in enumerate(running):
            if req.finished:
                if self._prefix_hits and self.cache is not None:
                    self.prefix_cache.store(req.token_ids, self.cache, row)
                self._release(req.request_id)
        if self.cache is not None:
            self.cache.keep_rows(keep)
        self.scheduler.running = [running[row] for row in keep]

    def _release(self, request_id: str) -> None:
        """The drafter, the draft-length policy and the output processor forget a request."""
        self._ids.discard(request_id)
        self.drafter.release(request_id)
        self.draft_length.release(request_id)
        self.outputs.release(request_id)


def _charge(reqs: list[Request], cpu: float) -> None:
    """Share the CPU seconds spent since `cpu` (`cpu_seconds()`) evenly among `reqs`."""
    share = (cpu_seconds() - cpu) / len(reqs)
    for req in reqs:
        req.cpu_s += share


def _prefix_cache(config: SchedulerConfig) -> PrefixCache | None:
    """The prefix cache `config` asks for (None: off)."""
    tokens = config.prefix_cache_tokens
    return PrefixCache(tokens) if tokens else None
