"""Positions: the one owner of position ids, left padding and the base that keeps ids bounded.

The position of a new token is the number of tokens its cache has seen before it (``cache.get_seq_length()``),
minus its row's left padding — pads sit at position 0 and a row's first real token at 0 too, as in
transformers' ``generate()`` — minus a base that keeps the ids bounded on endless streams through a bounded
:class:`~kvslim.SlimCache` (:func:`position_ids`, :func:`rebase_period`). Left padding is read once, from the
attention mask at prefill (:func:`left_padding`), handed to a SlimCache explicitly (:func:`hand_padding`), and
carried as ``pads`` to every later step. kvslim's loop (:mod:`kvslim.generate`) builds every id it feeds here;
the cache reads back here what a forward's ids imply when nobody handed them over (``model.generate()``:
:func:`pads_from_positions`, :func:`base_from_positions`, :func:`max_position`). The batch engine's ragged steps
take each row's id from :func:`position_ids` of the row's own cache and hand the base explicitly
(:mod:`kvslim.cache.ragged`). No other module builds or infers position ids.

This module holds no state and knows nothing about storage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .layer import SlimLayer
    from .policy import KeepPolicy
    from .rotary import Rotary


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Pads per row of a left-padded 2-D mask: (B, T) of 0/1 -> (B,) int64.

    Raises ValueError for a mask that is not left padding (a 0 after a 1 in some row): the cache's
    per-row sinks and these positions assume real tokens are contiguous at the end of each row.
    """
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be (batch, tokens), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.long()
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask must be left padding (zeros, then ones, in every row); "
            "tokenize with padding_side='left'"
        )
    return (mask.shape[1] - mask.sum(-1)).long()


def left_pad_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions for a left-padded batch: ``cumsum(mask) - 1``, pads at 0.

    attention_mask: (B, T) of 0/1 -> (B, T) int64. Equals :func:`position_ids` over the whole prompt
    with ``pads = left_padding(attention_mask)``.
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).clamp_(min=0)


def position_ids(cache, n_new: int, *, pads: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Position ids of the next ``n_new`` tokens fed through ``cache``: (1 or B, n_new) int64.

    ``seen + arange(n_new) - base`` where ``seen = cache.get_seq_length()`` counts every token fed so
    far (pads included); with ``pads`` (B,) each row is shifted left by its padding and clamped at 0.
    ``base`` keeps the ids bounded however long a stream runs: a bounded :class:`~kvslim.SlimCache`
    that can re-rotate keys has a ``rebase_period`` P, and ``base`` is the multiple of P at or below
    the first new token's position (ids stay below P + n_new). The cache reads the base back from the
    ids it is fed and keeps every key in phase (docs/streaming.md); any other cache gets base 0.
    """
    start = int(cache.get_seq_length())
    base = 0
    period = _loop_rebase_period(cache)
    if period:
        first = start - (int(pads.max()) if pads is not None and pads.numel() else 0)
        base = (max(first, 0) // period) * period
    pos = torch.arange(start - base, start - base + n_new, device=device)[None]  # (1, n_new)
    if pads is not None:
        pos = (pos - pads.to(device=device)[:, None]).clamp_(min=0)  # (B, n_new)
    return pos


@runtime_checkable
class PaddedCache(Protocol):
    """What this module reads of a cache that takes its left padding explicitly and can read a position base
    back from the ids it is fed (a :class:`~kvslim.SlimCache` is one; transformers' caches are not). The cache
    passes these; this module never imports it.

    padding_explicit: the padding was handed over (:meth:`set_left_padding`); rebase_period: how often
    kvslim's loop re-bases the ids (None: never)."""

    padding_explicit: bool
    rebase_period: int | None

    def get_seq_length(self) -> int: ...

    def set_left_padding(self, pads: torch.Tensor | None) -> None: ...


def _loop_rebase_period(cache) -> int | None:
    """The cache's re-base period, when it can read a base back from the ids: a :class:`PaddedCache` that was
    handed its padding (a cache fed before kvslim's loop saw it reads ids by transformers'
    convention, where an offset would look like padding)."""
    if isinstance(cache, PaddedCache) and cache.padding_explicit:
        return cache.rebase_period
    return None


def hand_padding(cache, pads: torch.Tensor | None) -> None:
    """Tell a :class:`PaddedCache` (a SlimCache) the batch's left padding, once, before its first token."""
    if isinstance(cache, PaddedCache) and not cache.padding_explicit and cache.get_seq_length() == 0:
        cache.set_left_padding(pads)


def pads_from_positions(position_ids: torch.Tensor, seen_before: int, keys: torch.Tensor) -> torch.Tensor:
    """transformers' convention (module docstring): ``pads = seen - 1 - position of the newest token``.

    position_ids: (B or 1, C); seen_before: tokens the layer held before these C. Returns (B,) int64.
    """
    batch = keys.shape[0]
    seen = seen_before + keys.shape[2]
    last = position_ids.reshape(-1, position_ids.shape[-1])[:, -1].to(device=keys.device, dtype=torch.long)
    if last.shape[0] == 1 and batch > 1:
        last = last.expand(batch)
    elif last.shape[0] != batch:
        raise ValueError(f"position_ids has batch {last.shape[0]} but the keys have batch {batch}")
    return torch.clamp(seen - 1 - last, min=0)


def max_position(position_ids, store: SlimLayer, n_new: int, base: int) -> int:
    """The longest position id of a forward: from the ids when the cache gets them, else from the tokens
    seen (the layer's rule: ``slot - pads - base``)."""
    if position_ids is not None:
        return int(position_ids.max())
    pads = store.pads
    least = 0 if pads is None or pads.numel() == 0 else int(pads.min())
    return store.seen + n_new - 1 - least - base


def rebase_period(policy: KeepPolicy, rotary: Rotary | None) -> int | None:
    """How often kvslim's loop re-bases position ids (a power of two >= 2 x capacity, >= 4096), or None."""
    if rotary is None or not policy.bounded:
        return None
    period = 4096
    while period < 2 * policy.capacity:
        period *= 2
    return period


def base_from_positions(position_ids, pads, seen_before: int, n_new: int, batch: int) -> int:
    """The base a forward's position ids were built with: ``true position - position id`` of each row's
    newest token (the same for every row holding a real token). 0 when position ids are unknown."""
    if position_ids is None:
        return 0
    last = position_ids.reshape(-1, position_ids.shape[-1])[:, -1].to(torch.long)
    if last.shape[0] == 1 and batch > 1:
        last = last.expand(batch)
    pads = pads.to(last.device) if pads is not None else torch.zeros_like(last)
    true = seen_before + n_new - 1 - pads  # (B,)
    real = true >= 0
    bases = (true - last)[real]
    if bases.numel() == 0:
        return 0
    base = int(bases[0])
    if bool((bases != base).any()):
        raise ValueError(
            f"position ids are not one offset from the tokens seen in every row (offsets {bases.tolist()}): "
            f"hand the left padding with cache.set_left_padding(pads) or feed position ids as kvslim.generate does"
        )
    return base
