"""The output processor: turns each request's new tokens into text for the API, the CLI and the
server alike (incremental detokenization, stop strings, `RequestOutput` snapshots).

Stop strings are matched on text, so a stop string may end inside a multi-token step: the
processor then cuts the request's tokens after it (`Request.stop_at`). Text that may still
turn out to begin a stop string is held back until it cannot.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from specdecode.engine.detokenizer import IncrementalDetokenizer
from specdecode.engine.request import Request
from specdecode.model.tokenizer import Tokenizer
from specdecode.types import CompletionOutput, RequestMetrics, RequestOutput


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


class _Text:
    """One request's text: released so far, held back, and its detokenizer."""

    __slots__ = ("detok", "pending", "text")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.pending = ""  # decoded text held back because it may begin a stop string
        self.text = ""  # text released to the user so far


class OutputProcessor:
    """Text and outputs of the requests in flight (`add` one, `process` its new tokens,
    `output` a snapshot, `release` it when done)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[str, _Text] = {}

    def add(self, request: Request) -> None:
        self._texts[request.request_id] = _Text(self.tokenizer)

    def release(self, request_id: str) -> None:
        """Forget a request's text (unknown ids are ignored)."""
        self._texts.pop(request_id, None)

    def process(
        self, request: Request, new_tokens: Seq[int], pieces: list[str] | None = None
    ) -> str:
        """Detokenize tokens just appended to `request`; return the newly released text; with
        `pieces`, append to it each token's own text (see `StepEvent.pieces`).

        A stop string completed by token i finishes the request there (later tokens are
        dropped); an EOS token that finished the request is not detokenized; at the end, text
        held back is released, unless a stop string matched.
        """
        state = self._texts[request.request_id]
        stops = request.params.stop
        released = ""
        kept = len(request.output_ids) - len(new_tokens)
        for token in new_tokens:
            kept += 1
            if request.stop_reason == token and kept == len(request.output_ids):
                if pieces is not None:
                    pieces.append("")
                break  # the EOS token that ended the request
            piece = state.detok.push([token])
            if pieces is not None:
                pieces.append(piece)
            buf = state.pending + piece
            hits = [(buf.find(s), s) for s in stops if s in buf]
            if hits:
                index, stop = min(hits)
                state.pending = ""
                released += buf[:index]
                state.text += released
                request.stop_at(kept, stop)
                return released
            keep = held_back(buf, stops)
            state.pending = buf[len(buf) - keep :]
            released += buf[: len(buf) - keep]
        if request.finished:
            rest = state.detok.flush()
            if pieces:
                pieces[-1] += rest
            released += state.pending + rest
            state.pending = ""
        state.text += released
        return released

    def output(self, request: Request) -> RequestOutput:
        """A snapshot of `request` (cumulative text and tokens)."""
        end = request.t_end if request.t_end is not None else time.perf_counter()
        first = request.t_first if request.t_first is not None else end
        metrics = RequestMetrics(
            num_prompt_tokens=len(request.prompt_ids),
            num_generated_tokens=len(request.output_ids),
            elapsed_s=end - request.t_start,
            time_to_first_token_s=first - request.t_start,
            spec=request.spec.copy(),
            cpu_s=request.cpu_s,
            num_cached_tokens=request.num_cached_tokens,
        )
        completion = CompletionOutput(
            index=0,
            text=self._texts[request.request_id].text,
            token_ids=tuple(request.output_ids),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            steps=tuple(request.steps),
            logprobs=None if request.logprobs is None else tuple(request.logprobs),
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=tuple(request.prompt_ids),
            outputs=(completion,),
            finished=request.finished,
            metrics=metrics,
        )
