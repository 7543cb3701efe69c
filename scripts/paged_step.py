"""A many-row decode step over a pool of kvslim pages against the engine's step over SlimCache rows, interleaved.

    python scripts/paged_step.py --rows 16 --length 4096 --config q4_0 int4 --steps 10
    python scripts/paged_step.py --rows 16 --length 1024 --config q4_0 --json out/paged-1024.json

For each ``--config``: prefills ``--length`` seeded random tokens of the embedded model once into a SlimCache of the
spec and once into a :class:`kvslim.cache.pagepool.PagePool` of the same spec (``forward_pages``, chunks of
``--chunk``), copies each into ``--rows`` rows (``copy.deepcopy`` of the cache; ``PagePool.copy_row``: the pool's
pages and staged pages copied into pages of each row's own, so that every row reads its own memory), then times ``--steps`` decode steps of
both, alternating step by step in one process (after ``--warmup`` of each), the linear layers on the engine's route
(``--linears``). Both steps carry the same random tokens. Prints a table (median and min ms a step, the
pages' step over the SlimCache rows' step) and, with ``--json``, every step's time, the thread settings and the
load average before and after.

Not the same cache: a page stores K per token (the SlimCache's int4 stores KIVI's per-channel K groups) and keeps
no sinks unless asked (``sink=N``; a SlimCache keeps 16); both keep a residual of 128-159 newest tokens in float16 by
default. docs/performance.md compares their quality (``scripts/paged_quality.py``).
Measure on a quiet machine, alone (``uptime`` before and after).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", nargs="+", default=["q4_0"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linears", default="auto", help="the route of the linear layers (kvslim.engine.linears)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's weights")
    p.add_argument(
        "--peers",
        nargs="*",
        default=[],
        help="serving peers to time at the same rows, length and threads "
        "in the same run (kvslim bench --concurrency --peers: openvino, vllm; each in its own venv)",
    )
    p.add_argument("--json", help="write every step's time here")
    a = p.parse_args()
    if a.length < 1 or a.rows < 1 or a.steps < 1:
        p.error("--length, --rows and --steps must be positive")
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.pagepool import pool_for
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.generate import forward_rows, prefill
    from kvslim.models.load import load_model

    load = [os.getloadavg()[0]]
    model = load_model(None, dtype=a.dtype)[0]
    kvslim.enable(model)
    route = Linears(model, a.linears, batch_hint=step_rows(a.rows))
    multiple = route.row_multiple()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), generator=g)
    results = {}
    with torch.inference_mode():
        for spec in a.config:
            base = kvslim.SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
            prefill(model, ids, base, chunk_size=a.chunk)
            rows = [copy.deepcopy(base) for _ in range(a.rows)]
            per_row = -(-(a.length + a.warmup + a.steps + 1) // 32)
            pool = pool_for(model, spec, pages=per_row * (a.rows + 1), max_rows=a.rows + 1)
            src = pool.new_row()
            for start in range(0, a.length, a.chunk):
                forward_pages(
                    model, pool, [(ids[0, start : start + a.chunk].tolist(), src)], row_multiple=multiple
                )
            prow = [pool.copy_row(src) for _ in range(a.rows)]
            times: dict = {"slimcache": [], "pages": []}
            for s in range(a.warmup + a.steps):
                tokens = torch.randint(0, 1000, (a.rows,), generator=g).tolist()
                for name in ("slimcache", "pages"):
                    t = time.perf_counter()
                    with route.routed():
                        if name == "pages":
                            logits = forward_pages(
                                model, pool, [([x], r) for x, r in zip(tokens, prow)], row_multiple=multiple
                            )
                        else:
                            logits = forward_rows(model, tokens, rows, row_multiple=multiple)
                        logits.argmax(-1).tolist()
                    if s >= a.warmup:
                        times[name].append((time.perf_counter() - t) * 1e3)
            results[spec] = times
            print(
                f"{spec}: pool {pool.n_pages} pages x {len(pool.pages)} layers, "
                f"{pool.nbytes(prow[0]) / 2**20:.1f} MiB a row in pages; "
                f"SlimCache {rows[0].nbytes() / 2**20:.1f} MiB a row"
            )
    peer_rows, notes = [], {}
    if a.peers:
        from kvslim.bench.concurrency_peers import run_peers

        peer_rows, notes = run_peers(
            a.peers,
            model,
            a.config,
            lambda n: ids[0, :n].tolist(),
            [a.length],
            [a.rows],
            a.steps,
            warmup=a.warmup,
            threads=a.threads,
        )
    load.append(os.getloadavg()[0])
    print(
        f"\n{a.rows} rows x {a.length} tokens, {a.threads} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, {a.dtype}, {route}; load average {load[0]:.2f} -> {load[1]:.2f}\n"
    )
    print(f"{'config':10s} {'SlimCache rows ms':>18s} {'pages ms':>10s} {'min / min':>10s} {'speed-up':>9s}")
    for spec, t in results.items():
        sc, pg = statistics.median(t["slimcache"]), statistics.median(t["pages"])
        print(
            f"{spec:10s} {sc:18.1f} {pg:10.1f} {min(t['slimcache']):5.1f} / {min(t['pages']):<5.1f} {sc / pg:8.2f}x"
        )
    for line in notes.values():
        print(line)
    for r in peer_rows:
        mine = results.get(r.mode.split(" ", 1)[-1])
        vs = f"; pages {r.ms_median / statistics.median(mine['pages']):.2f}x its speed" if mine else ""
        print(f"{r.mode:24s} {r.ms_median:8.1f} ms a step{vs}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "args": vars(a),
                    "load": load,
                    "ms": results,
                    "peers": [r.to_dict() for r in peer_rows],
                    "peer_notes": notes,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
