"""Session files: where a session's cache lives on disk, and how one is written, found and read back.

``session_dir`` is created 0700 and its files 0600 (they hold conversations); a session's file is named by
the sha256 of its id's UTF-8 bytes (:func:`session_key`), so a server restarted on the same directory finds
them (:meth:`SessionFiles.scan`, which also removes the temporaries a killed writer left). A file is a
prompt cache file (:mod:`kvslim.promptcache`) with the token ids the cache holds: written atomically
(:func:`kvslim.promptcache.write_state`: a temporary beside the target, checked, renamed), read back
through the one continuation rule first (:meth:`SessionFiles.saved`), then loaded.

This module knows the directory and the files. It knows nothing about which sessions are kept in memory,
least recently used, expired or being written (:mod:`kvslim.engine.sessions`,
:mod:`kvslim.engine.session_writer`), and nothing about HTTP, tokenizers or scheduling.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat

import torch

from .. import promptcache as pc  # looked up per call (pc.save, pc.load, ...): tests replace them
from ..atomic import TMP_TAG, remove_stale

log = logging.getLogger("kvslim.engine")

#: Session files: ``<sha256 of the id>.safetensors``, private to the user the server runs as.
SUFFIX = ".safetensors"
FILE_MODE = 0o600
DIR_MODE = 0o700


def session_key(session: str) -> str:
    """The sha256 hex of a session id's UTF-8 bytes: its file's name. An id that is not valid UTF-8 (a lone
    surrogate such as ``"\\ud800"``) still gets a key (its surrogates encoded as they stand), never an error."""
    return hashlib.sha256(session.encode("utf-8", "surrogatepass")).hexdigest()


def snapshot(cache, tokens: tuple[int, ...], fingerprint: str | None) -> tuple:
    """(tensors, header) of a session's cache holding ``tokens``: CPU copies, so the cache may change once
    this returns (:func:`kvslim.promptcache.to_state`)."""
    return pc.to_state(cache, token_ids=torch.tensor([tokens], dtype=torch.long), model_fingerprint=fingerprint)


class SessionFiles:
    """The files of ``session_dir`` (created 0700 if missing, made 0700 if it is the user's). config: the
    model's config (to rebuild a cache from a file); device: where restored tensors go; model_fingerprint:
    the model's, recorded in each file; new_cache: builds the empty cache a file fills
    (``SlimCache.from_config``)."""

    def __init__(self, session_dir, *, config=None, device=None, model_fingerprint=None, new_cache=None):
        self.dir = os.fspath(session_dir)
        private_dir(self.dir)
        self.config = config
        self.device = device
        self.model_fingerprint = model_fingerprint
        self.new_cache = new_cache

    def path(self, key: str) -> str:
        """The file of the session whose key is ``key``."""
        return os.path.join(self.dir, key + SUFFIX)

    def write(self, state: tuple, key: str) -> None:
        """Write a :func:`snapshot` as ``key``'s file (atomically, 0600)."""
        pc.write_state(*state, self.path(key), mode=FILE_MODE)

    def save(self, cache, tokens: tuple[int, ...], key: str) -> None:
        """Snapshot and write ``cache`` (holding ``tokens``) as ``key``'s file, now (atomically, 0600)."""
        pc.save(
            cache,
            self.path(key),
            token_ids=torch.tensor([tokens], dtype=torch.long),
            model_fingerprint=self.model_fingerprint,
            mode=FILE_MODE,
        )

    def saved(self, key: str):
        """What the continuation rule reads of ``key``'s file (:meth:`kvslim.promptcache.SavedCache.read`:
        its header and token ids); CannotContinue (kind ``damaged``) for a file this kvslim does not read."""
        return pc.SavedCache.read(self.path(key))

    def load(self, key: str, cache_config):
        """The cache of ``key``'s file, rebuilt for this model with ``cache_config`` (the file must have been
        saved with those settings and bias; :func:`kvslim.promptcache.load` checks the checksum, shapes,
        levers and bias). Raises what the load raises."""
        return pc.load(
            self.path(key),
            config=self.config,
            new_cache=self.new_cache,
            model_fingerprint=self.model_fingerprint,
            device=self.device,
            cache_config=cache_config,
            mean_center=cache_config.mean_center,
        ).cache

    def unlink(self, key: str) -> None:
        """Remove ``key``'s file; one that is gone already is fine, one that cannot be removed is logged (the
        session is gone from the store all the same)."""
        try:
            os.remove(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("session file %s could not be removed: %s", self.path(key), e)

    def scan(self) -> list[tuple[float, str]]:
        """The session files an earlier server left, as ``(mtime, key)`` sorted oldest first; the temporaries a
        killed writer left (older than a minute) are removed first."""
        remove_stale(self.dir, f".*{TMP_TAG}*", max_age_s=60.0)
        remove_stale(self.dir, ".tmp*", max_age_s=60.0)  # safetensors' own temporaries (save_file)
        found = []
        with os.scandir(self.dir) as it:
            for entry in it:
                name = entry.name
                key = name[: -len(SUFFIX)]
                if not name.endswith(SUFFIX) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                    continue
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        found.append((entry.stat(follow_symlinks=False).st_mtime, key))
        return sorted(found)


def private_dir(path: str) -> None:
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
