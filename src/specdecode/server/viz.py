"""The visualizer's routes: the page and its files (`static/`, served from the package) and
/viz/config, what the page offers (the model, its chat template, the drafters served)."""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from specdecode.llm import LLM

# route -> (file in static/, media type)
FILES = {
    "viz": ("viz.html", "text/html"),
    "viz/viz.js": ("viz.js", "text/javascript"),
    "viz/viz.css": ("viz.css", "text/css"),
}


def add_viz_routes(app: FastAPI, llm: LLM, served_model_name: str) -> None:
    """GET /viz, its script and style, and /viz/config on `app`."""

    @app.get("/viz/config")
    async def viz_config() -> dict[str, Any]:
        return config(llm, served_model_name)

    for route, (name, media_type) in FILES.items():
        app.add_api_route(f"/{route}", _static_route(name, media_type), methods=["GET"])


def config(llm: LLM, served_model_name: str) -> dict[str, Any]:
    """What the visualizer page offers: the model's name, whether it has a chat template, and
    the drafters served (name, K) in order, the default first."""
    drafters = [{"name": n, "num_speculative_tokens": k} for n, k in llm.served_drafters]
    return {
        "model": served_model_name,
        "chat": llm.tokenizer.chat_template is not None,
        "drafters": drafters,
    }


def _static_route(name: str, media_type: str) -> Any:
    """A GET handler answering with the package's `static/<name>`."""

    async def serve_file() -> Response:
        text = resources.files("specdecode.server").joinpath("static", name).read_text("utf-8")
        return Response(text, media_type=f"{media_type}; charset=utf-8")

    return serve_file
