"""Which requests run: admission under a memory budget, join and leave between steps, prefill order.

The scheduler holds rows (a request and its state) in two places: ``waiting`` (submitted, not admitted: no
cache memory yet) and ``active`` (admitted: prefilling or decoding). Admission is first come, first
served: the oldest waiting row is admitted when a batch slot is free and the bytes its cache can reach
(:meth:`kvslim.SlimCache.projected_nbytes` at prompt + max_new_tokens, reserved up front) fit in what the
budget has left; a younger request never overtakes it, so a large one is not starved. A request that could
not fit even alone is refused when it is submitted (the engine does that), never left waiting forever.
Nothing here touches tensors or the model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request


@dataclass(eq=False)
class Row:
    """One request inside the engine. state: ``waiting`` -> ``prefill`` -> ``decode`` -> ``done``.

    cache: its :class:`~kvslim.SlimCache` (given on admission); empty: the empty cache built (and checked) when
    the request was submitted, used on admission unless a kept session continues; fed: prompt tokens already prefilled;
    pending: the last sampled token, not yet fed; tokens: generated so far; reserved: bytes admission
    reserved; generator: its sampling generator (None: greedy).
    """

    request_id: str
    request: Request
    reserved: int
    state: str = "waiting"
    cache: object = None
    empty: object = None
    fed: int = 0
    pending: int | None = None
    tokens: list[int] = field(default_factory=list)
    generator: object = None
    peak_bytes: int = 0


class Scheduler:
    """Admission and order. memory_budget: bytes all admitted caches may reserve together (None: no limit);
    max_batch: rows admitted at once (the most a decode step carries)."""

    def __init__(self, memory_budget: int | None, max_batch: int):
        self.memory_budget = memory_budget
        self.max_batch = max_batch
        self.waiting: deque[Row] = deque()
        self.active: list[Row] = []
        self.reserved = 0

    def fits_alone(self, reserved: int) -> bool:
        return self.memory_budget is None or reserved <= self.memory_budget

    def submit(self, row: Row) -> None:
        self.waiting.append(row)

    def admit(self, room=None) -> list[Row]:
        """Move waiting rows into the batch, oldest first, while a slot and the budget allow; returns them.

        room: None, or ``room(row, free) -> bool``: whether ``row`` fits in the ``free`` bytes the admitted rows
        leave of the budget once memory held outside the rows (idle sessions) is made small enough —
        the engine's hook into :class:`~kvslim.engine.sessions.SessionStore`."""
        admitted = []
        while self.waiting and len(self.active) < self.max_batch:
            row = self.waiting[0]
            if self.memory_budget is not None:
                free = self.memory_budget - self.reserved
                if row.reserved > free or (room is not None and not room(row, free)):
                    break
            self.waiting.popleft()
            row.state = "prefill"
            self.active.append(row)
            self.reserved += row.reserved
            admitted.append(row)
        return admitted

    def next_prefill(self) -> Row | None:
        """The admitted row whose prompt is prefilled next (the oldest still prefilling)."""
        return next((r for r in self.active if r.state == "prefill"), None)

    def decoding(self) -> list[Row]:
        """Rows with a token to feed this step, in admission order."""
        return [r for r in self.active if r.state == "decode"]

    def release(self, row: Row) -> None:
        """A row leaves (finished, failed, cancelled): its slot and its reservation are free again."""
        if row in self.active:
            self.active.remove(row)
            self.reserved -= row.reserved
        elif row in self.waiting:
            self.waiting.remove(row)
        row.state = "done"
        row.cache = row.empty = None

    def find(self, request_id: str) -> Row | None:
        for row in (*self.active, *self.waiting):
            if row.request_id == request_id:
                return row
        return None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active
