"""Where a compiled decode step's time goes, and how fast the weights' one-row matmuls read.

    python scripts/compiled_profile.py --length 4032 --modes int4 tf-static      # compiled steps + profiler
    python scripts/compiled_profile.py --gemv                                    # the matmul forms alone

The default run prefills ``--length`` seeded random tokens into a fixed-shape cache per mode (a
``StaticSlimCache`` of the spec, or transformers' ``StaticCache`` for ``tf-static``), compiles the decode step
with :func:`kvslim.compile_decode` (the first step of each mode; its seconds are printed), times
``--steps`` interleaved compiled steps (median), then runs 5 steps of each mode under the torch profiler and
prints its table (the compiled graph, ``kvslim::k_scores`` / ``kvslim::v_weighted``, dynamo's guard check).

``--gemv`` times the embedded model's weight shapes (30 layers' q/k/v/o/gate/up/down and the lm_head, fp32)
as one-row products three ways: eager ``F.linear`` (MKL), the same compiled by plain Inductor, and compiled by
``compile_decode``'s backend (the fused multiply-and-sum), with the GB/s each reads.

Measure on a quiet machine (``uptime`` before and after), alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def gemv() -> None:
    from kvslim.compiled import _backend

    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
    shapes.append((49152, 576))  # the lm_head (tied embeddings)
    weights = [torch.randn(o, i) for o, i in shapes]
    nbytes = sum(w.numel() * 4 for w in weights)

    def step(x, ws):
        return [torch.nn.functional.linear(x if w.shape[1] == 576 else x.new_zeros(1, w.shape[1]), w) for w in ws]

    x = torch.randn(1, 576)
    forms = {
        "eager F.linear (MKL sgemv)": lambda: step(x, weights),
        "Inductor": torch.compile(lambda: step(x, weights), fullgraph=True, dynamic=False),
        "compile_decode's backend": torch.compile(lambda: step(x, weights), fullgraph=True, dynamic=False, backend=_backend),
    }
    print(f"{len(weights)} one-row products, {nbytes / 1e6:.1f} MB of fp32 weights, {torch.get_num_threads()} threads")
    with torch.no_grad():
        for name, fn in forms.items():
            ms = _median_ms(fn)
            print(f"  {name:28s} {ms:8.2f} ms  {nbytes / ms / 1e6:6.1f} GB/s")


def profile(length: int, modes: list[str], steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import StaticCache

    import kvslim
    from kvslim.generate import decode_one_token, prefill
    from kvslim.models import load_model

    model, _ = load_model(None)
    kvslim.enable(model)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    compiled = kvslim.compile_decode(model)
    state = {}
    with torch.inference_mode():
        for mode in modes:
            if mode == "tf-static":
                cache = StaticCache(config=model.config, max_cache_len=length + 64)
            else:
                cache = kvslim.StaticSlimCache(config=model.config, kv_quantize=mode, max_cache_len=length + 64)
            tok = prefill(model, ids, cache).argmax(-1, keepdim=True)[:, -1:]
            t0 = time.perf_counter()
            decode_one_token(model, tok, cache)
            print(f"{mode}: first compiled step (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
            state[mode] = (cache, tok)
        times = {m: [] for m in modes}
        for _ in range(steps):
            for mode, (cache, tok) in state.items():
                t0 = time.perf_counter()
                decode_one_token(model, tok, cache)
                times[mode].append(time.perf_counter() - t0)
        for mode in modes:
            print(f"{mode}: median {statistics.median(times[mode]) * 1e3:.2f} ms a compiled step at {length} tokens")
        for mode, (cache, tok) in state.items():
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    decode_one_token(model, tok, cache)
            print(f"===== {mode} (5 steps)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(f"compiled {compiled.compiles} graph(s) in {compiled.compile_s:.1f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=4032)
    p.add_argument("--modes", nargs="+", default=["int4", "tf-static"], help="kv_quantize specs, or tf-static")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gemv", action="store_true", help="time the one-row matmul forms instead")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gemv:
        gemv()
    else:
        profile(args.length, args.modes, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
