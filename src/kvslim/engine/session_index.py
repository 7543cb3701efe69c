"""The session table's index and counters: which sessions exist where, least recently used first.

A session is known by its key (:func:`~kvslim.engine.session_files.session_key`) and held in memory, on
disk, or both, or taken by a running request. :class:`SessionIndex` keeps that, in least recently used
order, and answers the two bound questions — which sessions are idle past a TTL (:meth:`~SessionIndex.due`)
and which must go to stay within a count (:meth:`~SessionIndex.over`) — without removing anything: the
store (:mod:`kvslim.engine.sessions`) does, memory, pending write and file together. :class:`SessionStats`
are the counters ``/metrics`` shows; :class:`Kept` is one idle session in memory, :func:`release` what leaving does.

This module reads no cache, no file and no thread (the store holds its lock around every call).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..config import CacheConfig


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
    :meth:`~kvslim.engine.sessions.SessionStore.delete`; discarded: removed, least recently used first, to
    stay within ``max_sessions``; written: files written; write_failed: writes that failed (logged)."""

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
class Entry:
    """A session the store holds (memory, disk or both): its id (None for a file found at start, known only
    by its name) and when it was last used (time.time(); a file's mtime at start)."""

    session: str | None
    used: float


@dataclass(eq=False)
class SessionIndex:
    """Which sessions exist where, least recently used first."""

    last: OrderedDict[str, Entry] = field(default_factory=OrderedDict)  # key -> entry, LRU first
    files: set[str] = field(default_factory=set)  # keys with a complete file
    current: set[str] = field(default_factory=set)  # keys whose file holds exactly the copy in memory
    taken: set[str] = field(default_factory=set)  # keys a running request is continuing

    def touch(self, key: str, session: str | None, used: float | None = None) -> None:
        """``key`` (of ``session``) used at ``used`` (None: now): the most recently used."""
        self.last.pop(key, None)
        self.last[key] = Entry(session, time.time() if used is None else used)

    def due(self, now: float, ttl: float) -> list[tuple[str, str | None]]:
        """``(key, session)`` of the sessions idle longer than ``ttl`` seconds at ``now``, never one taken.
        Cheap when none is due: the least recently used is looked at first."""
        due = []
        for key, entry in self.last.items():
            if now - entry.used <= ttl:
                break
            if key not in self.taken:
                due.append((key, entry.session))
        return due

    def over(self, max_sessions: int, spare: str | None = None) -> list[tuple[str, str | None]]:
        """``(key, session)`` of the least recently used sessions beyond ``max_sessions`` (never one taken,
        nor ``spare``)."""
        excess = len(self.last) - max_sessions
        victims: list[tuple[str, str | None]] = []
        if excess <= 0:
            return victims
        for key, entry in self.last.items():
            if key != spare and key not in self.taken:
                victims.append((key, entry.session))
                if len(victims) == excess:
                    break
        return victims


@dataclass(eq=False)
class Kept:
    """One idle session in memory: its cache, the token ids it holds, its settings, its bytes."""

    cache: object  # SlimCache
    tokens: tuple[int, ...]
    config: CacheConfig
    nbytes: int


def release(kept: Kept | None) -> None:
    """A kept cache leaves for good: a row of the engine's page pool (:class:`~kvslim.engine.pages.PooledCache`) back."""
    release = getattr(kept and kept.cache, "release", None)
    if release is not None:
        release()
