"""What a joining prompt's chunks cost the rows already decoding in a paged step, at several chunk sizes.

    python scripts/paged_join.py --rows 16 --length 4096 --join 4096 --chunk 32 64 128 \
        --config int4,sink=4,window=1020,positions=original

The engine's mixed step (:mod:`kvslim.engine.step`) carries every decoding row's token plus a chunk of a joining
prompt in one forward, so each chunk makes the decoding rows' step longer. This measures by how much, through the
paged step itself (:func:`kvslim.cache.paged_adapter.forward_pages`, the engine's forward with ``--pages``):
``--rows`` rows of one pool hold a ``--length``-token history each (one prefilled row copied); then, for each
``--chunk``, a fresh row reads a ``--join``-token prompt in chunks of that size, each chunk in a step beside the
rows' decode tokens, alternating with steps of the decode tokens alone. Per chunk size: the decode-only step's
median, the mixed step's median, the added ms per chunk (the difference) and that in decode steps (the issue's bound
is one), and the joining prompt's total time (its chunks' steps end to end: its time to first token with nobody else
joining).

Measure on a quiet machine (``uptime`` before and after), alone; ``kvslim bench --serve --join`` measures the same
through a real server.
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
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--join", type=int, default=4096, help="the joining prompt's tokens")
    p.add_argument("--chunk", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--config", default="int4,sink=4,window=1020,positions=original")
    p.add_argument("--prefill", type=int, default=1024, help="chunk of the rows' own prefill")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write every step's time here")
    a = p.parse_args()
    if min(a.rows, a.length, a.join, a.prefill, a.threads, *a.chunk) < 1:
        p.error("--rows, --length, --join, --chunk, --prefill and --threads must be positive")
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.pagepool import pool_for
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.models.load import load_model

    load = [os.getloadavg()[0]]
    model = load_model(None)[0]
    kvslim.enable(model)
    route = Linears(model, "auto", batch_hint=step_rows(a.rows))
    multiple = route.row_multiple()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, max(a.length, a.join)), generator=g)
    steps = sum(2 * -(-a.join // c) for c in a.chunk)  # every row's decode steps, all chunk sizes
    per_row = -(-(a.length + steps + 64) // 32)
    joiner_pages = -(-(a.join + 64) // 32)  # one joining row at a time
    results: dict = {}
    with torch.inference_mode(), route.routed():
        pool = pool_for(model, a.config, pages=per_row * (a.rows + 1) + joiner_pages, max_rows=a.rows + 2)
        src = pool.new_row()
        for start in range(0, a.length, a.prefill):
            forward_pages(
                model,
                pool,
                [(ids[0, start : min(start + a.prefill, a.length)].tolist(), src)],
                row_multiple=multiple,
            )
        rows = [pool.copy_row(src) for _ in range(a.rows)]
        pool.free(src)

        def step(feeds) -> float:
            t = time.perf_counter()
            forward_pages(model, pool, feeds, row_multiple=multiple).argmax(-1).tolist()
            return (time.perf_counter() - t) * 1e3

        def decode():
            return [
                ([int(x)], r)
                for x, r in zip(torch.randint(0, 1000, (a.rows,), generator=g), rows, strict=True)
            ]

        for _ in range(2):
            step(decode())  # warm-up
        for chunk in a.chunk:
            joiner = pool.new_row()
            alone, mixed = [], []
            for start in range(0, a.join, chunk):
                alone.append(step(decode()))
                mixed.append(step([(ids[0, start : min(start + chunk, a.join)].tolist(), joiner)] + decode()))
            pool.free(joiner)
            base, with_chunk = statistics.median(alone), statistics.median(mixed)
            results[chunk] = {
                "decode_ms": alone,
                "mixed_ms": mixed,
                "decode_median_ms": base,
                "mixed_median_ms": with_chunk,
                "added_per_chunk_ms": with_chunk - base,
                "added_steps": (with_chunk - base) / base,
                "join_s": sum(mixed) / 1e3,
            }
            print(
                f"chunk {chunk:4d}: decode step {base:7.1f} ms, with a chunk {with_chunk:7.1f} ms: +{with_chunk - base:6.1f}"
                f" ms a chunk ({(with_chunk - base) / base:.2f} steps); the {a.join}-token prompt in {len(mixed)} "
                f"chunks, {sum(mixed) / 1e3:.1f} s",
                flush=True,
            )
    load.append(os.getloadavg()[0])
    print(
        f"{a.rows} rows x {a.length} tokens of {a.config}, {a.threads} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, {route}; load average {load[0]:.2f} -> {load[1]:.2f}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "load": load, "chunks": results}, f, indent=1)


if __name__ == "__main__":
    main()
