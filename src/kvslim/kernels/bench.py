"""Time the attention kernels on one decode step's shapes: ``python -m kvslim.kernels.bench``.

For each format and history length it times, per layer, ``k_scores`` + ``v_weighted`` over the
encoded body with

- ``ref``:  the PyTorch reference (decode to fp32, then matmul),
- ``c``:    the C kernels (on the encoded bytes, no fp32 copy),
- ``fp32``: plain ``q @ K^T`` and ``p @ V`` on already materialized fp32 K/V — what the plain cache
  pays per layer (without its torch.cat),

over ``--layers`` distinct layers per step, cycled, so the working set is a real step's (KV of
every layer: hundreds of MB at 4K tokens, far beyond the last-level cache) rather than one layer
that stays in cache. Modes are interleaved within each repeat so that a noisy, shared machine
slows them alike; the table shows medians (and the spread) of microseconds per layer.

Shapes default to SmolLM2-135M's decode step: B=1, 3 KV heads, M=3 queries per KV head (its GQA
group), head dim 64.

``--rows R1,R2,...`` times a ragged decode step's attention instead: one layer's fused attention (sinks none,
an encoded K and V body in a Hadamard basis, a float16 residual of ``--residual`` tokens) for R rows of
``--lengths`` tokens each (``--ragged``: row r of R holds (r + 1) / R of it), as

- ``per-row``:  one :func:`kvslim.kernels.cpu.attend` call per row (one C ``kv_attend`` each), what a ragged
  step did before ``attend_rows``, the Python marshalling of each call included,
- ``one-call``: one :func:`kvslim.kernels.cpu.attend_rows` call for every row (C ``kv_attend_rows``),

whose outputs are bit-identical (checked before timing). Microseconds per layer, over ``--layers`` distinct
layers cycled, modes interleaved, median of ``--repeats``.

``--baseline REV`` (with ``--rows``): the same ``one-call`` against ``one-call@REV``, the C sources of git revision
REV built with the same compiler and flags (:func:`baseline_library`) and called with the same row table, in one
process, interleaved (the per-row mode is left out), with the body bytes each layer reads (codes, scales and
zeros of K and V) per second. The two outputs are compared (largest difference printed), not required equal: a
change of the arithmetic is what such a comparison is for. E.g. the engine's decode step at 16 rows x 4,096
tokens, int4, SmolLM2-135M's 3 KV heads x 3 queries x 64::

    python -m kvslim.kernels.bench --rows 16 --lengths 4096 --formats int4 --baseline main --layers 8
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..formats import Encoded, make_codec
from . import clib, cpu, reference

FORMATS = ("int8", "int4", "int2", "q8_0", "q4_0")


def _narrowed(enc: Encoded, t: int, group_size: int) -> Encoded:
    """Views of the first ``t`` tokens and their groups (as a cache's TimeBuffer hands them out)."""
    n = -(-t // group_size)
    return Encoded(
        token={k: v[:, :, :t] for k, v in enc.token.items()},
        group={k: v[:, :, :n] for k, v in enc.group.items()},
    )


def _layer_bodies(name: str, role: str, x: torch.Tensor, layers: int, group_size: int):
    """``layers`` distinct copies of x encoded with ``name``, as views with slack after the body."""
    codec = make_codec(name, role, group_size=group_size)
    t = x.shape[2]
    # the buffer's spare room: a group or more, up to a whole number of groups (per-channel K encodes groups)
    slack = torch.zeros(*x.shape[:2], group_size + (-t) % group_size, x.shape[3])
    enc = codec.encode(torch.cat([x, slack], dim=2))  # (B, H, T + slack, ...)
    bodies = []
    for _ in range(layers):
        e = Encoded(
            token={k: v.clone() for k, v in enc.token.items()},
            group={k: v.clone() for k, v in enc.group.items()},
        )
        bodies.append(_narrowed(e, t, codec.token_group))
    return codec, bodies


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _time(fn, layers: int, clock) -> float:
    """Microseconds per layer of one pass over every layer."""
    t0 = clock()
    for i in range(layers):
        fn(i)
    return (clock() - t0) * 1e6 / layers


def _modes(q, p, kc, kb, vc, vb, k32, v32) -> dict:
    """mode -> fn(layer index) running one layer's K scores + V weighted sum."""
    from . import select

    kk, vk = select(q, kc, kb[0])[1], select(p, vc, vb[0])[1]  # the kernels "auto" picks (C when built)
    modes = {
        "ref": lambda i: (reference.k_scores(q, kc, kb[i]), reference.v_weighted(p, vc, vb[i])),
        "c": lambda i: (kk.k_scores(q, kc, kb[i], 0), vk.v_weighted(p, vc, vb[i], 0)),
        "fp32": lambda i: (q @ k32[i].transpose(-1, -2), p @ v32[i]),
    }
    return modes


def bench(
    formats=FORMATS,
    lengths=(4096, 8192),
    batch: int = 1,
    heads: int = 3,
    queries: int = 3,
    head_dim: int = 64,
    layers: int = 30,
    repeats: int = 7,
    group_size: int = 32,
    clock: str = "wall",
    seed: int = 0,
) -> list[dict]:
    """Rows {format, tokens, mode, us_per_layer (median), spread (min, max), bytes_per_layer}.

    ``clock``: "wall" (perf_counter) or "cpu" (process CPU time: on a shared machine, with one
    thread, the time the work itself took, whoever else was running).
    """
    ok, why = cpu.status()
    if not ok:
        raise RuntimeError(f"the C kernels are unavailable: {why}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    tick = CLOCKS[clock]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for t in lengths:
        shape = (batch, heads, t, head_dim)
        mean = torch.randn(1, heads, 1, head_dim, generator=gen) * 2  # keys have per-channel means
        k = torch.randn(shape, generator=gen) + mean
        v = torch.randn(shape, generator=gen)
        q = torch.randn(batch, heads, queries, head_dim, generator=gen) * head_dim**-0.5
        p = torch.softmax(torch.randn(batch, heads, queries, t, generator=gen), dim=-1)
        k32 = [k.clone() for _ in range(layers)]
        v32 = [v.clone() for _ in range(layers)]
        for name in formats:
            kc, kb = _layer_bodies(name, "k", k, layers, group_size)
            vc, vb = _layer_bodies(name, "v", v, layers, group_size)
            nbytes = {"fp32": 2 * k.numel() * 4}
            modes = _modes(q, p, kc, kb, vc, vb, k32, v32)
            for fn in modes.values():  # warm-up
                _time(fn, min(2, layers), tick)
            times = {m: [] for m in modes}
            for _ in range(repeats):
                for mode, fn in modes.items():
                    times[mode].append(_time(fn, layers, tick))
            for mode, ts in times.items():
                rows.append(
                    {
                        "format": name,
                        "tokens": t,
                        "mode": mode,
                        "us_per_layer": statistics.median(ts),
                        "spread": (min(ts), max(ts)),
                        "bytes_per_layer": nbytes.get(mode, kb[0].nbytes() + vb[0].nbytes()),
                    }
                )
    return rows


def format_rows(rows: list[dict]) -> str:
    """One line per (format, tokens): bytes read per layer (encoded K+V vs fp32), the three modes,
    the bandwidth each mode's bytes imply, and the ratios c / fp32 and c / ref."""
    by = {}
    for r in rows:
        by.setdefault((r["format"], r["tokens"]), {})[r["mode"]] = r
    head = (
        f"{'format':7} {'tokens':>6} {'KV MB':>6} {'fp32 MB':>7} {'ref us':>8} {'c us':>7} {'fp32 us':>7} "
        f"{'c GB/s':>6} {'fp32 GB/s':>9} {'c/fp32':>6} {'c/ref':>6}"
    )
    lines = [head]
    for (name, t), m in by.items():
        c, f, ref = (m[k]["us_per_layer"] for k in ("c", "fp32", "ref"))
        cb, fb = m["c"]["bytes_per_layer"], m["fp32"]["bytes_per_layer"]
        lines.append(
            f"{name:7} {t:6d} {cb / 1e6:6.2f} {fb / 1e6:7.2f} {ref:8.0f} {c:7.0f} {f:7.0f} "
            f"{cb / c / 1e3:6.2f} {fb / f / 1e3:9.2f} {c / f:6.2f} {c / ref:6.2f}"
        )
    return "\n".join(lines)


def _row_layers(
    name: str,
    rows: int,
    lengths: list[int],
    residual: int,
    heads: int,
    head_dim: int,
    layers: int,
    group_size: int,
    gen: torch.Generator,
):
    """Per layer, the AttendRow of every row: its own encoded K and V body (``length - residual`` tokens, views
    with slack) and float16 residual."""
    out = [[] for _ in range(layers)]
    for r, t in enumerate(lengths):
        n = max(t - residual, 1)
        mean = torch.randn(1, heads, 1, head_dim, generator=gen) * 2
        k = torch.randn(1, heads, n, head_dim, generator=gen) + mean
        v = torch.randn(1, heads, n, head_dim, generator=gen)
        kc, kb = _layer_bodies(name, "k", k, layers, group_size)
        vc, vb = _layer_bodies(name, "v", v, layers, group_size)
        res = t - n
        for i in range(layers):
            kr = torch.randn(1, heads, res, head_dim, generator=gen).half()
            vr = torch.randn(1, heads, res, head_dim, generator=gen).half()
            out[i].append(
                cpu.AttendRow(r, None, None, kr, vr, ((kc, kb[i], 0),), ((vc, vb[i], 0),), head_dim, head_dim)
            )
    return out


def baseline_library(rev: str) -> ctypes.CDLL:
    """The C kernels of git revision ``rev`` (``src/kvslim/kernels/csrc/*.c`` there, read with ``git show`` from the
    repository this package sits in), built with the current build's compiler and flags into a temporary directory
    (removed once loaded). Refused unless its ABI and row table match this tree's (the same arguments mean the
    same thing to both)."""
    repo = Path(__file__).resolve().parents[3]
    csrc = "src/kvslim/kernels/csrc"
    git = ["git", "-C", str(repo)]
    names = subprocess.run([*git, "ls-tree", "--name-only", f"{rev}:{csrc}"], capture_output=True, text=True)
    if names.returncode:
        raise ValueError(f"--baseline {rev!r}: no {csrc} at that revision ({names.stderr.strip()})")
    ok, why = cpu.status()
    compiler = clib.find_compiler()
    if not ok or compiler is None:
        raise RuntimeError(f"the C kernels are unavailable: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="kvslim-baseline-"))
    try:
        sources = []
        for name in names.stdout.split():
            if name.endswith(".c"):
                src = subprocess.run([*git, "show", f"{rev}:{csrc}/{name}"], capture_output=True, check=True)
                (tmp / name).write_bytes(src.stdout)
                sources.append(str(tmp / name))
        flags = clib._state["flags"].split()
        res = subprocess.run([*compiler, *flags, "-o", str(tmp / "base.so"), *sources], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"building {rev}'s kernels failed: {res.stderr.strip()[-400:]}")
        lib = ctypes.CDLL(str(tmp / "base.so"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    clib._declare(lib)
    if lib.kv_abi_version() != clib.ABI_VERSION or clib.rows_layout(lib) != clib.ROWS_LAYOUT:
        raise ValueError(f"--baseline {rev!r}: its kernels' ABI or row table differ from this tree's")
    return lib


def _body_bytes(rows) -> int:
    """Bytes of the encoded K and V bodies of ``rows`` (AttendRow): codes, scales, zeros."""
    return sum(piece[1].nbytes() for r in rows for piece in (*r.k_body, *r.v_body))


def bench_rows(
    formats=("int4", "q4_0"),
    rows=(1, 4, 16),
    lengths=(1024, 4096),
    ragged: bool = False,
    residual: int = 64,
    heads: int = 3,
    queries: int = 3,
    head_dim: int = 64,
    layers: int = 8,
    repeats: int = 7,
    group_size: int = 32,
    clock: str = "wall",
    seed: int = 0,
    baseline: str | None = None,
) -> list[dict]:
    """Rows {format, rows, tokens (the longest row's), total_tokens, mode, us_per_layer (median), spread,
    body_bytes (per layer), max_diff (against one-call)}: one ragged step's attention per layer, a call per row
    (``per-row``) against one call (``one-call``), or with ``baseline`` (a git revision) one call against the
    same call into that revision's kernels (``one-call@REV``, :func:`baseline_library`)."""
    ok, why = cpu.status()
    if not ok:
        raise RuntimeError(f"the C kernels are unavailable: {why}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    tick = CLOCKS[clock]
    gen = torch.Generator().manual_seed(seed)
    base = baseline_library(baseline) if baseline else None
    out_rows = []
    for name in formats:
        for n_rows in rows:
            for t in lengths:
                lens = [max(t * (r + 1) // n_rows, 1) if ragged else t for r in range(n_rows)]
                per_layer = _row_layers(
                    name, n_rows, lens, residual, heads, head_dim, layers, group_size, gen
                )
                q = torch.randn(n_rows, heads, queries, head_dim, generator=gen) * head_dim**-0.5
                outs = [torch.zeros_like(q) for _ in range(layers)]

                def per_row(i, rs=per_layer, o=outs, q=q):
                    for r in rs[i]:
                        o[i][r.qrow] = cpu.attend(
                            q[r.qrow : r.qrow + 1].clone(), r.k_sink, r.v_sink, r.k_res, r.v_res, *r.k_body[0],
                            *r.v_body[0][:2], k_hblock=r.k_hblock, v_hblock=r.v_hblock,
                        )[0]  # fmt: skip

                def one_call(i, rs=per_layer, o=outs, q=q):
                    if cpu.attend_rows(q, rs[i], o[i]):
                        raise RuntimeError("attend_rows left rows")

                diffs = {}
                if base is None:
                    per_row(0)
                    ref = outs[0].clone()
                    one_call(0)
                    if not torch.equal(ref, outs[0]):
                        raise RuntimeError(f"{name}: one call and per-row calls differ")  # the kernel's contract
                    modes = {"per-row": per_row, "one-call": one_call}
                else:
                    bouts = [torch.zeros_like(q) for _ in range(layers)]

                    def base_call(i, rs=per_layer, o=bouts, q=q):
                        if cpu.attend_rows(q, rs[i], o[i], lib=base):
                            raise RuntimeError("attend_rows left rows")

                    one_call(0)
                    base_call(0)
                    diffs[f"one-call@{baseline}"] = (outs[0] - bouts[0]).abs().max().item()
                    modes = {"one-call": one_call, f"one-call@{baseline}": base_call}
                for fn in modes.values():  # warm-up
                    _time(fn, min(2, layers), tick)
                times = {m: [] for m in modes}
                for _ in range(repeats):
                    for mode, fn in modes.items():
                        times[mode].append(_time(fn, layers, tick))
                for mode, ts in times.items():
                    out_rows.append(
                        {
                            "format": name,
                            "rows": n_rows,
                            "tokens": t,
                            "total_tokens": sum(lens),
                            "mode": mode,
                            "us_per_layer": statistics.median(ts),
                            "spread": (min(ts), max(ts)),
                            "body_bytes": _body_bytes(per_layer[0]),
                            "max_diff": diffs.get(mode, 0.0),
                        }
                    )
    return out_rows


def format_baseline_table(rows: list[dict]) -> str:
    """One line per (format, rows, tokens, mode): ms per layer, body GB/s, the speedup over the baseline's mode,
    the largest output difference from one-call."""
    lines = [f"{'format':7} {'rows':>4} {'tokens':>6} {'mode':>24} {'ms/layer':>8} {'body MB':>7} {'GB/s':>6} "
             f"{'speedup':>7} {'max diff':>9}"]
    base = {(r["format"], r["rows"], r["tokens"]): r["us_per_layer"] for r in rows if "@" in r["mode"]}
    for r in rows:
        us, key = r["us_per_layer"], (r["format"], r["rows"], r["tokens"])
        lines.append(
            f"{r['format']:7} {r['rows']:4d} {r['tokens']:6d} {r['mode']:>24} {us / 1e3:8.2f} "
            f"{r['body_bytes'] / 1e6:7.1f} {r['body_bytes'] / us / 1e3:6.2f} {base.get(key, us) / us:7.2f} "
            f"{r['max_diff']:9.2g}"
        )
    return "\n".join(lines)


def format_rows_table(rows: list[dict]) -> str:
    """One line per (format, rows, tokens): both modes, their ratio, and tokens read per microsecond."""
    if any("@" in r["mode"] for r in rows):
        return format_baseline_table(rows)
    by = {}
    for r in rows:
        by.setdefault((r["format"], r["rows"], r["tokens"]), {})[r["mode"]] = r
    head = f"{'format':7} {'rows':>4} {'tokens':>6} {'total':>7} {'per-row us':>10} {'one-call us':>11} {'speedup':>7}"
    lines = [head + f" {'tok/us':>6}"]
    for (name, n, t), m in by.items():
        a, b = m["per-row"]["us_per_layer"], m["one-call"]["us_per_layer"]
        total = m["one-call"]["total_tokens"]
        lines.append(f"{name:7} {n:4d} {t:6d} {total:7d} {a:10.0f} {b:11.0f} {a / b:7.2f} {total / b:6.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvslim.kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated format names")
    ap.add_argument("--lengths", default="4096,8192", help="comma-separated history lengths (tokens)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=3, help="KV heads")
    ap.add_argument("--queries", type=int, default=3, help="queries per KV head (GQA group x new tokens)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30, help="distinct layers per step (cycled)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or process CPU time (steadier on a shared machine with --threads 1)",
    )
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument(
        "--rows",
        default=None,
        help="comma-separated row counts: time a ragged step's fused attention, a call per row against one call",
    )
    ap.add_argument(
        "--ragged", action="store_true", help="with --rows: row r of R holds (r + 1) / R of the length"
    )
    ap.add_argument("--residual", type=int, default=64, help="with --rows: float16 residual tokens per row")
    ap.add_argument(
        "--baseline",
        default=None,
        metavar="REV",
        help="with --rows: time one call against the same call into git revision REV's C kernels (e.g. main)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    lengths = [int(x) for x in args.lengths.split(",")]
    shape = dict(heads=args.heads, queries=args.queries, head_dim=args.head_dim, layers=args.layers,
                 repeats=args.repeats, clock=args.clock)
    if args.baseline and not args.rows:
        ap.error("--baseline needs --rows (it times the rows call)")
    if args.rows:
        try:
            rows = bench_rows(formats=formats, rows=[int(x) for x in args.rows.split(",")], lengths=lengths,
                              ragged=args.ragged, residual=args.residual, baseline=args.baseline, **shape)
        except ValueError as e:
            if not args.baseline or "--baseline" not in str(e):
                raise
            ap.error(str(e))
        what = "a ragged step's attention"
        layout = f"H_kv={args.heads} M={args.queries} D={args.head_dim} residual={args.residual}"
        layout += " ragged lengths" if args.ragged else ""
        table = format_rows_table(rows)
    else:
        rows = bench(formats=formats, lengths=lengths, batch=args.batch, **shape)
        what = "K scores + V weighted sum"
        layout = f"B={args.batch} H_kv={args.heads} M={args.queries} D={args.head_dim}"
        table = format_rows(rows)
    print(f"threads {torch.get_num_threads()}; {cpu.status()[1]}")
    print(
        f"{args.clock} microseconds per layer ({what}), median of {args.repeats} passes over {args.layers} "
        f"layers; {layout}"
    )
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.rows:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
