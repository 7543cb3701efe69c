"""The engine thread: steps the batch engine while there is work and hands each event to its request's
asyncio queue.

One thread drives the :class:`~kvslim.engine.Engine` (it is driven from one thread); the HTTP handlers,
on the event loop, call :meth:`Runner.submit` and :meth:`Runner.cancel` (the engine's lock orders them
with steps) and read their request's events from an ``asyncio.Queue`` that this thread feeds through
``loop.call_soon_threadsafe``. The thread sleeps while the engine is idle and wakes on a submit.

This module knows no HTTP and no tokenizer: token ids in, :class:`~kvslim.engine.Event` out. The counters
``/metrics`` shows are kept here (requests by outcome, tokens) next to the engine's memory figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections import Counter
from dataclasses import dataclass

from ..engine import Engine, Event, Request, Result

log = logging.getLogger("kvslim.serve")

#: what a request can end as in the ``kvslim_requests_total{outcome=...}`` counter
OUTCOMES = ("stop", "length", "error", "cancelled", "refused")


@dataclass
class Done:
    """The last item a request's queue receives: its final event and the engine's :class:`Result`."""

    event: Event
    result: Result | None


class Runner:
    """Owns the engine thread. engine: a :class:`~kvslim.engine.Engine`; ``start()`` / ``stop()`` it (the app's
    lifespan does). Idle sessions are parked in the engine's session_dir when it stops."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.outcomes: Counter = Counter({o: 0 for o in OUTCOMES})
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.failure: str | None = None  # set when the engine thread died

    @classmethod
    def from_model(cls, model, **engine_kwargs) -> Runner:
        """A runner over a new ``Engine(model, **engine_kwargs)``."""
        return cls(Engine(model, **engine_kwargs))

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvslim-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread, cancel what is still running and park idle sessions on disk (with a session_dir)."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            for rid in list(self._queues):
                self.engine.cancel(rid)
            if self.failure is None and not self.engine.idle:
                self._dispatch(self.engine.step())  # hands out the cancellations
            else:  # a broken engine is not stepped again: its clients were told when it failed
                for rid in list(self._queues):
                    self._deliver(rid, Done(Event(rid, None, 0, True, "cancelled", None), None))
        finally:
            self.engine.park_sessions()

    # -- requests (called from the event loop) -----------------------------------------------
    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> tuple[str, asyncio.Queue]:
        """Queue ``request`` (its request_id is replaced by a fresh one); returns its id and the queue its
        events arrive on (a :class:`Done` last). ValueError (nothing queued) when the engine refuses it;
        RuntimeError when the engine thread is not running."""
        if not self.alive:
            raise RuntimeError(self.failure or "the engine is not running")
        rid = f"r{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (loop, queue)
        try:
            self.engine.submit(_with_id(request, rid))
        except ValueError:
            self._queues.pop(rid, None)
            self.outcomes["refused"] += 1
            raise
        except Exception:
            self._queues.pop(rid, None)  # never a queue nobody will answer
            raise
        with self._wake:
            self._wake.notify_all()
        return rid, queue

    def cancel(self, request_id: str) -> None:
        """The client went away: end the request now, freeing its cache (its final event still comes)."""
        self.engine.cancel(request_id)
        with self._wake:
            self._wake.notify_all()

    def refused(self) -> None:
        """Count a request the HTTP layer refused before it reached the engine."""
        self.outcomes["refused"] += 1

    # -- figures -----------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Counters and the engine's memory figures (:meth:`kvslim.engine.Engine.memory`)."""
        return {
            "outcomes": dict(self.outcomes),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "cached_tokens": self.cached_tokens,
            "active_streams": len(self._queues),
            "memory": self.engine.memory(),
            "alive": self.alive,
        }

    # -- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and self.engine.idle:
                        self._wake.wait(0.5)
                    if self._stop:
                        return
                self._dispatch(self.engine.step())
        except Exception as e:  # a bug in a step: every waiting client gets an error, not a hung connection
            self.failure = f"the engine failed: {type(e).__name__}: {e}"
            log.exception("engine thread died")
            for rid in list(self._queues):
                self._deliver(rid, Done(Event(rid, None, 0, True, "error", self.failure), None))
            self._stop = True

    def _dispatch(self, events: list[Event]) -> None:
        for ev in events:
            if ev.token is not None:
                self.generated_tokens += 1
            if not ev.finished:
                self._deliver(ev.request_id, ev)
                continue
            result = self.engine.results.pop(ev.request_id, None)
            self.outcomes[ev.finish_reason or "error"] += 1
            if result is not None:
                self.prompt_tokens += result.prompt_tokens
                self.cached_tokens += result.cached_tokens
            self._deliver(ev.request_id, Done(ev, result))

    def _deliver(self, rid: str, item) -> None:
        entry = self._queues.get(rid) if not isinstance(item, Done) else self._queues.pop(rid, None)
        if entry is None:
            return
        loop, queue = entry
        with contextlib.suppress(RuntimeError):  # the loop closed (shutdown)
            loop.call_soon_threadsafe(queue.put_nowait, item)


def _with_id(request: Request, rid: str) -> Request:
    from dataclasses import replace

    return replace(request, request_id=rid)
