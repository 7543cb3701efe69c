"""kvp_attend against vLLM's stock CPU attention op on the same shapes, in one process, interleaved.

Run in the vLLM venv (it needs vLLM's ``_C`` ops), with the source tree first on the path:

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 .venv-vllm/bin/python tests/vllm/paged_microbench.py \
        --rows 16 --kv 2048 --q 1 --formats q4_0 int8 none --reps 20

Each repetition times one call of every variant in turn (stock first), so a busy machine slows them alike; the
medians are printed with their ratio to stock. ``--q 1`` is a decode step (every row's history on pages, its new
token raw, as kvslim's backend attends); ``--q N --kv N`` a prefill over no cached prefix (every key raw).
One layer's attention only: the model's matmuls, writes and Python are not in it (the engine profile is).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--kv", type=int, default=2048, help="keys per row (its queries' own tokens included)")
    p.add_argument("--q", type=int, default=1, help="queries per row (its newest tokens)")
    p.add_argument("--hq", type=int, default=9)
    p.add_argument("--hkv", type=int, default=3)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--formats", nargs="+", default=["q4_0", "int8", "none"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    import kvslim
    from kvslim.vllm import attend as paged
    from kvslim.vllm.pages import PAGE_TOKENS, PageLayout, write

    print(f"kvslim from {kvslim.__file__}; kernel: {paged.status()}; threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    r, n, m, hq, hkv, d, t = a.rows, a.kv, a.q, a.hq, a.hkv, a.d, PAGE_TOKENS
    per_row = -(-n // t)
    n_pages = r * per_row
    table = torch.randperm(n_pages, generator=g).to(torch.int32).view(r, per_row)
    k = torch.randn(r, n, hkv, d, generator=g) * 2
    v = torch.randn(r, n, hkv, d, generator=g)
    pos = torch.arange(n)
    slots = (table[:, pos // t].long() * t + pos % t).reshape(-1)  # (r * n,)
    query = torch.randn(r * m, hq, d, generator=g)
    starts = torch.arange(r + 1, dtype=torch.int32) * m
    lens = torch.full((r,), n, dtype=torch.int32)
    new_k = k[:, n - m :].reshape(r * m, hkv, d).contiguous()
    new_v = v[:, n - m :].reshape(r * m, hkv, d).contiguous()
    scale = d**-0.5

    # stock: fp32 pages of vLLM's layout (blocks, H_kv, 2 x block, D), written by its own op
    isa = _get_attn_isa(torch.float32, t, d)
    stock_cache = torch.zeros(n_pages, hkv, 2 * t, d)
    key_cache, value_cache = stock_cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), key_cache, value_cache, slots, isa
    )
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=r,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        seq_lens=lens,
        dtype=torch.float32,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    out_stock = torch.empty_like(query)

    def stock():
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out_stock,
            query_start_loc=starts,
            seq_lens=lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=table,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )

    variants = {"stock fp32": stock}
    outs = {"stock fp32": out_stock}
    rows = paged.Rows.of(starts, lens, table)
    for fmt in a.formats:
        layout = PageLayout.of(fmt, fmt, d, torch.float32)
        pages = torch.zeros(n_pages, hkv, t, layout.row_bytes, dtype=torch.uint8)
        write(layout, pages, k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), slots)
        out = torch.empty_like(query)

        def run(layout=layout, pages=pages, out=out):
            paged.attend(layout, pages, query, out, rows, scale, 0, True, new_k, new_v)

        variants[f"kvslim {fmt}"] = run
        outs[f"kvslim {fmt}"] = out

    times = {name: [] for name in variants}
    for fn in variants.values():  # warm-up (the library's first build, caches)
        fn()
    for _ in range(a.reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["stock fp32"])
    print(
        f"{r} rows x {n} keys, {m} queries each, H_q {hq}, H_kv {hkv}, D {d}; median of {a.reps}, interleaved"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        err = (outs[name] - out_stock).abs().max().item()
        print(f"  {name:14s} {med * 1e3:9.3f} ms  {med / base:6.2f}x stock  (max |out - stock| {err:.2e})")


if __name__ == "__main__":
    main()
