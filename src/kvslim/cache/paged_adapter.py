"""The transformers adapter of a :class:`~kvslim.cache.pagepool.PagePool` step, and its one forward.

:func:`forward_pages` is the paged twin of :func:`kvslim.generate.forward_step`: every row's new tokens (a decode
token, or a prompt chunk) packed into ONE sequence with their own position ids, the linear layers once over all of
them, filler rows rounding the step up to ``row_multiple`` tokens (:mod:`kvslim.cache.ragged`, "Filler rows").
Each attention layer's :meth:`PagedStepLayer.update` hands the ``kvslim`` attention a :class:`PagedKV` (the step's
K/V and where to put them), and the attention makes the pool's two calls (:meth:`PagePool.attend
<kvslim.cache.pagepool.PagePool.attend>`): the write and the attention over every row's pages.

Each row's logits do not depend on what else shares the step: the linear layers are row-wise (at a
``row_multiple`` where the products round a row alike), the write and the attention compute each row on its own
(``kvp_attend`` splits its work by row, head and query, and sums a row's keys in one order whatever the others), so
a row's greedy output equals the row stepped alone (tests/test_pagepool.py).

A Llama, Mistral or Qwen2 model's step skips transformers' module stack (:mod:`kvslim.cache.paged_direct`: the same
calls on the same tensors, the same logits bit for bit, 4-9 ms less a step); any other model runs its own forward.

This module knows nothing about page formats, slots or staging (:mod:`kvslim.cache.pagepool` does), nor about
scheduling or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from ..checks import check_int
from . import paged_compiled, paged_direct
from .pagepool import PagePool, StepPlan
from .ragged import StepLayer


class PagedKV:
    """What one layer's attention reads in a paged step: the pool, the step's plan, the layer, and the step's own
    K/V (N, H_kv, D)."""

    __slots__ = ("pool", "plan", "layer", "key", "value")

    def __init__(self, pool: PagePool, plan: StepPlan, layer: int, key: torch.Tensor, value: torch.Tensor):
        self.pool, self.plan, self.layer, self.key, self.value = pool, plan, layer, key, value

    @property
    def shape(self) -> torch.Size:
        """(1, H_kv, N, D): what transformers' shape checks read."""
        n, h, d = self.key.shape
        return torch.Size((1, h, n, d))

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query (1, H_q, N, D) -> (1, N, H_q, D) in query's dtype: the pool's write and attention for this layer."""
        q = query[0].transpose(0, 1)  # (N, H_q, D): a view, read in place
        out = self.pool.attend(self.plan, self.layer, q, self.key, self.value, scaling)
        return out[None].to(query.dtype)


class PagedStepLayer(StepLayer):
    """Layer ``layer_idx`` of a paged step: transformers' per-layer contract."""

    _what = "a paged step's cache"
    _reset = "free the pool's rows"

    def __init__(self, owner: PagedStepCache, layer_idx: int):
        super().__init__()
        self._owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """key_states, value_states: (1, H_kv, N, D), the step's tokens packed. Returns ``(view, view)``, a
        :class:`PagedKV` (the write happens in the attention, with the queries: one place owns the layer's calls)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self._owner
        if key_states.shape[0] != 1 or key_states.shape[2] != owner.plan.n_tokens:
            raise ValueError(
                f"a paged step feeds {owner.plan.n_tokens} tokens packed in one sequence; got keys "
                f"{tuple(key_states.shape)}"
            )
        view = PagedKV(
            owner.pool,
            owner.plan,
            self.layer_idx,
            key_states[0].transpose(0, 1),
            value_states[0].transpose(0, 1),
        )
        return view, view


class PagedStepCache(Cache):
    """One step's rows of a :class:`PagePool` as one transformers ``Cache`` (its :class:`StepPlan`)."""

    def __init__(self, pool: PagePool, plan: StepPlan):
        self.pool, self.plan = pool, plan
        self.longest = max([r.length for r in plan.rows if r is not None] or [0])
        super().__init__(layers=[PagedStepLayer(self, i) for i in range(len(pool.pages))])


def forward_pages(
    model,
    pool: PagePool,
    feeds: Sequence[tuple[Sequence[int], object]],
    *,
    row_multiple: int = 4,
    compiled=None,
) -> torch.Tensor:
    """ONE forward of a paged step: ``feeds[b] = (token ids, row)``, a row of ``pool`` (its decode token or a prompt
    chunk), each row at most once. Returns (len(feeds), V) float32, each row's LAST token's logits; the rows hold
    their tokens afterwards. A forward that raises leaves every row and the pool as they were
    (:meth:`PagePool.abandon`). row_multiple: filler rows pad the step to a multiple of it (1 where every product rounds
    a row alike at any row count: :meth:`kvslim.engine.linears.Linears.row_multiple`). compiled: a
    :class:`~kvslim.cache.paged_compiled.CompiledStep` of ``model``, which runs a step whose every row feeds one token
    (padded with filler rows to its bucket) where it serves the model now; other steps run eagerly."""
    from ..compat import cache_kwargs

    check_int("row_multiple", row_multiple, minimum=1)
    if not feeds:
        raise ValueError("forward_pages needs at least one (tokens, row) feed")
    ids: list[int] = []
    rows, lengths = [], []
    for b, (tokens, row) in enumerate(feeds):
        tokens = list(tokens)
        if not tokens:
            raise ValueError(f"forward_pages row {b} has no tokens to feed")
        rows.append(row)
        lengths.append(len(tokens))
        ids += tokens
    n_rows = len(feeds)
    fill = -len(ids) % row_multiple
    if compiled is not None and len(ids) == n_rows and paged_compiled.why_not(model) is None:
        fill = compiled.rows_for(n_rows, row_multiple) - n_rows
    else:
        compiled = None
    ids += [0] * fill
    device = model.device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    last = torch.tensor(lengths, device=device).cumsum(0) - 1
    keep = torch.cat([last, last.new_full((-n_rows % row_multiple,), len(ids) - 1)])
    plan = pool.plan(rows + [None] * fill, lengths + [1] * fill)
    try:
        if compiled is not None:
            logits = compiled.run(pool, plan, input_ids[0])
        else:  # None: not a model the direct step serves now
            logits = paged_direct.step(model, pool, plan, input_ids[0], keep)
        if logits is None:
            logits = model(
                input_ids=input_ids,
                use_cache=True,
                position_ids=plan.positions.to(device),
                logits_to_keep=keep,
                **cache_kwargs(PagedStepCache(pool, plan)),
            ).logits[0]
    except BaseException:
        pool.abandon(plan)  # every row, its pages and the staging plan as before the step
        raise
    pool.commit(plan)
    return logits[:n_rows].float()
