"""The batch engine: continuous batching over per-request bounded, compressed caches.

Each request gets its own :class:`~kvslim.SlimCache` (its own settings, length, positions, sinks and
eviction). A :meth:`Engine.step`:

1. admits waiting requests the budget allows (:class:`~kvslim.engine.scheduler.Scheduler`), one at a time,
   each given its cache as soon as it is admitted — its session's kept cache (read back from disk if it was
   parked) or a new one — so making room for the next never parks the session the previous one continues;
2. runs ONE forward (:mod:`kvslim.engine.step`): every decoding row's pending token plus up to
   ``prefill_chunk`` prompt tokens of joining requests — the prompts with the fewest tokens left first
   (several short ones when their chunks fit together), one passed over for a few steps getting its turn
   (:meth:`Scheduler.prefill_plan`) — packed into one sequence (:func:`kvslim.generate.forward_step`: the
   linear layers once for every token of the step, no padding; attention per row on each row's own codes).
   A joining prompt never pauses the decoding rows: its chunk rides in their forward, which grows by at most
   ``prefill_chunk`` tokens. A long prompt delays another request's first token by at most the chunk running
   and one aged chunk; a prompt's last chunk samples its first token;
3. samples each row's next token with its own settings and generator;
4. retires rows that hit a stop token or ``max_new_tokens``, freeing their caches and reservations, so
   waiting requests join at the next step — a request that names a ``session`` leaves its cache to the
   :class:`~kvslim.engine.sessions.SessionStore`, and the session's next request continues on it,
   prefilling only its new tokens (idle sessions count against the budget; the least recently used are
   parked on disk when admission needs their room).

Faults stay in their row. Whatever fails for one request — making room for it, restoring its session, a
prefill chunk, its K/V in the ragged step (dropped from the step, :mod:`kvslim.cache.ragged`), sampling
(non-finite logits), keeping or parking its session — ends that request alone with ``finish_reason
"error"`` and a one-line ``error`` naming the step and the cause (server paths elided); the other rows and
the engine go on. Only a forward that fails as a whole (no row left, out of memory) ends every row of it —
the decoding rows a prompt chunk shares its forward with included.

Refusals are typed (:mod:`kvslim.engine.errors`): :meth:`Engine.submit` raises a
:class:`~kvslim.engine.errors.Refusal` subclass saying which limit a request hit, before anything is queued.

Greedy output of a request equals that request run alone through the engine, token for token, whatever
else shares its steps (every row's logits are bit-identical: :mod:`kvslim.cache.ragged`, "Packed, not
padded" and "Filler rows"; a prompt is read in the chunks it has alone, whatever shares their forward). The
engine is driven from one thread; :meth:`submit`, :meth:`cancel`, :meth:`cancel_all` and
:meth:`delete_session` may be called from others (a lock orders them with steps).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator

import torch

from ..checks import check_int
from ..config import CacheConfig, parse_spec
from . import pages as paged
from . import report
from .errors import InputRefusal, QueueFull, RequestLimits, describe
from .gate import BATCH_DEPENDENT_ROPE, Gate  # noqa: F401 - BATCH_DEPENDENT_ROPE re-exported
from .linears import Linears, step_rows
from .request import FINISH_REASONS, Event, Request, Result
from .scheduler import Row, Scheduler
from .sessions import SessionStore
from .step import Stepping, generator
from .trim import Trimmer

log = logging.getLogger("kvslim.engine")

#: the limits a request's own cache settings meet unless the engine is given others
DEFAULT_LIMITS = RequestLimits()


class Engine(Stepping):
    """Continuous batching of generation requests over one model.

    model: a loaded transformers causal LM; the engine switches it to the ``kvslim`` attention
    (:func:`kvslim.enable`), which it needs for ragged steps. Every layer must store K/V (models with
    linear-attention or KV-sharing layers, and MLA, are refused). cache: the default cache settings (a
    :class:`~kvslim.config.CacheConfig` or spec; requests may bring their own); its ``mean_center`` bias
    file is read once, here, and checked against the model's fingerprint (ValueError if it was calibrated
    for another model, unless ``allow_other_model``). memory_budget: bytes every admitted request's cache
    may reach together (None: no limit); a request waits until its share fits, and one that cannot fit
    alone is refused. max_batch: rows decoded together at most. prefill_chunk: prompt tokens read per
    step, in the same forward as the decoding rows' tokens (not counted against it), and the longest chunk a
    prompt is read in (:mod:`kvslim.engine.step`). session_dir: where idle sessions are parked when the budget needs their memory (None: they are
    dropped then, counted and logged; :mod:`kvslim.engine.sessions`). max_queue: requests waiting for a
    slot at most (None: no limit; past it :class:`~kvslim.engine.errors.QueueFull`). max_prompt_tokens:
    the longest prompt taken (None: the context decides). request_limits: the maxima of a request's own
    cache settings (:class:`~kvslim.engine.errors.RequestLimits`). max_sessions, session_ttl: idle sessions
    kept at most, and seconds an idle session is kept (None: no bound; :class:`SessionStore`).
    keep_decoded: a prompt of more than one chunk keeps its cache's bodies decoded between its chunks
    (:meth:`kvslim.SlimCache.keep_decoded`: a chunk decodes only what the last one encoded, the same bits); the
    copy's bytes are reserved on top of the cache's until the prompt is read, and a prompt whose copy would not fit
    the budget alone, or whose cache's window is shorter than the prompt, goes without. linears: which library
    runs the model's linear layers inside a step (:mod:`kvslim.engine.linears`: ``auto``, the default: of ``torch`` and
    ``onednn``, those whose product rounds a row alike at every step's row count (else a row's bits would depend on
    its neighbours), the faster (oneDNN where its products are 1.25x quicker, timed once); ``torch``; ``onednn``;
    ``packed``, oneDNN with a second copy of the weights; ``mkl``, MKL's packed sgemm at a full step's rows, torch's
    bits); outside a step, and on other threads, torch's own. pages: None (each row in a SlimCache of its own), or
    every row in one pool of ``pages`` pages a layer (an int, or ``"auto"``: what ``memory_budget`` holds, at most
    ``max_batch`` rows at the model's context), a step two kernel calls a layer (:mod:`kvslim.engine.pages`: one
    format, admission by pages, sessions kept in memory). compile: True (``"python"``), ``"cpp"`` or a model's
    ``CompiledStep`` to share: with ``pages``, decode steps through the compiled paged step (wrappers: docs/compile.md;
    prompt chunks eagerly: :mod:`kvslim.engine.step`); each bucket compiles on its first step, or all at :meth:`warm_up`.
    """

    def __init__(
        self,
        model,
        *,
        cache: CacheConfig | str = "none",
        memory_budget: int | None = None,
        max_batch: int = 16,
        prefill_chunk: int = 256,
        session_dir=None,
        max_queue: int | None = None,
        max_prompt_tokens: int | None = None,
        request_limits: RequestLimits = DEFAULT_LIMITS,
        max_sessions: int | None = None,
        session_ttl: float | None = None,
        allow_other_model: bool = False,
        keep_decoded: bool = True,
        linears: str = "auto",
        pages: int | str | None = None,
        compile=False,
    ):
        self.default_cache = parse_spec(cache) if isinstance(cache, str) else cache
        if not isinstance(self.default_cache, CacheConfig):
            raise ValueError(f"cache must be a CacheConfig or a spec string, got {cache!r}")
        if memory_budget is not None:
            check_int("memory_budget", memory_budget, minimum=1, hint="bytes, or None for no limit")
        check_int("max_batch", max_batch, minimum=1)
        check_int("prefill_chunk", prefill_chunk, minimum=1)
        for name, limit in (("max_queue", max_queue), ("max_prompt_tokens", max_prompt_tokens)):
            if limit is not None:
                check_int(name, limit, minimum=1, hint="or None for no limit")
        if not isinstance(request_limits, RequestLimits):
            raise ValueError(f"request_limits must be a RequestLimits, got {type(request_limits).__name__}")
        for name, flag in (("keep_decoded", keep_decoded), ("allow_other_model", allow_other_model)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        # reads the model only (a refused route leaves it untouched); packs the weights for "packed"
        routes = Linears(model, linears, batch_hint=step_rows(max_batch))
        self.gate = Gate(
            model,
            self.default_cache,
            request_limits=request_limits,
            max_prompt_tokens=max_prompt_tokens,
            fingerprint=session_dir is not None,
            allow_other_model=allow_other_model,
        )
        self.model, self.shapes, self.dtype = self.gate.model, self.gate.shapes, self.gate.dtype
        self.vocab_size = self.gate.vocab_size
        self.pool = self.compiled = None
        if pages is not None or compile is not False:
            self.pool, memory_budget, max_sessions, self.compiled = paged.setup(
                self.model, self.default_cache, pages, compile=compile, session_dir=session_dir,
                max_sessions=max_sessions, max_batch=max_batch, memory_budget=memory_budget,
                context=self.shapes.max_position_embeddings, chunk=prefill_chunk,
            )
        self.scheduler = Scheduler(memory_budget, max_batch)
        self.prefill_chunk = prefill_chunk
        self.keep_decoded = keep_decoded
        self.linears = routes
        self.max_queue = max_queue
        self.max_prompt_tokens = max_prompt_tokens
        self.request_limits = request_limits
        self.results: dict[str, Result] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._events: list[Event] = []  # produced outside step() (cancellations), handed out by the next step
        self._step_times: deque[float] = deque(maxlen=32)  # seconds of recent working steps (Retry-After)
        self._expired_at = float("-inf")
        self.trimmer = Trimmer()
        self.steps = 0
        self.prefilled_tokens = 0  # prompt tokens fed through prefill (a continued session's are not)
        self.row_errors = 0  # requests ended by a failure in a step
        self._fingerprint = self.gate.fingerprint
        self.sessions = SessionStore(
            session_dir,
            config=model.config,
            device=self.model.device,
            model_fingerprint=self._fingerprint,
            dtype=self.dtype,
            max_sessions=max_sessions,
            ttl=session_ttl,
        )

    # -- requests --------------------------------------------------------------------------
    def submit(self, request: Request) -> str:
        """Queue ``request``; returns its id. Raises a :class:`~kvslim.engine.errors.Refusal` (and queues
        nothing) for a request the engine will not serve: :class:`InputRefusal` (a token id outside the
        vocabulary, a prompt past ``max_prompt_tokens``, an id already in use), :class:`SettingsRefusal`
        (cache settings this model cannot take, or past ``request_limits``), :class:`ContextRefusal` (prompt
        + max_new_tokens past the model's context without bounded position ids), :class:`BudgetRefusal`
        (cannot fit the memory budget even alone), :class:`QueueFull` (``max_queue`` requests waiting)."""
        if not isinstance(request, Request):
            raise InputRefusal(f"submit() takes a kvslim.engine.Request, got {type(request).__name__}")
        if self.pool is None:
            cache, reserved = self.gate.check(request, prefill_chunk=self.prefill_chunk, scheduler=self.scheduler)
        else:  # one pool of pages: its format, admission by pages
            cache, reserved = None, paged.check_request(
                request, self.gate, self.pool, scheduler=self.scheduler, chunk=self.prefill_chunk
            )
        # a full queue after the request's own checks: a bad request is told what is wrong with it, not to retry
        self._check_queue()
        with self._lock:
            rid = request.request_id or f"req-{next(self._ids)}"
            if rid in self.results or self.scheduler.find(rid) is not None:
                raise InputRefusal(f"request_id {rid!r} is already in use")
            self._check_queue()
            # the empty cache built above (no tokens: a waiting request holds no cache memory) serves on admission
            kept = self._kept_bytes(cache, len(request.prompt), reserved)
            row = Row(request_id=rid, request=request, reserved=reserved + kept, empty=cache, kept=kept)
            row.generator = generator(request, self.model.device)
            self.results[rid] = Result(rid, prompt_tokens=len(request.prompt), reserved_bytes=reserved)
            self.scheduler.submit(row)
        return rid

    def _kept_bytes(self, cache, n_prompt: int, reserved: int) -> int:
        """Bytes to reserve for the prompt's kept decoded bodies while it is read (0: it goes without)."""
        if not self.keep_decoded or cache is None or n_prompt <= self.prefill_chunk:
            return 0
        capacity = cache.policy.capacity
        if capacity is not None and n_prompt > capacity:  # every chunk evicts: a kept copy would start over
            return 0
        kept = cache.projected_kept_nbytes(n_prompt, dtype=self.dtype)
        return kept if self.scheduler.fits_alone(reserved + kept) else 0

    def _check_queue(self) -> None:
        with self._lock:
            waiting = len(self.scheduler.waiting)
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFull(
                    f"{waiting} requests are already waiting (max_queue {self.max_queue}): retry later",
                    self._retry_after(),
                )

    def _retry_after(self) -> int:
        """Seconds until a queued request may find room: the mean recent step time, times the steps the
        active row closest to its end still needs, times the waves of ``max_batch`` the queue ahead forms."""
        times = self._step_times
        per_step = sum(times) / len(times) if times else 0.05
        chunk = self.prefill_chunk
        left = [
            r.request.max_new_tokens - len(r.tokens) + math.ceil((len(r.request.prompt) - r.fed) / chunk)
            for r in self.scheduler.active
        ]
        waves = max(1, math.ceil(len(self.scheduler.waiting) / self.scheduler.max_batch))
        return max(1, min(3600, math.ceil(per_step * (min(left) if left else 1) * waves)))

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """End a request now: its cache is freed; its final event comes with the next step. reason:
        ``cancelled`` (a client went away) or ``stop`` (the caller saw a stop of its own, e.g. a stop string in
        the decoded text: the request ended normally). Either way its session keeps what was fed. Returns
        False when no such request is waiting or running."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"reason must be 'cancelled' or 'stop', got {reason!r}")
        with self._lock:
            row = self.scheduler.find(request_id)
            if row is None:
                return False
            self._end(row, reason, self._events)
            return True

    def cancel_all(self, reason: str = "cancelled", error: str | None = None, *, active_only: bool = False) -> int:
        """End every waiting and running request now (only the running ones with ``active_only``: a runner
        whose step failed) with ``reason`` (one of ``FINISH_REASONS``) and ``error`` (a server shutting down);
        their final events come with the next step (or :meth:`take_events`). A running row's session keeps
        what it was fed, as for a cancellation. Returns how many requests were ended."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason must be one of {', '.join(FINISH_REASONS)}, got {reason!r}")
        with self._lock:
            rows = list(self.scheduler.active)
            if not active_only:
                rows += self.scheduler.waiting
            for row in rows:
                self._end(row, reason, self._events, error=error)
            return len(rows)

    def take_events(self) -> list[Event]:
        """The events not handed out yet — cancellations, and what a step that raised had produced before it
        did — now instead of with the next step (a runner whose step failed, or that stopped stepping)."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def pending_ids(self) -> set[str]:
        """The ids of the requests waiting or running (what a final event is still owed to)."""
        with self._lock:
            return {r.request_id for r in (*self.scheduler.active, *self.scheduler.waiting)}

    def delete_session(self, session: str) -> bool:
        """Forget ``session``: its kept cache (memory and disk) is removed, and a request of it still running
        will not leave its cache to it. Returns False when there was none of either."""
        with self._lock:
            running = False
            for row in (*self.scheduler.active, *self.scheduler.waiting):
                if row.request.session == session:
                    row.keep_session, running = False, True
            return bool(self.sessions.delete(session)) or running

    # -- running ---------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        with self._lock:
            return self.scheduler.idle and not self._events

    def warm_up(self, progress=None) -> list[int]:
        """With ``compile``: compile every bucket of up to ``max_batch`` rows now, holding the engine's lock (minutes);
        returns the buckets compiled by this call. progress: :meth:`CompiledStep.warm`'s."""
        if self.compiled is None:
            return []
        with self._lock, torch.inference_mode(), self.linears.routed() as route:
            return self.compiled.warm(self.pool, self.scheduler.max_batch, route.row_multiple(), progress)

    def step(self) -> list[Event]:
        """One scheduling step (module docstring); returns what it produced, in row order."""
        with self._lock, torch.inference_mode():
            start = time.perf_counter()
            # appended to in place: should the step raise, take_events() still hands out what it produced
            events = self._events
            self._expire()
            self._admit(events)
            prefilled = self.scheduler.prefill_plan(self.prefill_chunk)
            rows = [r for r in self.scheduler.decoding() if r.pending is not None]
            if prefilled or rows:
                self._forward(prefilled, rows, events)
            self.steps += 1
            if prefilled or rows:
                self._step_times.append(time.perf_counter() - start)
            self._events = []
            return events

    def _expire(self) -> None:
        """Housekeeping, at most once a second (a step stays cheap): idle sessions past their TTL leave, and
        the heap freed since the last time is given back (:mod:`kvslim.engine.trim`)."""
        now = time.monotonic()
        if now - self._expired_at < 1.0:
            return
        self._expired_at = now
        try:
            self.sessions.expire()
        except Exception:  # noqa: BLE001 - housekeeping never ends a request or the engine
            log.exception("expiring idle sessions failed")
        self.trimmer.maybe()  # the heap that ended requests and parked sessions freed, back to the system

    def _admit(self, events: list[Event]) -> None:
        """Admit what fits, attaching each row's cache as it is admitted (module docstring, 1)."""
        waiting = self.scheduler.waiting
        while waiting:
            head = waiting[0]
            try:
                row = self.scheduler.admit_next(self._room)
            except Exception as e:  # noqa: BLE001 - making room (parking another session) failed: this row ends
                self._fail(head, events, "making room for it", e)
                continue
            if row is None:
                return
            try:
                self._attach(row)
            except Exception as e:  # noqa: BLE001 - its session could not be restored: this row ends
                self._fail(row, events, "restoring its session", e)

    def _room(self, row: Row, free: int) -> bool:
        """Admission's hook: park idle sessions (not ``row``'s own) until ``row`` fits in ``free`` bytes."""
        return self.sessions.make_room(free - row.reserved, exclude=row.request.session)

    def _attach(self, row: Row) -> None:
        """Give an admitted row its cache: its session's kept one when the prompt continues it, else a new one."""
        req = row.request
        cfg = req.cache or self.default_cache
        if req.session is not None:
            got = self.sessions.take(req.session, req.prompt, cfg)
            if got is not None:
                row.cache, row.fed = got
                row.empty, row.started = None, row.fed
                self.results[row.request_id].cached_tokens = row.fed
                return
        if self.pool is not None:  # a row of the pool, its pages taken as its tokens come
            row.empty = paged.PooledCache(self.pool, self.pool.new_row())
        row.cache, row.empty = row.empty, None

    def _emit(self, row: Row, token: int, logprob, top, events: list[Event]) -> None:
        try:
            row.tokens.append(token)
            result = self.results[row.request_id]
            result.tokens.append(token)
            reason = None
            if token in row.request.stop_ids:
                reason = "stop"
            elif len(row.tokens) >= row.request.max_new_tokens:
                reason = "length"
            if reason is None:
                row.pending = token
                events.append(
                    Event(row.request_id, token, len(row.tokens) - 1, logprob=logprob, top_logprobs=top)
                )
                return
        except Exception as e:  # noqa: BLE001 - this row alone
            self._fail(row, events, "emitting its token", e)
            return
        self._end(row, reason, events, token=token, logprob=logprob, top=top)

    def _fail(self, row: Row, events: list[Event], phase: str, exc: BaseException) -> None:
        """``row`` failed in ``phase``: it ends alone with an error naming the phase and the cause."""
        error = f"{phase} failed: {describe(exc)}"
        if isinstance(exc, (ValueError, OSError)):
            log.warning("request %s: %s", row.request_id, error)
        else:  # not a refusal of bad data: the traceback is for whoever reads the log
            log.warning("request %s: %s", row.request_id, error, exc_info=exc)
        row.failed = True
        self._end(row, "error", events, error=error)

    def _end(self, row: Row, reason: str, events: list[Event], *, token=None, error=None, logprob=None, top=None):
        """``row`` leaves with its final event (carrying ``token`` when it ended on one). Leaving never fails:
        when keeping its session does, the row still leaves, and its final event says so (an error)."""
        if row.state == "done":
            return
        self.trimmer.freed()
        if row.cache is not None:  # its peak bytes, once (a decode step does not walk every row's cache)
            try:
                self._track(row)
            except Exception:  # noqa: BLE001 - leaving never fails; the figure is only reported
                log.warning("request %s: sizing its cache failed", row.request_id)
        try:
            self._release(row)
        except Exception as e:  # noqa: BLE001 - the session is lost; the row still leaves
            self.scheduler.release(row)
            log.warning("request %s: keeping session %r failed: %s", row.request_id, row.request.session, describe(e))
            if reason != "error":
                reason, error = "error", f"keeping its session failed: {describe(e)}"
        if reason == "error":
            self.row_errors += 1
        result = self.results.get(row.request_id)
        if result is not None:
            result.finish_reason, result.error = reason, error
        index = len(row.tokens) - (token is not None)
        events.append(
            Event(
                row.request_id, token, index, finished=True, finish_reason=reason, error=error,
                logprob=logprob, top_logprobs=top,
            )
        )

    def _release(self, row: Row) -> None:
        """A row leaves: unless it failed, a session row leaves its cache, holding the prompt tokens fed and
        every generated token but the last (never fed), to its session."""
        session, cache, state = row.request.session, row.cache, row.state
        self.scheduler.release(row)
        free = getattr(cache, "release", lambda: None)  # a row of the page pool: its pages back
        if session is None or cache is None or not row.keep_session:
            return free()
        if row.failed:
            free()
            self.sessions.forget(session)
            return
        if not row.fed:
            return free()
        fed = tuple(row.request.prompt[: row.fed])
        if state == "decode":
            fed += tuple(row.tokens[:-1])
        self.sessions.keep(session, cache, fed, row.request.cache or self.default_cache)
        budget = self.scheduler.memory_budget
        if budget is not None:  # a cache may hold more than its reservation (buffers allocated ahead)
            self.sessions.make_room(budget - self.scheduler.reserved)

    # -- convenience -----------------------------------------------------------------------
    def events(self) -> Iterator[Event]:
        """Step until every submitted request has finished, yielding each event as it happens."""
        while not self.idle:
            yield from self.step()

    def run(self, requests: Iterable[Request]) -> list[Result]:
        """Submit ``requests``, run them to the end together, return their results in order."""
        ids = [self.submit(r) for r in requests]
        for _ in self.events():
            pass
        return [self.results.pop(i) for i in ids]

    def park_sessions(self, timeout: float = 30.0) -> None:
        """Write every idle session in memory to session_dir and wait (up to ``timeout`` seconds) for pending
        writes (a server shutting down); without one, nothing."""
        with self._lock:
            if self.sessions.session_dir is not None:
                self.sessions.make_room(0)
            self.sessions.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Park every idle session and stop the session store's writer (the engine serves nothing after)."""
        with self._lock:
            if self.sessions.session_dir is not None:
                self.sessions.make_room(0)
            self.sessions.close(timeout)

    def memory(self) -> dict:
        """Bytes now (:func:`kvslim.engine.report.memory`): the admitted caches, the decoded copies kept while prompts
        are read, the reservations, the idle sessions, the budget, what plain fp16 caches would take; rows waiting
        and active; requests ended by a failure; the session counters; with ``pages``, the pool's figures."""
        with self._lock:
            return report.memory(self)
