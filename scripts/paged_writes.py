"""The vLLM plugin's page writes: ``kvp_write`` (C) against the torch encoders (``pages.write``), per format.

    OMP_NUM_THREADS=1 python scripts/paged_writes.py --tokens 16 2048 --formats q4_0 int4 int3 int2 fp8 fp16 bf16

One layer's write of ``--tokens`` new tokens (16: a decode step of 16 sequences; 2,048: a prefill chunk) into
32-token pages of ``--heads`` KV heads, K and V in the same format (int2/int3 K is refused by the plugin's spec,
so those rows store int4 K: the V side is the format named). Each repetition times one call of each route in
turn (torch first), so a busy machine slows them alike; prints the median microseconds and the ratio, and checks
that both routes wrote the same bytes. No vLLM, no model: ``kvslim.vllm.pages`` / ``.attend`` import nothing of
vLLM. Measure on a quiet machine (``uptime`` before and after).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 2048])
    p.add_argument("--formats", nargs="+", default=["q4_0", "q8_0", "int8", "int4", "int3", "int2", "fp8", "fp16",
                                                    "bf16"])  # fmt: skip
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()

    from kvslim.vllm import attend as paged
    from kvslim.vllm.pages import PAGE_TOKENS, PageLayout, write

    if paged.library() is None:
        raise SystemExit(f"error: the C kernels are unavailable: {paged.status()}")
    print(f"torch threads {torch.get_num_threads()}; {a.heads} KV heads x head_dim {a.d}; median of {a.reps}")
    print(f"{'format':8s} {'tokens':>6s} {'torch us':>10s} {'C us':>9s} {'C speed-up':>10s}")
    g = torch.Generator().manual_seed(0)
    for fmt in a.formats:
        k_fmt = "int4" if fmt in ("int3", "int2") else fmt
        layout = PageLayout.of(k_fmt, fmt, a.d, torch.float32)
        if not (paged._c_writes(layout.k) and paged._c_writes(layout.v)):
            print(f"{fmt:8s} (torch only: kvp_write does not encode it)")
            continue
        for n in a.tokens:
            key = torch.randn(n, a.heads, a.d, generator=g) * 2
            value = torch.randn(n, a.heads, a.d, generator=g)
            pages = -(-n // PAGE_TOKENS) + 1
            slots = torch.randperm(pages * PAGE_TOKENS, generator=g)[:n]
            want = torch.zeros(pages, a.heads, PAGE_TOKENS, layout.row_bytes, dtype=torch.uint8)
            got = want.clone()
            times: dict = {"torch": [], "C": []}
            for _ in range(a.reps):
                t = time.perf_counter()
                write(layout, want, key, value, slots)
                times["torch"].append(time.perf_counter() - t)
                t = time.perf_counter()
                paged.store(layout, got, key, value, slots)
                times["C"].append(time.perf_counter() - t)
            if not torch.equal(got, want):
                raise SystemExit(f"error: {fmt}: the C write's bytes differ from the torch encoders'")
            tt, tc = (statistics.median(times[r]) * 1e6 for r in ("torch", "C"))
            print(f"{fmt:8s} {n:6d} {tt:10.1f} {tc:9.1f} {tt / tc:9.1f}x")


if __name__ == "__main__":
    main()
