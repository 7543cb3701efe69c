"""``kvslim bench --concurrency --pages``: each spec's streams also in one pool of pages (``SPEC+pages``).

The engine's rows in pages (``Engine(pages=...)``, :mod:`kvslim.engine.pages`) decode through
:func:`~kvslim.cache.paged_adapter.forward_pages`: every row's token in one forward, two kernel calls a layer. Here a
spec's row is prefilled once into a pool sized for every concurrency of the run, and each concurrency's ``C`` rows are
copies of it (:meth:`PagePool.copy_row <kvslim.cache.pagepool.PagePool.copy_row>`: its codes and its staged pages),
as the SlimCache rows are copies of one prefill; they step interleaved with the other modes, through the same route
for the linear layers. A spec pages cannot store (a window at ``cache`` positions, KIVI's per-channel K, ...) gets no
pages row, and the run says why.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.paged_adapter import forward_pages
from ..cache.paged_compiled import CompiledStep, wrapper_of
from ..cache.pagepool import PagePool, check_config, pool_for
from ..config import parse_spec
from ..engine.pages import pages_for
from .modes import Mode

#: the mode name's suffix of a spec's rows in pages (and of those stepped by the compiled paged step, after it)
SUFFIX = "+pages"
COMPILED = "+compiled"
#: id(model) -> its compiled paged step, one per model, held (with the model it closes over) for the bench's process:
#: its graphs compile once per bucket of rows across the run's lengths and concurrencies
_steps: dict[tuple, CompiledStep] = {}
#: prompt tokens a prefill forward reads
PREFILL_CHUNK = 1024


def pages_modes(modes: Sequence[Mode], compiled: bool | str = False) -> tuple[list[Mode], dict[str, str]]:
    """A ``SPEC+pages`` mode for each kvslim mode pages can store (and, ``compiled``, a ``SPEC+pages+compiled`` one
    stepped by the compiled paged step: True or a wrapper's name, kept as the mode's ``compiled``), and ``{spec: why
    not}`` for the others."""
    out, notes = [], {}
    for mode in modes:
        if mode.kind != "kvslim" or mode.compiled:
            continue
        cfg = parse_spec(mode.name)
        try:
            check_config(cfg)
        except ValueError as e:
            notes[mode.name] = str(e)
            continue
        out.append(Mode(mode.name + SUFFIX, "pages", lambda cfg=cfg: cfg, mode.bits))
        if compiled:
            wrapper = wrapper_of(compiled)
            out.append(Mode(mode.name + SUFFIX + COMPILED, "pages", lambda cfg=cfg: cfg, mode.bits, compiled=wrapper))
    return out, notes


def prefill_pages(model, mode: Mode, ids: torch.Tensor, *, rows: int, tokens: int) -> tuple[PagePool, object]:
    """A pool with room for ``rows`` copies of a row of ``tokens`` tokens beside the prefilled row of ``ids`` (1, L),
    and that row."""
    need = pages_for(tokens)
    pool = pool_for(model, mode.make(), pages=(rows + 1) * need, max_rows=rows + 1)
    row = pool.new_row()
    prompt = ids[0].tolist()
    with torch.inference_mode():
        for start in range(0, len(prompt), PREFILL_CHUNK):
            forward_pages(model, pool, [(prompt[start : start + PREFILL_CHUNK], row)])
    return pool, row


def compiled_step(model, wrapper: bool | str = "python") -> CompiledStep:
    """``model``'s compiled paged step with ``wrapper`` (True: ``"python"``; one a model and wrapper; ValueError in
    one line where it cannot be compiled)."""
    key = (id(model), wrapper_of(wrapper))
    if key not in _steps:
        _steps[key] = CompiledStep(model, wrapper=key[1])
    return _steps[key]


class PagedRows:
    """``concurrency`` copies of a prefilled row in its pool, stepped together (through ``compiled``, a
    :class:`~kvslim.cache.paged_compiled.CompiledStep`, where given)."""

    def __init__(self, pool: PagePool, base, concurrency: int, compiled: CompiledStep | None = None):
        self.pool = pool
        self.rows = [pool.copy_row(base) for _ in range(concurrency)]
        self.compiled = compiled

    def step(self, model, tokens: list[int], row_multiple: int) -> torch.Tensor:
        """One decode step of every row: (C, V) logits."""
        return forward_pages(model, self.pool, [([t], r) for t, r in zip(tokens, self.rows, strict=True)],
                             row_multiple=row_multiple, compiled=self.compiled)

    def nbytes(self) -> int:
        """The rows' pages, every layer, plus the pool's staging (the full-precision newest tokens) for these rows."""
        stage = self.pool.stage_bytes() * len(self.rows) // self.pool.max_rows
        return sum(self.pool.nbytes(r) for r in self.rows) + stage

    def close(self) -> None:
        for r in self.rows:
            self.pool.free(r)
        self.rows = []
