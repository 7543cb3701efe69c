"""The engine's decode step under each route for the linear layers (kvslim.engine.linears), interleaved in one
process: step medians, the ratio to torch's route, and how far each route's logits are from torch's.

    python scripts/linears_ab.py --rows 16 --length 4096 --config int4 --steps 8
    python scripts/linears_ab.py --rows 16 --length 1100 --config int4,sink=4,window=1020

Prefills one cache of ``--config`` with ``--length`` seeded random tokens of the embedded model, copies it into
``--rows`` rows per route, then runs ``--warmup + --steps`` engine decode steps
(:func:`kvslim.generate.forward_rows`) round by round, each route's step in turn (the order rotating), so a
slower or faster stretch of the machine falls on every route alike. ``--chunk N`` makes each step also carry an
N-token prompt chunk of a joining row (:func:`kvslim.generate.forward_step`), as the server's steps do while a
prompt is read. The first step's logits of each route are compared with torch's (the same caches, the same
tokens). ``--profile``: then 4 more steps per route under the torch profiler, and the self time of the linear
ops (``aten::mm``/``addmm``, ``mkldnn::_linear_pointwise``) per step. Measure on a quiet machine (``uptime``
before and after), alone.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", default="int4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=0, help="a joining prompt's chunk carried by every step (0: none)")
    p.add_argument("--routes", nargs="+", default=None, help="default: every route this torch runs")
    p.add_argument("--profile", action="store_true", help="also the linear ops' self time under the torch profiler")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.engine.linears import ROUTES, Linears, mkl_ready, onednn_ready, step_rows
    from kvslim.generate import forward_step, prefill
    from kvslim.models.load import load_model

    model = load_model(None)[0]
    kvslim.enable(model)
    a.routes = a.routes or [r for r in ROUTES if r == "torch" or (mkl_ready() if r == "mkl" else onednn_ready())]
    routes = {r: Linears(model, r, batch_hint=step_rows(a.rows)) for r in a.routes}
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, a.length), generator=g)
    spec = kvslim.parse_spec(a.config)
    n = a.warmup + a.steps
    feed = torch.randint(0, vocab, (n, a.rows), generator=g).tolist()
    prompt = torch.randint(0, vocab, (n * max(a.chunk, 1),), generator=g).tolist()
    with torch.inference_mode():
        base = kvslim.SlimCache.from_config(spec, config=model.config)
        prefill(model, ids, base, chunk_size=1024)
        rows = {r: [copy.deepcopy(base) for _ in range(a.rows)] for r in routes}
        joining = {r: kvslim.SlimCache.from_config(spec, config=model.config) for r in routes}
        times: dict = {r: [] for r in routes}
        first: dict = {}
        names = list(routes)
        for s in range(n):
            order = names[s % len(names):] + names[: s % len(names)]
            for r in order:
                feeds = [([t], c) for t, c in zip(feed[s], rows[r], strict=True)]
                if a.chunk:
                    feeds = [(prompt[s * a.chunk : (s + 1) * a.chunk], joining[r])] + feeds
                t0 = time.perf_counter()
                with routes[r].routed():
                    logits = forward_step(model, feeds)
                logits.argmax(-1).tolist()
                dt = time.perf_counter() - t0
                if s == 0:
                    first[r] = logits
                if s >= a.warmup:
                    times[r].append(dt * 1e3)
        linear_ms = {r: _profiled(model, routes[r], rows[r]) for r in names} if a.profile else {}
    ref = times[names[0]]
    print(f"{a.rows} rows x {a.length} tokens, {a.config}, {a.threads} threads, chunk {a.chunk}, "
          f"{a.steps} steps after {a.warmup} warm-up, routes interleaved")
    print(f"{'route':<8} {'ms/step':>9} {'q1':>8} {'q3':>8} {'x ' + names[0]:>10} {'max |dlogit|':>13} {'packed MiB':>11}"
          + ("  linear ops ms/step (profiled)" if linear_ms else ""))
    for r in names:
        q = statistics.quantiles(times[r], n=4)
        diff = (first[r] - first[names[0]]).abs().max().item()
        print(f"{r:<8} {statistics.median(times[r]):9.1f} {q[0]:8.1f} {q[2]:8.1f} "
              f"{statistics.median(ref) / statistics.median(times[r]):10.2f} {diff:13.2e} {routes[r].nbytes / 2**20:11.0f}"
              + (f"  {linear_ms[r]:8.1f}" if linear_ms else ""))


def _profiled(model, route, rows, steps: int = 4) -> float:
    """The linear ops' self time (ms) per decode step of ``rows`` under ``route``, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    from kvslim.generate import forward_rows

    with route.routed(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            forward_rows(model, [5] * len(rows), rows)
    ops = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ops) / 1e3 / steps


if __name__ == "__main__":
    main()
