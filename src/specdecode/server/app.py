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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode import energy
from specdecode.engine.async_engine import AsyncEngine
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.server.errors import APIError, bad_request
from specdecode.server.guard import Guard, GuardConfig
from specdecode.server.handlers import Handlers
from specdecode.server.limits import MAX_BODY_BYTES, PUBLIC_PATHS
from specdecode.server.metrics import ServerMetrics
from specdecode.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from specdecode.server.streams import Runs
from specdecode.server.viz import add_viz_routes


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
    engine.warm_up(llm.scheduler.max_num_seqs)
    metrics = ServerMetrics(config.served_model_name)
    state: dict[str, AsyncEngine] = {}
    runs = Runs(lambda: state["runner"], metrics)
    api = Handlers(llm, engine, config.served_model_name, runs)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state["runner"] = AsyncEngine(engine, metrics.observe, metrics.gauges)
        yield
        state.pop("runner").shutdown()

    app = FastAPI(title="specdecode", lifespan=lifespan)

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

    add_viz_routes(app, llm, config.served_model_name)

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
