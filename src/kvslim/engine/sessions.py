"""Sessions: a conversation's compressed cache kept between its requests, written through to disk, restored.

When a request that names a ``session`` finishes, the engine hands its cache to the :class:`SessionStore`
with the token ids the cache holds (the prompt, then every generated token but the last, which was never
fed). A later request of that session continues on the kept cache when the one continuation rule
(:func:`kvslim.promptcache.check_continuation`, shared with ``kvslim sample --prompt-cache``) allows it:
the same model, dtype and cache settings, and a prompt that *starts with* those ids — then only the tokens
past them are prefilled. Otherwise the session starts over: the request is prefilled from scratch and what
was kept is removed (memory and file), counted in ``reset`` and logged with the rule's reason. That covers an
edited history, other settings, and a file that cannot be continued: saved by another model or with
another dtype (a server restarted with ``--dtype bfloat16``), other settings, or damaged bytes.
:meth:`SessionStore.take` never raises. A compressed cache is never cropped or re-quantized here: it is
continued as it is or not at all — the rule llama.cpp's slots and ``--prompt-cache`` follow.

Disk (``session_dir``, created 0700, files 0600; a file is named by the sha256 of the session id's UTF-8
bytes, so a server restarted on the same directory finds them): with ``write_through`` every kept session
is also written to its file by a background writer thread, soon after the turn ends and never under the
engine's lock, so a ``kill -9`` loses at most the turns in flight. :meth:`~SessionStore.keep` hands the
cache over; the writer first takes a snapshot (CPU copies, :func:`kvslim.promptcache.to_state`), then
writes it (:func:`~kvslim.promptcache.write_state`: a temporary beside the target, checked, renamed). If
the session comes back before its write has taken the snapshot, :meth:`~SessionStore.take` takes the
snapshot itself (a memory copy) or waits for the writer's to finish, so the writer never reads a cache the
engine is extending; the file then holds the previous turn, replaced at the next keep. A file stays while
its session runs (it is the last finished turn: a request that fails falls back to it).

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
lock (reading is not moved off it yet). This module knows no HTTP, no tokenizer and no scheduling.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from .. import promptcache as pc
from ..atomic import TMP_TAG, remove_stale
from ..config import CacheConfig

log = logging.getLogger("kvslim.engine")

#: Session files: ``<sha256 of the id>.safetensors``, private to the user the server runs as.
SUFFIX = ".safetensors"
FILE_MODE = 0o600
DIR_MODE = 0o700
#: How long make_room waits for the writes of parked sessions before it says "no room yet": short, so the
#: running rows of the caller's step are not held up (admission asks again at its next step), long enough
#: that an engine with nothing else to do does not spin while a write lands.
PARK_WAIT_S = 0.05
#: The writer thread ends after this many idle seconds (a store that stopped writing holds no thread).
WRITER_IDLE_S = 30.0


def session_key(session: str) -> str:
    """The sha256 hex of a session id's UTF-8 bytes: its file's name. An id that is not valid UTF-8 (a lone
    surrogate such as ``"\\ud800"``) still gets a key (its surrogates encoded as they stand), never an error."""
    return hashlib.sha256(session.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(eq=False)
class Kept:
    """One idle session in memory: its cache, the token ids it holds, its settings, its bytes."""

    cache: object  # SlimCache
    tokens: tuple[int, ...]
    config: CacheConfig
    nbytes: int


@dataclass
class SessionStats:
    """Counters since the store was made (what ``/metrics`` shows).

    continued: requests that continued a kept session; reused_tokens: prompt tokens they did not prefill;
    reset: requests whose session started over because the continuation rule refused what was kept — the
    prompt does not start with its tokens, other settings, or a file saved by another model, with another
    dtype, or damaged (each logged with the reason); evicted: idle sessions whose memory was freed to make
    room, their file current or being written; restored: sessions read back from disk; dropped: sessions
    lost — freed to make room without a session_dir, a failed request with no file to fall back to, a
    parked session whose write failed; expired: removed after ``ttl`` idle seconds; deleted: removed by
    :meth:`SessionStore.delete`; discarded: removed, least recently used first, to stay within
    ``max_sessions``; written: files written; write_failed: writes that failed (logged)."""

    continued: int = 0
    reused_tokens: int = 0
    reset: int = 0
    evicted: int = 0
    restored: int = 0
    dropped: int = 0
    expired: int = 0
    deleted: int = 0
    discarded: int = 0
    written: int = 0
    write_failed: int = 0


@dataclass(eq=False)
class _Write:
    """One write-through of a session: ``kept`` is handed over by keep() and referenced until the write ends;
    ``state`` is its snapshot (taken by the writer, or by take() if the session returns first). started: the
    writer picked it; snapshotted: ``state`` is taken, so the cache may change; cancelled: the session was
    removed or kept again (a started write's file is removed when it lands); parked: the session left memory
    while the write was pending, so ``kept`` is its only copy (its bytes count in held())."""

    key: str
    session: str
    kept: Kept | None
    state: tuple | None = None
    started: bool = False
    snapshotted: bool = False
    cancelled: bool = False
    parked: bool = False


@dataclass(eq=False)
class _Entry:
    """A session the store holds (memory, disk or both): its id (None for a file found at start, known only
    by its name) and when it was last used (time.time(); a file's mtime at start)."""

    session: str | None
    used: float


@dataclass(eq=False)
class _Index:
    """Which sessions exist where, least recently used first. All fields under SessionStore._cond."""

    last: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)  # key -> entry, LRU first
    files: set[str] = field(default_factory=set)  # keys with a complete file
    current: set[str] = field(default_factory=set)  # keys whose file holds exactly the copy in memory
    taken: set[str] = field(default_factory=set)  # keys a running request is continuing
    jobs: dict[str, _Write] = field(default_factory=dict)  # key -> its latest write, queued or running
    queue: deque[str] = field(default_factory=deque)  # keys to write, oldest first


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
        if session_dir is not None:
            session_dir = os.fspath(session_dir)
            _private_dir(session_dir)
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
        self._ix = _Index()
        self._kept_bytes = 0
        self._parked_bytes = 0  # caches only a pending write holds (parked before their write ran)
        self._writer: threading.Thread | None = None
        self._running: _Write | None = None  # the job the writer is on
        self._closed = False
        if session_dir is not None:
            self._scan()

    # -- accounting ------------------------------------------------------------------------------
    def held(self, *, exclude: str | None = None) -> int:
        """Bytes of the idle sessions' caches the store holds in memory (all but ``exclude``'s), counting
        the caches of parked sessions whose write has not run yet."""
        with self._cond:
            own = self.kept[exclude].nbytes if exclude is not None and exclude in self.kept else 0
            return self._kept_bytes + self._parked_bytes - own

    def on_disk(self) -> int:
        """Session files in ``session_dir`` (0 without one): a count kept by the store, not a listing."""
        return len(self._ix.files)

    def count(self) -> int:
        """Sessions the store holds (in memory, on disk, or in use by a running request): what
        ``max_sessions`` bounds."""
        return len(self._ix.last)

    def path(self, session: str) -> str | None:
        """The file of ``session`` in ``session_dir`` (None without one): named by the id's sha256."""
        if self.session_dir is None:
            return None
        return self._file(session_key(session))

    # -- the engine's calls ----------------------------------------------------------------------
    def keep(self, session: str, cache, tokens, config: CacheConfig) -> None:
        """Keep ``cache`` (holding ``tokens``) as ``session``'s, the most recently used; an older copy in memory
        is replaced (its file is replaced when this one is written). The cache is handed over: the caller must
        not change it until :meth:`take` gives it back. With write-through it is written in the background.
        Then the bounds are applied (``max_sessions``, ``ttl``)."""
        key = session_key(session)
        kept = Kept(cache, tuple(tokens), config, int(cache.nbytes()))
        with self._cond:
            ix = self._ix
            ix.taken.discard(key)
            self._pop_kept(session)
            old = ix.jobs.get(key)
            if old is not None and not old.started:  # a write not begun: this newer copy replaces it
                self._cancel(old)
            self.kept[session] = kept
            self._kept_bytes += kept.nbytes
            ix.current.discard(key)
            self._touch(key, session)
            if self._writes():
                ix.jobs[key] = _Write(key, session, kept)
                ix.queue.append(key)
                self._start_writer()
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
                lambda: self.held(exclude=exclude) <= need or not self._parked_bytes or self._writer_gone(),
                timeout=PARK_WAIT_S,
            ) and self.held(exclude=exclude) <= need

    def forget(self, session: str) -> None:
        """A session's request failed: the cache it was running on is gone. The session falls back to its file
        (the last finished turn) when it has one, else it is lost (counted in ``dropped``)."""
        key = session_key(session)
        with self._cond:
            ix = self._ix
            ix.taken.discard(key)
            job = ix.jobs.get(key)
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
            found = session in self.kept or key in ix.files or key in ix.jobs or key in ix.last
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
            due = []
            for key, entry in self._ix.last.items():
                if now - entry.used <= self.ttl:
                    break
                if key not in self._ix.taken:
                    due.append((key, entry.session))
            for key, session in due:
                self._remove(key, session)
            self.stats.expired += len(due)
        if due:
            log.info("%d session(s) expired after %g s idle", len(due), self.ttl)
        return len(due)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending write has landed (up to ``timeout`` seconds; None: as long as it takes).
        Returns whether none is left."""
        with self._cond:
            return self._cond.wait_for(self._idle_writer, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush (up to ``timeout`` seconds) and stop the writer; returns whether every write landed. Later
        keeps stay in memory only (a session that must make room is written then, as without write-through)."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(timeout)
        if not done:
            log.warning("session writes still pending at close: those sessions keep their previous file (if any)")
        return done

    # -- under _cond -----------------------------------------------------------------------------
    def _writes(self) -> bool:
        return self.session_dir is not None and self.write_through and not self._closed

    def _writer_gone(self) -> bool:
        return self._writer is None or not self._writer.is_alive()

    def _idle_writer(self) -> bool:
        return not self._ix.queue and self._running is None

    def _file(self, key: str) -> str:
        return os.path.join(self.session_dir, key + SUFFIX)

    def _touch(self, key: str, session: str) -> None:
        """``key`` (of ``session``) used now: the most recently used."""
        self._ix.last.pop(key, None)
        self._ix.last[key] = _Entry(session, time.time())

    def _pop_kept(self, session: str) -> Kept | None:
        kept = self.kept.pop(session, None)
        if kept is not None:
            self._kept_bytes -= kept.nbytes
        return kept

    def _cancel(self, job: _Write) -> None:
        """The job's session was removed or kept again: it writes nothing (a started one's file is removed
        when it lands) and holds nothing."""
        job.cancelled = True
        self._let_go(job)
        if self._ix.jobs.get(job.key) is job:
            del self._ix.jobs[job.key]

    def _let_go(self, job: _Write) -> None:
        if job.parked:
            self._parked_bytes -= job.kept.nbytes
            job.parked = False
        job.kept = None

    def _remove(self, key: str, session: str | None) -> None:
        """Remove a session entirely: memory, pending write, file, index."""
        ix = self._ix
        entry = ix.last.pop(key, None)
        for s in {session, entry and entry.session} - {None}:
            self._pop_kept(s)
        job = ix.jobs.get(key)
        if job is not None:
            self._cancel(job)
        ix.current.discard(key)
        if key in ix.files:
            ix.files.discard(key)
            self._unlink(key)

    def _unlink(self, key: str) -> None:
        try:
            os.remove(self._file(key))
        except FileNotFoundError:
            pass
        except OSError as e:  # a file we cannot remove stays; the session is gone from the store all the same
            log.warning("session file %s could not be removed: %s", self._file(key), e)

    def _bound(self, spare: str | None = None) -> None:
        """Remove the least recently used sessions (never one in use, nor ``spare``) beyond max_sessions."""
        if self.max_sessions is None:
            return
        excess = len(self._ix.last) - self.max_sessions
        if excess <= 0:
            return
        victims = []
        for key, entry in self._ix.last.items():
            if key != spare and key not in self._ix.taken:
                victims.append((key, entry.session))
                if len(victims) == excess:
                    break
        for key, session in victims:
            self._remove(key, session)
        self.stats.discarded += len(victims)
        log.info("%d least recently used session(s) removed: max_sessions is %d", len(victims), self.max_sessions)

    def _take(self, session: str, key: str, prompt: tuple[int, ...], config: CacheConfig):
        with self._cond:
            ix = self._ix
            kept = self._pop_kept(session)
            job = ix.jobs.get(key)
            if kept is None and job is not None and job.parked:  # parked, its write still pending: take it back
                kept = job.kept
                self._parked_bytes -= kept.nbytes
                job.parked = False
            if kept is not None:
                ix.current.discard(key)
                saved = pc.SavedCache.of(
                    kept.cache, kept.tokens, cache_config=kept.config, model_fingerprint=self.model_fingerprint
                )
                n, why = self._rule(saved, prompt, config)
                if n is None:
                    self._start_over(session, key, why)
                    return None
                self._hold(key)
                self._continued(session, key, n)
                return kept.cache, n
            if key not in ix.files:
                return None
        return self._restore(session, key, prompt, config)

    def _rule(self, saved, prompt, config):
        n, why = pc.can_continue(
            saved,
            prompt,
            cache_config=config,
            model_fingerprint=self.model_fingerprint,
            dtype=self.dtype,
            where="session",
        )
        if n == 0:  # nothing held: nothing to continue
            return None, pc.CannotContinue("session: it holds no tokens", "tokens")
        return n, why

    def _start_over(self, session: str, key: str, why) -> None:
        self.stats.reset += 1
        self._remove(key, session)
        level = logging.INFO if why.kind == "tokens" else logging.WARNING
        log.log(level, "session %s starts over: %s", _show(session), _after_where(why))

    def _continued(self, session: str, key: str, n: int) -> None:
        self._ix.taken.add(key)
        self._touch(key, session)
        self.stats.continued += 1
        self.stats.reused_tokens += n

    def _hold(self, key: str) -> None:
        """The session's cache goes back to the engine, which will extend it: a pending write must have its
        snapshot first — taken here (a memory copy) when the writer has not begun, else awaited."""
        job = self._ix.jobs.get(key)
        if job is None or job.cancelled or job.snapshotted:
            return
        if not job.started:
            try:
                job.state = _snapshot(job.kept, self.model_fingerprint)
                job.snapshotted = True
            except Exception as e:  # noqa: BLE001 - no snapshot, no write: the file keeps the turn before
                log.warning("session %s: snapshot for its write failed (%s)", _show(job.session), e)
                self.stats.write_failed += 1
                self._cancel(job)
            return
        while not job.snapshotted and not job.cancelled:
            if not self._cond.wait(timeout=5.0) and self._writer_gone():
                self._cancel(job)  # the writer is gone (it never dies on a write; this is a last resort)

    def _park(self, session: str) -> None:
        """Free ``session``'s memory (the least recently used idle one)."""
        kept = self._pop_kept(session)
        key = session_key(session)
        ix = self._ix
        if self.session_dir is None:
            self.stats.dropped += 1
            ix.last.pop(key, None)
            log.warning(
                "session %s dropped (%d bytes, %d tokens) to make room: no session_dir to park it in",
                _show(session), kept.nbytes, len(kept.tokens),
            )  # fmt: skip
            return
        job = ix.jobs.get(key)
        if job is not None and job.kept is kept and not job.cancelled:  # its write is pending: freed when done
            job.parked = True
            self._parked_bytes += kept.nbytes
            if not job.started:
                ix.queue.appendleft(key)  # written next: its memory is wanted
        elif key not in ix.current:  # no current file (write-through off, closed, or its write failed)
            try:
                pc.save(
                    kept.cache,
                    self._file(key),
                    token_ids=torch.tensor([kept.tokens], dtype=torch.long),
                    model_fingerprint=self.model_fingerprint,
                    mode=FILE_MODE,
                )
            except Exception as e:  # noqa: BLE001 - a full disk: the session is lost, said out loud
                self.stats.dropped += 1
                self._remove(key, session)
                log.warning("session %s dropped: writing %s failed (%s)", _show(session), self._file(key), e)
                return
            ix.files.add(key)
            self.stats.written += 1
        self.stats.evicted += 1
        log.info("session %s parked in %s (%d bytes in memory freed)", _show(session), self._file(key), kept.nbytes)

    # -- disk ----------------------------------------------------------------------------------
    def _restore(self, session: str, key: str, prompt: tuple[int, ...], config: CacheConfig):
        """Continue ``session`` from its file (no copy in memory): the rule on its header and token ids first,
        then the load (checksum, shapes, levers, bias). Runs under the engine's lock."""
        path = self._file(key)
        try:
            saved = pc.SavedCache.read(path)
        except pc.CannotContinue as e:
            why = e
        else:
            n, why = self._rule(saved, prompt, config)
        if why is None:
            try:
                restored = pc.load(
                    path,
                    config=self.config,
                    model_fingerprint=self.model_fingerprint,
                    device=self.device,
                    cache_config=config,
                    mean_center=config.mean_center,
                )
            except Exception as e:  # noqa: BLE001 - damaged past its header, or a bias that changed
                why = pc.CannotContinue(f"{e}", "damaged")
        with self._cond:
            if why is not None:
                self._start_over(session, key, why)
                return None
            self.stats.restored += 1
            self._continued(session, key, n)
        return restored.cache, n

    def _scan(self) -> None:
        """Index the files an earlier server left (least recently used first, by mtime), remove temporaries a
        killed writer left, and apply the bounds to them."""
        remove_stale(self.session_dir, f".*{TMP_TAG}*", max_age_s=60.0)
        remove_stale(self.session_dir, ".tmp*", max_age_s=60.0)  # safetensors' own temporaries (save_file)
        found = []
        with os.scandir(self.session_dir) as it:
            for entry in it:
                name = entry.name
                key = name[: -len(SUFFIX)]
                if not name.endswith(SUFFIX) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                    continue
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        found.append((entry.stat(follow_symlinks=False).st_mtime, key))
        with self._cond:
            for mtime, key in sorted(found):
                self._ix.last[key] = _Entry(None, mtime)
                self._ix.files.add(key)
            self._bound()
        self.expire()

    def _start_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="kvslim-session-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        """The writer thread: one job at a time, snapshot then file; it never dies of a write."""
        while True:
            with self._cond:
                while not self._ix.queue and not self._closed:
                    if not self._cond.wait(WRITER_IDLE_S) and not self._ix.queue:
                        break  # idle: the thread ends, the next keep() starts another
                if not self._ix.queue:
                    if self._writer is threading.current_thread():
                        self._writer = None
                    return
                key = self._ix.queue.popleft()
                job = self._ix.jobs.get(key)
                if job is None or job.started or job.cancelled:
                    continue
                job.started = True
                self._running = job
                kept, state = job.kept, job.state  # a cancel lets go of job.kept; the snapshot still reads it
            ok, error = False, None
            try:
                if state is None:
                    try:
                        state = _snapshot(kept, self.model_fingerprint)
                    finally:
                        with self._cond:
                            job.state, job.snapshotted = state, True
                            self._cond.notify_all()
                if not job.cancelled:
                    pc.write_state(*state, self._file(job.key), mode=FILE_MODE)
                    ok = True
            except Exception as e:  # noqa: BLE001 - a full disk, a removed directory: logged and counted
                error = e
            finally:
                with self._cond:
                    try:
                        self._landed(job, kept, ok, error)
                    finally:
                        self._running = None
                        self._cond.notify_all()

    def _landed(self, job: _Write, kept: Kept, ok: bool, error) -> None:
        """A write ended (under _cond): index its file, or undo it (cancelled meanwhile), or count the failure."""
        ix = self._ix
        job.state = None
        latest = ix.jobs.get(job.key) is job
        if latest:
            del ix.jobs[job.key]
        parked = job.parked
        self._let_go(job)
        if job.cancelled:
            if ok and job.key not in ix.files:  # removed while it was written: its file goes too
                with contextlib.suppress(OSError):
                    os.remove(self._file(job.key))
            return
        if ok:
            ix.files.add(job.key)
            self.stats.written += 1
            if latest and self.kept.get(job.session) is kept:
                ix.current.add(job.key)
            return
        self.stats.write_failed += 1
        log.warning("session %s: writing %s failed (%s)", _show(job.session), self._file(job.key), error)
        if parked and latest and job.key not in ix.files:  # this write held its only copy: lost
            self.stats.dropped += 1
            ix.last.pop(job.key, None)
            log.warning("session %s dropped: it was parked and its write failed", _show(job.session))


def _snapshot(kept: Kept, fingerprint: str | None) -> tuple:
    """(tensors, header) of a kept session: CPU copies, so the cache may change once this returns."""
    return pc.to_state(
        kept.cache, token_ids=torch.tensor([kept.tokens], dtype=torch.long), model_fingerprint=fingerprint
    )


def _private_dir(path: str) -> None:
    """Create ``path`` 0700, or make an existing directory of this user 0700 (session files hold
    conversations); a directory of another user is used as it is, with a warning if others can read it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"session_dir {path!r} is a file; expected a directory (or a new path)")
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    if mode == DIR_MODE:
        return
    if not hasattr(os, "geteuid") or st.st_uid == os.geteuid():
        os.chmod(path, DIR_MODE)
        if mode & 0o077:
            log.warning("session_dir %s was mode %o; made it %o (its files hold conversations)", path, mode, DIR_MODE)
    elif mode & 0o077:
        log.warning("session_dir %s belongs to another user and is mode %o: others may list it", path, mode)


def _show(session: str) -> str:
    """A session id for a log line: its repr, cut at 80 characters."""
    text = repr(session)
    return text if len(text) <= 80 else text[:77] + "..."


def _after_where(e: Exception) -> str:
    return str(e).removeprefix("session: ")
