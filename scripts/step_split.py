"""Where a many-row decode step's time goes, by kvslim function, with wall-clock timers (no profiler's overhead).

    python scripts/step_split.py --rows 16 --length 3000 --config 'int4,sink=4,window=1020' --steps 8
    python scripts/step_split.py --rows 16 --length 3000 --config 'int4,sink=4,window=1020' --steps 40 \
        --synced --per-step

Prefills one cache of ``--config`` with ``--length`` seeded random tokens of the embedded model and copies it into
``--rows`` rows. Without ``--synced`` row ``i`` is then fed ``2 i`` more tokens alone, so that the rows leave their
residual groups at different steps, as a server's rows do; with it the rows stay copies (``kvslim bench
--concurrency``'s rows: every row flushes, and a full ring compacts, in the same step). Then ``--warmup`` untimed
and ``--steps`` timed engine decode steps (:func:`kvslim.generate.forward_rows`, the linear layers on
``--linears``'s route), each function below timed inclusively (nested timers overlap: ``SlimLayer.append``
is inside ``RaggedLayer.update``):

- ``linear``: the model's linear layers; ``attend_rows``: the rows call (C, with its marshalling);
- ``RaggedLayer.update`` (the step's cache update), ``SlimLayer.append``/``segments``/``_evict`` (per row);
- ``fused_row``, ``_run_pieces``, ``_moved_queries`` (rows whose keys sit in two RoPE frames);
- ``encode`` (``Stream._encode``: the groups leaving residuals), ``compact`` (``TimeBuffer._compact``: a full
  ring moving its live entries to the front).

Prints the step's median and each function's milliseconds a step; ``--per-step``: every step's time and its
``encode``/``compact`` (the flush steps' spikes). Measure on a quiet machine (``uptime`` before and after), alone.
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import pstats
import statistics
import time

import torch


def _timed(owner, name: str, label: str, acc: dict) -> None:
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - t

    setattr(owner, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=3000)
    p.add_argument("--config", default="int4,sink=4,window=1020")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linears", default="auto", help="the route of the linear layers (kvslim.engine.linears)")
    p.add_argument("--synced", action="store_true", help="rows stay copies of one prefill (flush together)")
    p.add_argument("--per-step", action="store_true", help="every step's time, encode and compaction")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile the measured steps (cProfile) and print the N functions of most own time")
    p.add_argument("--dump", help="with --cprofile: write the pstats here too (for pstats' callers and callees)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim import fused
    from kvslim.cache import layer, ragged, stream, timebuffer
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.generate import forward_rows, prefill
    from kvslim.kernels import cpu
    from kvslim.models.load import load_model

    acc: dict = collections.defaultdict(float)
    for owner, name, label in (
        (cpu, "attend_rows", "attend_rows"), (fused, "fused_row", "fused_row"), (fused, "_run_pieces", "_run_pieces"),
        (fused, "_moved_queries", "_moved_queries"), (ragged.RaggedLayer, "update", "RaggedLayer.update"),
        (layer.SlimLayer, "append", "SlimLayer.append"), (layer.SlimLayer, "segments", "SlimLayer.segments"),
        (layer.SlimLayer, "_evict", "SlimLayer._evict"), (stream.Stream, "_encode", "encode"),
        (timebuffer.TimeBuffer, "_compact", "compact"),
    ):  # fmt: skip
        _timed(owner, name, label, acc)
    _timed(torch.nn.Linear, "forward", "linear", acc)

    model = load_model(None)[0]
    kvslim.enable(model)
    route = Linears(model, a.linears, batch_hint=step_rows(a.rows))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), generator=g)
    base = kvslim.SlimCache.from_config(kvslim.parse_spec(a.config), config=model.config)
    steps = []
    with torch.inference_mode():
        prefill(model, ids, base, chunk_size=1024)
        rows = [copy.deepcopy(base) for _ in range(a.rows)]
        if not a.synced:
            for i, r in enumerate(rows):
                for j in range(2 * i):
                    forward_rows(model, [int(ids[0, j])], [r])
        totals: dict = collections.defaultdict(float)
        prof = cProfile.Profile() if a.cprofile else None
        for s in range(a.warmup + a.steps):
            acc.clear()
            if prof is not None and s == a.warmup:
                prof.enable()
            t = time.perf_counter()
            with route.routed():
                forward_rows(model, torch.randint(0, 1000, (a.rows,), generator=g).tolist(), rows).argmax(-1).tolist()
            ms = (time.perf_counter() - t) * 1e3
            if s >= a.warmup:
                steps.append((ms, acc.get("encode", 0.0) * 1e3, acc.get("compact", 0.0) * 1e3))
                for k, v in acc.items():
                    totals[k] += v
    print(f"{a.rows} rows x {a.length} tokens, {a.config}, {'synced' if a.synced else 'staggered'}, {route}, "
          f"{a.threads} threads: step median {statistics.median(s[0] for s in steps):.1f} ms")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {k:20s} {v / a.steps * 1e3:7.1f} ms a step")
    if prof is not None:
        prof.disable()
        print(f"cProfile of the {a.steps} measured steps (its overhead inflates Python; own time first):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.cprofile)
        if a.dump:
            prof.dump_stats(a.dump)
    if a.per_step:
        for i, (ms, enc, comp) in enumerate(steps):
            print(f"  step {i:3d} {ms:8.1f} ms   encode {enc:6.1f}   compact {comp:6.1f}")


if __name__ == "__main__":
    main()
