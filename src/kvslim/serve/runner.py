"""The engine thread: steps the batch engine while there is work and hands each event to its request's
asyncio queue.

One thread drives the :class:`~kvslim.engine.Engine` (it is driven from one thread); the HTTP handlers,
on the event loop, call :meth:`Runner.submit` and :meth:`Runner.cancel` (the engine's lock orders them
with steps) and read their request's events from an ``asyncio.Queue`` that this thread feeds through
``loop.call_soon_threadsafe``. The thread sleeps while the engine is idle and wakes on a submit.

No request can hang. The thread never dies from a request: the engine keeps a row's failure to that row,
and an exception that still escapes a step ends the rows of that step with an error event (logged, counted
in ``engine_errors``) while the loop goes on. A queue is registered under the same gate that stopping (or
the thread's death) closes, so a submit either raises :class:`~kvslim.engine.ShuttingDown` or its queue is
answered — by its events or by a :class:`Done` with an error. :meth:`Runner.drain` stops admitting, gives
in-flight requests a grace period, ends the rest with an error and parks every idle session.

This module knows no HTTP and no tokenizer: token ids in, :class:`~kvslim.engine.Event` out. The counters
``/metrics`` shows are kept here (requests by outcome, refusals by kind, engine errors, tokens) next to the
engine's memory figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ..engine import Engine, Event, Request, Result, ShuttingDown
from ..engine.errors import describe

log = logging.getLogger("kvslim.serve")

#: what a request can end as in the ``kvslim_requests_total{outcome=...}`` counter
OUTCOMES = ("stop", "length", "error", "cancelled", "refused")

#: the error a request still running when the server shuts down ends with
SHUTTING_DOWN = "the server is shutting down"


@dataclass
class Done:
    """The last item a request's queue receives: its final event and the engine's :class:`Result`."""

    event: Event
    result: Result | None


class Runner:
    """Owns the engine thread. engine: a :class:`~kvslim.engine.Engine`; ``start()`` / ``drain()`` or
    ``stop()`` it (the app's lifespan does). Idle sessions are parked in the engine's session_dir when it
    stops."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Condition()
        # Orders submit with stopping and with the thread's death: a queue is registered while the gate is
        # open, and whoever closes the gate answers every queue registered before.
        self._gate = threading.Lock()
        self._accepting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._shutdown_lock = threading.RLock()  # reentrant: a second signal may arrive inside the first drain
        self._hurry = threading.Event()  # a second drain cuts the first one's grace short
        self._shutdowns = 0
        self._closed = False
        self._ids = itertools.count()
        self.outcomes: Counter = Counter({o: 0 for o in OUTCOMES})
        self.refusals: Counter = Counter()  # refused requests by the engine's Refusal.kind
        self.engine_errors = 0  # steps that raised (their rows ended with an error, the loop went on)
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
        """The thread runs and requests are taken (False once draining or stopped)."""
        return self._thread is not None and self._thread.is_alive() and self._accepting

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        with self._gate:
            self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="kvslim-engine", daemon=True)
        self._thread.start()

    def drain(self, grace: float) -> None:
        """Shut down without losing what can be kept: stop admitting (:meth:`submit` raises ShuttingDown), let
        in-flight requests finish for up to ``grace`` seconds, end the rest with an error event ("the server
        is shutting down"), then park every idle session (with a session_dir). Idempotent; a second call
        while the first waits cuts its grace short (a second Ctrl-C) and still parks. Safe to call from any
        thread, a signal handler's included."""
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise ValueError(f"grace must be a number of seconds >= 0, got {grace!r}")
        self._shutdown(grace, "error", SHUTTING_DOWN)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop now: the thread ends (waiting up to ``timeout`` for its step), what is still running is
        cancelled, idle sessions are parked on disk (with a session_dir)."""
        self._shutdown(0.0, "cancelled", None, join_timeout=timeout)

    def _shutdown(self, grace: float, reason: str, error: str | None, join_timeout: float = 10.0) -> None:
        with self._gate:
            self._accepting = False
            self._shutdowns += 1
            if self._shutdowns > 1:  # a second call (a second signal): the first stops waiting
                self._hurry.set()
        with self._shutdown_lock:
            deadline = time.monotonic() + grace
            while self._queues and self._thread_alive() and not self._hurry.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._hurry.wait(min(left, 0.05))
            with self._wake:
                self._stop = True
                self._wake.notify_all()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(join_timeout)
            try:
                self.engine.cancel_all(reason, error)
                self._dispatch(self.engine.take_events())
            except Exception:  # noqa: BLE001 - a broken engine: its clients are still answered below
                log.exception("ending the requests still running failed")
            self._answer_all(reason, error)
            if not self._closed:
                self._closed = True
                try:
                    self.engine.close()
                except Exception:  # noqa: BLE001 - logged: the process is going away anyway
                    log.exception("parking idle sessions failed")

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests (called from the event loop) -----------------------------------------------
    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> tuple[str, asyncio.Queue]:
        """Queue ``request`` (its request_id is replaced by a fresh one); returns its id and the queue its
        events arrive on (a :class:`Done` last, always). Raises the engine's
        :class:`~kvslim.engine.Refusal` (nothing queued; counted as refused, by kind), or
        :class:`~kvslim.engine.ShuttingDown` when the runner is not taking requests."""
        with self._gate:
            if not self._accepting or not self._thread_alive():
                raise ShuttingDown(self.failure or (SHUTTING_DOWN if self._stop else "the engine is not running"))
            rid = f"r{next(self._ids)}"
            queue: asyncio.Queue = asyncio.Queue()
            self._queues[rid] = (loop, queue)
            try:
                self.engine.submit(_with_id(request, rid))
            except ValueError as e:
                self._queues.pop(rid, None)
                self.outcomes["refused"] += 1
                self.refusals[getattr(e, "kind", "input")] += 1
                raise
            except BaseException:
                self._queues.pop(rid, None)  # never a queue nobody will answer
                raise
        with self._wake:
            self._wake.notify_all()
        return rid, queue

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End the request now, freeing its cache (its final event still comes): the client went away
        (``cancelled``), or its reply met a stop string (``stop``, counted as a normal stop)."""
        self.engine.cancel(request_id, reason)
        with self._wake:
            self._wake.notify_all()

    def delete_session(self, session: str) -> bool:
        """Forget a session's kept cache, in memory and on disk; False when there was none."""
        return self.engine.delete_session(session)

    def refused(self, kind: str = "input") -> None:
        """Count a request the HTTP layer refused before it reached the engine."""
        self.outcomes["refused"] += 1
        self.refusals[kind] += 1

    # -- figures -----------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Counters and the engine's memory figures (:meth:`kvslim.engine.Engine.memory`)."""
        return {
            "outcomes": dict(self.outcomes),
            "refusals": dict(self.refusals),
            "engine_errors": self.engine_errors,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "cached_tokens": self.cached_tokens,
            "active_streams": len(self._queues),
            "memory": self.engine.memory(),
            "alive": self.alive,
            "accepting": self._accepting,
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
                try:
                    events = self.engine.step()
                except Exception as e:  # noqa: BLE001 - a bug in a step: its rows end, the loop goes on
                    events = self._step_failed(e)
                self._dispatch(events)
                self._answer_orphans()
        except BaseException as e:  # the thread cannot go on: every waiting client is told, none hangs
            self.failure = f"the engine stopped: {describe(e)}"
            log.exception("engine thread died")
        finally:
            if self.failure is not None:
                with self._gate:
                    self._accepting = False
                try:
                    self.engine.cancel_all("error", self.failure)
                    self.engine.take_events()
                except Exception:  # noqa: BLE001 - the engine is broken; its clients are answered below
                    log.exception("ending the requests of a dead engine failed")
                self._answer_all("error", self.failure)

    def _step_failed(self, exc: Exception) -> list[Event]:
        """A step raised past the engine's per-row guards: end the rows it was running with an error (the
        waiting ones go on) and hand out what it had produced."""
        self.engine_errors += 1
        error = f"the engine step failed: {describe(exc)}"
        log.error("engine step failed; ending the requests it was running", exc_info=exc)
        self.engine.cancel_all("error", error, active_only=True)
        return self.engine.take_events()

    def _answer_orphans(self) -> None:
        """A queue whose request the engine no longer holds, and which got no final event, is answered now
        (only after a failed step can that happen; the check is one set per step)."""
        if not self._queues or self.engine_errors == 0:
            return
        with self._gate:  # submit registers a queue and then the request under the gate: never between the two
            pending = self.engine.pending_ids()
            orphans = [r for r in list(self._queues) if r not in pending]
        for rid in orphans:
            self.outcomes["error"] += 1
            self._deliver(rid, Done(Event(rid, None, 0, True, "error", "the engine lost this request"), None))

    def _answer_all(self, reason: str, error: str | None) -> None:
        """Every queue still open gets a final :class:`Done` (the runner is stopping or its thread died)."""
        for rid in list(self._queues):
            self.outcomes[reason] += 1
            self._deliver(rid, Done(Event(rid, None, 0, True, reason, error), None))

    def _dispatch(self, events: list[Event]) -> None:
        """A step's events to their queues: one hand-over per event loop for the whole step (waking the loop
        once, not once per row), in row order."""
        batches: dict = {}
        for ev in events:
            if ev.token is not None:
                self.generated_tokens += 1
            if not ev.finished:
                self._deliver(ev.request_id, ev, batches)
                continue
            result = self.engine.results.pop(ev.request_id, None)
            if ev.request_id in self._queues:
                self.outcomes[ev.finish_reason or "error"] += 1
            if result is not None:
                self.prompt_tokens += result.prompt_tokens
                self.cached_tokens += result.cached_tokens
            self._deliver(ev.request_id, Done(ev, result), batches)
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # the loop closed (shutdown)
                loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, rid: str, item, batches: dict | None = None) -> None:
        entry = self._queues.get(rid) if not isinstance(item, Done) else self._queues.pop(rid, None)
        if entry is None:
            return
        loop, queue = entry
        if batches is not None:
            batches.setdefault(loop, []).append((queue, item))
            return
        with contextlib.suppress(RuntimeError):  # the loop closed (shutdown)
            loop.call_soon_threadsafe(queue.put_nowait, item)


def _put_all(items: list) -> None:
    """On the event loop: each ``(queue, item)`` put, in order."""
    for queue, item in items:
        queue.put_nowait(item)


def _with_id(request: Request, rid: str) -> Request:
    from dataclasses import replace

    return replace(request, request_id=rid)
