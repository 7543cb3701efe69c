"""The append cost: one ``cache.update`` of a single token on layer 0, at two or more history lengths.

Habit 1 of the style guide (append, don't redo) as a number: a cache that quantizes each group once
when it fills costs the same at any history length; one that re-reads or re-encodes its history grows
with it. No model forward runs here: the K/V are random, of the model's shapes and dtype.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..shapes import ModelShapes
from .modes import Mode
from .timing import quiet, sync


@dataclass
class AppendRow:
    """``cache.update`` of one token on layer 0, median microseconds at each history length."""

    mode: str
    kind: str
    us: dict[int, float]
    ratio: float  # longest history over shortest


def measure_append(
    model,
    modes: Sequence[Mode],
    lengths: Sequence[int],
    *,
    reps: int = 50,
    warmup: int = 5,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[AppendRow]:
    """Median time of ``cache.update(k, v, 0)`` for one token (random K/V ``(1, H_kv, 1, D)`` in the
    model's dtype) at each history length.

    One cache per (mode, length), its layer 0 grown to that length with random K/V; then the
    single-token updates are interleaved over every (mode, length) pair, so the ratio between two
    lengths is not a ratio between two moments of a noisy machine. What is timed is the whole
    ``update`` call: for caches whose update returns the materialized history (DynamicCache
    concatenates, QuantizedCache dequantizes) that read is part of the cost.
    """
    log = log or quiet
    shapes = ModelShapes.from_config(model.config)
    param = next(model.parameters())
    gen = torch.Generator().manual_seed(seed + 7)

    def rand(t: int) -> torch.Tensor:
        x = torch.randn((1, shapes.n_kv_heads, t, shapes.head_dim), generator=gen)  # (1, H_kv, t, D)
        return x.to(device=param.device, dtype=param.dtype)

    lengths = sorted(set(lengths))
    pairs = [(m, n) for n in lengths for m in modes]
    caches = {}
    for mode, n in pairs:
        cache = mode.make()
        cache.update(rand(n), rand(n), 0)
        caches[mode.name, n] = cache
    log(f"append cost: {len(pairs)} caches filled")
    ones = [(rand(1), rand(1)) for _ in range(warmup + reps)]
    samples: dict[tuple[str, int], list[float]] = {(m.name, n): [] for m, n in pairs}
    for r in range(warmup + reps):
        k = r % len(pairs)
        for mode, n in pairs[k:] + pairs[:k]:
            key, value = ones[r]
            sync(param.device)
            t0 = time.perf_counter()
            caches[mode.name, n].update(key, value, 0)
            sync(param.device)
            if r >= warmup:
                samples[mode.name, n].append(time.perf_counter() - t0)
    us = {m.name: {n: statistics.median(samples[m.name, n]) * 1e6 for n in lengths} for m in modes}
    lo, hi = lengths[0], lengths[-1]
    return [AppendRow(m.name, m.kind, us[m.name], us[m.name][hi] / us[m.name][lo]) for m in modes]
