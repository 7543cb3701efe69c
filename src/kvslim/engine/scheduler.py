"""Which requests run: admission under a memory budget, join and leave between steps, prefill turns.

The scheduler holds rows (a request and its state) in two places: ``waiting`` (submitted, not admitted: no
cache memory yet) and ``active`` (admitted: prefilling or decoding). Admission is first come, first
served: the oldest waiting row is admitted when a batch slot is free and the bytes its cache can reach
(:meth:`kvslim.SlimCache.projected_nbytes` at prompt + max_new_tokens, reserved up front) fit in what the
budget has left; a younger request never overtakes it, so a large one is not starved. A request that could
not fit even alone is refused when it is submitted (the engine does that), never left waiting forever.

Prefill is shortest-first with aging, not first in first out (:meth:`Scheduler.prefill_plan`): a step
reads up to ``prefill_chunk`` prompt tokens (in the same forward as the decoding rows' tokens:
:mod:`kvslim.engine.step`), taking the admitted rows still reading their prompts in order
of the fewest tokens left — several short ones in one step when their chunks fit together — except that a
row passed over ``MAX_SKIPS`` steps in a row goes first. A conversation's new turn (a few dozen tokens) is
read at the next step even while a 50,000-token prompt prefills: it waits for at most the chunk already
running and an aged one, and the long prompt still gets a chunk in every ``MAX_SKIPS + 1`` steps. Round
robin, one row a step, measured first, left every short prompt behind the long one's chunks and the other
short ones (docs/serving.md, "A long prompt among 15 conversations").
Nothing here touches tensors or the model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request

#: steps a prompt still being read may be passed over in a row before it gets a chunk (aging: a long prompt
#: among a stream of short ones still advances, at least one chunk in every MAX_SKIPS + 1 steps)
MAX_SKIPS = 3


@dataclass(eq=False)
class Row:
    """One request inside the engine. state: ``waiting`` -> ``prefill`` -> ``decode`` -> ``done``.

    cache: its :class:`~kvslim.SlimCache` (given on admission); empty: the empty cache built (and checked) when
    the request was submitted, used on admission unless a kept session continues; fed: prompt tokens already prefilled;
    pending: the last sampled token, not yet fed; tokens: generated so far; reserved: bytes admission
    reserved; generator: its sampling generator (None: greedy); keep_session: whether its cache goes to its
    session when it ends (False once the session was deleted while it ran); failed: it ended on a failure
    (its cache is not left to its session); skipped: steps in a row its prompt waited for a chunk; kept: bytes of
    ``reserved`` held for its prompt's kept decoded bodies (:meth:`Scheduler.end_prefill` gives them back).
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
    skipped: int = 0  # steps in a row its prompt was passed over for a prefill chunk (Scheduler.next_prefill)
    kept: int = 0
    started: int = 0  # prompt tokens its cache held when it was admitted (a continued session's)


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

    def prefill_plan(self, chunk: int) -> list[Row]:
        """The rows whose prompts get a chunk this step (module docstring), in order, within a step's budget of
        ``chunk`` prompt tokens: the rows passed over ``MAX_SKIPS`` steps first (the longest passed over
        first), then the fewest tokens left first (the earliest admitted on a tie); a row is taken when its
        whole next chunk (``min(chunk, tokens left)``) fits in what is left of the budget, so a row's chunks
        are the ones it would have alone (its results are too). The rows not taken are counted as passed over."""
        turns = [r for r in self._turns if r.state == "prefill"]  # finished prefilling, or left: dropped
        self._turns = deque(turns)
        aged = sorted((r for r in turns if r.skipped >= MAX_SKIPS), key=lambda r: -r.skipped)
        rest = sorted((r for r in turns if r.skipped < MAX_SKIPS), key=lambda r: len(r.request.prompt) - r.fed)
        plan: list[Row] = []
        left = chunk
        for row in aged + rest:
            size = min(chunk, len(row.request.prompt) - row.fed)
            if size <= left:
                plan.append(row)
                left -= size
            if not left:
                break
        for r in turns:
            r.skipped = 0 if r in plan else r.skipped + 1
        return plan

    def next_prefill(self) -> Row | None:
        """The one row :meth:`prefill_plan` puts first (a budget of one token takes one row)."""
        plan = self.prefill_plan(1)
        return plan[0] if plan else None

    def decoding(self) -> list[Row]:
        """Rows with a token to feed this step, in admission order."""
        return [r for r in self.active if r.state == "decode"]

    def start_prefill(self, row: Row, chunk: int) -> None:
        """Before a chunk (at most ``chunk`` tokens) of ``row``'s prompt: its cache keeps its bodies decoded if bytes
        were reserved for it, unless its first chunk is its last (a session that continues with a short prompt:
        nothing to keep between chunks, the reservation is given back)."""
        if not row.kept or row.cache is None:
            return
        if row.fed == row.started and len(row.request.prompt) - row.fed <= chunk:
            self.end_prefill(row)
            return
        row.cache.keep_decoded(True)

    def end_prefill(self, row: Row) -> None:
        """``row``'s prompt is read (or it leaves): the kept decoded bodies are freed, their reservation given back."""
        if row.kept:
            if row.cache is not None:
                row.cache.keep_decoded(False)
            row.reserved -= row.kept
            if row in self.active:
                self.reserved -= row.kept
            row.kept = 0

    def release(self, row: Row) -> None:
        """A row leaves (finished, failed, cancelled): its slot and its reservation are free again."""
        self.end_prefill(row)
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
