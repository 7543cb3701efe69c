"""A many-row decode step with the Hadamard basis' small products on torch's ``mm`` or on kvslim's kernel, and with
or without filler rows, interleaved in one process (what docs/performance.md's "Small products" table comes from).

Arms (``--arms``): ``mm4`` the Hadamard products through torch's ``mm`` and steps padded to a multiple of 4 (kvslim
before 2026-12-04 late), ``own4`` through kvslim's kernel (:mod:`kvslim.kernels.linear`) still padded, ``own1``
through the kernel with no filler rows (what the engine does where every product is kvslim's:
:meth:`kvslim.engine.linears.Linears.row_multiple`). Each arm steps its own copies of the same rows (one prefill,
copied; row ``i`` fed ``2 i`` more tokens alone, so that rows flush at different steps as a server's do), the arms'
order rotating each step. The linear layers run ``--linears``' route in every arm. Measure on a quiet machine
(``uptime`` before and after), alone::

    OMP_WAIT_POLICY=PASSIVE python scripts/small_products_ab.py --rows 16 --length 4100 \\
        --config 'int4,sink=4,window=1020' --config int4
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

ARMS = {"mm4": ("mm", 4), "own4": ("own", 4), "own1": ("own", 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4100)
    p.add_argument("--config", action="append", help="a cache spec (repeat for more; default int4)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linears", default="kvslim", help="the route of the linear layers in every arm")
    p.add_argument("--json", help="also write the medians here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.cache import hadamard
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.generate import forward_rows, prefill
    from kvslim.kernels import linear as own_kernel
    from kvslim.models.load import load_model

    if "own" in {ARMS[arm][0] for arm in a.arms} and not own_kernel.ready():
        raise SystemExit("kvslim's linear kernel is not built here (AVX2 and FMA, or AVX-512): only --arms mm4 runs")
    model = load_model(None)[0]
    kvslim.enable(model)
    route = Linears(model, a.linears, batch_hint=step_rows(a.rows))
    print(f"{route}; {a.threads} threads; {a.rows} rows x {a.length} tokens")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), generator=g)
    results = {}
    for config in a.config or ["int4"]:
        base = kvslim.SlimCache.from_config(kvslim.parse_spec(config), config=model.config)
        with torch.inference_mode():
            prefill(model, ids, base, chunk_size=1024)
            rows = [copy.deepcopy(base) for _ in range(a.rows)]
            for i, r in enumerate(rows):
                for j in range(2 * i):
                    forward_rows(model, [int(ids[0, j])], [r])
        arms = {arm: copy.deepcopy(rows) for arm in a.arms}
        times: dict = {arm: [] for arm in a.arms}
        feed = torch.randint(0, 1000, (a.warmup + a.steps, a.rows), generator=g).tolist()
        with torch.inference_mode():
            for s in range(a.warmup + a.steps):
                k = s % len(a.arms)
                for arm in a.arms[k:] + a.arms[:k]:
                    product, multiple = ARMS[arm]
                    hadamard._OWN[:] = [None] if product == "mm" else [own_kernel.linear]
                    t = time.perf_counter()
                    with route.routed():
                        forward_rows(model, feed[s], arms[arm], row_multiple=multiple).argmax(-1).tolist()
                    if s >= a.warmup:
                        times[arm].append((time.perf_counter() - t) * 1e3)
        hadamard._OWN.clear()
        first = statistics.median(times[a.arms[0]])
        print(f"\n{config}: ms a step, median of {a.steps} (quartiles), interleaved")
        for arm in a.arms:
            q = statistics.quantiles(times[arm], n=4)
            med = statistics.median(times[arm])
            print(f"  {arm:5s} {med:8.1f}  ({q[0]:.1f}-{q[2]:.1f})  {first / med:5.2f}x {a.arms[0]}")
        results[config] = {arm: statistics.median(times[arm]) for arm in a.arms}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": a.rows, "length": a.length, "threads": a.threads, "route": route.route,
                       "ms": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
