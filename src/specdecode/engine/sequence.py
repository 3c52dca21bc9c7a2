"""Per-request state: prompt, generated tokens, text emitted so far, stop handling and timings.

The committed length (prompt + generated tokens) is the one truth about a sequence's position.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from specdecode.engine.detokenizer import IncrementalDetokenizer
from specdecode.metrics import SpecCounters
from specdecode.model.tokenizer import Tokenizer
from specdecode.types import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams


def held_back(text: str, stops: Seq[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    Example: text "abc<|e", stops ["<|end|>"] -> 3 ("<|e" may still become the stop string).
    """
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class Sequence:
    """One request being generated."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        max_context: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if len(prompt_ids) >= max_context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{max_context} tokens (prompt + generated tokens must fit); shorten the prompt"
            )
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_new = min(params.max_tokens, max_context - len(prompt_ids))
        self.eos_ids = frozenset(() if params.ignore_eos else tokenizer.eos_token_ids)
        self.generator = (
            None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
        )
        self.output_ids: list[int] = []
        self.spec = SpecCounters()  # draft / accept counters of this request
        self.text = ""  # text released to the user so far
        self._pending = ""  # decoded text held back because it may begin a stop string
        self._detok = IncrementalDetokenizer(tokenizer)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """Committed tokens: prompt + generated (a new list)."""
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        """Committed tokens: prompt + generated."""
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, token_ids: Seq[int]) -> str:
        """Commit generated tokens in order, stopping at EOS, a stop string or the token limit.

        Returns the newly released text (may be empty).
        """
        released = ""
        for token in token_ids:
            if self.finished:
                break
            self.output_ids.append(token)
            if self.t_first is None:
                self.t_first = time.perf_counter()
            if token in self.eos_ids:
                self._finish("stop", token)
            else:
                released += self._release(self._detok.push([token]))
                if not self.finished and len(self.output_ids) >= self.max_new:
                    self._finish("length", None)
        if self.finished:
            released += self._drain()
        return released

    def _release(self, new_text: str) -> str:
        """Pass text on, holding back what may begin a stop string; finish on a full match."""
        buf = self._pending + new_text
        stops = self.params.stop
        hits = [(buf.find(s), s) for s in stops if s in buf]
        if hits:
            index, stop = min(hits)
            self._pending = ""
            self._finish("stop", stop)
            self.text += buf[:index]
            return buf[:index]
        keep = held_back(buf, stops)
        out = buf[: len(buf) - keep]
        self._pending = buf[len(buf) - keep :]
        self.text += out
        return out

    def _drain(self) -> str:
        """At the end, release what was held back (nothing after a stop string matched)."""
        if isinstance(self.stop_reason, str):
            return ""
        out = self._pending + self._detok.flush()
        self._pending = ""
        self.text += out
        return out

    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.t_end = time.perf_counter()

    def output(self) -> RequestOutput:
        """A snapshot of this request (cumulative text and tokens)."""
        end = self.t_end if self.t_end is not None else time.perf_counter()
        first = self.t_first if self.t_first is not None else end
        metrics = RequestMetrics(
            num_prompt_tokens=len(self.prompt_ids),
            num_generated_tokens=len(self.output_ids),
            elapsed_s=end - self.t_start,
            time_to_first_token_s=first - self.t_start,
            spec=self.spec.copy(),
        )
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=tuple(self.output_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=tuple(self.prompt_ids),
            outputs=(completion,),
            finished=self.finished,
            metrics=metrics,
        )
