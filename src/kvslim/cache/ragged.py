"""Many SlimCaches as one batch: the transformers adapter for a ragged decode step.

A decode step of the batch engine (:mod:`kvslim.engine`) feeds one token to each of several rows whose
caches have different lengths, different evicted ranges and different settings (each row is its own
:class:`~kvslim.SlimCache`, built for batch 1). Padding every row to the longest would cost what the
longest row costs, for every row, and would need one storage layout for all of them. Instead
:class:`RaggedCache` hands each attention layer a :class:`RaggedSegments`: one
:class:`~kvslim.cache.layer.Segments` view per row (None for a filler row, see below), and the ``kvslim``
attention (:mod:`kvslim.attention`) attends on each row's own codes: one C call a layer for every row the
fused kernel reads (:func:`kvslim.kernels.cpu.attend_rows`, each row computed as it would be alone), row by
row for the others. The linear layers, the norms and RoPE run once over the whole batch — that is what a
batch is for: the weights are read once per step for every row.

A row that fails (its K/V not finite, or its store refuses them) in a step run with an ``errors`` dict is
dropped from the rest of that step: it is recorded in ``errors[b]`` and becomes a filler row (below) from
that layer on, so the other rows' logits are exactly those they would have had with it (every row's work
is its own: the linear layers are row-wise, attention computes each row on its own, even in one call). Its own cache has taken the token in
the layers before the failure and is not to be fed again: the caller ends that row. Without ``errors`` the
first failure raises, as a batch-1 cache would.

Positions are not decided here: the decode loop (:func:`kvslim.generate.forward_rows`) computes each
row's position id and hands the base it subtracted (``bases``); this module passes them to each row's
layers as they are. Only decode steps (one new token per row) are ragged: a joining request is
prefilled alone, in chunks, through its own cache.

Filler rows. The CPU BLAS rounds a row of a matrix product differently depending on how many rows the
product has (MKL: the same for 4, 8 and 12 or more rows, differently for 1-3, 5-7, 9-11), so one row's
logits would depend on how many rows share its step. The loop pads a step to a multiple of 4 rows with
filler rows (``None`` caches: token 0, position 0,
attention output 0, nothing stored), which makes every row's logits bit-identical whatever else is in
the batch (tests/test_engine.py checks it).

This module knows nothing about scheduling, sampling or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .layer import Segments


@dataclass(frozen=True)
class RaggedSegments:
    """One layer's stored tokens for every row of a ragged step: ``rows[b]`` is row ``b``'s
    :class:`~kvslim.cache.layer.Segments` (batch 1, taken after this step's token was appended, before
    eviction), or None for a filler row. Valid until the next step."""

    rows: tuple[Segments | None, ...]
    drop: object = None  # drop(b, exc): the owner's hook that ends row b's part in this step (or None: raise)

    @property
    def shape(self) -> torch.Size:
        """(B, H_kv, longest row, D): what transformers' shape checks read."""
        real = [s for s in self.rows if s is not None]
        if not real:
            return torch.Size((len(self.rows), 0, 0, 0))
        _, h, d = real[0].kv_shape
        return torch.Size((len(self.rows), h, max(s.length for s in real), d))


class RaggedLayer(CacheLayerMixin):
    """Layer ``layer_idx`` of every row: transformers' per-layer contract for one ragged decode step."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: RaggedCache, layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        rows = [c for c in owner.caches if c is not None]
        self.is_sliding = rows[0].layers[layer_idx].is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """key_states, value_states: (B, H_kv, 1, D), one new token per row. Appends row ``b``'s token to
        row ``b``'s cache (filler rows: nothing) and returns ``(view, view)``, a :class:`RaggedSegments`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self._owner
        if key_states.shape[0] != len(owner.caches) or key_states.shape[2] != 1:
            raise ValueError(
                f"a ragged step feeds one token to each of {len(owner.caches)} rows; got keys {tuple(key_states.shape)}"
            )
        # One finiteness check for the whole step (a sync per layer, not per row); where it fails, each row
        # checks its own tokens: a bad row raises as a batch-1 cache would, or is dropped (module docstring).
        finite = bool(torch.isfinite(key_states).all() & torch.isfinite(value_states).all())
        rows = []
        for b, cache in enumerate(owner.caches):
            if cache is None:
                rows.append(None)
                continue
            store = cache.layers[self.layer_idx].store
            try:
                rope = cache._rope_source.at(owner.positions[b]) if store.pre_rope else None
                rows.append(
                    store.append(  # a transaction: a row it refuses stores nothing in this layer
                        key_states[b : b + 1],
                        value_states[b : b + 1],
                        segments=True,
                        base=owner.bases[b],
                        rope=rope,
                        finite_checked=finite,
                    )
                )
            except Exception as e:  # noqa: BLE001 - one row's failure, kept to that row when the caller asks
                owner.drop(b, e)
                rows.append(None)
        view = RaggedSegments(tuple(rows), owner.drop if owner.errors is not None else None)
        return view, view

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # The kvslim attention ignores the mask of a ragged step (each row attends to all it stores); the
        # sizes only have to be consistent for transformers' mask builder.
        return self._owner.longest + 1, 0

    def get_seq_length(self) -> int:
        return self._owner.longest

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        raise ValueError("a ragged step's cache cannot be reset: reset the rows' own caches")

    def reorder_cache(self, beam_idx) -> None:
        raise ValueError("a ragged step's cache cannot be reordered (no beam search in the batch engine)")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a ragged step's cache cannot be cropped")


class RaggedCache(Cache):
    """The caches of the rows of one decode step, as one transformers ``Cache``.

    caches: one :class:`~kvslim.SlimCache` (built for batch 1, with ``config=``, fed its prompt) or None
    (a filler row) per batch row. positions: each row's position id for this step; bases: what was
    subtracted from each row's true position to get it (:func:`kvslim.generate.position_ids`). errors: None
    (a row's failure raises) or a dict that receives ``{row: exception}`` for each row dropped from the step
    (module docstring).
    """

    def __init__(self, caches, positions: list[int], bases: list[int], errors: dict | None = None):
        from .adapter import SlimCacheLayer

        real = [c for c in caches if c is not None]
        if not real:
            raise ValueError("a ragged step needs at least one row with a cache")
        n = len(real[0].layers)
        for c in real:
            if len(c.layers) != n or not all(isinstance(layer, SlimCacheLayer) for layer in c.layers):
                raise ValueError(
                    "every row of a ragged step must be a SlimCache of the same model whose layers all store K/V"
                )
            if c.padding_explicit and c.pads is not None:
                raise ValueError("a ragged step's rows are batch-1 caches without padding")
        self.caches = list(caches)
        self.positions = list(positions)
        self.bases = list(bases)
        self.errors = errors
        self.longest = max(c.get_seq_length() for c in real)
        super().__init__(layers=[RaggedLayer(self, i) for i in range(n)])

    def drop(self, row: int, exc: BaseException) -> None:
        """Row ``row`` failed in this step: raise ``exc`` (no ``errors`` dict), or record it and feed the row
        as a filler row from here on. When no real row is left, the step has nothing to compute: raise."""
        if self.errors is None:
            raise exc
        self.errors.setdefault(row, exc)
        self.caches[row] = None
        if all(c is None for c in self.caches):
            raise exc
