"""How long the C kernels' workers should spin between calls: paged decode steps timed at each spin, in one process.

    OMP_WAIT_POLICY=PASSIVE python scripts/pool_spin.py --rows 1 --length 4096 --spins 50 400 --rounds 10
    OMP_WAIT_POLICY=PASSIVE python scripts/pool_spin.py --rows 16 --spins 50 400 --load busy:2 --rounds 4 --steps 2

Prefills ``--length`` seeded random tokens of the embedded model into a :class:`kvslim.cache.pagepool.PagePool` of
``--config``, copies the row into ``--rows`` rows, then times decode steps (``forward_pages`` on the linear route
``auto`` picks, as the engine steps): each round sets every spin of ``--spins`` in turn
(:func:`kvslim.kernels.clib.pool_spin_us`; the order reversed every other round), runs one untimed step and
``--steps`` timed ones; ``--renew both`` times each spin with the direct step's renewals of the spin
(:data:`kvslim.cache.paged_direct.RENEW`; the compiled step's too) off and on (``on``, the default, and ``off``: one
of them); ``--compile`` steps through the compiled paged step (:class:`kvslim.cache.paged_compiled.CompiledStep`). Prints
each one's median, quartiles and extremes, how often a worker went to sleep a step
(:func:`kvslim.kernels.clib.pool_sleeps`), and how many times a worker found itself descheduled mid-spin (:func:`kvslim.kernels.clib.pool_preempted`: the workers then take the short spin for a
second). ``--load busy:N`` runs N Python busy loops beside it, ``--load torch`` a torch process multiplying
1024 x 1024 matrices on 2 threads (another OpenMP program); both are started after the prefill and ended at exit.
Measure alone: the ratios come from one process, interleaved; the absolute times only give the context.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_TORCH_LOAD = "import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


def _load(spec: str) -> list[subprocess.Popen]:
    if spec == "none":
        return []
    if spec == "torch":
        return [subprocess.Popen([sys.executable, "-c", _TORCH_LOAD])]
    kind, _, n = spec.partition(":")
    if kind != "busy" or not n.isdigit() or int(n) < 1:
        raise SystemExit(f"--load {spec!r}: expected none, torch or busy:N (N >= 1)")
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(n))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", default="int4")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--spins", type=int, nargs="+", default=[50, 400], help="microseconds")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="timed steps a spin and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load", default="none", help="none, busy:N or torch")
    p.add_argument("--renew", choices=("on", "off", "both"), default="on")
    p.add_argument("--compile", action="store_true", help="step through the compiled paged step")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import kvslim
    from kvslim.cache import paged_direct
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.pagepool import pool_for
    from kvslim.engine.linears import Linears, step_rows
    from kvslim.kernels import clib
    from kvslim.models.load import load_model
    from kvslim.threads import load_average

    for us in args.spins:
        clib.pool_spin_us(us)  # a bad value fails here, before the prefill
    model = kvslim.enable(load_model(None, dtype=args.dtype)[0])
    route = Linears(model, "auto", batch_hint=step_rows(args.rows))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.length,), generator=g).tolist()
    renews = {"on": (True,), "off": (False,), "both": (False, True)}[args.renew]
    modes = [(us, r) for us in args.spins for r in renews]
    compiled = None
    if args.compile:
        from kvslim.cache.paged_compiled import CompiledStep

        compiled = CompiledStep(model)
    times: dict[tuple, list[float]] = {m: [] for m in modes}
    sleeps = dict.fromkeys(modes, 0)
    with torch.inference_mode():
        pages = -(-(args.length + 8 * args.rounds * (args.steps + 1) * len(args.spins)) // 32) * (
            args.rows + 1
        )
        pool = pool_for(model, args.config, pages=pages, max_rows=args.rows + 1)
        src = pool.new_row()
        for s in range(0, args.length, 1024):
            forward_pages(model, pool, [(ids[s : s + 1024], src)])
        rows = [pool.copy_row(src) for _ in range(args.rows)]

        def step() -> None:
            tokens = torch.randint(0, 1000, (args.rows,), generator=g).tolist()
            with route.routed() as r:
                forward_pages(
                    model, pool, [([t], row) for t, row in zip(tokens, rows)], row_multiple=r.row_multiple(),
                    compiled=compiled,
                )

        procs = _load(args.load)
        try:
            time.sleep(3 if procs else 0)
            before = load_average()
            preempted = clib.pool_preempted()
            for _ in range(3):
                step()
            for rnd in range(args.rounds):
                for mode in modes if rnd % 2 == 0 else modes[::-1]:
                    clib.pool_spin_us(mode[0])
                    paged_direct.RENEW = mode[1]
                    step()
                    slept = clib.pool_sleeps()
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        step()
                        times[mode].append((time.perf_counter() - t) * 1e3)
                    sleeps[mode] += clib.pool_sleeps() - slept
            preempted = clib.pool_preempted() - preempted
            after = load_average()
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    print(
        f"{args.rows} rows x {args.length} tokens, {args.config}, {args.dtype}, {args.threads} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, load {args.load}; load average {before} -> {after}"
    )
    head = (
        f"{'spin us':>8} {'renew':>6} {'median':>8} {'p25':>8} {'p75':>8} {'min':>8} {'max':>8} {'sleeps':>7}"
    )
    print(head + "   (ms a step; a worker's sleeps a step)")
    for mode in modes:
        q = sorted(times[mode])
        print(
            f"{mode[0]:>8} {'on' if mode[1] else 'off':>6} {statistics.median(q):>8.2f} {q[len(q) // 4]:>8.2f} "
            f"{q[3 * len(q) // 4]:>8.2f} {q[0]:>8.2f} {q[-1]:>8.2f} {sleeps[mode] / len(q):>7.1f}"
        )
    print(f"workers descheduled mid-spin: {preempted}")
    if args.json:
        out = {
            **vars(args),
            "times_ms": {f"{us} {'renew' if r else 'plain'}": v for (us, r), v in times.items()},
        }
        out["preempted"] = preempted
        out["sleeps_a_step"] = {
            f"{us} {'renew' if r else 'plain'}": n / len(times[(us, r)]) for (us, r), n in sleeps.items()
        }
        out["load_average"] = [before, after]
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
