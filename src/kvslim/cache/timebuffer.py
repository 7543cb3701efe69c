"""A tensor growing along the time axis: amortized O(1) appends, O(1) drops of the oldest entries.

:class:`TimeBuffer` holds one tensor ``(B, H, T, ...)`` of one stream — encoded codes, per-group scales or
full-precision tokens alike — in a preallocated block, growing (unbounded caches) or capped at a capacity
(bounded caches: a ring that is compacted in place, never reallocated once full).

This module knows nothing about formats, codecs, positions, eviction policy or transformers: it stores
whatever tensors it is given (:mod:`kvslim.cache.stream` builds a K or V stream from several).
"""

from __future__ import annotations

import ctypes

import torch


class TimeBuffer:
    """A tensor ``(B, H, T, ...)`` growing along dim 2, oldest entry first.

    Two storage modes:

    - growing (``capacity=None``, unbounded caches): a preallocated block with slack at the end;
      ``start`` moves on drops. When an append does not fit, the live part moves into a new block with
      25% headroom (at least ``min_slack`` entries) — amortized O(1) appends, a fresh allocation, so
      views handed out earlier are never overwritten.
    - capped (``capacity=N``, bounded caches): the block grows as above but never past ``N`` entries; once
      it holds ``N`` it is never reallocated again as long as at most ``N`` entries are live. A drop moves
      ``start`` (an index: nothing is copied, nothing re-encoded); when an append reaches the end of the
      block, the live entries move to its front, in place (a copy of the live entries once per ``N - live``
      appends, no allocation). Only a chunk that does not fit beside the live entries (a prefill chunk
      longer than the capacity, before its eviction) grows the block past ``N``, and the drop that follows
      gives the extra back. So a bounded cache's bytes are constant once it is full, and a short stream
      in a long window holds only what it stores (plus slack), not the window.

    Views (:meth:`view`) are valid until the next append or drop.
    """

    __slots__ = ("data", "start", "end", "min_slack", "capacity", "_view", "_view_of")

    def __init__(self, min_slack: int = 64, capacity: int | None = None):
        self.data: torch.Tensor | None = None
        self.start = 0
        self.end = 0
        # the last view and (data, start, end) it was cut from: an encoded body's parts change once a group,
        # and an eager decode step reads each of them every layer
        self._view: torch.Tensor | None = None
        self._view_of: tuple | None = None
        self.min_slack = min_slack
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
        ):
            raise ValueError(f"capacity must be a positive number of entries or None, got {capacity!r}")
        self.capacity = capacity

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[2]
        if n == 0 and self.data is not None:
            return
        if self.data is None or self.end + n > self.data.shape[2]:
            live = len(self)
            if self.capacity is not None and self.data is not None and live + n <= self.data.shape[2]:
                self._compact()
            else:
                self._realloc(live + n, x)
        self.data[:, :, self.end : self.end + n] = x
        self.end += n

    def _compact(self) -> None:
        """Move the live entries to the front of the block, in place (fixed mode)."""
        live, gap = len(self), self.start
        if gap and live:
            data = self.data
            if data.is_cpu and data.is_contiguous() and data.numel() and gap < live:
                # Source and target overlap (a full ring: a bounded stream's body compacts at every flush, ~30x
                # its flushed tokens): one memmove per (batch, head) block, in place, where a clone made two
                # passes and an allocation (a 16-row flush step: ~190 ms of compaction) and torch's copy_ has no
                # defined order for overlapping memory.
                size = data.element_size()
                per = data.stride(2) * size  # bytes of one entry
                base = data.data_ptr()
                for b in range(data.shape[0]):
                    for h in range(data.shape[1]):  # each (batch, head) block at its own strides
                        row = base + (b * data.stride(0) + h * data.stride(1)) * size
                        ctypes.memmove(row, row + gap * per, live * per)
            else:  # no overlap (or not a contiguous CPU block): one copy, through a temporary when they overlap
                src = data[:, :, gap : self.end]
                data[:, :, :live] = src.clone() if gap < live else src
        self.start, self.end = 0, live

    def _realloc(self, need: int, like: torch.Tensor) -> None:
        """Move the live entries into a new block with room for ``need`` entries (plus slack when growing).

        Slack is a quarter of the live size (at least ``min_slack``): appends stay amortized O(1) (each
        entry is copied about four more times at most) and the block holds at most ~25% more than it
        stores; capped mode stops at ``capacity`` (or exactly ``need`` for a chunk past it). A fresh
        allocation: views handed out earlier are never overwritten.
        """
        live = len(self)
        cap = need + max(self.min_slack, live // 4)
        if self.capacity is not None:  # capped: never past the capacity unless one chunk needs more
            cap = need if need > self.capacity else min(cap, self.capacity)
        new = like.new_empty((*like.shape[:2], cap, *like.shape[3:]))
        if live:
            new[:, :, :live] = self.data[:, :, self.start : self.end]
        self.data, self.start, self.end = new, 0, live
        self._view = self._view_of = None  # the old block is not kept alive by a cached view

    def drop_front(self, k: int) -> None:
        if not 0 <= k <= len(self):
            raise ValueError(f"cannot drop {k} of {len(self)} entries")
        self.start += k
        if self.start == self.end:
            self.start = self.end = 0  # reuse the block from its beginning
        cap = self.data.shape[2] if self.data is not None else 0
        if self.capacity is not None:
            if cap > self.capacity and len(self) <= self.capacity:
                self._realloc(
                    len(self), self.data[:, :, :0]
                )  # a long chunk grew the block: back under capacity
        elif cap > 2 * len(self) + 2 * self.min_slack:
            # A big drop (a prefill leaving the residual, a window evicting a long prompt): give the memory back.
            self._realloc(len(self), self.data[:, :, :0])

    def drop_back(self, k: int) -> None:
        if not 0 <= k <= len(self):
            raise ValueError(f"cannot drop {k} of {len(self)} entries")
        self.end -= k

    def view(self) -> torch.Tensor | None:
        if self.data is None:
            return None
        of = self._view_of
        if of is None or of[0] is not self.data or of[1] != self.start or of[2] != self.end:
            self._view = self.data[:, :, self.start : self.end]
            self._view_of = (self.data, self.start, self.end)
        return self._view

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (a batch-dim index/repeat) to the stored block."""
        if self.data is not None:
            self.data = fn(self.data)
            self._view = self._view_of = None

    def nbytes(self) -> int:
        """Bytes allocated (live entries and slack): what the buffer really holds in memory."""
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def live_nbytes(self) -> int:
        if self.data is None:
            return 0
        per = self.data[:, :, :1].numel() * self.data.element_size()
        return per * len(self)
