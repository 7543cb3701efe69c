"""Time one decode step's attention (every layer, the cache's K/V at a given length) for cache specs, fused and
op by op: ``python scripts/fitted_attention_time.py FILE LENGTH SPEC [SPEC ...]``.

For each spec a SlimCache of the embedded model's shapes (its config; no model forward) is filled with LENGTH
random tokens per layer (channel means added, as real keys have), then one decode token; the attention of one
decode query per layer (kvslim.attention.compressed_attention on the layer's Segments) is timed with
``kvslim.attention.FUSED_DECODE`` on (the fused call) and off (op by op). Modes interleaved within each repeat;
the median over repeats of the whole step (all layers), in ms; and per spec the largest difference between the two
routings' outputs over the layers, relative to the layer's largest output value. FILE: the calibration file a spec's
``mean_center=`` names as ``FILE`` (``rotate=fitted`` needs one). Indicative on a shared machine: run ``uptime``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvslim import SlimCache, attention, parse_spec
from kvslim.models import load_model


def build(spec: str, config, length: int, seed: int):
    """The Segments of every layer of a cache with ``spec`` after ``length`` tokens and one decode token."""
    cache = SlimCache.from_config(parse_spec(spec), config=config)
    h, d = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    segs = []
    for layer in cache.layers:
        store = layer.store

        def kv(t):
            return torch.randn(1, h, t, d, generator=g) * 2 + torch.linspace(-3, 3, d)  # noqa: B023

        store.append(kv(length), kv(length))
        segs.append(store.append(kv(1), kv(1), segments=True))
    return segs


def main(argv: list[str]) -> None:
    path, length, specs = argv[0], int(argv[1]), argv[2:]
    model, _ = load_model(None)
    config = model.config
    hq, d = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    q = torch.randn(1, hq, 1, d, generator=torch.Generator().manual_seed(1))
    modes, diffs = [], {}
    for spec in specs:
        segs = build(spec.replace("FILE", path), config, length, 0)
        worst = 0.0
        for seg in segs:
            out = {}
            for fused in (True, False):
                attention.FUSED_DECODE = fused
                out[fused] = attention.compressed_attention(q, seg, None, d**-0.5)
            worst = max(worst, float((out[True] - out[False]).abs().max() / out[False].abs().max()))
        diffs[spec] = worst
        for fused in (True, False):
            modes.append((f"{spec} {'fused' if fused else 'op-by-op'}", segs, fused))
    times = {name: [] for name, _, _ in modes}
    for r in range(25):
        for name, segs, fused in modes[r % len(modes) :] + modes[: r % len(modes)]:
            attention.FUSED_DECODE = fused
            t0 = time.perf_counter()
            for seg in segs:
                attention.compressed_attention(q, seg, None, d**-0.5)
            if r >= 5:  # 5 warm-up rounds
                times[name].append(time.perf_counter() - t0)
    attention.FUSED_DECODE = True
    layers = len(modes[0][1])
    print(f"length {length}, {layers} layers, {torch.get_num_threads()} threads; ms per step (attention only)")
    for name, ts in times.items():
        med = statistics.median(ts) * 1e3
        q1, _, q3 = statistics.quantiles(ts, n=4)
        print(f"{name:60s} {med:8.3f}  IQR {q1 * 1e3:.3f}-{q3 * 1e3:.3f}")
    for spec, worst in diffs.items():
        print(f"{spec:60s} max |fused - op by op| / max |op by op| over layers: {worst:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
