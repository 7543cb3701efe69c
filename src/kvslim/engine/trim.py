"""Give freed heap memory back to the system: glibc's ``malloc_trim``, at most once a housekeeping period.

A server's caches come and go: every request allocates its cache's buffers (tens of KiB each, per layer and
tensor), and every finished request and parked or expired session frees them. glibc keeps small freed
blocks in its heaps, so the process's resident memory stays at its peak churn long after the bytes are free
— measured on the embedded model with a 64 MiB budget and 800 one-turn sessions: 80 MiB of the server's
RSS was free heap that ``malloc_trim(0)`` returned (docs/serving.md, "The attack table"). The engine calls
:meth:`Trimmer.maybe` once a second when requests have ended since the last call.

Where the C library has no ``malloc_trim`` (musl, macOS, Windows) this does nothing. Knows no tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvslim.engine")


def _malloc_trim():
    """glibc's ``malloc_trim`` as a ctypes function, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class Trimmer:
    """Counts what was freed and trims the heap when something was (``maybe``), never twice for one batch
    of frees. ``available``: whether this C library can trim at all."""

    def __init__(self):
        self._trim = _malloc_trim()
        self._freed = 0
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def freed(self, n: int = 1) -> None:
        """Caches were freed (a request ended, a session left memory)."""
        self._freed += n

    def maybe(self) -> bool:
        """Trim if anything was freed since the last trim; returns whether it trimmed."""
        if not self._freed or self._trim is None:
            return False
        self._freed = 0
        try:
            self._trim(0)
        except Exception:  # noqa: BLE001 - housekeeping never ends a request or the engine
            log.exception("malloc_trim failed")
            return False
        self.trims += 1
        return True
