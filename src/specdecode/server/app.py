"""The OpenAI-compatible HTTP app: routes, validation, streaming, errors, metrics.

The app never runs the model on its event loop: requests go to an `AsyncEngine` (the engine in
its own thread, continuous batching), and tokenizing runs on worker threads. `Guard`
(`server/guard.py`) checks the key and the body's size before any route. Every refusal is an
OpenAI-shaped error (400 bad JSON, field or Unicode, prompt or max_tokens that do not fit the
context or the KV cache, 401 wrong API key, 404 unknown model or route, 413 body too large); a
client that disconnects aborts its request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode import energy
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS
from specdecode.engine.async_engine import AsyncEngine
from specdecode.engine.costs import seed_rows
from specdecode.engine.engine import Engine
from specdecode.engine.request import Request as EngineRequest
from specdecode.errors import UserError, context_overflow
from specdecode.llm import LLM
from specdecode.server.errors import APIError, bad_request
from specdecode.server.guard import MAX_BODY_BYTES, PUBLIC_PATHS, Guard, GuardConfig
from specdecode.server.metrics import ServerMetrics
from specdecode.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    envelope,
    usage,
)
from specdecode.server.viz import add_viz_routes
from specdecode.types import RequestOutput

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is there


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What `specdecode serve` adds to the model and its speculative config.

    served_model_name: the name clients pass as `model` (and /v1/models lists).
    api_key: when set, every route but `public_paths` needs `Authorization: Bearer <api_key>`
        (or HTTP Basic with it as the password).
    replica_id: when set (one replica of several, `server/ray_serve.py`), every response
        carries it in the `x-specdecode-replica` header.
    public_paths: the paths open without the key (default /health and /metrics).
    max_body_bytes: the largest request body the server reads; a longer one is a 413.
    """

    served_model_name: str
    api_key: str | None = None
    replica_id: str | None = None
    public_paths: tuple[str, ...] = PUBLIC_PATHS
    max_body_bytes: int = MAX_BODY_BYTES

    def guard(self) -> GuardConfig:
        """The middleware's part of this config."""
        return GuardConfig(self.api_key, self.public_paths, self.max_body_bytes, self.replica_id)


def build_app(llm: LLM, config: ServeConfig) -> FastAPI:
    """The app serving `llm` as `config` says: it runs `llm.engine` (its target, drafter and
    scheduler limits, `LLM(scheduler=...)`) on its own thread, so do not generate with `llm`
    while the app serves."""
    energy.watts_per_core()  # a bad SPECDECODE_WATTS_PER_CORE stops the start, not a request
    engine = llm.engine
    seed_pass_costs(engine, engine.scheduler.config.max_num_seqs)
    metrics = ServerMetrics(config.served_model_name)
    state: dict[str, AsyncEngine] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state["runner"] = AsyncEngine(engine, metrics.observe, metrics.gauges)
        yield
        state.pop("runner").shutdown()

    app = FastAPI(title="specdecode", lifespan=lifespan)
    api = _Api(llm, engine, config, metrics, state)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(UserError)
    async def refused(_: Request, error: UserError) -> JSONResponse:
        return bad_request(str(error)).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return _http_error(error).response()

    @app.exception_handler(Exception)
    async def internal(_: Request, error: Exception) -> JSONResponse:
        message = f"internal error: {type(error).__name__}: {error}"
        return APIError(500, message, "internal_server_error", None, "internal_error").response()

    app.add_middleware(Guard, config=config.guard())

    @app.get("/health")
    async def health() -> Response:
        runner = state.get("runner")
        return Response(status_code=200 if runner is not None and runner.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.served_model_name,
                    "object": "model",
                    "created": api.created,
                    "owned_by": "specdecode",
                    "max_model_len": api.context,
                }
            ],
        }

    add_viz_routes(app, llm, engine, config.served_model_name)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await asyncio.to_thread(api.tokenize, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await asyncio.to_thread(api.detokenize, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(body, request)

    return app


def seed_pass_costs(engine: Engine, max_num_seqs: int) -> dict[tuple[int, int], float]:
    """With the "cost" draft-length policy, measure verification passes of 1 .. max_num_seqs
    rows (powers of two and the most; `seed_rows`) before serving, so the rule picks K for
    every batch size from measured costs (`DraftLength`); returns the seeded table, (rows,
    tokens per row) -> seconds (empty otherwise)."""
    policy = engine.draft_length
    if policy.policy != "cost":
        return {}
    seed_rows(engine.model, policy.passes, policy.max_tokens, policy.passes.unseeded(max_num_seqs))
    return dict(policy.passes.seeded)


def _validation_error(error: RequestValidationError) -> APIError:
    """400 for a body that is not JSON, or has a bad or missing field (naming the first)."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        return APIError(400, f"the body is not valid JSON: {reason}", code="bad_json")
    if isinstance(error.body, bytes):  # sent without a JSON content type: FastAPI kept bytes
        try:
            json.loads(error.body)
        except (ValueError, RecursionError) as bad:
            return APIError(400, f"the body is not valid JSON: {bad}", code="bad_json")
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return bad_request(message, param)


def _http_error(error: StarletteHTTPException) -> APIError:
    """Starlette's and FastAPI's own refusals (an unknown route, a wrong method, a body that
    cannot be parsed: invalid UTF-8, nesting too deep) in the OpenAI shape."""
    kinds = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "bad_method")}
    kind, code = kinds.get(error.status_code, ("invalid_request_error", "invalid_value"))
    message = str(error.detail)
    if error.status_code == 400 and "parsing the body" in message:
        message = "the body cannot be parsed: it must be UTF-8 JSON, not nested too deeply"
        code = "bad_json"
    return APIError(error.status_code, message, kind, None, code)


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


class _Api:
    """The handlers' logic, over one engine."""

    def __init__(
        self,
        llm: LLM,
        engine: Engine,
        config: ServeConfig,
        metrics: ServerMetrics,
        state: dict[str, AsyncEngine],
    ) -> None:
        self.llm, self.engine, self.config, self.metrics = llm, engine, config, metrics
        self.state = state
        self.context = llm.model.config.max_position_embeddings
        self.created = int(time.time())

    # -- validation -------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{self.config.served_model_name!r}",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        ids = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_token_ids(ids, "token ids", param)
        if not ids:
            raise bad_request("the prompt is empty", param)
        if len(ids) >= self.context:
            raise bad_request(
                f"the prompt has {len(ids)} tokens but this model's context is {self.context} "
                "tokens (prompt + completion must fit); shorten the prompt",
                param,
            )
        return ids

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation's prompt ids, its chat template applied and checked."""
        try:
            ids = self.llm.chat_prompt(body.conversation())["prompt_token_ids"]
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
        room = self.context - num_prompt
        if asked is None:
            kv = self.engine.scheduler.config.kv_cache_tokens
            fits = room if kv is None else min(room, kv - num_prompt - MAX_SPECULATIVE_TOKENS)
            return max(1, fits if default is None else min(default, room))
        if asked > room:
            raise bad_request(str(context_overflow(self.context, num_prompt, asked)), "max_tokens")
        return asked

    async def request(self, ids: list[int], body: Any, max_tokens: int, kind: str) -> EngineRequest:
        """The engine's request for a body, prepared (`Engine.prepare`: a bad drafter name or
        constraint is a 400 before any stream starts). A constraint compiles on a worker
        thread: a schema can take seconds, and the event loop serves other streams meanwhile."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        try:
            params = body.sampling_params(max_tokens)
            request = self.llm.make_request({"prompt_token_ids": ids}, params, request_id)
            self.engine.scheduler.check_fits(request)
            await asyncio.to_thread(self.engine.prepare, request)
        except UserError as error:
            raise bad_request(str(error)) from error
        return request

    # -- routes (tokenize, detokenize and the prompts run on worker threads: a long text takes
    # seconds, and the tokenizer lets the event loop serve other requests meanwhile) ---------

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = self.llm.chat_prompt(conversation)["prompt_token_ids"]
        else:
            ids = self.llm.tokenizer.encode(body.prompt or "", body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.context, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self._check_token_ids(body.tokens, "tokens", "tokens")
        return {"prompt": self.llm.tokenizer.decode(body.tokens)}

    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        self.check_model(body.model)
        ids = await asyncio.to_thread(self.prompt_ids, body.prompt_one(), "prompt")
        limit = self.max_tokens(body.max_tokens, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS)
        request = await self.request(ids, body, limit, "cmpl")
        head = envelope("text_completion", request.request_id, body.model)
        if body.stream:
            chunks = self._chunks(request, head, body.include_usage, chat=False)
            return StreamingResponse(self._guard(chunks), media_type="text/event-stream")
        out = await self._collect(request, http)
        choice = {
            "index": 0,
            "text": out.text,
            "finish_reason": out.outputs[0].finish_reason,
            "logprobs": None,
        }
        return JSONResponse(
            {**head, "choices": [choice], "usage": usage(out), **self.steps(request, out)}
        )

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        self.check_model(body.model)
        ids = await asyncio.to_thread(self.chat_ids, body)
        asked = body.max_completion_tokens or body.max_tokens
        limit = self.max_tokens(asked, len(ids), None)
        request = await self.request(ids, body, limit, "chatcmpl")
        if body.stream:
            head = envelope("chat.completion.chunk", request.request_id, body.model)
            chunks = self._chunks(request, head, body.include_usage, chat=True)
            return StreamingResponse(self._guard(chunks), media_type="text/event-stream")
        out = await self._collect(request, http)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "finish_reason": out.outputs[0].finish_reason,
            "logprobs": None,
        }
        head = envelope("chat.completion", request.request_id, body.model)
        return JSONResponse(
            {**head, "choices": [choice], "usage": usage(out), **self.steps(request, out)}
        )

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

    # -- running ----------------------------------------------------------------------------

    async def _collect(self, request: EngineRequest, http: Request) -> RequestOutput:
        """Run a request to its end; abort it if the client disconnects first."""

        async def run() -> RequestOutput:
            final = None
            async for event in self.state["runner"].generate(request):
                final = event.output
            assert final is not None  # generate ends with a finished event
            return final

        task = asyncio.ensure_future(run())
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await http.is_disconnected():
                task.cancel()  # generate's cleanup aborts the request
                self.metrics.aborted()
                raise APIError(499, "client disconnected", code="client_closed_request")
        out = task.result()
        self.metrics.completed(out)
        return out

    async def _events(self, request: EngineRequest) -> AsyncIterator[tuple[str, RequestOutput]]:
        """(new text, output) as they land; counts the request as completed or aborted."""
        finished = False
        try:
            async for event in self.state["runner"].generate(request):
                finished = event.output.finished
                if finished:
                    self.metrics.completed(event.output)
                yield event.text, event.output
        finally:
            if not finished:
                self.metrics.aborted()

    async def _chunks(
        self, request: EngineRequest, head: dict[str, Any], include_usage: bool, chat: bool
    ) -> AsyncIterator[str]:
        """SSE chunks of a completion (`text` choices) or, with `chat`, a chat completion
        (`delta` choices, the first announcing the assistant's role); then, with
        `include_usage`, a chunk with the usage and no choices; then [DONE]."""
        extra = {"usage": None} if include_usage else {}
        if chat:
            delta = {"role": "assistant", "content": ""}
            first = {"index": 0, "delta": delta, "finish_reason": None}
            yield _sse({**head, "choices": [first], **extra})
        out, sent = None, 0
        async for text, out in self._events(request):
            body = {"delta": {"content": text} if text else {}} if chat else {"text": text}
            reason = out.outputs[0].finish_reason
            choice = {"index": 0, **body, "finish_reason": reason, "logprobs": None}
            steps = self.steps(request, out, sent)
            sent = len(out.outputs[0].steps)
            yield _sse({**head, "choices": [choice], **extra, **steps})
        if include_usage and out is not None:
            yield _sse({**head, "choices": [], "usage": usage(out)})
        yield _sse("[DONE]")

    @staticmethod
    async def _guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream whose request fails midway ends with an error event (the status line has
        been sent) instead of a broken connection."""
        try:
            async for chunk in chunks:
                yield chunk
        except UserError as error:
            yield _sse(bad_request(str(error)).body())
            yield _sse("[DONE]")
        except Exception as error:  # the engine failed this step: report it, keep serving
            body = APIError(500, f"{type(error).__name__}: {error}", "internal_server_error")
            yield _sse(body.body())
            yield _sse("[DONE]")
