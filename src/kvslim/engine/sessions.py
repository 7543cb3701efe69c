"""Sessions: a conversation's compressed cache kept between its requests, parked on disk, restored.

When a request that names a ``session`` finishes, the engine hands its cache to the :class:`SessionStore`
with the token ids the cache holds (the prompt, then every generated token but the last, which was never
fed). A later request of that session whose prompt *starts with* those ids continues on the kept cache:
only the tokens past them are prefilled. A prompt that does not start with them (the client edited the
history), or that asks for other cache settings, drops the kept cache and is prefilled from scratch
(counted in ``reset``). A compressed cache is never cropped or re-quantized here: it is continued as it is
or not at all — the rule llama.cpp's slots and ``--prompt-cache`` follow.

Memory: an idle session's cache counts against the engine's memory budget. When admission needs room, the
least recently used idle sessions are written to ``session_dir`` (:func:`kvslim.promptcache.to_state`
through its atomic :func:`~kvslim.promptcache.save`: a temporary beside the target, checked, renamed) and
their memory freed; they are read back (:func:`~kvslim.promptcache.load`) when their session returns. A
session file is named by the sha256 of the session id, so a server restarted on the same directory finds
the sessions an earlier one parked. Without a ``session_dir`` an idle session that must make room is
dropped — counted in ``dropped`` and logged, never silently.

This module knows no HTTP, no tokenizer and no scheduling: the engine calls it, under its lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..config import CacheConfig

log = logging.getLogger("kvslim.engine")


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
    reset: requests whose session cache was dropped because the prompt did not start with its tokens or
    asked for other settings; evicted: sessions written to disk to make room; restored: read back;
    dropped: idle sessions dropped to make room (no session_dir) or lost (a failed request, an unreadable
    file)."""

    continued: int = 0
    reused_tokens: int = 0
    reset: int = 0
    evicted: int = 0
    restored: int = 0
    dropped: int = 0


class SessionStore:
    """Idle sessions, least recently used first, in memory and on disk.

    session_dir: where idle sessions go when memory is needed (created if missing; None: they are dropped).
    config: the model's config (to rebuild a cache from a file); device: where restored tensors go;
    model_fingerprint: recorded in each file and checked when it is read back.
    """

    def __init__(self, session_dir=None, *, config=None, device=None, model_fingerprint: str | None = None):
        if session_dir is not None:
            session_dir = os.fspath(session_dir)
            if os.path.exists(session_dir) and not os.path.isdir(session_dir):
                raise ValueError(f"session_dir {session_dir!r} is a file; expected a directory (or a new path)")
            os.makedirs(session_dir, exist_ok=True)
        self.session_dir = session_dir
        self.config = config
        self.device = device
        self.model_fingerprint = model_fingerprint
        self.kept: OrderedDict[str, Kept] = OrderedDict()  # least recently used first
        self.stats = SessionStats()

    # -- accounting ------------------------------------------------------------------------------
    def held(self, *, exclude: str | None = None) -> int:
        """Bytes the idle sessions in memory hold (all but ``exclude``'s)."""
        return sum(k.nbytes for s, k in self.kept.items() if s != exclude)

    def on_disk(self) -> int:
        """Session files in ``session_dir`` (0 without one)."""
        if self.session_dir is None:
            return 0
        return sum(1 for n in os.listdir(self.session_dir) if n.endswith(".safetensors"))

    def path(self, session: str) -> str | None:
        """The file of ``session`` in ``session_dir`` (None without one): named by the id's sha256."""
        if self.session_dir is None:
            return None
        return os.path.join(self.session_dir, hashlib.sha256(session.encode()).hexdigest() + ".safetensors")

    # -- the engine's calls ----------------------------------------------------------------------
    def keep(self, session: str, cache, tokens, config: CacheConfig) -> None:
        """Keep ``cache`` (holding ``tokens``) as ``session``'s, the most recently used; an older copy of the
        session (in memory or on disk) is replaced."""
        self.kept.pop(session, None)
        self._remove_file(session)
        self.kept[session] = Kept(cache, tuple(tokens), config, int(cache.nbytes()))

    def forget(self, session: str) -> None:
        """A session's request failed: what it held is gone (counted in ``dropped``)."""
        self.stats.dropped += 1
        log.warning("session %r dropped: its request failed", session)

    def make_room(self, need: int, *, exclude: str | None = None) -> bool:
        """Free idle sessions' memory, least recently used first (never ``exclude``), until they hold at most
        ``need`` bytes; returns whether they do. Each is written to disk, or dropped without a session_dir."""
        while self.held(exclude=exclude) > need:
            victim = next((s for s in self.kept if s != exclude), None)
            if victim is None:
                return False
            kept = self.kept.pop(victim)
            self._park(victim, kept)
        return True

    def take(self, session: str, prompt: tuple[int, ...], config: CacheConfig):
        """The kept cache ``prompt`` continues, removed from the store: ``(cache, n_tokens_it_holds)``, or None
        when there is none to continue (no such session, another history, other settings: then the session's
        old cache is dropped and counted in ``reset``)."""
        kept = self.kept.pop(session, None)
        if kept is None:
            kept = self._restore(session, config)
            if kept is None:
                return None
        n = len(kept.tokens)
        if kept.config != config or len(prompt) <= n or tuple(prompt[:n]) != kept.tokens:
            self.stats.reset += 1
            log.info("session %r starts over: its prompt does not continue the %d tokens kept", session, n)
            return None
        self.stats.continued += 1
        self.stats.reused_tokens += n
        return kept.cache, n

    # -- disk ----------------------------------------------------------------------------------
    def _park(self, session: str, kept: Kept) -> None:
        path = self.path(session)
        if path is None:
            self.stats.dropped += 1
            log.warning(
                "session %r dropped (%d bytes, %d tokens) to make room: no session_dir to park it in",
                session, kept.nbytes, len(kept.tokens),
            )
            return
        from ..promptcache import save

        ids = torch.tensor([kept.tokens], dtype=torch.long)
        try:
            save(kept.cache, path, token_ids=ids, model_fingerprint=self.model_fingerprint)
        except (OSError, ValueError) as e:  # a full disk: the session is lost, said out loud
            self.stats.dropped += 1
            log.warning("session %r dropped: writing %s failed (%s)", session, path, e)
            return
        self.stats.evicted += 1
        log.info("session %r parked in %s (%d bytes in memory freed)", session, path, kept.nbytes)

    def _restore(self, session: str, config: CacheConfig) -> Kept | None:
        path = self.path(session)
        if path is None or not os.path.isfile(path):
            return None
        from ..promptcache import load

        try:
            restored = load(path, config=self.config, model_fingerprint=self.model_fingerprint, device=self.device)
        except ValueError as e:
            self.stats.dropped += 1
            log.warning("session %r: its file cannot be continued (%s); starting over", session, e)
            self._remove_file(session)
            return None
        self._remove_file(session)
        self.stats.restored += 1
        ids = () if restored.token_ids is None else tuple(restored.token_ids[0].tolist())
        cache = restored.cache
        return Kept(cache, ids, cache.cache_config, int(cache.nbytes()))

    def _remove_file(self, session: str) -> None:
        path = self.path(session)
        if path is not None and os.path.isfile(path):
            os.remove(path)
