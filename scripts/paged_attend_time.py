"""One layer's paged attention call of a real many-row decode step, timed on both decode paths of the C kernel.

    python scripts/paged_attend_time.py --rows 16 --length 4096 --config int4 q4_0 --reps 10 --rounds 6

For each ``--config``: prefills ``--length`` seeded random tokens of the embedded model into a
:class:`kvslim.cache.pagepool.PagePool` of the spec (``forward_pages``), copies the row into ``--rows`` rows of
their own pages, runs one decode step of all rows and keeps the arguments of every layer's attention call
(``kvslim.vllm.attend.attend``: the pages, the rows' block tables, the staged residual, the queries, the step's raw
K/V and the Hadamard rotation). Then replays the calls of three layers (first, middle, last), ``--reps`` calls in
a row, each round timing the kernel's AVX-512 decode loops and the AVX2 loops a build without them takes
(:func:`kvslim.vllm.attend.use_avx512_loops`), alternating, in one process. Prints, per path, the fastest round's ms
a call and ns per (token, KV head) of the rows' history; and the largest difference between the two paths' outputs.

A replay in a warm loop, not the step: inside a step the linear layers' weights pass through the caches between
two attention calls (``scripts/paged_step.py`` times whole steps). ``--sequence`` replays the step's calls as the
step makes them instead: every layer's call in order (each layer's own pages, so the rows' history comes from
memory, not from a cache the last call warmed), with a product streaming 14 MB of weights between two calls (a
layer's float32 weights of the embedded model; four such matrices in turn, 57 MB, more than the L3 holds); only the
calls are timed. Measure on a quiet machine, alone.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", nargs="+", default=["int4"])
    p.add_argument("--reps", type=int, default=10, help="calls in a row, timed together")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--sequence",
        action="store_true",
        help="every layer's call in order, weights streamed between (docstring)",
    )
    a = p.parse_args()
    if min(a.rows, a.length, a.reps, a.rounds, a.chunk, a.threads) < 1:
        p.error("--rows, --length, --reps, --rounds, --chunk and --threads must be positive")
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.cache import pagecalls
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.pagepool import pool_for
    from kvslim.models.load import load_model
    from kvslim.vllm import attend as paged

    if paged.library() is None:
        raise SystemExit(f"the C kernel is unavailable: {paged.status()}")
    built = paged.use_avx512_loops(True)
    load = [os.getloadavg()[0]]
    model = load_model(None)[0]
    kvslim.enable(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), generator=g)
    print(
        f"{a.rows} rows x {a.length} tokens, {a.threads} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}; AVX-512 loops built: {built}"
    )
    print(f"{'config':10s} {'path':8s} {'ms a call':>10s} {'ns / token-head':>16s}")
    for spec in a.config:
        calls = []
        attend = paged.attend

        def keep(*args, calls=calls, attend=attend, **kwargs):
            calls.append((args, kwargs))
            return attend(*args, **kwargs)

        with torch.inference_mode():
            pool = pool_for(model, spec, pages=-(-(a.length + 2) // 32) * (a.rows + 1), max_rows=a.rows + 1)
            src = pool.new_row()
            for start in range(0, a.length, a.chunk):
                forward_pages(model, pool, [(ids[0, start : start + a.chunk].tolist(), src)])
            rows = [pool.copy_row(src) for _ in range(a.rows)]
            tokens = torch.randint(0, 1000, (a.rows,), generator=g).tolist()
            paged.attend = keep
            # the step's own tables (kvslim.cache.pagecalls) call the kernel without kvslim.vllm.attend.attend: the
            # captured step takes the pool's general path, the same kernel on the same arguments
            fast, pagecalls.attend = pagecalls.attend, lambda *args, **kwargs: None
            try:
                forward_pages(model, pool, [([t], r) for t, r in zip(tokens, rows, strict=True)])
            finally:
                paged.attend, pagecalls.attend = attend, fast
            picked = calls if a.sequence else [calls[0], calls[len(calls) // 2], calls[-1]]
            weights = [torch.randn(6144, 576) for _ in range(4)]  # 14 MB each: a layer's weights (docstring)
            x = torch.randn(576, a.rows)
            best: dict = {}
            outs: dict = {}
            for _ in range(a.rounds):
                for path in ("avx512", "avx2") if built else ("avx2",):
                    paged.use_avx512_loops(path == "avx512")
                    if a.sequence:
                        spent = 0.0
                        for _ in range(a.reps):
                            for n, (args, kwargs) in enumerate(picked):
                                torch.mm(weights[n % len(weights)], x)
                                t = time.perf_counter()
                                attend(*args, **kwargs)
                                spent += time.perf_counter() - t
                        ms = spent / (a.reps * len(picked)) * 1e3
                        best[path] = min(best.get(path, ms), ms)
                    for i, (args, kwargs) in enumerate(picked):  # (in --sequence: once each, for the outputs)
                        t = time.perf_counter()
                        for _ in range(1 if a.sequence else a.reps):
                            attend(*args, **kwargs)
                        if not a.sequence:
                            ms = (time.perf_counter() - t) / a.reps * 1e3
                            best[path] = min(best.get(path, ms), ms)
                        outs[path, i] = args[3].clone()  # the call's output
            paged.use_avx512_loops(True)
        heads = picked[0][0][1].shape[1]  # the pages' KV heads
        for path, ms in best.items():
            print(f"{spec:10s} {path:8s} {ms:10.3f} {ms * 1e6 / (a.rows * a.length * heads):16.2f}")
        if built:
            diff = max((outs["avx512", i] - outs["avx2", i]).abs().max().item() for i in range(len(picked)))
            print(f"{spec:10s} largest difference between the paths' outputs: {diff:.2e}")
    load.append(os.getloadavg()[0])
    print(f"load average {load[0]:.2f} -> {load[1]:.2f}")


if __name__ == "__main__":
    main()
