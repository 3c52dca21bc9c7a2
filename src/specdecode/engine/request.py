"""Per-request state, owned by the engine (a scheduler later): prompt, limits, generated
tokens, finish state, timings and speculative counters. Text lives in the `OutputProcessor`.

The committed length (prompt + generated tokens) is the one truth about a request's position.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from collections.abc import Sequence as Seq

import torch

from specdecode.energy import cpu_seconds
from specdecode.errors import UserError, prompt_too_long
from specdecode.metrics import SpecCounters
from specdecode.sampling_params import SamplingParams
from specdecode.structured.state import GrammarState
from specdecode.types import StepEvent, TokenLogprob


class Request:
    """One request being generated.

    request_id: unique among the requests in flight.
    prompt: the prompt text (None for a tokens prompt); reported back, never re-tokenized.
    prompt_ids: the prompt's token ids (at least one, fewer than `max_context`).
    params: how to sample and when to stop.
    eos_ids: end-of-sequence token ids (ignored with `params.ignore_eos`).
    max_context: the model's context; prompt + generated tokens never exceed it.
    device: where the request's random generator lives.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_ids: Collection[int],
        max_context: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if not prompt_ids:
            raise UserError("the prompt is empty: it must contain at least one token")
        if len(prompt_ids) >= max_context:
            raise prompt_too_long(len(prompt_ids), max_context)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_new = min(params.max_tokens, max_context - len(prompt_ids))
        self.eos_ids = frozenset(() if params.ignore_eos else eos_ids)
        self.generator = (
            None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
        )
        self.output_ids: list[int] = []
        self.spec = SpecCounters()  # draft / accept counters of this request
        self.steps: list[StepEvent] = []  # with params.step_events: one per step
        # with params.logprobs: one per generated token
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.cpu_s = 0.0  # CPU seconds of its prefill and its share of each batch step
        self.num_cached_tokens = 0  # prompt tokens whose keys and values the prefix cache gave
        self.num_computed_tokens = 0  # tokens of `prefill_ids` in its cache row
        self.num_preemptions = 0  # times its cache row was taken back (`preempt`)
        self._resume_at = 0  # after a preemption: the committed tokens to prefill again
        self.grammar: GrammarState | None = None  # with params.structured_outputs (the engine's)
        self.finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
        self.stop_reason: str | int | None = None  # the stop string or EOS id
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens its row must hold before it decodes: the prompt, or after a preemption
        every committed token but the last (which the next step feeds)."""
        return self.token_ids[: self._resume_at] if self._resume_at else self.prompt_ids

    @property
    def prefilling(self) -> bool:
        """Whether `prefill_ids` are not all in its cache row yet (then it does not decode)."""
        return self.num_computed_tokens < (self._resume_at or len(self.prompt_ids))

    def preempt(self) -> None:
        """Its cache row is taken back (the KV cache ran short): it waits, then prefills its
        committed tokens again (`prefill_ids`) and goes on decoding; nothing is lost."""
        self.num_preemptions += 1
        self.num_computed_tokens = 0
        self._resume_at = self.length - 1 if self.output_ids else 0

    @property
    def token_ids(self) -> list[int]:
        """Committed tokens: prompt + generated (a new list)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def length(self) -> int:
        """Committed tokens: prompt + generated."""
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, token_ids: Seq[int]) -> list[int]:
        """Commit generated tokens in order until EOS or the token limit; return those taken.

        Example: max_tokens 3, one token generated, append([5, 6, 7]) takes [5, 6] and
        finishes with "length"; with EOS 6 it takes [5, 6] and finishes with "stop", 6.
        """
        taken: list[int] = []
        for token in token_ids:
            if self.finished:
                break
            self.output_ids.append(token)
            taken.append(token)
            if self.t_first is None:
                self.t_first = time.perf_counter()
            if token in self.eos_ids:
                self.finish("stop", token)
            elif len(self.output_ids) >= self.max_new:
                self.finish("length", None)
        return taken

    def stop_at(self, num_generated: int, stop: str) -> None:
        """A stop string ended at generated token `num_generated - 1`: drop the later tokens
        and finish with "stop" (whatever finished the request at a later token before)."""
        del self.output_ids[num_generated:]
        if self.logprobs is not None:
            del self.logprobs[num_generated:]
        self.finish("stop", stop)

    def finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.t_end = time.perf_counter()


def charge(reqs: Seq[Request], since: float) -> None:
    """Share the CPU seconds spent since `since` (a `cpu_seconds()` reading) evenly among
    `reqs` (their `cpu_s`)."""
    share = (cpu_seconds() - since) / len(reqs)
    for req in reqs:
        req.cpu_s += share
