"""The compiled paged step against the eager direct step, interleaved in one process: decode steps of the same rows.

    OMP_WAIT_POLICY=PASSIVE python scripts/paged_compiled_ab.py --rows 1 --length 4096 --config int4 --steps 40

Prefills ``--length`` seeded random tokens of the embedded model into a pool of ``--config`` pages and copies the
row into one set of ``--rows`` rows per mode, then steps every set in turn (the order reversed every other round)
with the same tokens:

- ``eager``: the direct paged step (:mod:`kvslim.cache.paged_direct`) on kvslim's linear route;
- ``compiled``: :class:`kvslim.cache.paged_compiled.CompiledStep`, Inductor's loops on one thread (the default);
- ``compiled-omp``: the same with Inductor's loops on its OpenMP default (``loop_threads=-1``);
- ``compiled-noguards``: ``compiled`` with dynamo's guard checks skipped after the warm-up
  (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: what the guards cost; unsafe, not what kvslim runs);
- ``compiled-twin``: a second step built as ``compiled`` is (an A/A control: how far two of the same drift apart);
- ``compiled-cpp``: ``compiled`` with Inductor's wrapper generated as C++ (``wrapper="cpp"``);
- ``compiled-pyops``, ``compiled-cpp-pyops``: ``compiled`` and ``compiled-cpp`` with the products and the page
  attention as the Python ops (``cpp_ops=False``) where the others have kvslim's C++ ops
  (:mod:`kvslim.kernels.cppops`, where they build);
- ``compiled-fixed``: ``compiled`` (the same step) with the kernels' calls split in fixed shares, every worker
  waited for (:func:`kvslim.kernels.clib.pool_balance` off: the rule before) where the others balance them.

``--busy N`` runs N pure-Python busy loops beside the steps (a machine shared with other work; issue 30 item 6).

Prints each mode's quartiles, its median against the first mode's, the median of its step-by-step ratios to the
first mode's (the same round's steps), how many times a step the kernels' workers went to sleep after their spin
(:func:`kvslim.kernels.clib.pool_sleeps`: each is a later call that waits for a wake-up), and the largest logit
difference from the first mode at the first step.
``--modes compiled compiled-twin`` is the A/A control to put beside a change measured this way. Measure alone, on a
quiet machine (``uptime`` before and after).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

MODES = (
    "eager", "compiled", "compiled-omp", "compiled-noguards", "compiled-twin", "compiled-cpp", "compiled-pyops",
    "compiled-cpp-pyops", "compiled-fixed",
)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", default="int4")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--busy", type=int, default=0, help="busy loops beside the steps (processes)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.paged_compiled import CompiledStep
    from kvslim.cache.pagepool import pool_for
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.kernels.clib import pool_balance, pool_sleeps
    from kvslim.models.load import load_model
    from kvslim.threads import load_average

    model = kvslim.enable(load_model(None, dtype=a.dtype)[0])
    route = Linears(model, "kvslim", batch_hint=step_rows(a.rows))
    steps = {
        "compiled": CompiledStep(model),
        "compiled-omp": CompiledStep(model, loop_threads=-1),
        "compiled-twin": CompiledStep(model),
        "compiled-cpp": CompiledStep(model, wrapper="cpp"),
        "compiled-pyops": CompiledStep(model, cpp_ops=False),
        "compiled-cpp-pyops": CompiledStep(model, wrapper="cpp", cpp_ops=False),
    }
    steps["compiled-noguards"] = steps["compiled-fixed"] = steps["compiled"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (a.length,), generator=g).tolist()
    sets = len(a.modes)
    with torch.inference_mode():
        pool = pool_for(model, a.config, pages=-(-(a.length + a.steps + 8) // 32) * (sets * a.rows + 1),
                        max_rows=sets * a.rows + 1)  # fmt: skip
        src = pool.new_row()
        for s in range(0, a.length, 1024):
            forward_pages(model, pool, [(ids[s : s + 1024], src)])
        rows = {m: [pool.copy_row(src) for _ in range(a.rows)] for m in a.modes}

        def run(mode: str, tokens: list[int]) -> torch.Tensor:
            pool_balance(mode != "compiled-fixed")
            feeds = [([t], r) for t, r in zip(tokens, rows[mode], strict=True)]
            if mode == "eager":
                with route.routed():
                    return forward_pages(model, pool, feeds, row_multiple=1)
            if mode == "compiled-noguards" and steps[mode].compiles:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return forward_pages(model, pool, feeds, row_multiple=1, compiled=steps[mode])
            return forward_pages(model, pool, feeds, row_multiple=1, compiled=steps.get(mode))

        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
        before = load_average()
        first = torch.randint(0, 1000, (a.rows,), generator=g).tolist()
        out = {m: run(m, first) for m in a.modes}  # compiles
        for m in a.modes:
            run(m, first)
        times: dict[str, list[float]] = {m: [] for m in a.modes}
        sleeps = dict.fromkeys(a.modes, 0)  # the kernels' workers gone to sleep after their spin, within the steps
        for i in range(a.steps):
            tokens = torch.randint(0, 1000, (a.rows,), generator=g).tolist()
            for m in a.modes if i % 2 == 0 else a.modes[::-1]:
                s0 = pool_sleeps() or 0
                t0 = time.perf_counter()
                run(m, tokens)
                times[m].append((time.perf_counter() - t0) * 1e3)
                sleeps[m] += (pool_sleeps() or 0) - s0
        after = load_average()
        for b in busy:
            b.kill()
            b.wait()
    pool_balance(True)
    print(f"{a.rows} rows x {a.length} tokens, {a.config}, {a.dtype}, {a.threads} threads, {a.busy} busy loops; "
          f"load {before} -> {after}")  # fmt: skip
    base = statistics.median(times[a.modes[0]])
    for m in a.modes:
        q = statistics.quantiles(times[m], n=4)
        paired = statistics.median(t / b for t, b in zip(times[m], times[a.modes[0]], strict=True))
        diff = (out[m] - out[a.modes[0]]).abs().max().item()
        compile_s = f"   compiled in {steps[m].compile_s:.0f} s" if m in steps else ""
        print(f"{m:>18}: p25 {q[0]:7.2f}  median {q[1]:7.2f}  p75 {q[2]:7.2f} ms   x{q[1] / base:5.3f}   "
              f"paired x{paired:5.3f}   sleeps/step {sleeps[m] / a.steps:5.1f}   "
              f"max |logit - {a.modes[0]}| {diff:.2g}{compile_s}")  # fmt: skip


if __name__ == "__main__":
    main()
