"""Where the rows kernel's time goes: ``kv_attend_rows`` split into its phases (the queries' rotation, K scores,
softmax, V sums, finishing the heads), on a ragged step's shapes.

    OMP_WAIT_POLICY=PASSIVE python scripts/rows_phases.py --rows 16 --length 4096 --formats int4,int8,q4_0 \\
        --queries 1,3 --groups 32,128

Builds this tree's C kernels with ``-DKV_PHASE_TIMERS`` (a measuring build: a barrier and a clock read between the
phases, ``kv_phase`` in ``csrc/kvslim_kernels.c``; the library kvslim loads never has them) with the library's own
compiler and flags, into a temporary directory. Then, for each format, K group size (affine formats) and query
count per KV head, it times ``--repeats`` passes over ``--layers`` distinct layers of ``--rows`` rows
(:func:`kvslim.kernels.bench`'s synthetic rows: an encoded body in a Hadamard basis and a float16 residual of
``--residual`` tokens) and prints milliseconds a layer per phase. The phases cover the call's parallel region only
(not its setup, the tasks' sort and allocations, nor the Python that builds the row table), and the marks' barriers
cost a little. Measure alone on a quiet machine (``uptime`` before and after).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

PHASES = ("rotate", "K", "softmax", "V", "finish")


def _build():
    from kvslim.kernels import clib, cpu

    ok, why = cpu.status()
    compiler = clib.find_compiler()
    if not ok or compiler is None:
        raise SystemExit(f"the C kernels are unavailable: {why}")
    flags = clib._state.get("flags") or ""
    if flags in ("", "?"):
        raise SystemExit("the loaded C kernels do not say which flags built them: rebuild them (kvslim's cache)")
    csrc = Path(clib.__file__).resolve().parent / "csrc"
    tmp = Path(tempfile.mkdtemp(prefix="kvslim-phases-"))
    try:
        out = tmp / "phases.so"
        cmd = [*compiler, *flags.split(), "-DKV_PHASE_TIMERS", "-o", str(out), *map(str, sorted(csrc.glob("*.c")))]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode:
            raise SystemExit(f"building the measuring kernels failed: {res.stderr.strip()[-400:]}")
        lib = ctypes.CDLL(str(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    clib._declare(lib)
    try:
        phase = (ctypes.c_double * 6).in_dll(lib, "kv_phase")
    except ValueError:
        raise SystemExit("this build has no phase timers (built without OpenMP?)") from None
    return lib, phase


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--formats", default="int4,int8,q4_0")
    p.add_argument("--queries", default="1,3", help="queries per KV head (the embedded model's GQA group is 3)")
    p.add_argument("--groups", default="32", help="K token groups of the affine formats")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--residual", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from kvslim.kernels import bench, cpu

    lib, phase = _build()
    gen = torch.Generator().manual_seed(0)
    print(f"{a.rows} rows x {a.length} tokens, {a.heads} KV heads x {a.head_dim}, residual {a.residual}, "
          f"{a.threads} threads; ms a layer")
    print(f"{'format':8s} {'group':>5s} {'M':>2s} {'region':>7s} " + " ".join(f"{k:>8s}" for k in PHASES))
    for fmt in a.formats.split(","):
        groups = [int(g) for g in a.groups.split(",")] if fmt.startswith("int") else [32]
        for group in groups:
            layers = bench._row_layers(fmt, a.rows, [a.length] * a.rows, a.residual, a.heads, a.head_dim, a.layers,
                                       group, gen)
            for m in (int(x) for x in a.queries.split(",")):
                q = torch.randn(a.rows, a.heads, m, a.head_dim, generator=gen) * a.head_dim**-0.5
                out = torch.zeros_like(q)
                for rows in layers:  # warm
                    cpu.attend_rows(q, rows, out, lib=lib)
                for j in range(6):
                    phase[j] = 0.0
                for _ in range(a.repeats):
                    for rows in layers:
                        if cpu.attend_rows(q, rows, out, lib=lib):
                            raise SystemExit("attend_rows left rows")
                n = a.repeats * len(layers)
                ms = [phase[j] / n * 1e3 for j in range(5)]
                print(f"{fmt:8s} {group if fmt.startswith('int') else '-':>5} {m:>2d} {sum(ms):7.2f} "
                      + " ".join(f"{x:8.2f}" for x in ms), flush=True)


if __name__ == "__main__":
    main()
