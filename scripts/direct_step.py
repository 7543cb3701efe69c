"""A paged step through the direct step (kvslim.cache.paged_direct) against the model's own forward, interleaved.

    python scripts/direct_step.py --rows 1 16 --length 4096 --config int4 --steps 16
    python scripts/direct_step.py --rows 16 --config 'int4,sink=4,window=1020,positions=original' --dtype bfloat16

For each ``--config`` and ``--rows``: prefills ``--length`` seeded random tokens of the embedded model into a pool
of pages of the spec (chunks of 1,024), copies the row into two sets of ``--rows`` rows, then steps the two sets
alternately with the same random tokens: one through the direct step, one through transformers' forward
(``paged_direct.ENABLED`` off), the linear layers on the engine's route (``--linears``). Every step's logits are
compared bit for bit (a difference stops the run). Prints a table (median and min ms a step, the direct step's
saving and ratio) and, with ``--json``, every step's time, the thread settings and the load average before and after.
Measure on a quiet machine, alone (``uptime`` before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", nargs="+", default=["int4"])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linears", default="auto", help="the route of the linear layers (kvslim.engine.linears)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's weights")
    p.add_argument("--json", help="write every step's time here")
    a = p.parse_args()
    if a.length < 1 or min(a.rows) < 1 or a.steps < 1:
        p.error("--length, --rows and --steps must be positive")
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.cache import paged_direct
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.pagepool import pool_for
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.models.load import load_model

    load = [os.getloadavg()]
    model = kvslim.enable(load_model(None, dtype=a.dtype)[0])
    with torch.inference_mode():
        if paged_direct.why_not(model) is not None:
            raise SystemExit(
                f"direct_step.py: the direct step does not serve this model: {paged_direct.why_not(model)}"
            )
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (a.length,), generator=g).tolist()
    rows_out = []
    for spec in a.config:
        for n in a.rows:
            route = Linears(model, a.linears, batch_hint=step_rows(n))
            with torch.inference_mode():
                pages = -(-(a.length + a.warmup + a.steps + 32) // 32)
                pool = pool_for(model, spec, pages=pages * (2 * n + 1), max_rows=2 * n + 1)
                src = pool.new_row()
                for s in range(0, a.length, 1024):
                    forward_pages(model, pool, [(prompt[s : s + 1024], src)])
                sets = {
                    True: [pool.copy_row(src) for _ in range(n)],
                    False: [pool.copy_row(src) for _ in range(n)],
                }
                times = {True: [], False: []}
                for i in range(a.warmup + a.steps):
                    tokens = torch.randint(0, 1000, (n,), generator=g).tolist()
                    got = {}
                    for direct in (True, False) if i % 2 else (False, True):
                        paged_direct.ENABLED = direct
                        t0 = time.perf_counter()
                        with route.routed() as r:
                            feeds = [([t], row) for t, row in zip(tokens, sets[direct], strict=True)]
                            got[direct] = forward_pages(model, pool, feeds, row_multiple=r.row_multiple())
                        got[direct].argmax(-1).tolist()
                        dt = time.perf_counter() - t0
                        if i >= a.warmup:
                            times[direct].append(dt * 1e3)
                    paged_direct.ENABLED = True
                    if not torch.equal(got[True], got[False]):
                        raise SystemExit(f"direct_step.py: {spec} at {n} rows: step {i}'s logits differ")
            med = {k: statistics.median(v) for k, v in times.items()}
            rows_out.append(
                {
                    "config": spec,
                    "rows": n,
                    "length": a.length,
                    "model_ms_median": med[False],
                    "model_ms_min": min(times[False]),
                    "direct_ms_median": med[True],
                    "direct_ms_min": min(times[True]),
                    "saved_ms": med[False] - med[True],
                    "speedup": med[False] / med[True],
                    "model_ms": times[False],
                    "direct_ms": times[True],
                }
            )
            print(f"{spec} rows={n}: model {med[False]:.1f} ms, direct {med[True]:.1f} ms", flush=True)
    load.append(os.getloadavg())
    print(
        f"\nlength {a.length}, {a.dtype}, {a.threads} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"linears {route.route}; load average {load[0][0]:.2f} -> {load[1][0]:.2f}; logits bit-equal at every step"
    )
    print(f"{'config':<44} {'rows':>4} {'model ms':>9} {'direct ms':>9} {'saved':>6} {'speedup':>7}")
    for r in rows_out:
        print(
            f"{r['config']:<44} {r['rows']:>4} {r['model_ms_median']:>9.1f} {r['direct_ms_median']:>9.1f} "
            f"{r['saved_ms']:>6.1f} {r['speedup']:>6.2f}x"
        )
    if a.json:
        settings = {
            "dtype": a.dtype,
            "threads": a.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "linears": route.route,
            "load_before": load[0],
            "load_after": load[1],
        }
        with open(a.json, "w") as f:
            json.dump({"settings": settings, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
