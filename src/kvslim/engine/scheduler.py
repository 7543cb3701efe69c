"""Which requests run: admission under a memory budget, join and leave between steps, prefill turns.

The scheduler holds rows (a request and its state) in two places: ``waiting`` (submitted, not admitted: no
cache memory yet) and ``active`` (admitted: prefilling or decoding). Admission is first come, first
served: the oldest waiting row is admitted when a batch slot is free and the bytes its cache can reach
(:meth:`kvslim.SlimCache.projected_nbytes` at prompt + max_new_tokens, reserved up front) fit in what the
budget has left; a younger request never overtakes it, so a large one is not starved. A request that could
not fit even alone is refused when it is submitted (the engine does that), never left waiting forever.

Prefill is shared in turns, not first in first out: the admitted rows still reading their prompts take one
chunk each in rotation (:meth:`Scheduler.next_prefill`), so a 50,000-token prompt delays another request's
first token by at most one chunk per prompt ahead of it in the rotation, not by the whole long prompt.
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
    reserved; generator: its sampling generator (None: greedy); keep_session: whether its cache goes to its
    session when it ends (False once the session was deleted while it ran); failed: it ended on a failure
    (its cache is not left to its session).
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
    keep_session: bool = True
    failed: bool = False


class Scheduler:
    """Admission and order. memory_budget: bytes all admitted caches may reserve together (None: no limit);
    max_batch: rows admitted at once (the most a decode step carries)."""

    def __init__(self, memory_budget: int | None, max_batch: int):
        self.memory_budget = memory_budget
        self.max_batch = max_batch
        self.waiting: deque[Row] = deque()
        self.active: list[Row] = []
        self.reserved = 0
        self._turns: deque[Row] = deque()  # the rows still prefilling, whose turn is next first

    def fits_alone(self, reserved: int) -> bool:
        return self.memory_budget is None or reserved <= self.memory_budget

    def submit(self, row: Row) -> None:
        self.waiting.append(row)

    def admit_next(self, room=None) -> Row | None:
        """Move the oldest waiting row into the batch when a slot and the budget allow; returns it (None: none
        can join now). The engine attaches each row's cache as soon as it is admitted, before the next one is
        considered, so making room for the next never parks the session the previous is about to continue.

        room: None, or ``room(row, free) -> bool``: whether ``row`` fits in the ``free`` bytes the admitted rows
        leave of the budget once memory held outside the rows (idle sessions) is made small enough —
        the engine's hook into :class:`~kvslim.engine.sessions.SessionStore`. An exception from it leaves
        the row waiting (the engine ends that row)."""
        if not self.waiting or len(self.active) >= self.max_batch:
            return None
        row = self.waiting[0]
        if self.memory_budget is not None:
            free = self.memory_budget - self.reserved
            if row.reserved > free or (room is not None and not room(row, free)):
                return None
        self.waiting.popleft()
        row.state = "prefill"
        self.active.append(row)
        self._turns.append(row)
        self.reserved += row.reserved
        return row

    def admit(self, room=None) -> list[Row]:
        """Every row :meth:`admit_next` lets in now, oldest first."""
        admitted = []
        while (row := self.admit_next(room)) is not None:
            admitted.append(row)
        return admitted

    def next_prefill(self) -> Row | None:
        """The admitted row whose prompt gets the next chunk: the rows still prefilling take turns (round
        robin); the one returned goes to the back of the rotation."""
        while self._turns and self._turns[0].state != "prefill":
            self._turns.popleft()  # finished prefilling, or left
        if not self._turns:
            return None
        row = self._turns.popleft()
        self._turns.append(row)
        return row

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
        if row in self._turns:
            self._turns.remove(row)
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
