"""The engine owns the target, a drafter, the scheduler, the KV manager (cache rows and the
prefix cache), the prefiller and the output processor, and runs requests with continuous
batching: `add` queues a request, `abort` cancels one, and each `step` lets waiting requests
join (each into its own cache row; short prompts that share no cached block may share a
prefill pass) and then drafts, verifies and commits once for every running request.

Losslessness per request: a prefill pass attends each row's tokens by themselves (DECODE
mode; with prefix caching and chunked prefill both off, each prompt is one PREFILL pass
alone), and so does a verification pass (DECODE / TREE mode), so in fp32 a request's
greedy output is the same alone or in a busy batch; in bf16 and int8 it is too wherever the
projections are row-exact (the native CPU kernels; docs/formats.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specdecode.cache.block_pool import BLOCK_TOKENS
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS, Drafter
from specdecode.drafters.plain import PlainDrafter
from specdecode.energy import cpu_seconds
from specdecode.engine.costs import seed_rows
from specdecode.engine.draft_length import DraftLength
from specdecode.engine.kv_manager import KVManager
from specdecode.engine.output import OutputProcessor
from specdecode.engine.prefill import Prefiller
from specdecode.engine.request import Request, charge
from specdecode.engine.scheduler import Scheduler, SchedulerConfig
from specdecode.engine.stats import EngineStats
from specdecode.engine.step import speculative_step
from specdecode.errors import UserError, context_overflow, prompt_too_long
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer
from specdecode.sampling.probs import SamplingTensors
from specdecode.structured.grammars import Grammars
from specdecode.types import RequestOutput


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
        self._limit(scheduler or SchedulerConfig())
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
        self._limit(scheduler)

    def _limit(self, scheduler: SchedulerConfig) -> None:
        """A scheduler, KV manager (no rows yet) and prefiller under `scheduler`'s limits."""
        self.scheduler = Scheduler(scheduler)
        reads_states = bool(self.drafter.needs.hidden_layers)
        self.kv = KVManager(self.model, scheduler, reads_states)
        self.prefiller = Prefiller(self.model, self.kv, self.drafter, self.outputs)

    def kv_cache_usage(self) -> float:
        """The share of the KV cache the running requests' rows hold (0..1)."""
        return self.kv.usage()

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
        self.kv.clear()

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Drop finished rows, admit waiting requests, prefill (their first tokens; a chunk of
        a long prompt while others decode: `Prefiller.run`), then one speculative step over
        every request past its prefill; return the events in order (a request's last event
        has `output.finished` True)."""
        self._drop_finished()
        self._preempt()
        draft_tokens = self.draft_length.max_tokens
        self.kv.add_rows(len(self.scheduler.admit(draft_tokens)))
        firsts = self.prefiller.run(self.scheduler.running, draft_tokens)
        events = [self._event(r, t) for r, t in firsts]
        self._drop_finished()  # requests done at their first token
        running = self.scheduler.running
        decoding = sum(not r.prefilling for r in running)  # the first rows: prefills are FIFO
        assert not any(r.prefilling for r in running[:decoding])
        if decoding:
            rows = running[:decoding]
            self.warm_up(decoding)
            cpu = cpu_seconds()
            st = SamplingTensors.from_params([r.params for r in rows], self.model.device)
            assert self.kv.cache is not None
            whole = self.kv.cache
            cache = whole if decoding == len(running) else whole.rows(0, decoding)
            texts = speculative_step(
                self.model, cache, rows, self.drafter, st, self.outputs, self.draft_length
            )
            whole.take_lengths(cache)
            charge(rows, cpu)
            events += [self._event(r, t) for r, t in zip(rows, texts, strict=True)]
        return [e for e in events if e.text or e.output.finished]

    def _preempt(self) -> None:
        """Take the newest running requests back to the queue while the batch would outgrow
        the KV cache in the next step (`Scheduler.preempt`); their full blocks stay in the
        prefix cache (`KVManager.preempt`), so most of their prefill again is a hit."""
        running = len(self.scheduler.running)
        taken = self.scheduler.preempt(self.draft_length.max_tokens)
        self.num_preemptions += len(taken)
        self.kv.preempt(taken, running)

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

    def _event(self, req: Request, text: str) -> Event:
        return Event(req, text, self.outputs.output(req))

    def _drop_finished(self) -> None:
        """Free the rows of finished (and aborted) requests and release them."""
        running = self.scheduler.running
        keep = self.kv.keep(running)
        if len(keep) == len(running):
            return
        for req in running:
            if req.finished:
                self._release(req.request_id)
        self.scheduler.running = [running[row] for row in keep]

    def _release(self, request_id: str) -> None:
        """The drafter, the draft-length policy and the output processor forget a request."""
        self._ids.discard(request_id)
        self.drafter.release(request_id)
        self.draft_length.release(request_id)
        self.outputs.release(request_id)
