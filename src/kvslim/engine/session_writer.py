"""The write-through writer: one background thread that writes kept sessions to their files.

A kept session is handed over as a :class:`WriteJob`; the thread takes one job at a time, first a
snapshot of its cache (CPU copies), then the file, never under the engine's lock, and never dies of a
write (a full disk, a removed directory: the failure is handed to the store, which logs and counts it).
Jobs are keyed by session: a newer copy kept before its predecessor's write began replaces it. The
thread ends after :data:`WRITER_IDLE_S` idle seconds (a store that stopped writing holds no thread) and
the next job starts another.

The writer shares the store's condition (``cond``): every field here is read and changed under it, and
it is notified whenever a snapshot is taken or a write lands. The job's cache is referenced until the
write ends; a job is *parked* when its session left memory while the write was pending (its bytes count
in :attr:`SessionWriter.parked_bytes` until then).

This module knows the queue, the thread and the jobs' life. It knows nothing about which sessions
exist, their bounds (:mod:`kvslim.engine.sessions`) or the files' format and names
(:mod:`kvslim.engine.session_files`: what ``snapshot`` and ``write`` do).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: The writer thread ends after this many idle seconds (a store that stopped writing holds no thread).
WRITER_IDLE_S = 30.0


@dataclass(eq=False)
class WriteJob:
    """One write-through of a session: ``kept`` is handed over by keep() and referenced until the write ends;
    ``state`` is its snapshot (taken by the writer, or by take() if the session returns first). started: the
    writer picked it; snapshotted: ``state`` is taken, so the cache may change; cancelled: the session was
    removed or kept again (a started write's file is removed when it lands); parked: the session left memory
    while the write was pending, so ``kept`` is its only copy (its bytes count in parked_bytes)."""

    key: str
    session: str
    kept: object | None  # sessions.Kept: cache, tokens, config, nbytes
    state: tuple | None = None
    started: bool = False
    snapshotted: bool = False
    cancelled: bool = False
    parked: bool = False


class SessionWriter:
    """The queue of write jobs and the thread that runs them.

    cond: the store's condition (held around every call here but :meth:`flush` and :meth:`close`, which
    take it). snapshot(kept) -> state: CPU copies of a kept session's cache; write(state, key): the file;
    landed(job, kept, ok, error, latest=, parked=): called under ``cond`` when a job's write ended (``ok``, or
    the exception; ``latest``: no newer job for its key came; ``parked``: it held the session's only copy)."""

    def __init__(
        self,
        cond: threading.Condition,
        *,
        snapshot: Callable[[object], tuple],
        write: Callable[[tuple, str], None],
        landed: Callable[..., None],
    ):
        self.cond = cond
        self.snapshot = snapshot
        self.write = write
        self.landed = landed
        self.jobs: dict[str, WriteJob] = {}  # key -> its latest job, queued or running
        self.queue: deque[str] = deque()  # keys to write, oldest first
        self.parked_bytes = 0  # caches only a pending job holds (parked before their write ran)
        self.running: WriteJob | None = None  # the job the thread is on
        self.thread: threading.Thread | None = None
        self.closed = False

    # -- under cond ------------------------------------------------------------------------------
    def submit(self, key: str, session: str, kept) -> None:
        """Queue a write of ``kept`` as ``session``'s (a job not begun for it is replaced)."""
        old = self.jobs.get(key)
        if old is not None and not old.started:
            self.cancel(old)
        self.jobs[key] = WriteJob(key, session, kept)
        self.queue.append(key)
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._loop, name="kvslim-session-writer", daemon=True)
            self.thread.start()

    def pending(self, key: str) -> WriteJob | None:
        """``key``'s latest job, queued or running (None: none)."""
        return self.jobs.get(key)

    def park(self, job: WriteJob) -> None:
        """``job``'s session left memory: the job holds its only copy (counted) and is written next."""
        job.parked = True
        self.parked_bytes += job.kept.nbytes
        if not job.started:
            self.queue.appendleft(job.key)  # written next: its memory is wanted

    def unpark(self, job: WriteJob):
        """A parked session taken back before its write ran: its kept copy, no longer counted here."""
        self.parked_bytes -= job.kept.nbytes
        job.parked = False
        return job.kept

    def cancel(self, job: WriteJob) -> None:
        """The job's session was removed or kept again: it writes nothing (a started one's file is removed
        when it lands) and holds nothing."""
        job.cancelled = True
        self.release(job)
        if self.jobs.get(job.key) is job:
            del self.jobs[job.key]

    def release(self, job: WriteJob) -> None:
        """The job lets go of its cache (and its parked bytes)."""
        if job.parked:
            self.parked_bytes -= job.kept.nbytes
            job.parked = False
        job.kept = None

    def hold(self, job: WriteJob) -> None:
        """``job``'s cache goes back to the engine, which will extend it: the job must have its snapshot
        first — taken here (a memory copy) when the thread has not begun it, else awaited. A snapshot that
        fails raises (the caller cancels the job: no snapshot, no write)."""
        if job.cancelled or job.snapshotted:
            return
        if not job.started:
            job.state = self.snapshot(job.kept)
            job.snapshotted = True
            return
        while not job.snapshotted and not job.cancelled:
            if not self.cond.wait(timeout=5.0) and self.gone():
                self.cancel(job)  # the thread is gone (it never dies on a write; this is a last resort)

    def gone(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def idle(self) -> bool:
        return not self.queue and self.running is None

    # -- from the engine's thread ------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending write has landed (up to ``timeout`` seconds; None: as long as it takes).
        Returns whether none is left."""
        with self.cond:
            return self.cond.wait_for(self.idle, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush (up to ``timeout`` seconds) and stop the thread; returns whether every write landed."""
        done = self.flush(timeout)
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            thread = self.thread
        if thread is not None:
            thread.join(timeout)
        return done

    # -- the thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        """One job at a time, snapshot then file; it never dies of a write."""
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    if not self.cond.wait(WRITER_IDLE_S) and not self.queue:
                        break  # idle: the thread ends, the next submit() starts another
                if not self.queue:
                    if self.thread is threading.current_thread():
                        self.thread = None
                    return
                key = self.queue.popleft()
                job = self.jobs.get(key)
                if job is None or job.started or job.cancelled:
                    continue
                job.started = True
                self.running = job
                kept, state = job.kept, job.state  # a cancel lets go of job.kept; the snapshot still reads it
            ok, error = False, None
            try:
                if state is None:
                    try:
                        state = self.snapshot(kept)
                    finally:
                        with self.cond:
                            job.state, job.snapshotted = state, True
                            self.cond.notify_all()
                if not job.cancelled:
                    self.write(state, job.key)
                    ok = True
            except Exception as e:  # noqa: BLE001 - a full disk, a removed directory: the store logs and counts
                error = e
            finally:
                with self.cond:
                    try:
                        self._landed(job, kept, ok, error)
                    finally:
                        self.running = None
                        self.cond.notify_all()

    def _landed(self, job: WriteJob, kept, ok: bool, error) -> None:
        job.state = None
        latest = self.jobs.get(job.key) is job
        if latest:
            del self.jobs[job.key]
        parked = job.parked
        self.release(job)
        self.landed(job, kept, ok, error, latest=latest, parked=parked)
