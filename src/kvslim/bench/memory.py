"""Bytes and memory: what a cache holds, what one decode step reads, process RSS, memory bandwidth.

- ``cache_nbytes``: every byte the cache holds (``SlimCache.nbytes()``; for transformers' caches the
  sum of every tensor in its layers, quantized payloads, scales and residuals included);
- ``cache_read_bytes`` / ``weight_bytes_per_step``: the bytes a decode step must read at least, for
  the memory-bandwidth floor ``(weights + cache read) / bandwidth``;
- :func:`measure_bandwidth`: a large tensor copy, timed;
- :class:`MemoryProbe`: process RSS (``/proc/self/statm``, after a ``malloc_trim``) and its
  high-water mark (Linux ``VmHWM``, reset to the current RSS by writing ``5`` to
  ``/proc/self/clear_refs``), which separate modes where ``ru_maxrss`` (monotonic over the process)
  cannot.

This module never runs the model.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys
import time

import torch

from .timing import sync

MB = 1 << 20


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters one decode step reads: every parameter once (tied weights once), except
    an input embedding table not shared with the output head, of which one row is read."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    if emb is not None and (out is None or out.weight.data_ptr() != emb.weight.data_ptr()):
        w = emb.weight
        total -= w.numel() * w.element_size() - w.shape[-1] * w.element_size()
    return total


def _tensor_bytes(obj, seen: set[int]) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensors, tensor subclasses that flatten into
    inner tensors such as optimum-quanto's, tuples, lists, dicts), each storage counted once."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen) for n in names)
        if obj.numel() == 0:
            return 0
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x, seen) for x in obj.values())
    return 0


def cache_nbytes(cache) -> int:
    """Every byte a cache holds. SlimCache reports its own; for transformers' caches every tensor
    attribute of every layer is counted (keys/values, quantized payloads, scales, zeros)."""
    from ..cache.adapter import SlimCache

    if isinstance(cache, SlimCache):
        return cache.nbytes()
    seen: set[int] = set()
    return sum(_tensor_bytes(vars(layer), seen) for layer in cache.layers)


def cache_read_bytes(cache) -> int:
    """Bytes one decode step must read from the cache at least: the stored tokens, without the
    preallocated slack a SlimCache buffer may hold."""
    from ..cache.adapter import SlimCache

    if isinstance(cache, SlimCache):
        return cache.live_nbytes()
    return cache_nbytes(cache)


def stored_tokens(cache) -> int:
    """Tokens the cache holds now (a windowed SlimCache holds fewer than it has seen)."""
    from ..cache.adapter import SlimCache

    if isinstance(cache, SlimCache):
        return cache.stored_tokens()
    return int(cache.get_seq_length())  # (StaticCache's is a tensor)


def measure_bandwidth(nbytes: int = 256 * MB, repeats: int = 5, device="cpu") -> float:
    """Memory bandwidth in bytes/s: ``2 * nbytes / best time`` of copying an ``nbytes`` tensor into
    a preallocated one (a read and a write of every byte), best of ``repeats``."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: fault the pages in outside the timing
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


class MemoryProbe:
    """Process memory on Linux: the current RSS (``/proc/self/statm``) and the high-water mark
    (``VmHWM``), which can be reset to the current RSS by writing ``5`` to ``/proc/self/clear_refs``
    (Linux >= 4.0). Elsewhere every reading is None."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.has_rss = self.rss() is not None
        self.can_reset = self.reset_peak()
        self._libc = None
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            libc.malloc_trim  # noqa: B018 - glibc only
            self._libc = libc

    def rss(self) -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self.page
        except (OSError, ValueError, IndexError):
            return None

    def reset_peak(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def peak(self) -> int | None:
        """VmHWM: the largest RSS since the last :meth:`reset_peak` (or process start)."""
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
        return None

    @staticmethod
    def max_rss_ever() -> int:
        """ru_maxrss in bytes: monotonic over the whole process."""
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def settle(self, collect: bool = False) -> int | None:
        """Give freed heap back to the OS (glibc ``malloc_trim``), then read RSS. ``collect``: run
        a full garbage collection first (slow with transformers loaded: ~1 s on a busy machine; only
        needed where reference cycles, such as a dropped cache's, must be freed)."""
        if collect:
            gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        return self.rss()
