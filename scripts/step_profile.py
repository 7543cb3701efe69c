"""Where the engine's many-row decode step spends its time, and how far it is from the machine's floors.

    python scripts/step_profile.py --rows 16 --length 4096 --config int4 --steps 6

Prefills one cache of ``--config`` with ``--length`` seeded random tokens of the embedded model, copies it
into ``--rows`` rows (as ``kvslim bench --concurrency`` does), runs ``--warmup`` untimed engine decode steps
(:func:`kvslim.generate.forward_rows`), then:

1. ``--steps`` timed steps with a timer around the attention's C rows call (``kernels.cpu.attend_rows``) and
   around the per-row attention path (``attention._segments_attention``): the step's median and the share of
   each;
2. ``--steps`` more under the torch profiler: the aten ops' self times per step (the weights' matmuls, the
   elementwise ops, the cache's appends), the rest being Python and the ctypes calls;
3. the floors: the bytes a step must read (the weights once, every row's cache) at the memory bandwidth this
   machine shows for a large fp32 sum, and the weights' FLOPs at the rate it shows for a 2,048-square fp32
   matmul. Both rates are measured here, in this process, at the same thread count.

Measure on a quiet machine (``uptime`` before and after), alone; the profiler adds its own overhead to part 2.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def _rates(threads: int) -> tuple[float, float]:
    """(GB/s of a large fp32 sum, GFLOP/s of a 2,048-square fp32 matmul) at ``threads`` threads."""
    x = torch.randn(64 * 1024 * 1024)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(2):
        x.sum(), a @ b
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    gbs = 5 * x.numel() * 4 / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    gflops = 5 * 2 * 2048**3 / (time.perf_counter() - t) / 1e9
    return gbs, gflops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", default="int4")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's weights")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim import attention, kernels
    from kvslim.generate import forward_rows, prefill
    from kvslim.models.load import load_model

    model = load_model(None, dtype=getattr(torch, a.dtype))[0]
    kvslim.enable(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.length), generator=g)
    base = kvslim.SlimCache.from_config(kvslim.parse_spec(a.config), config=model.config)
    with torch.inference_mode():
        t0 = time.perf_counter()
        prefill(model, ids, base, chunk_size=1024)
        print(f"prefilled {a.length} tokens of {a.config} in {time.perf_counter() - t0:.1f} s")
        rows = [copy.deepcopy(base) for _ in range(a.rows)]
        feed = torch.randint(0, model.config.vocab_size, (a.warmup + 2 * a.steps, a.rows), generator=g)
        spent = {"attend_rows": 0.0, "per_row": 0.0}
        calls = {"attend_rows": 0, "per_row": 0}

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[name] += time.perf_counter() - t
                    calls[name] += 1

            return wrapper

        real_rows, real_row = kernels.cpu.attend_rows, attention._segments_attention
        kernels.cpu.attend_rows = timed("attend_rows", real_rows)
        attention._segments_attention = timed("per_row", real_row)
        step_ms = []
        try:
            for r in range(a.warmup + a.steps):
                if r == a.warmup:
                    spent.update(attend_rows=0.0, per_row=0.0)
                    calls.update(attend_rows=0, per_row=0)
                t = time.perf_counter()
                forward_rows(model, feed[r].tolist(), rows).argmax(-1).tolist()
                if r >= a.warmup:
                    step_ms.append((time.perf_counter() - t) * 1e3)
        finally:
            kernels.cpu.attend_rows, attention._segments_attention = real_rows, real_row
        med = statistics.median(step_ms)
        n = len(step_ms)
        print(f"\n{a.rows} rows x {a.length} tokens, {a.config}, {a.dtype}, {a.threads} threads: step median {med:.1f} ms "
              f"(min {min(step_ms):.1f}, max {max(step_ms):.1f})")
        print(f"  attention, C rows call: {spent['attend_rows'] / n * 1e3:.1f} ms/step "
              f"({100 * spent['attend_rows'] / n * 1e3 / med:.0f}%), {calls['attend_rows'] / n:.0f} calls/step")
        print(f"  attention, per-row path: {spent['per_row'] / n * 1e3:.1f} ms/step "
              f"({100 * spent['per_row'] / n * 1e3 / med:.0f}%), {calls['per_row'] / n:.0f} rows/step")

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for r in range(a.warmup + a.steps, a.warmup + 2 * a.steps):
                forward_rows(model, feed[r].tolist(), rows).argmax(-1).tolist()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        print("\n  aten ops under the profiler (self time, ms per step; the profiler's overhead included):")
        total = 0.0
        for e in events[:14]:
            ms = e.self_cpu_time_total / 1e3 / a.steps
            total += ms
            print(f"    {e.key:<48} {ms:8.1f}  ({e.count // a.steps} calls/step)")
        print(f"    {'(the 14 above)':<48} {total:8.1f}")

    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    cache = sum(c.nbytes() for c in rows)
    params = sum(t.numel() for t in model.parameters())
    gbs, gflops = _rates(a.threads)
    read_ms = (weights + cache) / gbs / 1e6
    flop_ms = 2 * params * a.rows / gflops / 1e6
    print(f"\n  floors at this machine's rates ({gbs:.1f} GB/s sum, {gflops:.0f} GFLOP/s matmul, {a.threads} threads):")
    print(f"    bytes a step reads: weights {weights / 2**20:.0f} MiB + caches {cache / 2**20:.0f} MiB -> {read_ms:.1f} ms")
    print(f"    weight FLOPs: 2 x {params / 1e6:.0f}M x {a.rows} rows -> {flop_ms:.1f} ms")
    print(f"    the step: {med:.1f} ms = {med / max(read_ms, flop_ms):.1f}x the larger floor")


if __name__ == "__main__":
    main()
