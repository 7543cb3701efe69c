"""StreamingLLM flatness: the decode step time of windowed modes at growing numbers of tokens seen.

A sink+window cache holds at most ``sink + window`` tokens, so its decode step should cost the same
after 1k or 64k tokens seen. Advancing a cache by 64k tokens through the model would dominate the
run, so the history is advanced cheaply: one real prefill of the fewest tokens seen gives a
``DynamicCache``'s K/V, which are fed again, in chunks, through ``cache.update`` on every layer. The
decode steps themselves are real forwards (:func:`.timing.timed_decode_step`), at the cache's true
position: its count of tokens seen.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..generate import prefill
from .memory import stored_tokens
from .modes import Mode
from .timing import quartiles, quiet, timed_decode_step


@dataclass
class SeenRow:
    """A windowed mode's decode step at ``seen`` tokens seen."""

    mode: str
    seen: int
    tokens_stored: int
    ms_median: float
    ms_q1: float
    ms_q3: float
    ratio_to_first: float


def measure_streaming(
    model,
    modes: Sequence[Mode],
    seen: Sequence[int],
    steps: int,
    *,
    warmup: int = 2,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[SeenRow]:
    """Decode step time of windowed ``modes`` at each number of tokens seen.

    One cache per (mode, seen value): each gets the K/V of one real prefill of ``min(seen)`` tokens
    (a DynamicCache's), fed again in chunks through ``cache.update`` on every layer until it has
    seen its number of tokens (cheap: no model forward; a windowed cache stays small). Then
    ``steps`` decode steps at the true position are interleaved over every (mode, seen) pair, so
    ``ratio_to_first`` compares moments of the same rounds.
    """
    from transformers import DynamicCache

    log = log or quiet
    seen = sorted(set(seen))
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 99)
    first = seen[0]
    src = DynamicCache(config=model.config)
    prefill(model, torch.randint(0, vocab, (1, first), generator=gen).to(device), src)
    chunks = [(layer.keys, layer.values) for layer in src.layers]  # per layer: (1, H_kv, first, D) each
    pairs = [(m, n) for n in seen for m in modes]
    caches = {}
    for mode, target in pairs:
        cache = mode.make()
        while (missing := target - cache.get_seq_length()) > 0:
            n = min(missing, first)
            for i, (k, v) in enumerate(chunks):
                cache.update(k[:, :, :n], v[:, :, :n], i)
        caches[mode.name, target] = cache
        log(f"streaming: {mode.name} advanced to {target} tokens seen")
    del src, chunks
    tokens = torch.randint(0, vocab, (warmup + steps, 1, 1), generator=gen).to(device)
    times: dict[tuple[str, int], list[float]] = {(m.name, n): [] for m, n in pairs}
    for r in range(warmup + steps):
        k = r % len(pairs)
        for mode, target in pairs[k:] + pairs[:k]:
            dt = timed_decode_step(model, caches[mode.name, target], tokens[r])
            if r >= warmup:
                times[mode.name, target].append(dt)
        log(f"streaming: round {r + 1}/{warmup + steps}")
    rows: list[SeenRow] = []
    for mode in modes:
        first_ms = statistics.median(times[mode.name, first]) * 1e3
        for target in seen:
            med, q1, q3 = quartiles(times[mode.name, target])
            stored = stored_tokens(caches[mode.name, target])
            rows.append(
                SeenRow(mode.name, target, stored, med * 1e3, q1 * 1e3, q3 * 1e3, med * 1e3 / first_ms)
            )
    return rows
