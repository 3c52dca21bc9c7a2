"""`AsyncEngine`: an `Engine` stepping in its own thread, fed and read from asyncio.

The HTTP server's event loop never runs the model: `generate` queues a request for the engine
thread and awaits its events; the thread takes new requests and aborts between steps, steps
while anything waits or runs, and sleeps otherwise. Events cross back with
`loop.call_soon_threadsafe`. A consumer that stops reading (a client that disconnected) aborts
its request, which frees its row at the next step. A step that raises fails the requests in
flight with that error (each consumer gets it) and the thread goes on with new requests.

The model runs only in the engine thread: starting it releases the idle OpenMP workers of the
thread that loaded the model (`engine.openmp`), which would otherwise slow every kernel of the
engine thread by ~15% on a 2-core machine. Run no model work in the starting thread after it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specdecode.engine.engine import Engine, Event
from specdecode.engine.openmp import release_idle_workers
from specdecode.engine.request import Request
from specdecode.engine.stats import EngineStats


@dataclass(frozen=True, slots=True)
class _Failed:
    """The engine could not run a request: `error` is raised in its consumer."""

    error: BaseException


# What the engine thread takes from its inbox: a request to add (with the loop and queue its
# events go to), or the id of a request to abort.
_Add = tuple[Request, asyncio.AbstractEventLoop, asyncio.Queue]


class AsyncEngine:
    """Runs `engine` in a daemon thread; `observe` (optional) sees every step's events in the
    engine thread (metrics), and `on_step` the engine's `stats()` after every step (gauges)."""

    def __init__(
        self,
        engine: Engine,
        observe: Callable[[list[Event]], None] | None = None,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> None:
        self.engine = engine
        self._observe = observe
        self._on_step = on_step
        self._inbox: queue.SimpleQueue[_Add | str | None] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        release_idle_workers()  # the engine thread's team is to be the only one
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (it stops only at `shutdown`)."""
        return self._thread.is_alive()

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        """Run `request` and yield its events until its last (`output.finished`). Leaving the
        iteration early (break, cancel, a disconnect) aborts the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event | _Failed] = asyncio.Queue()
        self._inbox.put((request, loop, events))
        done = False
        try:
            while not done:
                item = await events.get()
                if isinstance(item, _Failed):
                    done = True
                    raise item.error
                done = item.output.finished
                yield item
        finally:
            if not done:
                self._inbox.put(request.request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step (requests in flight get no more
        events)."""
        self._inbox.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        """The engine thread: take commands, step while there is work, sleep otherwise."""
        while True:
            block = not self.engine.has_unfinished()
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                command = ""  # nothing new: step
            while command is not None:
                if command:
                    self._take(command)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    break
            if command is None:
                return
            if self.engine.has_unfinished():
                self._step()

    def _take(self, command: _Add | str) -> None:
        """Add a request (its sink receives the error if the engine refuses it) or abort one."""
        if isinstance(command, str):
            self.engine.abort(command)
            self._sinks.pop(command, None)
            return
        request, loop, events = command
        try:
            self.engine.add(request)
        except Exception as error:  # refused: tell its consumer, keep serving
            _deliver(loop, events, _Failed(error))
            return
        self._sinks[request.request_id] = loop, events

    def _step(self) -> None:
        """One engine step; deliver its events (or its error to every request in flight)."""
        try:
            events = self.engine.step()
        except Exception as error:  # fail what was in flight, keep serving
            self.engine.abort_all()
            for loop, sink in self._sinks.values():
                _deliver(loop, sink, _Failed(error))
            self._sinks.clear()
            return
        if self._observe is not None:
            self._observe(events)
        for event in events:
            request_id = event.request.request_id
            target = self._sinks.get(request_id)
            if target is not None and not _deliver(*target, event):
                self.engine.abort(request_id)  # its consumer's loop is gone
                target = None
            if event.output.finished or target is None:
                self._sinks.pop(request_id, None)
        if self._on_step is not None:
            self._on_step(self.engine.stats())


def _deliver(loop: asyncio.AbstractEventLoop, sink: asyncio.Queue, item: Event | _Failed) -> bool:
    """Hand `item` to a consumer's queue on its loop; False when that loop is closed."""
    try:
        loop.call_soon_threadsafe(sink.put_nowait, item)
    except RuntimeError:  # the loop was closed: nobody reads this request any more
        return False
    return True
