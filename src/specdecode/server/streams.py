"""Running a response's choices (one engine request each; `n` of them) on the engine thread:
to their ends, aborting them if the client leaves (`Runs.collect`), or as one stream of their
events in arrival order (`Runs.stream`). Every request is counted once in the metrics, as
completed or aborted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request as HTTPRequest

from specdecode.engine.async_engine import AsyncEngine
from specdecode.engine.request import Request
from specdecode.server.errors import APIError
from specdecode.server.metrics import ServerMetrics
from specdecode.types import RequestOutput

DISCONNECT_POLL_S = 0.5  # how often a non-streamed response checks that its client is there


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """New text of choice `index`, and its output so far."""

    index: int
    text: str
    output: RequestOutput


class Runs:
    """Runs requests on the engine thread `runner()` gives (the server's, once started)."""

    def __init__(self, runner: Callable[[], AsyncEngine], metrics: ServerMetrics) -> None:
        self.runner = runner
        self.metrics = metrics

    async def collect(self, requests: Sequence[Request], http: HTTPRequest) -> list[RequestOutput]:
        """Run `requests` to their ends (their outputs, in order); abort them all if the
        client disconnects first (a 499) or one of them fails (its error)."""
        tasks = [asyncio.ensure_future(self._run(r)) for r in requests]
        try:
            while True:
                done, pending = await asyncio.wait(
                    tasks, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION
                )
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                if not pending:
                    return [task.result() for task in tasks]
                if await http.is_disconnected():
                    raise APIError(499, "client disconnected", code="client_closed_request")
        finally:
            for task in tasks:
                task.cancel()  # no-op for the finished; generate's cleanup aborts the rest

    async def stream(self, requests: Sequence[Request]) -> AsyncIterator[ChoiceEvent]:
        """The requests' events as they land, each tagged with its request's index. Leaving
        the iteration early aborts the requests still running."""
        queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

        async def pump(index: int, request: Request) -> None:
            try:
                async for text, out in self._events(request):
                    queue.put_nowait(ChoiceEvent(index, text, out))
            except Exception as error:  # the engine failed it: the stream reports it
                queue.put_nowait(error)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _run(self, request: Request) -> RequestOutput:
        final = None
        async for _, out in self._events(request):
            final = out
        assert final is not None  # generate ends with a finished event
        return final

    async def _events(self, request: Request) -> AsyncIterator[tuple[str, RequestOutput]]:
        """(new text, output) as they land; counts the request as completed or aborted."""
        finished = False
        try:
            async for event in self.runner().generate(request):
                finished = event.output.finished
                if finished:
                    self.metrics.completed(event.output)
                yield event.text, event.output
        finally:
            if not finished:
                self.metrics.aborted()
