"""One stream's decode step (``kvslim sample``'s loop) under each route for the linear layers, interleaved in one
process: step medians, the ratio to torch's route, and how far each route's logits are from torch's.

    python scripts/stream_linears.py --length 1024 --config int4 --config 'int4,sink=4,window=1020' --steps 20

Prefills one cache per (config, route) with ``--length`` seeded random tokens of the embedded model (chunks of
1,024, torch's route), then runs ``--warmup + --steps`` single-stream decode steps
(:func:`kvslim.generate.decode_one_token`) round by round, each (config, route) in turn, so a slower or faster
stretch of the machine falls on all alike. The first step's logits of each route are compared with torch's (the
same cache contents, the same token). ``--prefill-chunk N``: also each route's prefill of the ``--length`` tokens in
chunks of N (the first config), twice per route in turn, the faster kept. Measure on a quiet machine (``uptime``
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
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--config", action="append", default=None, help="a cache spec (repeat for more; default int4)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--routes", nargs="+", default=["torch", "onednn", "kvslim"])
    p.add_argument("--prefill-chunk", type=int, default=0, help="also time each route's prefill in chunks of N")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.engine.linears import Linears
    from kvslim.generate import decode_one_token, prefill
    from kvslim.models.load import load_model

    model = load_model(None)[0]
    kvslim.enable(model)
    routes = {r: Linears(model, r, batch_hint=1, single=True) for r in a.routes}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), generator=g)
    feed = torch.randint(0, model.config.vocab_size, (a.warmup + a.steps,), generator=g).tolist()
    configs = a.config or ["int4"]
    runs, times, first = {}, {}, {}
    with torch.inference_mode():
        for cfg in configs:
            base = kvslim.SlimCache.from_config(kvslim.parse_spec(cfg), config=model.config)
            prefill(model, ids, base, chunk_size=1024)
            for r in routes:
                runs[(cfg, r)] = copy.deepcopy(base)
                times[(cfg, r)] = []
        for s, tok in enumerate(feed):
            keys = list(runs)
            keys = keys[s % len(keys) :] + keys[: s % len(keys)]
            for cfg, r in keys:
                t = time.perf_counter()
                with routes[r].routed():
                    logits = decode_one_token(model, torch.tensor([[tok]]), runs[(cfg, r)])
                logits[0, 0].item()
                if s == 0:
                    first[(cfg, r)] = logits
                if s >= a.warmup:
                    times[(cfg, r)].append((time.perf_counter() - t) * 1e3)
    print(f"one stream, {a.length} tokens, {a.threads} threads, {a.steps} steps after {a.warmup} warm-up, interleaved")
    print(f"{'config':28s} {'route':8s} {'ms/step':>8s} {'q1':>7s} {'q3':>7s} {'x torch':>8s} {'max |dlogit|':>13s}")
    for cfg in configs:
        ref = statistics.median(times[(cfg, "torch")]) if "torch" in routes else None
        for r in routes:
            ts = sorted(times[(cfg, r)])
            med = statistics.median(ts)
            q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
            ratio = f"{ref / med:.2f}" if ref else "-"
            d = (first[(cfg, r)] - first[(cfg, "torch")]).abs().max().item() if "torch" in routes else float("nan")
            print(f"{cfg:28s} {r:8s} {med:8.1f} {q1:7.1f} {q3:7.1f} {ratio:>8s} {d:13.2e}")
    if a.prefill_chunk:
        best = dict.fromkeys(routes, float("inf"))
        with torch.inference_mode():
            for _ in range(2):
                for r, route in routes.items():
                    cache = kvslim.SlimCache.from_config(kvslim.parse_spec(configs[0]), config=model.config)
                    t = time.perf_counter()
                    with route.routed():
                        prefill(model, ids, cache, chunk_size=a.prefill_chunk)
                    best[r] = min(best[r], time.perf_counter() - t)
        print(f"prefill of {a.length} tokens in chunks of {a.prefill_chunk}, {configs[0]}: "
              + ", ".join(f"{r} {s:.2f} s" for r, s in best.items()))
    for r in routes.values():
        if r.asked == "auto":
            print(r)


if __name__ == "__main__":
    main()
