"""The routes' logic over one engine: validate a body, turn it into engine requests (one per
choice, `n`), run them (`server/streams.py`) and shape OpenAI's responses: choices, `echo`,
`logprobs`, usage, step events, streamed as Server-Sent Events or whole.

Tokenizing runs on worker threads (`/tokenize`, `/detokenize` and every prompt, its chat
template included): a long text takes seconds, and the tokenizer lets the event loop serve
other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request as HTTPRequest

from specdecode.engine.engine import Engine
from specdecode.engine.request import Request as EngineRequest
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import StructuredOutputsParams
from specdecode.server.errors import APIError, bad_request
from specdecode.server.logprobs import chat_logprobs, completion_logprobs
from specdecode.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    envelope,
    usage,
)
from specdecode.server.streams import Runs
from specdecode.tool_calls.request import ToolRequest
from specdecode.types import RequestOutput

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sse(payload: dict[str, Any] | str) -> str:
    """One Server-Sent Event line."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


class Handlers:
    """What the routes do, over `llm`'s engine, serving it as `served_model_name`."""

    def __init__(
        self,
        llm: LLM,
        engine: Engine,
        served_model_name: str,
        runs: Runs,
        tool_call_parser: str | None = None,
    ) -> None:
        self.llm, self.engine, self.name, self.runs = llm, engine, served_model_name, runs
        self.tool_call_parser = tool_call_parser
        self.context = llm.model.config.max_position_embeddings
        self.created = int(time.time())

    # -- validation -------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.name!r}",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        ids = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_token_ids(ids, "token ids", param)
        if not ids:
            raise bad_request("the prompt is empty", param)
        try:
            self.engine.check_context(len(ids))
        except UserError as error:
            raise bad_request(str(error), param) from error
        return ids

    def tools(self, body: ChatCompletionRequest) -> ToolRequest | None:
        """The body's tools, checked against the model (400 naming the field)."""
        try:
            return self.llm.tool_request(
                body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_call_parser
            )
        except UserError as error:
            field = "tool_choice" if "tool_choice" in str(error) else "tools"
            raise bad_request(str(error), field) from error

    def chat_ids(self, body: ChatCompletionRequest, tools: ToolRequest | None) -> list[int]:
        """The conversation's prompt ids, its chat template applied (with the tools offered)
        and checked."""
        try:
            ids = self.llm.chat_prompt(body.conversation(), tools)["prompt_token_ids"]
        except UserError as error:
            raise bad_request(str(error), "messages") from error
        return self.prompt_ids(ids, "messages")

    def _check_token_ids(self, ids: list[int], what: str, param: str) -> None:
        """400 (naming `param`) for token ids outside the vocabulary."""
        try:
            self.llm.check_token_ids(ids, what)
        except UserError as error:
            raise bad_request(str(error), param) from error

    def max_tokens(self, asked: int | None, num_prompt: int, default: int | None) -> int:
        """The completion's token limit: asked, else `default`, else what fits (the context
        and, alone, the KV cache); 400 when the asked number does not fit the context."""
        if asked is None:
            fits = self.engine.room(num_prompt)
            return max(1, fits if default is None else min(default, self.context - num_prompt))
        try:
            self.engine.check_context(num_prompt, asked)
        except UserError as error:
            raise bad_request(str(error), "max_tokens") from error
        return asked

    async def requests(
        self,
        ids: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        rule: StructuredOutputsParams | None = None,
    ) -> list[EngineRequest]:
        """The engine's requests for a body, one per choice, checked (`Engine.check`: one
        that cannot fit, a bad drafter name or constraint is a 400 before any stream starts);
        `rule`: the tool choice's constraint. A constraint compiles on a worker thread: a
        schema can take seconds."""
        kind = "cmpl" if isinstance(body, CompletionRequest) else "chatcmpl"
        request_id = f"{kind}-{uuid.uuid4().hex}"
        requests = []
        try:
            for choice in range(body.n):
                params = body.sampling_params(max_tokens, choice, rule)
                name = request_id if body.n == 1 else f"{request_id}-{choice}"
                request = self.llm.make_request({"prompt_token_ids": ids}, params, name)
                await asyncio.to_thread(self.engine.check, request)
                requests.append(request)
        except UserError as error:
            raise bad_request(str(error)) from error
        return requests

    # -- routes -----------------------------------------------------------------------------

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            conversation = [m.as_template() for m in body.messages]
            ids = self.llm.chat_prompt(conversation)["prompt_token_ids"]
        else:
            ids = self.llm.tokenizer.encode(body.prompt or "", body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.context, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self._check_token_ids(body.tokens, "tokens", "tokens")
        return {"prompt": self.llm.tokenizer.decode(body.tokens)}

    async def completions(self, body: CompletionRequest, http: HTTPRequest) -> Response:
        self.check_model(body.model)
        prompt = body.prompt_one()
        ids = await asyncio.to_thread(self.prompt_ids, prompt, "prompt")
        limit = self.max_tokens(body.max_tokens, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS)
        requests = await self.requests(ids, body, limit)
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else self.llm.tokenizer.decode(ids)
        shape = _CompletionShape(self._decode_one, echo)
        return await self._respond(requests, body, http, shape)

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        self.check_model(body.model)
        tools = self.tools(body)
        ids = await asyncio.to_thread(self.chat_ids, body, tools)
        asked = body.max_completion_tokens or body.max_tokens
        limit = self.max_tokens(asked, len(ids), None)
        rule = None if tools is None else tools.constraint()
        requests = await self.requests(ids, body, limit, rule)
        return await self._respond(requests, body, http, _ChatShape(self._decode_one, tools))

    # -- responses --------------------------------------------------------------------------

    def _decode_one(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id], skip_special_tokens=False)

    def steps(self, request: EngineRequest, out: RequestOutput, sent: int = 0) -> dict[str, Any]:
        """`{"step_events": [...]}`: the output's step events from index `sent` on, each with
        `drafted_pieces` (every drafted token's text alone); {} when the request did not ask
        for them."""
        if not request.params.step_events:
            return {}
        events = out.outputs[0].steps[sent:]
        decode = self.llm.tokenizer.decode
        return {
            "step_events": [
                {**e.as_dict(), "drafted_pieces": [decode([t]) for t in e.drafted]} for e in events
            ]
        }

    async def _respond(
        self,
        requests: list[EngineRequest],
        body: CompletionRequest | ChatCompletionRequest,
        http: HTTPRequest,
        shape: _Shape,
    ) -> Response:
        """The whole response, or its stream when the body asks."""
        if body.stream:
            head = envelope(shape.chunk_object, requests[0].request_id, body.model)
            chunks = self._chunks(requests, head, body.include_usage, shape)
            return StreamingResponse(_guard(chunks), media_type="text/event-stream")
        outs = await self.runs.collect(requests, http)
        choices = [shape.choice(i, out) for i, out in enumerate(outs)]
        head = envelope(shape.object, requests[0].request_id, body.model)
        steps = self.steps(requests[0], outs[0])
        return JSONResponse({**head, "choices": choices, "usage": usage(outs), **steps})

    async def _chunks(
        self,
        requests: list[EngineRequest],
        head: dict[str, Any],
        include_usage: bool,
        shape: _Shape,
    ) -> AsyncIterator[str]:
        """SSE chunks: one chunk per event of any choice, a choice's first one preceded by
        its opening chunk (if the shape has one: sent with the first token, as vLLM and OpenAI
        do, so a client's time to first token counts the prefill); then, with
        `include_usage`, a chunk with the usage and no choices; then [DONE]."""
        extra = {"usage": None} if include_usage else {}
        outs: list[RequestOutput | None] = [None] * len(requests)
        steps_sent = [0] * len(requests)
        async for event in self.runs.stream(requests):
            if outs[event.index] is None:
                opening = shape.opening(event.index)
                if opening is not None:
                    yield sse({**head, "choices": [opening], **extra})
            outs[event.index] = event.output
            choice = shape.delta(event.index, event.text, event.output)
            steps = self.steps(requests[event.index], event.output, steps_sent[event.index])
            steps_sent[event.index] = len(event.output.outputs[0].steps)
            yield sse({**head, "choices": [choice], **extra, **steps})
        if include_usage and all(out is not None for out in outs):
            yield sse({**head, "choices": [], "usage": usage(outs)})  # type: ignore[arg-type]
        yield sse("[DONE]")


class _Shape(ABC):
    """How one route shapes its choices, whole and as stream deltas (which remember, per
    choice, what they have sent)."""

    object = ""
    chunk_object = ""

    def __init__(self, decode: Callable[[int], str]) -> None:
        self.decode = decode
        self.sent: dict[int, int] = {}  # choice -> log-probabilities sent
        self.chars: dict[int, int] = {}  # choice -> characters of text sent

    @abstractmethod
    def choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """Choice `index` of a whole response, from its final output."""

    @abstractmethod
    def opening(self, index: int) -> dict[str, Any] | None:
        """The chunk choice `index` opens its stream with (None: none)."""

    @abstractmethod
    def delta(self, index: int, text: str, out: RequestOutput) -> dict[str, Any]:
        """The chunk of choice `index`'s new `text` (its output so far: `out`)."""

    def new_logprobs(self, index: int, out: RequestOutput) -> Sequence | None:
        """The choice's log-probabilities not sent yet (None when it asked for none)."""
        entries = out.outputs[0].logprobs
        if entries is None:
            return None
        start = self.sent.get(index, 0)
        self.sent[index] = len(entries)
        return entries[start:]


class _CompletionShape(_Shape):
    """/v1/completions: `text` choices, the prompt first with `echo`."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, decode: Callable[[int], str], echo: str) -> None:
        super().__init__(decode)
        self.echo = echo

    def choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        entries = out.outputs[0].logprobs
        logprobs = None
        if entries is not None:
            logprobs = completion_logprobs(entries, self.decode, len(self.echo))
        return {
            "index": index,
            "text": self.echo + out.text,
            "finish_reason": out.outputs[0].finish_reason,
            "logprobs": logprobs,
        }

    def opening(self, index: int) -> dict[str, Any] | None:
        if not self.echo:
            return None
        self.chars[index] = len(self.echo)
        return {"index": index, "text": self.echo, "finish_reason": None, "logprobs": None}

    def delta(self, index: int, text: str, out: RequestOutput) -> dict[str, Any]:
        entries = self.new_logprobs(index, out)
        offset = self.chars.get(index, 0)
        self.chars[index] = offset + len(text)
        logprobs = None if entries is None else completion_logprobs(entries, self.decode, offset)
        reason = out.outputs[0].finish_reason
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}


class _ChatShape(_Shape):
    """/v1/chat/completions: `message` choices, streamed as `delta`s after one announcing
    the assistant's role. With tools, the calls an output holds are read out of its text
    (`tools.read`) into `tool_calls` (finish_reason "tool_calls"); a stream holds back what
    may still become a call and sends each call whole once read."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, decode: Callable[[int], str], tools: ToolRequest | None = None) -> None:
        super().__init__(decode)
        self.tools = tools
        self.calls_sent: dict[int, int] = {}  # choice -> tool calls sent

    def choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        entries = out.outputs[0].logprobs
        reason = out.outputs[0].finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        if self.tools is not None:
            parsed = self.tools.read(out.text)
            if parsed.calls:
                message["content"] = parsed.content if parsed.content.strip() else None
                message["tool_calls"] = [c.as_openai(_call_id()) for c in parsed.calls]
                reason = _calls_reason(reason)
        return {
            "index": index,
            "message": message,
            "finish_reason": reason,
            "logprobs": None if entries is None else chat_logprobs(entries, self.decode),
        }

    def opening(self, index: int) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "finish_reason": None}

    def delta(self, index: int, text: str, out: RequestOutput) -> dict[str, Any]:
        entries = self.new_logprobs(index, out)
        logprobs = None if entries is None else chat_logprobs(entries, self.decode)
        reason = out.outputs[0].finish_reason
        delta: dict[str, Any] = {"content": text} if text else {}
        if self.tools is not None:
            delta, reason = self._tool_delta(index, out, reason)
        return {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}

    def _tool_delta(
        self, index: int, out: RequestOutput, reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The delta of choice `index`'s content and calls not sent yet, read from its whole
        text so far (trailing blanks held until more text follows), and its finish reason."""
        assert self.tools is not None
        parsed = self.tools.read(out.text, final=reason is not None)
        content = parsed.content if reason is not None else parsed.content.rstrip()
        sent, calls_sent = self.chars.get(index, 0), self.calls_sent.get(index, 0)
        delta: dict[str, Any] = {}
        if len(content) > sent and (content.strip() or not parsed.calls):
            delta["content"] = content[sent:]
            self.chars[index] = len(content)
        new = parsed.calls[calls_sent:]
        if new:
            delta["tool_calls"] = [
                {"index": calls_sent + i, **call.as_openai(_call_id())}
                for i, call in enumerate(new)
            ]
            self.calls_sent[index] = len(parsed.calls)
        if parsed.calls and reason is not None:
            reason = _calls_reason(reason)
        return delta, reason


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls_reason(reason: str | None) -> str | None:
    """An answer that calls tools ends with "tool_calls" (OpenAI's), unless cut by length."""
    return "tool_calls" if reason == "stop" else reason


async def _guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose request fails midway ends with an error event (the status line has been
    sent) instead of a broken connection."""
    try:
        async for chunk in chunks:
            yield chunk
    except UserError as error:
        yield sse(bad_request(str(error)).body())
        yield sse("[DONE]")
    except Exception as error:  # the engine failed this step: report it, keep serving
        body = APIError(500, f"{type(error).__name__}: {error}", "internal_server_error")
        yield sse(body.body())
        yield sse("[DONE]")
