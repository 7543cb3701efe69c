"""Timing primitives every bench measurement shares: a device sync, one timed decode step, quartiles.

The timed decode step is one forward through :func:`kvslim.generate.decode_one_token`, the decode
step ``sample`` and ``eval`` run: its position is the cache's count of tokens seen, computed there,
never here. This module knows nothing about modes, caches' bytes or results.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from ..generate import decode_one_token


def sync(device) -> None:
    """Wait for queued device work (CUDA); a no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_decode_step(model, cache, token: torch.Tensor) -> float:
    """Seconds of one single-token forward, token (1, 1), at the cache's next position.

    Exactly one forward is timed, between two device syncs.
    """
    sync(token.device)
    t0 = time.perf_counter()
    decode_one_token(model, token, cache)
    sync(token.device)
    return time.perf_counter() - t0


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """``(median, q1, q3)`` of ``xs`` (inclusive method; one sample is its own quartiles)."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q1, q3


def quiet(msg: str) -> None:
    """The progress log that prints nothing."""
