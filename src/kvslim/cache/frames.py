"""The RoPE frames of one layer's stored keys: which rotation each key carries, and where it must be read.

Each key carries the RoPE rotation of the position id it was fed with. :class:`Frames` tracks, per stored
key, that rotation relative to the token's *true* position (its index among the row's real tokens):
``rotation = true - base``, where ``base`` is what the caller subtracted to keep position ids bounded (0 under
``model.generate()``). Stream tokens share bases in a few runs (``runs``, oldest first); sinks keep their
rotation per row (``sink_rot``). At read time, in the frame of the current forward's base, every key is
presented at the rotation its ``positions`` mode asks for (docs/streaming.md):

- ``original``: every key at its true position;
- ``cache`` (StreamingLLM's in-cache positions): window keys at their true positions and sink ``j`` right
  before the window's first key, as if the kept tokens were one contiguous sequence.

Only the full-precision sinks are ever re-rotated (:meth:`Frames.sink_delta`); a stream run whose base differs
from the current one is moved at read time (:meth:`Frames.run_deltas`), never re-encoded. With ``pre_rope``
the stream's keys carry no rotation at all: each is rotated on read to its true position in the current
frame (:meth:`Frames.read_positions`), so runs never need moving.

A token's *slot* is its index among every token the layer has seen (pads included); its true position is
``slot - pads`` of its row. The layer (:mod:`kvslim.cache.layer`) owns the counts (``seen``, the stream's
length), the padding and the sinks' slots, and hands them in; this object owns the rotations.

This module knows nothing about storage, codecs, eviction decisions or transformers.
"""

from __future__ import annotations

import torch

from .rotary import Rotary


def fed_positions(first: int, n: int, pads: torch.Tensor | None, base: int, device) -> torch.Tensor:
    """The position ids tokens at slots ``first .. first + n - 1`` were fed with: ``slot - pads - base``,
    (B, n) int64 (``(1, n)`` with ``pads`` None: no padding)."""
    slots = torch.arange(first, first + n, device=device)  # (n,)
    return slots[None, :] - (0 if pads is None else pads[:, None]) - base


class Frames:
    """The rotation bookkeeping of one layer's keys (module docstring).

    positions: ``original`` or ``cache``; rotary: the model's RoPE (None: keys are never moved, the base is
    always 0); pre_rope: the stream holds keys before RoPE. State: ``sink_rot`` (B, <=sink) int64, the
    rotation position of each sink key; ``runs`` ``[[tokens, base], ...]`` over the stream's keys, oldest
    first; ``base`` and ``rope``, the base and rotary of the forward being served.
    """

    __slots__ = ("positions", "rotary", "pre_rope", "_sink_rot", "runs", "base", "rope", "_rot_host", "_still")

    def __init__(self, positions: str, rotary: Rotary | None, pre_rope: bool):
        self.positions = positions
        self.rotary = rotary
        self.pre_rope = pre_rope
        self._sink_rot: torch.Tensor | None = None
        self.runs: list[list[int]] = []
        self.base = 0
        self.rope: Rotary | None = rotary
        #: sink_rot's values as lists, read on the host by :meth:`sink_delta` once per new tensor (None: not yet)
        self._rot_host: list | None = None
        #: (first, base, sinks) for which :meth:`sink_delta` found that no sink moves, for this sink_rot (None: none
        #: yet): an unbounded cache's sinks never move, and its rows asked every step and layer (~4 ms a 16-row step)
        self._still: tuple | None = None

    @property
    def sink_rot(self) -> torch.Tensor | None:
        """(B, <=sink) int64: the rotation position of each sink key (None: no sinks). Replaced, never written."""
        return self._sink_rot

    @sink_rot.setter
    def sink_rot(self, rot: torch.Tensor | None) -> None:
        if rot is not self._sink_rot:
            self._sink_rot, self._rot_host, self._still = rot, None, None

    # -- writes ----------------------------------------------------------------------------
    def serve(self, base: int, rope: Rotary | None) -> None:
        """The forward being served has this base and rotary (set when its tokens are committed)."""
        self.base = base
        self.rope = rope

    def add_run(self, n: int, base: int) -> None:
        """``n`` stream keys fed with ``base`` joined the stream's end."""
        if self.runs and self.runs[-1][1] == base:
            self.runs[-1][0] += n
        else:
            self.runs.append([n, base])

    def drop_runs(self, k: int, *, from_back: bool = False) -> None:
        """Remove ``k`` stream keys from the front (or back) of the runs."""
        runs = self.runs
        while k and runs:
            run = runs[-1] if from_back else runs[0]
            take = min(k, run[0])
            run[0] -= take
            k -= take
            if run[0] == 0:
                runs.pop(-1 if from_back else 0)

    # -- reads -----------------------------------------------------------------------------
    def sink_delta(
        self,
        sink_k: torch.Tensor | None,
        *,
        first_stream_slot: int,
        pads: torch.Tensor | None,
        sink_start: torch.Tensor | None,
        host: bool = False,
    ):
        """How far the sink keys ``sink_k`` (B, H, S, D) must move to sit where the current forward must see
        them (at the rotation their ``positions`` mode asks for, in the frame of the current base): (B, S) int64
        distances for :meth:`Rotary.move`, or None where no key moves. first_stream_slot: the slot of the
        stream's oldest key; pads, sink_start: (B,) per row, or both None: every row unpadded with its sinks at
        slot 0 (then the distances are worked out on the host, from the sinks' rotations read once per change:
        no torch op and no sync per call; ``host=True`` returns them as a tuple of per-row tuples instead of a
        tensor). A ragged step moves the sinks of all its rows in one call (:mod:`kvslim.cache.ragged`): the move
        is elementwise, so a row's keys get the same bits."""
        if sink_k is None or self.rotary is None:
            return None
        s = sink_k.shape[2]
        if pads is None:  # unpadded rows, sinks from slot 0: the same integers, on the host
            first = first_stream_slot - s if self.positions == "cache" else 0
            if self._still == (first, self.base, s):  # asked before for these sinks: none moves
                return None
            rows = self._host_rot()
            delta = tuple(tuple(first + j - self.base - r for j, r in enumerate(row)) for row in rows)
            if not any(any(row) for row in delta):
                self._still = (first, self.base, s)
                return None
            return delta if host else torch.tensor(delta, dtype=torch.long, device=self.sink_rot.device)
        j = torch.arange(s, device=self.sink_rot.device)
        if self.positions == "cache":
            want = (first_stream_slot - s + j)[None, :] - pads[:, None]  # (B, S) true positions, contiguous
        else:
            want = (sink_start[:, None] + j[None, :]) - pads[:, None]  # their own true positions
        delta = want - self.base - self.sink_rot  # (B, S)
        return delta if bool((delta != 0).any()) else None

    def _host_rot(self) -> list[list[int]]:
        """``sink_rot`` as lists (B, S), read from the tensor once per new tensor (it is replaced, never written)."""
        if self._rot_host is None:
            self._rot_host = self._sink_rot.tolist()
        return self._rot_host

    def run_deltas(self) -> tuple[tuple[int, int], ...]:
        """(tokens, delta) per run of stream keys, oldest first: each run's keys must be moved by
        ``delta = run base - current base`` positions. Empty when every delta is 0 (or the stream is
        pre-RoPE: its keys are rotated to their read positions, :meth:`read_positions`)."""
        if self.pre_rope or all(b == self.base for _, b in self.runs):
            return ()
        return tuple((n, b - self.base) for n, b in self.runs)

    def read_positions(self, first_stream_slot: int, n_stream: int, pads: torch.Tensor) -> torch.Tensor | None:
        """(B, L) int64: where each of the ``n_stream`` stream keys sits in the current frame (its true
        position minus the current base) — what a pre-RoPE stream is rotated to on read. None unless
        ``pre_rope`` (or an empty stream)."""
        if not self.pre_rope or not n_stream:
            return None
        return fed_positions(first_stream_slot, n_stream, pads, self.base, pads.device)

    def stream_rot(self, k: int, first_stream_slot: int, pads: torch.Tensor) -> torch.Tensor:
        """(B, k) rotation positions of the stream's ``k`` oldest keys (the ids they were fed with)."""
        slots = torch.arange(first_stream_slot, first_stream_slot + k, device=pads.device)
        bases = torch.tensor([b for n, b in self.runs for _ in range(n)][:k], device=pads.device)
        return slots[None, :] - pads[:, None] - bases[None, :]
