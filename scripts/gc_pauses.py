"""Python's garbage collector in a many-row decode loop: step times and the collector's passes, with the startup heap
frozen (``--gc-freeze on``: :func:`kvslim.heap.freeze_startup_heap` after the model and the rows are built, what
``kvslim serve`` and ``kvslim bench`` do by default) or not (``off``).

    for f in off on off on; do OMP_WAIT_POLICY=PASSIVE python scripts/gc_pauses.py --gc-freeze $f --steps 400 \
        --json out/gc-$f.json; done

Prefills one cache of ``--config`` with ``--length`` seeded random tokens of the embedded model, copies it into
``--rows`` rows and feeds row ``i`` ``i`` more tokens alone (rows at different phases, as a server's), then runs
``--warmup`` and ``--steps`` engine decode steps (:func:`kvslim.generate.forward_rows`, the linear layers on
``auto``'s route). Prints the step times' percentiles and the collector's passes during the timed steps (count and
time per generation, the longest); ``--json`` writes them. One arm a process (a freeze cannot be taken back
without changing what the collector does next): run the arms in turn, alone, on a quiet machine (``uptime``
before and after).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--config", default="int4")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--gc-freeze", choices=("on", "off"), default="on")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the arms' numbers here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.generate import forward_rows, prefill
    from kvslim.heap import GcPauses, freeze_startup_heap
    from kvslim.models.load import load_model

    model = load_model(None)[0]
    kvslim.enable(model)
    route = Linears(model, "auto", batch_hint=step_rows(a.rows))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), generator=g)
    base = kvslim.SlimCache.from_config(kvslim.parse_spec(a.config), config=model.config)
    times, pauses = [], GcPauses()
    with torch.inference_mode():
        prefill(model, ids, base, chunk_size=1024)
        rows = [copy.deepcopy(base) for _ in range(a.rows)]
        for i, r in enumerate(rows):
            for j in range(i):
                forward_rows(model, [int(ids[0, j])], [r])
        tracked = len(gc.get_objects())
        frozen = freeze_startup_heap() if a.gc_freeze == "on" else 0
        for s in range(a.warmup + a.steps):
            timed = s >= a.warmup
            if timed:
                pauses.start()
            t = time.perf_counter()
            with route.routed():
                forward_rows(model, torch.randint(0, 1000, (a.rows,), generator=g).tolist(), rows).argmax(-1).tolist()
            ms = (time.perf_counter() - t) * 1e3
            if timed:
                pauses.stop()
                times.append(ms)
    v = sorted(times)
    pct = {q: v[min(len(v) - 1, int(q / 100 * len(v)))] for q in (50, 90, 99)}
    d = pauses.to_dict()
    print(f"{a.rows} rows x {a.length} tokens, {a.config}, {a.threads} threads, {a.steps} steps, --gc-freeze "
          f"{a.gc_freeze} ({tracked:,} objects tracked, {frozen:,} frozen); {route}")
    print(f"  step ms: p50 {pct[50]:.1f}  p90 {pct[90]:.1f}  p99 {pct[99]:.1f}  max {v[-1]:.1f}  mean "
          f"{statistics.mean(v):.1f}")
    print(f"  gc passes (gen 0/1/2): {'/'.join(map(str, d['passes']))}, ms {'/'.join(f'{x:.0f}' for x in d['ms'])}, "
          f"longest {d['longest_ms']:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "tracked": tracked, "frozen": frozen, "p50": pct[50], "p90": pct[90],
                       "p99": pct[99], "max": v[-1], "mean": statistics.mean(v), "steps_ms": times, **d}, f, indent=1)


if __name__ == "__main__":
    main()
