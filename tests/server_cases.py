"""A real `specdecode serve` app on 127.0.0.1 in a background thread, for the server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from specdecode.llm import LLM
from specdecode.server.app import ServeConfig, build_app

START_TIMEOUT_S = 30.0


@contextmanager
def running_server(llm: LLM, config: ServeConfig) -> Iterator[str]:
    """Serve `llm` on a free loopback port; yields the base URL (http://127.0.0.1:PORT)."""
    app = build_app(llm, config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of the Prometheus samples named `name` in `text` whose labels contain `label`
    (e.g. 'finished_reason="abort"'; "" = any)."""
    total = 0.0
    for line in text.splitlines():
        sample, _, labels = line.partition("{")
        if (sample == name and label in labels) or (not labels and line.startswith(name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total
