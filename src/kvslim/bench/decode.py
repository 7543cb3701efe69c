"""Decode and prefill speed and memory of every mode at one context length, interleaved.

Every mode's cache is built for length ``L`` (by a timed prefill of the same seeded random ``L``
tokens, or by handing it the plain cache's K/V through ``cache.update``), all of them stay alive,
and single-token decode steps are *interleaved*: round ``r`` runs one step of every mode (in an
order rotated by ``r``), so slow drifts of a shared, noisy machine hit every mode alike and the
ratios to the baseline ``dynamic`` stay meaningful.

What is reported, per mode (:class:`DecodeRow`):

- decode ms/token: median, quartiles, min/max of the timed steps (each one forward through
  :func:`kvslim.generate.decode_one_token`: the position is the cache's count of tokens seen,
  ``logits_to_keep=1``), tok/s, the ratio of medians to ``dynamic`` and the median of the
  per-round paired ratios;
- prefill tok/s (when prefilled, through :func:`kvslim.generate.prefill`) and its ratio to ``dynamic``;
- ``cache_bytes`` (see :mod:`.memory`);
- memory: ``resident_bytes`` is the process RSS growth caused by building this cache;
  ``step_transient_bytes`` the largest RSS rise *inside* one decode step of this mode (the
  high-water mark reset before each step); ``peak_bytes`` their sum: what this mode adds to the
  process (over the loaded model) at its decode peak;
- the memory-bandwidth floor: ``(weight bytes read per step + cache bytes read per step) /
  bandwidth``, the bandwidth measured with a large tensor copy just before the decode steps (so it
  sees the same machine load), and the measured step's ratio to it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..generate import prefill
from ..shapes import ModelShapes
from .memory import MB, MemoryProbe, cache_nbytes, cache_read_bytes, measure_bandwidth, stored_tokens
from .modes import DYNAMIC, Mode
from .timing import quartiles, quiet, sync, timed_decode_step


@dataclass
class DecodeRow:
    """One mode at one length. Times in ms; bytes in bytes."""

    mode: str
    kind: str
    length: int
    steps: int
    ms_median: float
    ms_q1: float
    ms_q3: float
    ms_min: float
    ms_max: float
    tok_s: float
    ratio_to_dynamic: float
    paired_ratio_to_dynamic: float
    built_by: str  # "prefill" (timed model prefill) or "copy" (the dynamic cache's K/V via cache.update)
    build_s: float
    prefill_tok_s: float | None
    prefill_ratio_to_dynamic: float | None
    cache_bytes: int
    cache_read_bytes: int
    tokens_stored: int
    one_layer_fp_bytes: int  # a full-precision K and V of one layer of the stored tokens
    resident_bytes: int | None
    step_transient_bytes: int | None
    peak_bytes: int | None
    bandwidth_gb_s: float  # measured just before this length's decode steps
    floor_ms: float
    ratio_to_floor: float
    compiled: bool = False  # the decode steps ran compiled (bench --compile, kvslim.compiled)


def warm_up(model, modes: Sequence[Mode], length: int = 8) -> None:
    """One short prefill and decode step per mode, untimed: first-call costs (lazy imports, kernel
    selection, allocator growth) land here, not in the first measured mode."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, length), dtype=torch.long, device=device)
    for mode in modes:
        cache = mode.make()
        prefill(model, ids, cache)
        timed_decode_step(model, cache, ids[:, :1])


def measure_decode(
    model,
    modes: Sequence[Mode],
    length: int,
    steps: int,
    *,
    warmup: int,
    seed: int,
    prefill_all: bool,
    bandwidth_bytes: int,
    weights: int,
    probe: MemoryProbe,
    log: Callable[[str], None] | None = None,
) -> list[DecodeRow]:
    """One :class:`DecodeRow` per mode at context length ``length``, ``dynamic`` (``modes[0]``) the baseline.

    prefill_all: build every cache by a timed prefill (else only ``dynamic``; the others get its K/V
    through ``cache.update`` and report no prefill speed). ``warmup`` untimed rounds come before the
    ``steps`` timed ones. weights: :func:`.memory.weight_bytes_per_step` of ``model``; probe: the
    run's memory probe.
    """
    log = log or quiet
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + length)
    ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
    next_tokens = torch.randint(0, vocab, (warmup + steps, 1, 1), generator=gen).to(device)

    caches, build_s, built_by, resident = {}, {}, {}, {}
    for mode in modes:  # dynamic first: the others may be built from its K/V
        r0 = probe.settle()
        cache = mode.make()
        by = "prefill" if (prefill_all or mode.name == DYNAMIC) else "copy"
        sync(device)
        t0 = time.perf_counter()
        if by == "prefill":
            prefill(model, ids, cache)
        else:
            for i, layer in enumerate(caches[DYNAMIC].layers):
                cache.update(layer.keys, layer.values, i)
        sync(device)
        build_s[mode.name] = time.perf_counter() - t0
        r1 = probe.settle()
        resident[mode.name] = None if r0 is None or r1 is None else r1 - r0
        caches[mode.name], built_by[mode.name] = cache, by
        log(f"L={length} {mode.name}: {by} {build_s[mode.name]:.2f} s")

    bandwidth = measure_bandwidth(bandwidth_bytes, device=device)
    log(f"L={length}: memory bandwidth {bandwidth / 1e9:.2f} GB/s ({bandwidth_bytes / MB:.0f} MB copy)")
    times = {m.name: [] for m in modes}
    transients = {m.name: [] for m in modes}
    for r in range(warmup + steps):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            probe.reset_peak()
            before = probe.rss()
            dt = timed_decode_step(model, caches[mode.name], next_tokens[r])
            peak = probe.peak() if probe.can_reset else None
            if r >= warmup:
                times[mode.name].append(dt)
                if peak is not None and before is not None:
                    transients[mode.name].append(max(0, peak - before))
        log(f"L={length} round {r + 1}/{warmup + steps}")

    base = times[DYNAMIC]
    base_med = statistics.median(base)
    dyn_prefill = length / build_s[DYNAMIC]
    shapes = ModelShapes.from_config(model.config)
    elsize = next(model.parameters()).element_size()
    rows = []
    for mode in modes:
        t = times[mode.name]
        med, q1, q3 = quartiles(t)
        cache = caches[mode.name]
        read = cache_read_bytes(cache)
        floor_s = (weights + read) / bandwidth
        prefilled = built_by[mode.name] == "prefill"
        ptok = length / build_s[mode.name] if prefilled else None
        stored = stored_tokens(cache)
        transient = max(transients[mode.name]) if transients[mode.name] else None
        res = resident[mode.name]
        rows.append(
            DecodeRow(
                mode=mode.name,
                kind=mode.kind,
                length=length,
                steps=steps,
                ms_median=med * 1e3,
                ms_q1=q1 * 1e3,
                ms_q3=q3 * 1e3,
                ms_min=min(t) * 1e3,
                ms_max=max(t) * 1e3,
                tok_s=1.0 / med,
                ratio_to_dynamic=med / base_med,
                paired_ratio_to_dynamic=statistics.median(a / b for a, b in zip(t, base, strict=True)),
                built_by=built_by[mode.name],
                build_s=build_s[mode.name],
                prefill_tok_s=ptok,
                prefill_ratio_to_dynamic=None if ptok is None else ptok / dyn_prefill,
                cache_bytes=cache_nbytes(cache),
                cache_read_bytes=read,
                tokens_stored=stored,
                # K and V (2) x batch x H_kv x stored tokens x head_dim x bytes per element
                one_layer_fp_bytes=2 * ids.shape[0] * shapes.n_kv_heads * stored * shapes.head_dim * elsize,
                resident_bytes=res,
                step_transient_bytes=transient,
                peak_bytes=None if res is None or transient is None else res + transient,
                bandwidth_gb_s=bandwidth / 1e9,
                floor_ms=floor_s * 1e3,
                ratio_to_floor=med / floor_s,
                compiled=mode.compiled,
            )
        )
    caches.clear()
    probe.settle(collect=True)
    return rows
