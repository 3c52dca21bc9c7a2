"""The OpenAI-compatible HTTP app: the engine's thread, the key and body guard, the routes
(`server/routes.py`), the refusals (`server/refusals.py`), metrics.

The app never runs the model on its event loop: requests go to an `AsyncEngine` (the engine in
its own thread, continuous batching), and tokenizing runs on worker threads. `Guard`
(`server/guard.py`) checks the key and the body's size before any route. Every refusal is an
OpenAI-shaped error (400 bad JSON, field or Unicode, prompt or max_tokens that do not fit the
context or the KV cache, 401 wrong API key, 404 unknown model or route, 413 body too large); a
client that disconnects aborts its request, which frees its slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from specdecode import energy
from specdecode.engine.async_engine import AsyncEngine
from specdecode.llm import LLM
from specdecode.server.guard import Guard, GuardConfig
from specdecode.server.handlers import Handlers
from specdecode.server.limits import MAX_BODY_BYTES, PUBLIC_PATHS
from specdecode.server.metrics import ServerMetrics
from specdecode.server.refusals import add_error_handlers
from specdecode.server.routes import add_routes
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
    tool_call_parser: the format tool calls are read in (`tool_calls.parsers.PARSERS`; None:
        the one the model's chat template shows).
    """

    served_model_name: str
    api_key: str | None = None
    replica_id: str | None = None
    public_paths: tuple[str, ...] = PUBLIC_PATHS
    max_body_bytes: int = MAX_BODY_BYTES
    tool_call_parser: str | None = None

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
    api = Handlers(llm, engine, config.served_model_name, runs, config.tool_call_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state["runner"] = AsyncEngine(engine, metrics.observe, metrics.gauges)
        yield
        state.pop("runner").shutdown()

    app = FastAPI(title="specdecode", lifespan=lifespan)
    add_error_handlers(app)
    app.add_middleware(Guard, config=config.guard())
    add_routes(app, api, metrics, lambda: state.get("runner"), config.served_model_name)
    add_viz_routes(app, llm, config.served_model_name)
    return app
