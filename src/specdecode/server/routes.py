"""The server's routes: /health, /metrics, the OpenAI API's /v1/models, /v1/completions and
/v1/chat/completions, and /tokenize, /detokenize (vLLM's), over `Handlers`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from specdecode.engine.async_engine import AsyncEngine
from specdecode.server.handlers import Handlers
from specdecode.server.metrics import ServerMetrics
from specdecode.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


def add_routes(
    app: FastAPI,
    api: Handlers,
    metrics: ServerMetrics,
    runner: Callable[[], AsyncEngine | None],
    served_model_name: str,
) -> None:
    """The routes on `app`: `api` answers the bodies, `metrics` the scrape, `runner()` (None
    before the app started or after it stopped) tells /health whether the engine runs."""

    @app.get("/health")
    async def health() -> Response:
        running = runner()
        return Response(status_code=200 if running is not None and running.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": api.created,
                    "owned_by": "specdecode",
                    "max_model_len": api.context,
                }
            ],
        }

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
