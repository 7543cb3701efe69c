"""Prefill time of every mode against DynamicCache, interleaved, and where a compressed mode's extra time goes.

    python scripts/prefill_profile.py --length 2048 --rounds 3 --config int4 q4_0 int8 --profile int4

Each round prefills the same seeded ``--length`` random tokens through a fresh cache of every mode, in an
order rotated by the round (so a drift of the machine hits every mode alike); the table gives the median
seconds and the ratio of medians to ``dynamic``. ``--profile SPEC`` then runs one more prefill of that mode
and of ``dynamic`` under the torch profiler and prints the ops where the mode spends more than dynamic:
encode (quantize, pack), rotation (the Hadamard matmuls), decoding the stored body the prefill attends to.
Measure on a quiet machine (``uptime`` before and after), alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--config", nargs="+", default=["int4", "q4_0", "int8"])
    p.add_argument("--profile", default=None, metavar="SPEC", help="profile one prefill of this mode")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import DynamicCache

    import kvslim
    from kvslim import SlimCache
    from kvslim.config import parse_spec
    from kvslim.generate import prefill
    from kvslim.models import load_model

    model, _ = load_model(None)
    kvslim.enable(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    makers = {"dynamic": lambda: DynamicCache(config=model.config)}
    for spec in args.config:
        cfg = parse_spec(spec)
        makers[cfg.to_spec()] = lambda cfg=cfg: SlimCache.from_config(cfg, config=model.config)
    names = list(makers)
    times = {n: [] for n in names}
    with torch.inference_mode():
        prefill(model, ids[:, :64], makers[names[-1]]())  # first-call costs (kernel build, allocator) untimed
        for r in range(args.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                cache = makers[n]()
                t0 = time.perf_counter()
                prefill(model, ids, cache)
                times[n].append(time.perf_counter() - t0)
                del cache
    base = statistics.median(times["dynamic"])
    rows = [
        {"mode": n, "s_median": statistics.median(t), "ratio_to_dynamic": statistics.median(t) / base, "s": t}
        for n, t in times.items()
    ]
    print(f"prefill of {args.length} tokens, {args.threads} threads, {args.rounds} interleaved rounds")
    print(f"{'mode':<12} {'s median':>9} {'x dynamic':>10}")
    for row in rows:
        print(f"{row['mode']:<12} {row['s_median']:>9.3f} {row['ratio_to_dynamic']:>10.3f}")
    out = {"length": args.length, "threads": args.threads, "rounds": args.rounds, "rows": rows}
    if args.profile:
        out["profile"] = _profile(model, ids, makers, parse_spec(args.profile).to_spec(), prefill)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _profile(model, ids, makers, name, prefill) -> list[dict]:
    """Self CPU ms per op of one prefill of ``name`` minus that of dynamic: where the extra time goes."""
    from torch.profiler import ProfilerActivity, profile

    per_op = {}
    for n in ("dynamic", name):
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            prefill(model, ids, makers[n]())
        per_op[n] = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    extra = {op: ms - per_op["dynamic"].get(op, 0.0) for op, ms in per_op[name].items()}
    total = sum(per_op[name].values()) - sum(per_op["dynamic"].values())
    rows = sorted(({"op": op, "extra_ms": ms} for op, ms in extra.items()), key=lambda r: -abs(r["extra_ms"]))[:15]
    print(f"\n{name}: self CPU {sum(per_op[name].values()):.0f} ms vs dynamic {sum(per_op['dynamic'].values()):.0f} ms")
    print(f"(+{total:.0f} ms); the ops that differ most:")
    for r in rows:
        print(f"  {r['op']:<48} {r['extra_ms']:+9.1f} ms")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
