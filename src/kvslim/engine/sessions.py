"""Sessions: a conversation's compressed cache kept between its requests, written through to disk, restored.

When a request that names a ``session`` finishes, the engine hands its cache to the :class:`SessionStore`
with the token ids the cache holds (the prompt, then every generated token but the last, which was never
fed). A later request of that session continues on the kept cache when the one continuation rule
(:func:`kvslim.promptcache.check_continuation`, shared with ``kvslim sample --prompt-cache``; the engine
goes through this store and checks nothing itself) allows it:
the same model, dtype and cache settings, and a prompt that *starts with* those ids — then only the tokens
past them are prefilled. Otherwise the session starts over: the request is prefilled from scratch and what
was kept is removed (memory and file), counted in ``reset`` and logged with the rule's reason. That covers an
edited history, other settings, and a file that cannot be continued: saved by another model or with
another dtype (a server restarted with ``--dtype bfloat16``), other settings, or damaged bytes.
:meth:`SessionStore.take` never raises. A compressed cache is never cropped or re-quantized here: it is
continued as it is or not at all — the rule llama.cpp's slots and ``--prompt-cache`` follow.

Disk (``session_dir``; the directory, the files' names and modes, reading and writing one:
:mod:`kvslim.engine.session_files`): with ``write_through`` every kept session is also written to its file
by a background writer thread (:mod:`kvslim.engine.session_writer`), soon after the turn ends and never
under the engine's lock, so a ``kill -9`` loses at most the turns in flight. :meth:`~SessionStore.keep`
hands the cache over; the writer first takes a snapshot (CPU copies), then writes it (atomically). If
the session comes back before its write has taken the snapshot, :meth:`~SessionStore.take` takes the
snapshot itself (a memory copy) or waits for the writer's to finish, so the writer never reads a cache the
engine is extending; the file then holds the previous turn, replaced at the next keep. A file stays while
its session runs (it is the last finished turn: a request that fails falls back to it).

Pages (``Engine(pages=...)``): a session keeps its row of the pool in memory; one dropped gives it back (:func:`_release`).

Memory: an idle session's cache counts against the engine's memory budget. When admission needs room,
:meth:`~SessionStore.make_room` frees the least recently used idle sessions: one whose file is current needs
no second write, one whose write is pending is freed when the write has run (its bytes count in
:meth:`~SessionStore.held` until then), one without a current file is written there and then (write_through
off, or its write failed). Without a ``session_dir`` a session that must make room is dropped — counted in
``dropped`` and logged, never silently.

Bounds: ``max_sessions`` sessions at most (in memory, on disk or both; the least recently used removed
first, files too) and ``ttl`` seconds idle at most (:meth:`~SessionStore.expire`; the last use of a file
found at start is its mtime), so 10,000 distinct session ids fill neither memory nor disk.

Restoring a file (:func:`kvslim.promptcache.load`) happens in :meth:`~SessionStore.take`, under the engine's
lock (reading is not moved off it yet). This module is the session table and its policy (which sessions
exist, in memory or on disk, least recently used first; the bounds; what is continued): it knows no file
format, no thread but the writer's condition it shares, no HTTP, no tokenizer and no scheduling.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict

import torch

from .. import promptcache as pc  # looked up per call (pc.check_continuation, ...): tests replace them
from ..cache.adapter import SlimCache
from ..config import CacheConfig
from .session_files import DIR_MODE, FILE_MODE, SUFFIX, SessionFiles, session_key, snapshot
from .session_index import Kept, SessionIndex, SessionStats
from .session_index import release as _release
from .session_writer import WRITER_IDLE_S, SessionWriter, WriteJob

__all__ = [
    "DIR_MODE", "FILE_MODE", "SUFFIX", "WRITER_IDLE_S", "Kept", "SessionStats", "SessionStore", "session_key",
]  # fmt: skip

log = logging.getLogger("kvslim.engine")

#: How long make_room waits for the writes of parked sessions before it says "no room yet": short, so the
#: running rows of the caller's step are not held up (admission asks again at its next step), long enough
#: that an engine with nothing else to do does not spin while a write lands.
PARK_WAIT_S = 0.05


class SessionStore:
    """Idle sessions, least recently used first, in memory and on disk.

    session_dir: where sessions are written (created 0700 if missing, made 0700 if it is the user's; None:
    memory only, and a session that must make room is dropped). config: the model's config (to rebuild a
    cache from a file); device: where restored tensors go; model_fingerprint and dtype: the model's, recorded
    in each file and checked by the continuation rule when it is read back (pass both: a file saved from
    a float32 model is never continued by a bfloat16 one). max_sessions: at most this many sessions (memory
    and disk together; None: no bound); ttl: seconds a session may stay idle (None: forever).
    write_through: write every kept session to disk in the background (with a session_dir); False: only
    when it must leave memory (under the caller's lock, as before).

    Thread use: the engine calls every method from its own thread, under its lock; the writer thread shares
    the store's state under ``_cond`` and never takes the engine's lock.
    """

    def __init__(
        self,
        session_dir=None,
        *,
        config=None,
        device=None,
        model_fingerprint: str | None = None,
        dtype: torch.dtype | str | None = None,
        max_sessions: int | None = None,
        ttl: float | None = None,
        write_through: bool = True,
    ):
        if max_sessions is not None and (
            isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1
        ):
            raise ValueError(f"max_sessions must be an integer >= 1 (or None for no bound), got {max_sessions!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise ValueError(f"ttl must be a number of seconds > 0 (or None: sessions never expire), got {ttl!r}")
        self.files = None
        if session_dir is not None:
            self.files = SessionFiles(
                session_dir,
                config=config,
                device=device,
                model_fingerprint=model_fingerprint,
                new_cache=SlimCache.from_config,
            )
            session_dir = self.files.dir
        self.session_dir = session_dir
        self.config = config
        self.device = device
        self.model_fingerprint = model_fingerprint
        self.dtype = dtype
        self.max_sessions = max_sessions
        self.ttl = ttl
        self.write_through = bool(write_through)
        self.kept: OrderedDict[str, Kept] = OrderedDict()  # session id -> Kept, least recently used first
        self.stats = SessionStats()
        self._cond = threading.Condition(threading.RLock())
        self._ix = SessionIndex()
        self._kept_bytes = 0
        self.writer = SessionWriter(
            self._cond,
            snapshot=lambda kept: snapshot(kept.cache, kept.tokens, self.model_fingerprint),
            write=lambda state, key: self.files.write(state, key),
            landed=self._landed,
        )
        if self.files is not None:
            self._scan()

    # -- accounting ------------------------------------------------------------------------------
    def held(self, *, exclude: str | None = None) -> int:
        """Bytes of the idle sessions' caches the store holds in memory (all but ``exclude``'s), counting
        the caches of parked sessions whose write has not run yet."""
        with self._cond:
            own = self.kept[exclude].nbytes if exclude is not None and exclude in self.kept else 0
            return self._kept_bytes + self.writer.parked_bytes - own

    def on_disk(self) -> int:
        """Session files in ``session_dir`` (0 without one): a count kept by the store, not a listing."""
        return len(self._ix.files)

    def count(self) -> int:
        """Sessions the store holds (in memory, on disk, or in use by a running request): what
        ``max_sessions`` bounds."""
        return len(self._ix.last)

    def path(self, session: str) -> str | None:
        """The file of ``session`` in ``session_dir`` (None without one): named by the id's sha256."""
        if self.files is None:
            return None
        return self.files.path(session_key(session))

    # -- the engine's calls ----------------------------------------------------------------------
    def keep(self, session: str, cache, tokens, config: CacheConfig) -> None:
        """Keep ``cache`` (holding ``tokens``) as ``session``'s, the most recently used; an older copy in memory
        is replaced (its file is replaced when this one is written). The cache is handed over: the caller must
        not change it until :meth:`take` gives it back. With write-through it is written in the background.
        Then the bounds are applied (``max_sessions``, ``ttl``)."""
        key = session_key(session)
        try:
            kept = Kept(cache, tuple(tokens), config, int(cache.nbytes()))
        except BaseException:
            _release(Kept(cache, (), config, 0))  # never kept: a pool row goes back now
            raise
        with self._cond:
            ix = self._ix
            ix.taken.discard(key)
            old = self._pop_kept(session)
            if old is not None and old.cache is not cache:
                _release(old)
            self.kept[session] = kept
            self._kept_bytes += kept.nbytes
            ix.current.discard(key)
            self._ix.touch(key, session)
            if self._writes():
                self.writer.submit(key, session, kept)  # replaces a write of an older copy not begun
            else:
                old = self.writer.pending(key)
                if old is not None and not old.started:  # a write not begun: this newer copy replaces it
                    self.writer.cancel(old)
            self._cond.notify_all()
            self._bound(spare=key)
        self.expire()

    def take(self, session: str, prompt, config: CacheConfig):
        """The kept cache ``prompt`` continues, removed from the store: ``(cache, n_tokens_it_holds)``, or None
        when there is none to continue. None also when the continuation rule refuses what was kept (another
        history, other settings, a file of another model or dtype, a damaged file): the session starts over —
        what was kept is removed (memory and file), counted in ``reset`` and logged. Never raises."""
        key = session_key(session)
        try:
            return self._take(session, key, tuple(prompt), config)
        except Exception as e:  # noqa: BLE001 - a session never fails its request: it starts over
            log.warning("session %s starts over: continuing it failed (%s: %s)", _show(session), type(e).__name__, e)
            with self._cond:
                self.stats.reset += 1
                self._remove(key, session)
            return None

    def make_room(self, need: int, *, exclude: str | None = None) -> bool:
        """Free idle sessions' memory, least recently used first (never ``exclude``), until they hold at most
        ``need`` bytes; returns whether they do. A session whose file is current is only freed (no second
        write); one whose write is pending is freed when it lands (its write goes first; this waits up to
        PARK_WAIT_S for it, then returns False: ask again later); one without a current file is written now
        (write-through off or closed, or its write failed); without a session_dir it is dropped (counted)."""
        with self._cond:
            while self.held(exclude=exclude) > need:
                victim = next((s for s in self.kept if s != exclude), None)
                if victim is None:
                    break
                self._park(victim)
            else:
                return True
            # What is left are parked sessions whose writes are running (first in the writer's queue): their
            # memory is the room asked for, free once they land; wait a little for them (PARK_WAIT_S).
            return self._cond.wait_for(
                lambda: self.held(exclude=exclude) <= need or not self.writer.parked_bytes or self.writer.gone(),
                timeout=PARK_WAIT_S,
            ) and self.held(exclude=exclude) <= need

    def forget(self, session: str) -> None:
        """A session's request failed: the cache it was running on is gone. The session falls back to its file
        (the last finished turn) when it has one, else it is lost (counted in ``dropped``)."""
        key = session_key(session)
        with self._cond:
            ix = self._ix
            ix.taken.discard(key)
            job = self.writer.pending(key)
            if key in ix.files or (job is not None and not job.cancelled):
                log.warning("session %s: its request failed; it goes on from its last saved turn", _show(session))
                return
            self.stats.dropped += 1
            self._remove(key, session)
        log.warning("session %s dropped: its request failed", _show(session))

    def delete(self, session: str) -> bool:
        """Remove ``session`` (memory, pending write and file); False when the store holds none. A request
        running on it goes on; whether its end keeps the session again is the caller's choice (the engine's
        :meth:`~kvslim.engine.Engine.delete_session` makes it not)."""
        key = session_key(session)
        with self._cond:
            ix = self._ix
            found = session in self.kept or key in ix.files or key in self.writer.jobs or key in ix.last
            self._remove(key, session)
            ix.taken.discard(key)  # no request on it will hand it back (or, handing it back, re-adds it)
            if found:
                self.stats.deleted += 1
        return found

    def expire(self, now: float | None = None) -> int:
        """Remove the sessions idle longer than ``ttl`` seconds at ``now`` (time.time(); memory and disk, never
        one in use); returns how many. Cheap when none is due: the least recently used is looked at first."""
        if self.ttl is None:
            return 0
        now = time.time() if now is None else now
        with self._cond:
            due = self._ix.due(now, self.ttl)
            for key, session in due:
                self._remove(key, session)
            self.stats.expired += len(due)
        if due:
            log.info("%d session(s) expired after %g s idle", len(due), self.ttl)
        return len(due)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending write has landed (up to ``timeout`` seconds; None: as long as it takes).
        Returns whether none is left."""
        return self.writer.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush (up to ``timeout`` seconds) and stop the writer; returns whether every write landed. Later
        keeps stay in memory only (a session that must make room is written then, as without write-through)."""
        done = self.writer.close(timeout)
        if not done:
            log.warning("session writes still pending at close: those sessions keep their previous file (if any)")
        return done

    # -- under _cond -----------------------------------------------------------------------------
    def _writes(self) -> bool:
        return self.files is not None and self.write_through and not self.writer.closed

    def _pop_kept(self, session: str) -> Kept | None:
        kept = self.kept.pop(session, None)
        if kept is not None:
            self._kept_bytes -= kept.nbytes
        return kept

    def _remove(self, key: str, session: str | None) -> None:
        """Remove a session entirely: memory, pending write, file, index."""
        ix = self._ix
        entry = ix.last.pop(key, None)
        for s in {session, entry and entry.session} - {None}:
            _release(self._pop_kept(s))
        job = self.writer.pending(key)
        if job is not None:
            self.writer.cancel(job)
        ix.current.discard(key)
        if key in ix.files:
            ix.files.discard(key)
            self.files.unlink(key)

    def _bound(self, spare: str | None = None) -> None:
        """Remove the least recently used sessions (never one in use, nor ``spare``) beyond max_sessions."""
        victims = [] if self.max_sessions is None else self._ix.over(self.max_sessions, spare)
        if not victims:
            return
        for key, session in victims:
            self._remove(key, session)
        self.stats.discarded += len(victims)
        log.info("%d least recently used session(s) removed: max_sessions is %d", len(victims), self.max_sessions)

    def _take(self, session: str, key: str, prompt: tuple[int, ...], config: CacheConfig):
        with self._cond:
            ix = self._ix
            kept = self._pop_kept(session)
            job = self.writer.pending(key)
            if kept is None and job is not None and job.parked:  # parked, its write still pending: take it back
                kept = self.writer.unpark(job)
            if kept is not None:
                ix.current.discard(key)
                try:
                    saved = pc.SavedCache.of(
                        kept.cache, kept.tokens, cache_config=kept.config, model_fingerprint=self.model_fingerprint
                    )
                    n, why = self._rule(saved, prompt, config)
                except BaseException:
                    _release(kept)  # take() starts the session over: a pool row goes back with it
                    raise
                if n is None:
                    _release(kept)
                    self._start_over(session, key, why)
                    return None
                self._hold(key)
                self._continued(session, key, n)
                return kept.cache, n
            if key not in ix.files:
                return None
        return self._restore(session, key, prompt, config)

    def _rule(self, saved, prompt, config):
        """``(n, None)`` when the one continuation rule lets ``saved`` continue ``prompt`` holding its first
        ``n`` tokens (n > 0: a session holding nothing has nothing to continue), else ``(None, why)``."""
        try:
            n = pc.check_continuation(
                saved,
                prompt,
                cache_config=config,
                model_fingerprint=self.model_fingerprint,
                dtype=self.dtype,
                where="session",
            )
        except pc.CannotContinue as why:
            return None, why
        if n == 0:
            return None, pc.CannotContinue("session: it holds no tokens", "tokens")
        return n, None

    def _start_over(self, session: str, key: str, why) -> None:
        self.stats.reset += 1
        self._remove(key, session)
        level = logging.INFO if why.kind == "tokens" else logging.WARNING
        log.log(level, "session %s starts over: %s", _show(session), _after_where(why))

    def _continued(self, session: str, key: str, n: int) -> None:
        self._ix.taken.add(key)
        self._ix.touch(key, session)
        self.stats.continued += 1
        self.stats.reused_tokens += n

    def _hold(self, key: str) -> None:
        """The session's cache goes back to the engine, which will extend it: a pending write must have its
        snapshot first — taken here (a memory copy) when the writer has not begun, else awaited."""
        job = self.writer.pending(key)
        if job is None:
            return
        try:
            self.writer.hold(job)
        except Exception as e:  # noqa: BLE001 - no snapshot, no write: the file keeps the turn before
            log.warning("session %s: snapshot for its write failed (%s)", _show(job.session), e)
            self.stats.write_failed += 1
            self.writer.cancel(job)

    def _park(self, session: str) -> None:
        """Free ``session``'s memory (the least recently used idle one)."""
        kept = self._pop_kept(session)
        key = session_key(session)
        ix = self._ix
        if self.files is None:
            _release(kept)
            self.stats.dropped += 1
            ix.last.pop(key, None)
            log.warning(
                "session %s dropped (%d bytes, %d tokens) to make room: no session_dir to park it in",
                _show(session), kept.nbytes, len(kept.tokens),
            )  # fmt: skip
            return
        job = self.writer.pending(key)
        if job is not None and job.kept is kept and not job.cancelled:  # its write is pending: freed when done
            self.writer.park(job)
        elif key not in ix.current:  # no current file (write-through off, closed, or its write failed)
            try:
                self.files.save(kept.cache, kept.tokens, key)
            except Exception as e:  # noqa: BLE001 - a full disk: the session is lost, said out loud
                self.stats.dropped += 1
                self._remove(key, session)
                log.warning("session %s dropped: writing %s failed (%s)", _show(session), self.files.path(key), e)
                return
            ix.files.add(key)
            self.stats.written += 1
        self.stats.evicted += 1
        log.info("session %s parked in %s (%d bytes in memory freed)", _show(session), self.files.path(key), kept.nbytes)

    # -- disk ----------------------------------------------------------------------------------
    def _restore(self, session: str, key: str, prompt: tuple[int, ...], config: CacheConfig):
        """Continue ``session`` from its file (no copy in memory): the rule on its header and token ids first,
        then the load (checksum, shapes, levers, bias). Runs under the engine's lock."""
        try:
            saved = self.files.saved(key)
        except pc.CannotContinue as e:
            why = e
        else:
            n, why = self._rule(saved, prompt, config)
        if why is None:
            try:
                cache = self.files.load(key, config)
            except Exception as e:  # noqa: BLE001 - damaged past its header, or a bias that changed
                why = pc.CannotContinue(f"{e}", "damaged")
        with self._cond:
            if why is not None:
                self._start_over(session, key, why)
                return None
            self.stats.restored += 1
            self._continued(session, key, n)
        return cache, n

    def _scan(self) -> None:
        """Index the files an earlier server left (least recently used first, by mtime) and apply the bounds."""
        found = self.files.scan()
        with self._cond:
            for mtime, key in found:
                self._ix.touch(key, None, used=mtime)
                self._ix.files.add(key)
            self._bound()
        self.expire()

    def _landed(self, job: WriteJob, kept: Kept, ok: bool, error, *, latest: bool, parked: bool) -> None:
        """A write ended (under _cond): index its file, or undo it (cancelled meanwhile), or count the failure."""
        ix = self._ix
        if job.cancelled:
            if ok and job.key not in ix.files:  # removed while it was written: its file goes too
                with contextlib.suppress(OSError):
                    os.remove(self.files.path(job.key))
            return
        if ok:
            ix.files.add(job.key)
            self.stats.written += 1
            if latest and self.kept.get(job.session) is kept:
                ix.current.add(job.key)
            return
        self.stats.write_failed += 1
        log.warning("session %s: writing %s failed (%s)", _show(job.session), self.files.path(job.key), error)
        if parked and latest and job.key not in ix.files:  # this write held its only copy: lost
            self.stats.dropped += 1
            ix.last.pop(job.key, None)
            log.warning("session %s dropped: it was parked and its write failed", _show(job.session))


def _show(session: str) -> str:
    """A session id for a log line: its repr, cut at 80 characters."""
    text = repr(session)
    return text if len(text) <= 80 else text[:77] + "..."


def _after_where(e: Exception) -> str:
    return str(e).removeprefix("session: ")
