"""What a compiled paged decode step costs beyond its kernels: its Python and torch's, measured in one process.

    OMP_WAIT_POLICY=PASSIVE python scripts/compiled_fixed_costs.py --length 4096 --steps 60

Prints, for the embedded model (float32, 2 threads):

1. ``paged_compiled.why_not`` (the per-step check that the model is still one the step serves), and the engine's
   per-step entry into its linear route with the step's row multiple (``Linears.routed``, ``row_multiple``), each
   timed alone;
2. dynamo's settings around a step's graph call (``torch._dynamo.config.patch``), timed alone after a first call
   (the first imports dynamo: ~1 s);
3. decode steps of ``--rows`` rows (one by default) of ``--length`` tokens in int4 pages (``forward_pages`` through a
   :class:`~kvslim.cache.paged_compiled.CompiledStep`), interleaved in one process: the step as kvslim builds it
   (Inductor's size asserts off) and a second compiled step with them on, each once with the C kernels' calls
   replaced by outputs of the right shape (the ``kernels no-op`` rows: what is left is the step's own Python,
   torch's dispatch and Inductor's loops) and once as they are, with the time its linear kernel's calls and the
   pool's attention calls (``StepCalls.run``: the K/V written, the attention, their Python) took inside it.

Run with ``PYTHONPATH=<a worktree of an earlier commit>/src`` to time that commit's code the same way (the script
itself needs only what it times). Measure alone, on a quiet machine (``uptime`` before and after): absolute times
move from run to run on a shared host; the ratios within a run are what it shows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _per_call_us(fn, n: int) -> float:
    for _ in range(10):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--rows", type=int, default=1, help="rows a step, each of --length tokens")
    p.add_argument("--steps", type=int, default=60, help="timed steps a mode")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if min(a.length, a.rows, a.steps, a.threads) < 1:
        p.error("--length, --rows, --steps and --threads must be positive")
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.cache import pagecalls, paged_compiled
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.pagepool import pool_for
    from kvslim.engine.linears import Linears
    from kvslim.kernels import linear as kernel_linear
    from kvslim.models.load import load_model
    from kvslim.threads import load_average

    before = load_average()
    model = kvslim.enable(load_model(None, dtype="float32")[0])
    route = Linears(model, "kvslim", batch_hint=1)

    def routed() -> None:
        with route.routed() as r:
            r.row_multiple()

    with torch.inference_mode():
        print(f"why_not: {_per_call_us(lambda: paged_compiled.why_not(model), 500):.1f} us a step; the engine's "
              f"linear route entered with its row multiple: {_per_call_us(routed, 500):.1f} us a step")  # fmt: skip

    def patched():
        with torch._dynamo.config.patch(recompile_limit=16, fail_on_recompile_limit_hit=True):
            pass

    print(f"dynamo settings around a call: config.patch {_per_call_us(patched, 500):.1f} us")

    steps = {"size asserts off (kvslim)": paged_compiled.CompiledStep(model)}
    compile_ = torch.compile

    def with_asserts(fn, **kw):
        kw["options"] = {**kw.get("options", {}), "size_asserts": True}
        return compile_(fn, **kw)

    torch.compile = with_asserts
    try:
        steps["size asserts on"] = paged_compiled.CompiledStep(model)
    finally:
        torch.compile = compile_
    product, run = kernel_linear._product, pagecalls.StepCalls.run

    spent = {"linear": 0.0, "attention": 0.0}

    def timed(name: str, fn):
        def call(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] += time.perf_counter() - t

        return call

    timed_product, timed_run = timed("linear", product), timed("attention", run)

    def noop(on: bool) -> None:
        kernel_linear._product = (
            (lambda rows, wp, o, ws, bp: torch.empty(rows.shape[0], o)) if on else timed_product
        )
        pagecalls.StepCalls.run = (lambda self, layer, q, k, v, s: torch.empty(q.shape)) if on else timed_run

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (a.length,), generator=g).tolist()
    modes = [(name, on) for on in (True, False) for name in steps]
    times: dict[tuple, list[float]] = {m: [] for m in modes}
    parts: dict[tuple, list[tuple]] = {m: [] for m in modes}
    with torch.inference_mode():
        pool = pool_for(model, "int4", pages=-(-(a.length + 4 * a.steps + 64) // 32) * (len(modes) * a.rows + 1),
                        max_rows=len(modes) * a.rows + 1)  # fmt: skip
        src = pool.new_row()
        for s in range(0, a.length, 1024):
            forward_pages(model, pool, [(ids[s : s + 1024], src)])
        rows = {m: [pool.copy_row(src) for _ in range(a.rows)] for m in modes}

        def step(mode) -> None:
            noop(mode[1])
            try:
                tokens = torch.randint(0, 1000, (a.rows,), generator=g).tolist()
                feed = [([t], r) for t, r in zip(tokens, rows[mode], strict=True)]
                forward_pages(model, pool, feed, row_multiple=1, compiled=steps[mode[0]])
            finally:
                kernel_linear._product, pagecalls.StepCalls.run = product, run

        for m in modes:  # compiles each graph, then one more step each
            step(m)
            step(m)
        for i in range(a.steps):
            for m in modes if i % 2 == 0 else modes[::-1]:
                spent["linear"] = spent["attention"] = 0.0
                t = time.perf_counter()
                step(m)
                times[m].append((time.perf_counter() - t) * 1e3)
                parts[m].append((spent["linear"] * 1e3, spent["attention"] * 1e3))
    after = load_average()
    print(
        f"{a.rows} row(s) x {a.length} tokens, int4 pages, {a.threads} threads; load average {before} -> {after}"
    )
    for m in modes:
        q = statistics.quantiles(times[m], n=4)
        inside = ""
        if not m[1]:  # the kernels' calls as they are: what of the step they took (medians over its steps)
            lin_ms, att_ms = (statistics.median(x[k] for x in parts[m]) for k in (0, 1))
            inside = f"   linear calls {lin_ms:6.2f}, the pool's attention calls {att_ms:6.2f} ms"
        print(f"{m[0]:>26}{', kernels no-op' if m[1] else '':>16}: median {q[1]:6.2f}  p25 {q[0]:6.2f}  "
              f"p75 {q[2]:6.2f} ms{inside}")  # fmt: skip


if __name__ == "__main__":
    main()
