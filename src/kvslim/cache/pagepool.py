"""Many rows in one pool of kvslim pages: a step's K/V written in one call a layer, its attention in one more.

The engine's ragged step (:mod:`kvslim.cache.ragged`) keeps each row in a :class:`~kvslim.SlimCache` of its own
and pays Python for every row in every layer: its appends, its views, its record in the rows call (~60-90 ms of a
16-row step at 4,096 tokens, docs/performance.md). A :class:`PagePool` keeps every row's K/V in the pages the
vLLM plugin stores (:mod:`kvslim.vllm.pages`: 32 tokens of one KV head a page, kvslim's formats byte for byte),
and a step touches them twice a layer whatever its rows:

- one write of the step's tokens through a slot mapping (``kvp_write``: each token encoded once, when written);
- one attention call over the rows' block tables (``kvp_attend``): decode rows, prompt chunks continuing a cached
  prefix, and filler rows in one call, each row's new tokens attended at full precision from the step's own K/V
  and its history from the codes (:mod:`kvslim.vllm.attend`).

That is the "many rows, each with its own list of blocks" kernel issue 30 asks the engine to share with the vLLM
plugin: one kernel, one page layout, one staging scheme for both.

What a page keeps of kvslim's levers (the vLLM plugin's set, :mod:`kvslim.vllm.spec`): every page format
(``none``, fp16, bf16, fp8, the GGML blocks, int8 and int4 per-token K, int2/int3 V), Hadamard rotation
(``rotate``, :mod:`kvslim.vllm.basis`), a post-RoPE K bias (``mean_center``), full-precision sinks in whole pages
(``sink=N``: the first ``ceil(N / 32)`` pages of every row stay staged; ``sink=auto`` is none, as in the vLLM
plugin), and a row's newest tokens at full precision (the staging pool, :mod:`kvslim.vllm.staging`, in
``residual_dtype``: as a SlimCache, float16 for a float32 model): its partly filled last page and its last
``residual / 32`` full pages (``residual=auto``: 128, kvslim's default; a multiple of 32), so between ``residual`` and
``residual + 31`` newest tokens, as a SlimCache keeps its residual (every token is still encoded as it is written: a
page leaving the residual is read from its codes from then on, never encoded again), and StreamingLLM's sinks + window
with every key at its original position (``sink=N,window=W,positions=original``, :mod:`kvslim.cache.pagespec`: the
pages that leave every later query's window go back to the pool at :meth:`PagePool.commit`). What it does not keep:
a window that moves the kept keys (``positions=cache``), KIVI's per-channel K (int2/int3 K), pre-RoPE keys, clipping,
codebooks and per-layer formats — :func:`check_config` refuses each in one line.

Rows and positions: a row's tokens sit at positions ``0 .. length - 1`` (no re-base), token ``j`` in slot ``j % 32``
of page ``pages[j // 32]`` (``GONE`` once a window gave it back). :meth:`PagePool.plan` lays out one step (each row's
new tokens packed into one sequence, the pages they need taken from the free list first: a step the pool cannot
hold changes nothing), :meth:`PagePool.commit` advances the rows once the step's forward has run, and
:meth:`PagePool.abandon` puts a failed step back: the rows, the free pages, the staging plan and the staged tokens the
step wrote over (the page slots it wrote lie past the rows' lengths and are written again).

This module knows nothing about transformers; :mod:`kvslim.cache.paged_adapter` adapts it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..config import CacheConfig, parse_spec
from ..shapes import ModelShapes
from ..vllm import attend as paged
from ..vllm.basis import ModelShape, PageBasis
from ..vllm.basis import attend as attend_in_basis
from ..vllm.pages import PAGE_TOKENS, PageLayout
from ..vllm.spec import sink_pages
from ..vllm.staging import Stager
from . import pagecalls
from .pagespec import (  # noqa: F401 - DEFAULT_RESIDUAL, check_config, residual_pages, stage_dtype re-exported
    DEFAULT_RESIDUAL,
    check_config,
    check_staged,
    evictable,
    residual_pages,
    sink_tokens,
    stage_dtype,
)

#: a page a windowed row gave back (its place in the row's token order kept: the kernel never reads it)
GONE = -1

@dataclass(eq=False)
class PagedRow:
    """One row of a :class:`PagePool`: its pages (ids, in token order) and the tokens stored in them."""

    id: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    #: pages past the sink pages given back (a window: they are GONE in ``pages``)
    gone: int = 0

    def get_seq_length(self) -> int:
        return self.length


@dataclass
class StepPlan:
    """One step's layout (:meth:`PagePool.plan`): rows ``rows[b]`` (None: a filler row, one token at position 0 that
    attends on itself alone and stores nothing) with ``lengths[b]`` new tokens packed in row order; ``slots`` (N,)
    int64, each token's slot (-1: not stored); ``table``: the attention's row table; ``positions`` (1, N) int64;
    ``stage_dest`` (N,) int64 the tokens' staging rows (-1: none) and ``stage_map``, or None (no staging)."""

    rows: list
    lengths: list[int]
    slots: torch.Tensor
    table: paged.Rows
    positions: torch.Tensor
    stage_dest: torch.Tensor | None = None
    stage_map: torch.Tensor | None = None
    #: what :meth:`PagePool.abandon` puts back: each row's pages and the free list before the step, the stager's
    #: state and the staged slots the step hands to other pages
    undo: tuple | None = None
    #: whether any of the step's tokens is staged
    staged_any: bool = False
    #: the staged tokens' indices where only some are (a prompt's encoded tokens beside them), None where all are
    staged_index: torch.Tensor | None = None
    #: set by :meth:`PagePool.abandon`
    abandoned: bool = False
    #: the step's argument tables (:mod:`kvslim.cache.pagecalls`), built at its first layer
    calls: object = None

    @property
    def n_tokens(self) -> int:
        return int(self.slots.shape[0])


class PagePool:
    """Every row's K/V in ``pages`` pages of kvslim's formats per layer, and a staging pool for each row's newest
    tokens and sink pages (module docstring).

    config: a :class:`~kvslim.config.CacheConfig` or spec (:func:`check_config`); n_layers, kv_heads, head_dim, dtype:
    the model's attention (``dtype``: its K/V dtype, which ``none`` pages keep); pages: pages per layer (each
    ``kv_heads x 32`` tokens); max_rows: rows alive at once (each with ``1 + sink pages + residual / 32`` staging
    slots); model_type: what a ``mean_center`` bias file is checked against. stage: keep the residual and the sinks
    at full precision (lossless pages need none; False: every token read from its codes)."""

    def __init__(
        self,
        config: CacheConfig | str,
        *,
        n_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pages: int,
        max_rows: int,
        model_type: str | None = None,
        stage: bool = True,
    ):
        config = parse_spec(config) if isinstance(config, str) else config
        if not isinstance(config, CacheConfig):
            raise ValueError(f"a page pool needs a CacheConfig or a spec string, got {config!r}")
        check_config(config)
        sizes = (("n_layers", n_layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("pages", pages))
        for name, value in (*sizes, ("max_rows", max_rows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"a page pool's {name} must be a positive integer, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"a page pool's dtype must be the model's floating point dtype, got {dtype!r}")
        self.config = config
        self.layout = PageLayout.of(config.k_format, config.v_format, head_dim, dtype)
        self.basis = PageBasis.of(config, self.layout, ModelShape(n_layers, kv_heads, model_type))
        self.kv_heads, self.head_dim, self.dtype, self.n_pages = kv_heads, head_dim, dtype, pages
        shape = (pages, kv_heads, PAGE_TOKENS, self.layout.row_bytes)
        self.pages = [torch.zeros(shape, dtype=torch.uint8) for _ in range(n_layers)]
        self._free = list(range(pages - 1, -1, -1))  # popped from the end: page 0 first
        self._ids = itertools.count()
        self.max_rows = max_rows
        self._alive: dict[int, PagedRow] = {}  # id -> row: every alive row's sink pages stay staged
        lossy = self.layout.k.family != "cast" or self.layout.v.family != "cast"
        self.sink_pages = sink_pages(config)
        self.window, self.sink = config.window, sink_tokens(config)  # StreamingLLM's, kept in pages
        self.residual_pages = residual_pages(config)
        self.stager = self.stage_layout = self.stage_dtype = None
        self.staged: list[torch.Tensor] = []
        if stage and lossy:
            # a slot for each row's partly filled page, its sink pages and its residual pages: never one short, so no
            # slot is ever taken from another row (a row's staging depends on its own length alone)
            slots = max_rows * (1 + self.sink_pages + self.residual_pages)
            self.stager = Stager(slots, sink_pages=self.sink_pages)
            self.stage_dtype = stage_dtype(config, dtype)
            name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.stage_dtype, "none")
            self.stage_layout = PageLayout.of(name, name, head_dim, dtype)
            sshape = (slots, kv_heads, PAGE_TOKENS, self.stage_layout.row_bytes)
            self.staged = [torch.empty(sshape, dtype=torch.uint8) for _ in range(n_layers)]
        elif self.sink_pages and lossy:
            raise ValueError(
                f"sink={config.sink} keeps whole pages in the staging pool, which stage=False turns off"
            )

    # -- rows --------------------------------------------------------------------------------
    def new_row(self) -> PagedRow:
        """A row with no tokens (ValueError when ``max_rows`` are alive)."""
        if len(self._alive) >= self.max_rows:
            raise ValueError(
                f"the page pool holds at most {self.max_rows} rows at once (max_rows); free one first"
            )
        row = PagedRow(next(self._ids))
        self._alive[row.id] = row
        return row

    def free(self, row: PagedRow) -> None:
        """Give ``row``'s pages back (the row is empty afterwards and no longer counts as alive)."""
        if not self.is_alive(row):
            raise ValueError(
                f"row {row.id} is not a live row of this page pool (freed already, or another pool's)"
            )
        del self._alive[row.id]
        live = [p for p in row.pages if p != GONE]
        if self.stager is not None:  # a page's staged copy is its old tokens' (the next owner may copy in)
            with torch.inference_mode():  # the stager's map is made in the steps' inference mode
                self.stager.forget(live)
        self._free.extend(reversed(live))
        row.pages, row.length, row.gone = [], 0, 0

    def copy_row(self, src: PagedRow) -> PagedRow:
        """A new row holding ``src``'s tokens in pages of its own: its codes copied in every layer, and its staged
        pages (sinks, residual, the partly filled one) staged alike, so the copy reads what ``src`` reads (ValueError
        in one line where the pool has too few free pages or rows; nothing changes)."""
        if not self.is_alive(src):
            raise ValueError(f"row {src.id} is not a live row of this page pool")
        live = [i for i, p in enumerate(src.pages) if p != GONE]
        if len(live) > len(self._free):
            raise ValueError(
                f"the page pool has {len(self._free)} free pages, copying row {src.id} needs {len(live)}"
            )
        if len(self._alive) >= self.max_rows:
            raise ValueError(
                f"the page pool holds at most {self.max_rows} rows at once (max_rows); free one first"
            )
        if self.stager is not None:
            staged = sum(
                1 for i in live if src.pages[i] < self.stager.map.shape[0] and int(self.stager.map[src.pages[i]]) >= 0
            )
            if staged > self.stager.free_slots:
                raise ValueError(
                    f"the staging pool has {self.stager.free_slots} free slots, copying row {src.id} needs {staged}"
                )
        row = self.new_row()
        row.pages = [GONE] * len(src.pages)
        for i in live:
            row.pages[i] = self._free.pop()
        try:
            with torch.inference_mode():
                mine, theirs = [row.pages[i] for i in live], [src.pages[i] for i in live]
                for layer in self.pages:
                    layer[mine] = layer[theirs]
                if self.stager is not None:  # its staged pages (sinks, residual, the partly filled one) alike
                    for a, b in zip(theirs, mine, strict=True):
                        slots = self.stager.copy(a, b)
                        if slots is not None:
                            for layer in self.staged:
                                layer[slots[1]] = layer[slots[0]]
        except BaseException:
            self.free(row)  # its pages and any slot they took, back
            raise
        row.length, row.gone = src.length, src.gone
        return row

    def is_alive(self, row) -> bool:
        return self._alive.get(getattr(row, "id", None)) is row

    @property
    def rows_alive(self) -> int:
        return len(self._alive)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def page_bytes(self) -> int:
        """Bytes of one page id across every layer (codes of ``kv_heads x 32`` tokens, K and V)."""
        return len(self.pages) * self.kv_heads * PAGE_TOKENS * self.layout.row_bytes

    def nbytes(self, row: PagedRow) -> int:
        """The bytes ``row`` holds: its pages in every layer (the staging pool is the pool's, :meth:`stage_bytes`)."""
        return sum(p != GONE for p in row.pages) * self.page_bytes()

    def stage_bytes(self) -> int:
        """Bytes of the staging pool, every layer."""
        return sum(t.numel() for t in self.staged)

    # -- a step ------------------------------------------------------------------------------
    def plan(self, rows: list, lengths: list[int]) -> StepPlan:
        """Lay out one step: ``lengths[b]`` new tokens of ``rows[b]`` (None: a filler row of one token), packed in
        row order. Takes the pages the new tokens need (ValueError in one line, nothing taken, when the pool has too
        few free pages); the rows themselves change only at :meth:`commit`."""
        if len(rows) != len(lengths) or not rows:
            raise ValueError(
                f"a paged step needs one length per row, got {len(lengths)} for {len(rows)} rows"
            )
        seen: set = set()
        need = 0
        for row, n in zip(rows, lengths, strict=True):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1 or (row is None and n != 1):
                raise ValueError(
                    f"a paged step's row needs at least one new token (a filler row exactly one), got {n}"
                )
            if row is None:
                continue
            if id(row) in seen:
                raise ValueError("a paged step feeds each row at most once")
            if not self.is_alive(row):
                raise ValueError("a paged step's rows must be live rows of its pool (new_row(), not freed)")
            seen.add(id(row))
            need += max(0, -(-(row.length + n) // PAGE_TOKENS) - len(row.pages))
        if need > len(self._free):
            raise ValueError(
                f"the page pool has {len(self._free)} free pages of {self.n_pages}, this step needs {need} more "
                f"(32 tokens a page): free rows or build a larger pool"
            )
        before = [(r, list(r.pages)) for r in rows if r is not None]
        free0 = list(self._free)
        with torch.inference_mode():
            stager_state = None if self.stager is None else self.stager.state()
        try:
            return self._lay_out(rows, lengths, (before, free0, stager_state))
        except BaseException:  # nothing taken, nothing planned
            self._undo((before, free0, stager_state, None, None))
            raise

    def _lay_out(self, rows: list, lengths: list[int], snapshot: tuple) -> StepPlan:
        """:meth:`plan`'s changes (pages taken, the staging planned), after its checks; ``snapshot``: what
        :meth:`abandon` puts back."""
        before, free0, stager_state = snapshot
        taken, slots, pos, kv_lens, tables = [], [], [], [], []
        t = PAGE_TOKENS
        for row, n in zip(rows, lengths, strict=True):  # plain lists, one tensor each at the end
            if row is None:
                slots.append(-1)
                pos.append(0)
                kv_lens.append(1)
                tables.append([])
                taken.append([])
                continue
            more = [self._free.pop() for _ in range(max(0, -(-(row.length + n) // t) - len(row.pages)))]
            taken.append(more)
            pages = row.pages + more
            where = range(row.length, row.length + n)
            slots += [pages[j // t] * t + j % t for j in where]
            pos += where
            kv_lens.append(row.length + n)
            tables.append(pages)
        width = max(1, max(len(p) for p in tables))
        block = torch.tensor([p + [0] * (width - len(p)) for p in tables], dtype=torch.int32)
        starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        table = paged.Rows.of(starts, torch.tensor(kv_lens, dtype=torch.int32), block)
        plan = StepPlan(
            list(rows), list(lengths), torch.tensor(slots, dtype=torch.long), table, torch.tensor([pos], dtype=torch.long)
        )
        plan.undo = (before, free0, stager_state, None, None)
        for row, more in zip(rows, taken, strict=True):
            if row is not None:
                row.pages = row.pages + more  # the pages are the row's from here (commit advances its length)
        if self.stager is not None:
            with torch.inference_mode():  # its map: an inference tensor whichever mode the step runs in
                plan.stage_dest = self.stager.plan(plan.slots, self._keep_staged(rows, lengths))
            plan.stage_map = self.stager.map
            staged = plan.stage_dest >= 0
            plan.staged_any = bool(staged.any())
            if plan.staged_any and not bool(staged.all()):
                plan.staged_index = staged.nonzero().flatten()
            # slots this step hands from one page to another (a page left a residual, a new one starts): their
            # contents are kept, so that an abandoned step can put them back (its layers write the new owner's)
            owners = stager_state[1]
            moved = [i for i, p in enumerate(self.stager._page) if owners[i] >= 0 and p != owners[i]]
            if moved:
                index = torch.tensor(moved)
                plan.undo = (
                    before,
                    free0,
                    stager_state,
                    index,
                    [layer[index].clone() for layer in self.staged],
                )
        return plan

    def _keep_staged(self, rows: list, lengths: list[int]) -> list[int]:
        """The pages every live row keeps staged after this step (stepped or not): its sink pages and the last
        ``residual_pages`` of its full pages. And a side effect: the pages a stepped row's residual leaves in this
        step are dropped from the staging pool here (their codes are read from now on, as a SlimCache encodes a group leaving its
        residual)."""
        after = {id(r): r.length + n for r, n in zip(rows, lengths, strict=True) if r is not None}
        s, rp = self.sink_pages, self.residual_pages
        pinned = []
        for row in self._alive.values():
            full = after.get(id(row), row.length) // PAGE_TOKENS
            if id(row) in after:
                before = row.length // PAGE_TOKENS
                self.stager.forget([p for p in row.pages[max(s, before - rp) : max(s, full - rp)] if p != GONE])
            pinned += [p for p in row.pages[:s] + row.pages[max(s, full - rp) : full] if p != GONE]
        return pinned

    def abandon(self, plan: StepPlan) -> None:
        """The step's forward failed: every row, the free pages, the staging plan and the staged tokens the step
        wrote over back to what they were before :meth:`plan` (the page slots the forward wrote lie past the rows'
        lengths and are written again). A plan already committed or abandoned is left as it is."""
        if plan.undo is None:
            return
        undo, plan.undo = plan.undo, None
        plan.abandoned = True
        self._undo(undo)

    def _undo(self, undo: tuple) -> None:
        before, free0, stager_state, moved, contents = undo
        self._free[:] = free0
        for row, pages in before:
            row.pages = pages
        if stager_state is not None:
            with torch.inference_mode():
                self.stager.restore(stager_state)
                if moved is not None:  # the slots the step gave to other pages: their old pages' tokens again
                    for layer, saved in zip(self.staged, contents, strict=True):
                        layer[moved] = saved

    def commit(self, plan: StepPlan) -> None:
        """The step's forward ran: each row holds its new tokens (ValueError for a plan abandoned or committed)."""
        if plan.undo is None:
            raise ValueError("this step was committed or abandoned already")
        plan.undo = None
        for row, n in zip(plan.rows, plan.lengths, strict=True):
            if row is not None:
                row.length += n
                if self.window is not None:
                    self._evict(row)

    def _evict(self, row: PagedRow) -> None:
        """A windowed row's pages that no later query sees go back to the pool (:func:`pagespec.evictable`)."""
        first, last = evictable(self.config, row.length)
        gone = [p for p in row.pages[first + row.gone : last] if p != GONE]
        if not gone:
            return
        for i in range(first + row.gone, last):
            row.pages[i] = GONE
        row.gone = last - first
        if self.stager is not None:
            with torch.inference_mode():
                self.stager.forget(gone)
        self._free.extend(reversed(gone))

    def attend(
        self,
        plan: StepPlan,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Layer ``layer`` of the step: the step's ``key``, ``value`` (N, H_kv, D) written to their pages (and staging
        slots), then every row's queries ``query`` (N, H_q, D) attended on its history and its own new tokens
        (causal). Returns (N, H_q, D) float32."""
        out = pagecalls.attend(self, plan, layer, query, key, value, scale)  # the step's tables, laid out once
        if out is not None:
            return out
        keys, values, largest = self.basis.stored(key, value, layer)
        check_staged(self.stage_dtype, self.dtype, plan, keys, values, largest)
        paged.store(self.layout, self.pages[layer], keys, values, plan.slots)
        staged = None
        if self.stager is not None:
            paged.store(self.stage_layout, self.staged[layer], keys, values, plan.stage_dest)
            staged = paged.Staged(self.staged[layer], self.stage_layout, plan.stage_map)
        out = torch.empty(query.shape, dtype=torch.float32)
        attend_in_basis(
            self.basis,
            self.layout,
            self.pages[layer],
            query,
            out,
            plan.table,
            scale,
            self.window or 0,
            True,
            keys,
            values,
            staged,
            self.sink,
        )
        return out


def pool_for(model, config: CacheConfig | str, *, pages: int, max_rows: int, stage: bool = True) -> PagePool:
    """A :class:`PagePool` for a transformers causal LM's attention (its layers, KV heads, head size and dtype)."""
    shapes = ModelShapes.from_config(model.config)
    if (shapes.k_head_dim, shapes.v_head_dim) != (shapes.head_dim, shapes.head_dim):
        raise ValueError(
            f"{shapes.model_type or 'this model'} caches keys of {shapes.k_head_dim} and values of "
            f"{shapes.v_head_dim} channels (multi-head latent attention): pages hold K and V of one head size"
        )
    return PagePool(
        config,
        n_layers=shapes.n_layers,
        kv_heads=shapes.n_kv_heads,
        head_dim=shapes.head_dim,
        dtype=model.dtype,
        pages=pages,
        max_rows=max_rows,
        model_type=shapes.model_type or None,
        stage=stage,
    )
