"""The batch engine: continuous batching over per-request bounded, compressed caches.

Each request gets its own :class:`~kvslim.SlimCache` (its own settings, length, positions, sinks and
eviction). A :meth:`Engine.step`:

1. admits waiting requests the budget allows (:class:`~kvslim.engine.scheduler.Scheduler`);
2. prefills one chunk (``prefill_chunk`` tokens) of the oldest request still reading its prompt, alone,
   through :func:`kvslim.generate.prefill` — a long prompt is read over several steps, so it never stalls
   the running rows for more than one chunk; its last chunk samples the request's first token;
3. feeds every decoding row its pending token in one ragged forward
   (:func:`kvslim.generate.forward_rows`: the linear layers once for all rows, attention row by row on
   each row's own codes, no padding to the longest row) and samples each row's next token with its own
   settings and generator;
4. retires rows that hit a stop token or ``max_new_tokens``, freeing their caches and reservations, so
   waiting requests join at the next step — a request that names a ``session`` leaves its cache to the
   :class:`~kvslim.engine.sessions.SessionStore`, and the session's next request continues on it,
   prefilling only its new tokens (idle sessions count against the budget; the least recently used are
   parked on disk when admission needs their room).

Greedy output of a request equals that request run alone through the engine, token for token, whatever
else shares its steps (every row's logits are bit-identical: :mod:`kvslim.ragged`, "Filler rows"; the
prefill of a request never mixes with another's). The engine is driven from one thread; :meth:`submit`
and :meth:`cancel` may be called from others (a lock orders them with steps).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator

import torch

from .. import generate as gen
from ..checks import check_int
from ..config import CacheConfig, parse_spec
from .request import Event, Request, Result
from .scheduler import Row, Scheduler
from .sessions import SessionStore

#: RoPE types whose frequencies transformers computes from the largest position id of the whole batch
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


class Engine:
    """Continuous batching of generation requests over one model.

    model: a loaded transformers causal LM; the engine switches it to the ``kvslim`` attention
    (:func:`kvslim.enable`), which it needs for ragged steps. Every layer must store K/V (models with
    linear-attention or KV-sharing layers, and MLA, are refused). cache: the default cache settings (a
    :class:`~kvslim.config.CacheConfig` or spec; requests may bring their own). memory_budget: bytes every
    admitted request's cache may reach together (None: no limit); a request waits until its share fits,
    and one that cannot fit alone is refused. max_batch: rows decoded together at most. prefill_chunk:
    prompt tokens read per step. session_dir: where idle sessions are parked when the budget needs their
    memory (None: they are dropped then, counted and logged; :mod:`kvslim.engine.sessions`).
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
    ):
        import kvslim

        from ..shapes import ModelShapes, is_mla, text_config

        self.default_cache = parse_spec(cache) if isinstance(cache, str) else cache
        if not isinstance(self.default_cache, CacheConfig):
            raise ValueError(f"cache must be a CacheConfig or a spec string, got {cache!r}")
        if memory_budget is not None:
            check_int("memory_budget", memory_budget, minimum=1, hint="bytes, or None for no limit")
        check_int("max_batch", max_batch, minimum=1)
        check_int("prefill_chunk", prefill_chunk, minimum=1)
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"Engine needs a loaded transformers model, got {type(model).__name__}")
        self.shapes = ModelShapes.from_config(config)
        if is_mla(text_config(config)):
            raise ValueError(
                f"the batch engine cannot serve {self.shapes.model_type}: MLA expands its cached latent before "
                "attention, so there are no per-row codes to attend on"
            )
        from ..levers import rotary_embedding

        emb, _ = rotary_embedding(config)
        rope_type = getattr(emb, "rope_type", "default") if emb is not None else "default"
        if rope_type in BATCH_DEPENDENT_ROPE:
            raise ValueError(
                f"the batch engine cannot serve {self.shapes.model_type} with rope_type {rope_type!r}: its frequencies "
                "follow the longest position in the whole batch, so one row would change every other row's results "
                "(run it one stream at a time with kvslim.generate)"
            )
        self.model = kvslim.enable(model)
        self.vocab_size = int(getattr(text_config(config), "vocab_size", 0) or 0)
        self.dtype = next(model.parameters()).dtype
        self.scheduler = Scheduler(memory_budget, max_batch)
        self.prefill_chunk = prefill_chunk
        self.results: dict[str, Result] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._events: list[Event] = []  # produced outside step() (cancellations), handed out by the next step
        self.steps = 0
        self.prefilled_tokens = 0  # prompt tokens fed through prefill (a continued session's are not)
        fingerprint = None
        if session_dir is not None:
            from ..fingerprint import model_fingerprint

            fingerprint = model_fingerprint(model)
        self.sessions = SessionStore(
            session_dir, config=model.config, device=self.model.device, model_fingerprint=fingerprint
        )
        self._make_cache(self.default_cache)  # the default settings must fit this model (raises if not)

    # -- requests --------------------------------------------------------------------------
    def _make_cache(self, cfg: CacheConfig):
        from ..cache import SlimCache, SlimCacheLayer

        cache = SlimCache.from_config(cfg, config=self.model.config)
        kinds = sorted(
            {type(layer).__name__ for layer in cache.layers if not isinstance(layer, SlimCacheLayer)}
        )
        if kinds or any(type(layer).__name__ == "SlimHybridLayer" for layer in cache.layers):
            raise ValueError(
                f"the batch engine serves models whose every layer stores K/V; {self.shapes.model_type} has "
                f"{', '.join(kinds) or 'hybrid'} layers (run it one stream at a time with kvslim.generate)"
            )
        return cache

    def submit(self, request: Request) -> str:
        """Queue ``request``; returns its id. Raises ValueError (and queues nothing) for a request the engine
        cannot serve: a token id outside the vocabulary, a cache setting this model cannot take, a prompt +
        max_new_tokens past the model's context without a window, one that cannot fit the budget alone, or
        an id already in use."""
        if not isinstance(request, Request):
            raise ValueError(f"submit() takes a kvslim.engine.Request, got {type(request).__name__}")
        cfg = request.cache or self.default_cache
        top = max(request.prompt)
        if self.vocab_size and top >= self.vocab_size:
            raise ValueError(
                f"prompt token id {top} is outside the model's vocabulary (0..{self.vocab_size - 1})"
            )
        total = len(request.prompt) + request.max_new_tokens
        try:
            cache = self._make_cache(cfg)  # raises ValueError for settings this model cannot take
        except OSError as e:  # a bias file that cannot be read
            raise ValueError(f"cache settings {cfg.to_spec()!r}: {e}") from None
        ctx = self.shapes.max_position_embeddings
        # Past the context only a bounded cache whose position ids are re-based (kept below the period plus a
        # chunk) stays inside it; any other cache would feed ids the model was never trained on.
        bounded_ids = cache.rebase_period is not None and cache.rebase_period + self.prefill_chunk <= (
            ctx or 0
        )
        if ctx is not None and total > ctx and not bounded_ids:
            why = (
                "the cache has no window"
                if cfg.window is None
                else "this cache's position ids are not kept bounded"
            )
            raise ValueError(
                f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) = {total} is past "
                f"the model's context of {ctx} tokens, and {why}: shorten it, or use a bounded cache "
                f"(sink=4,window=...) whose positions stay inside the context"
            )
        reserved = cache.projected_nbytes(total, dtype=self.dtype)
        if not self.scheduler.fits_alone(reserved):
            raise ValueError(
                f"this request's cache can reach {reserved} bytes ({cfg.to_spec()}, {total} tokens), more than the "
                f"whole memory budget of {self.scheduler.memory_budget} bytes: raise the budget, lower max_new_tokens "
                f"or use a smaller cache (a window, fewer bits)"
            )
        with self._lock:
            rid = request.request_id or f"req-{next(self._ids)}"
            if rid in self.results or self.scheduler.find(rid) is not None:
                raise ValueError(f"request_id {rid!r} is already in use")
            # the empty cache built above (no tokens: a waiting request holds no cache memory) serves on admission
            row = Row(request_id=rid, request=request, reserved=reserved, empty=cache)
            if request.temperature > 0:
                row.generator = torch.Generator(device=self.model.device)
                if request.seed is None:
                    row.generator.seed()
                else:
                    row.generator.manual_seed(request.seed)
            self.results[rid] = Result(rid, prompt_tokens=len(request.prompt), reserved_bytes=reserved)
            self.scheduler.submit(row)
        return rid

    def cancel(self, request_id: str) -> bool:
        """End a request now (a client went away): its cache is freed; its final event comes with the next
        step. Returns False when no such request is waiting or running."""
        with self._lock:
            row = self.scheduler.find(request_id)
            if row is None:
                return False
            self._finish(row, "cancelled", self._events)
            return True

    # -- running ---------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        with self._lock:
            return self.scheduler.idle and not self._events

    def step(self) -> list[Event]:
        """One scheduling step (module docstring); returns what it produced, in row order."""
        with self._lock, torch.inference_mode():
            events, self._events = self._events, []
            for row in self.scheduler.admit(self._room):
                self._attach(row)
            row = self.scheduler.next_prefill()
            if row is not None:
                self._prefill_chunk(row, events)
            rows = [r for r in self.scheduler.decoding() if r.pending is not None]
            if rows:
                self._decode(rows, events)
            self.steps += 1
            return events

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
                row.empty = None
                self.results[row.request_id].cached_tokens = row.fed
                return
        row.cache, row.empty = row.empty, None

    def _release(self, row: Row, reason: str) -> None:
        """A row leaves: a session row that ended cleanly (or was cancelled between steps) leaves its cache,
        holding the prompt tokens fed and every generated token but the last (never fed), to its session."""
        session, cache, state = row.request.session, row.cache, row.state
        self.scheduler.release(row)
        if session is None or cache is None:
            return
        if reason == "error":
            self.sessions.forget(session)
            return
        if row.fed:
            fed = tuple(row.request.prompt[: row.fed])
            if state == "decode":
                fed += tuple(row.tokens[:-1])
            self.sessions.keep(session, cache, fed, row.request.cache or self.default_cache)
            budget = self.scheduler.memory_budget
            if budget is not None:  # a cache may hold more than its reservation (buffers allocated ahead)
                self.sessions.make_room(budget - self.scheduler.reserved)

    def _prefill_chunk(self, row: Row, events: list[Event]) -> None:
        prompt = row.request.prompt
        end = min(row.fed + self.prefill_chunk, len(prompt))
        ids = torch.tensor([prompt[row.fed : end]], dtype=torch.long, device=self.model.device)
        try:
            logits = gen.prefill(self.model, ids, row.cache)  # (1, V)
        except Exception as e:  # noqa: BLE001 - this request fails (non-finite K/V, out of memory...), not the engine
            self._finish(
                row,
                "error",
                events,
                error=f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e),
            )
            return
        self.prefilled_tokens += end - row.fed
        row.fed = end
        self._track(row)
        if row.fed == len(prompt):
            row.state = "decode"
            self._emit(row, self._sample(row, logits), events)

    def _decode(self, rows: list[Row], events: list[Event]) -> None:
        try:
            logits = gen.forward_rows(self.model, [r.pending for r in rows], [r.cache for r in rows])
        except Exception as e:  # noqa: BLE001 - the step's rows fail, the engine and the waiting requests go on
            # A row's cache refused its K/V mid-step (or the forward failed): the step's other rows may have stored
            # this token in some layers, so none of them can go on consistently: they end with the error. (Known
            # gap: one row's non-finite K/V ends the other rows of its step too.)
            msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            for r in rows:
                self._finish(r, "error", events, error=msg)
            return
        for b, r in enumerate(rows):
            self._track(r)
            self._emit(r, self._sample(r, logits[b : b + 1]), events)

    def _sample(self, row: Row, logits: torch.Tensor) -> int:
        req = row.request
        return int(gen.sample_next(logits, req.temperature, req.top_p, row.generator)[0])

    def _emit(self, row: Row, token: int, events: list[Event]) -> None:
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
            events.append(Event(row.request_id, token, len(row.tokens) - 1))
            return
        events.append(Event(row.request_id, token, len(row.tokens) - 1, finished=True, finish_reason=reason))
        result.finish_reason = reason
        self._release(row, reason)

    def _finish(self, row: Row, reason: str, events: list[Event], error: str | None = None) -> None:
        result = self.results[row.request_id]
        result.finish_reason, result.error = reason, error
        events.append(
            Event(row.request_id, None, len(row.tokens), finished=True, finish_reason=reason, error=error)
        )
        self._release(row, reason)

    def _track(self, row: Row) -> None:
        n = row.cache.nbytes()
        row.peak_bytes = max(row.peak_bytes, n)
        self.results[row.request_id].cache_bytes = row.peak_bytes

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

    def park_sessions(self) -> None:
        """Write every idle session in memory to session_dir (a server shutting down); without one, nothing."""
        with self._lock:
            if self.sessions.session_dir is not None:
                self.sessions.make_room(0)

    def memory(self) -> dict:
        """Bytes now: held by the admitted caches, reserved for them, held by idle sessions in memory, the
        budget; ``fp16_bytes``: what plain fp16 caches of every token the admitted rows and the idle sessions
        hold would take (no window, no compression: the comparison a user makes); rows waiting and active;
        sessions kept in memory and parked on disk, and the session counters."""
        with self._lock:
            active = self.scheduler.active
            sh = self.shapes
            per_token = (
                2 * sh.n_layers * sh.n_kv_heads * (sh.k_head_dim + sh.v_head_dim)
            )  # fp16 K + V, all layers
            tokens = sum(r.fed + max(len(r.tokens) - 1, 0) for r in active if r.cache is not None)
            tokens += sum(len(k.tokens) for k in self.sessions.kept.values())
            return {
                "cache_bytes": sum(r.cache.nbytes() for r in active if r.cache is not None),
                "reserved_bytes": self.scheduler.reserved,
                "session_bytes": self.sessions.held(),
                "memory_budget": self.scheduler.memory_budget,
                "fp16_bytes": tokens * per_token,
                "active": len(active),
                "waiting": len(self.scheduler.waiting),
                "sessions_kept": len(self.sessions.kept),
                "sessions_on_disk": self.sessions.on_disk(),
                "prefilled_tokens": self.prefilled_tokens,
                **{f"sessions_{k}": v for k, v in vars(self.sessions.stats).items()},
            }
