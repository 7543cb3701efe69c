"""The pool's attention kernel (or the linear kernel) of two or more source revisions, timed on one real decode
step's calls in one process.

    OMP_WAIT_POLICY=PASSIVE python scripts/paged_kernel_ab.py --rows 16 --length 4096 --config int4 \\
        --revs 54f1dc7 HEAD HEAD
    OMP_WAIT_POLICY=PASSIVE python scripts/paged_kernel_ab.py --products --rows 16 --revs HEAD~1 HEAD HEAD~1

Each ``--revs`` entry is a git revision of this repository (``worktree``: the working tree's sources). Its
``src/kvslim/kernels/csrc`` is built with the compiler and flags of the library kvslim loaded (the same as
``scripts/rows_phases.py`` builds), into a temporary directory, and loaded beside the others with ctypes; each build
must have this tree's ``kvp_attend`` table (the same ABI). Then one decode step of ``--rows`` rows of ``--length``
seeded random tokens in ``--config`` pages (:func:`kvslim.cache.paged_adapter.forward_pages`, copies of one prefilled
row) runs through this tree's library, and every layer's pool attention call is kept as the step made it (the table
:mod:`kvslim.cache.pagecalls` laid out, with copies of the layer's query and raw K/V). Each round replays the step's
calls in order through every build in turn (the order reversed every other round): before each call, the build's
own linear kernel multiplies the rows by a 14 MB weight (a layer's float32 weights of the embedded model; four such
in turn, more than the L3 holds), so each layer's history comes from memory and the workers stay awake, as in a
step. Only the attention calls are timed.

Prints per build the median and fastest ms a step (30 calls), its per-round time against the first build's (median
and quartiles: the ratio to read), and whether its outputs are the first build's bit for bit and the step's own. Give
one revision twice for an A/A control: on a shared host the rounds move by 5-10%. Measure alone, on a quiet machine.

``--no-product`` leaves out the product before each call (the calls back to back: each layer's history still comes
from beyond the L3 at 16 rows, since a step's pages are larger than it); ``--warm`` replays the step's first call in
place of every call (its pages stay in the L3 at 16 rows, in the L2 at one row): with ``--no-product``, the two
say how much of a call is the trip to memory.

``--products``: the linear kernel instead (``kv_linear``). Each round runs one pass of the embedded model's products
in a step's order (every weight the engine routes to kvslim's kernel, 211, with its bias) at ``--rows`` rows of
seeded random input through every build in turn; the pass is timed whole (~0.5 GB of weights, more than the L3
holds, so each weight comes from memory as in a step), and its outputs are compared with the first build's and with
the library kvslim loaded (:func:`kvslim.kernels.linear.linear`) bit for bit.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CSRC = "src/kvslim/kernels/csrc"


def _build(rev: str, out: Path, compiler: list[str], flags: str) -> ctypes.CDLL:
    """The kernels of ``rev`` (or the working tree) built into ``out``, loaded."""
    src = out.with_suffix("")
    if rev == "worktree":
        shutil.copytree(ROOT / CSRC, src)
    else:
        src.mkdir()
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, CSRC], capture_output=True, timeout=120)
        if tar.returncode:
            raise SystemExit(f"git archive {rev}: {tar.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(src)], input=tar.stdout, check=True, timeout=120)
        src = src / CSRC
    cmd = [*compiler, *flags.split(), "-o", str(out), *map(str, sorted(src.glob("*.c")))]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode:
        raise SystemExit(f"building {rev}'s kernels failed: {res.stderr.strip()[-400:]}")
    lib = ctypes.CDLL(str(out))
    for name in ("kvp_attend", "kv_linear"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", default="int4")
    p.add_argument("--revs", nargs="+", default=["HEAD", "worktree"])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--reps", type=int, default=3, help="replays of the step's calls a round, timed together")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-product", action="store_true", help="no 14 MB product before each call")
    p.add_argument("--warm", action="store_true", help="replay the step's first call in place of every call")
    p.add_argument(
        "--products", action="store_true", help="time the linear kernel on the model's products instead"
    )
    a = p.parse_args()
    if min(a.rows, a.length, a.rounds, a.reps, a.threads) < 1:
        p.error("--rows, --length, --rounds, --reps and --threads must be positive")
    torch.set_num_threads(a.threads)

    import kvslim
    from kvslim.cache import pagecalls
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.pagepool import pool_for
    from kvslim.kernels import clib
    from kvslim.models.load import load_model
    from kvslim.threads import load_average
    from kvslim.vllm import attend as paged

    if paged.library() is None:
        raise SystemExit(f"the C kernel is unavailable: {paged.status()}")
    compiler, flags = clib.find_compiler(), clib._state.get("flags") or ""
    if compiler is None or flags in ("", "?"):
        raise SystemExit("the loaded C kernels do not say which compiler and flags built them: rebuild them")
    tmp = Path(tempfile.mkdtemp(prefix="kvslim-kernel-ab-"))
    try:
        libs = [
            (f"{i}:{rev}", _build(rev, tmp / f"k{i}.so", compiler, flags)) for i, rev in enumerate(a.revs)
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (loaded libraries stay mapped)
    for name, lib in libs:
        lib.kvp_abi_version.restype = ctypes.c_int
        if lib.kvp_abi_version() != paged.ABI:
            raise SystemExit(f"{name}: kvp_attend ABI {lib.kvp_abi_version()}, this tree's is {paged.ABI}")

    before = load_average()
    if a.products:
        _products(a, libs, load_model(None)[0], before)
        return
    model = kvslim.enable(load_model(None)[0])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (a.length,), generator=g).tolist()
    calls = []
    with torch.inference_mode():
        pool = pool_for(model, a.config, pages=-(-(a.length + 2) // 32) * (a.rows + 1), max_rows=a.rows + 1)
        src = pool.new_row()
        for start in range(0, a.length, 1024):
            forward_pages(model, pool, [(ids[start : start + 1024], src)])
        rows = [pool.copy_row(src) for _ in range(a.rows)]
        run = pagecalls.StepCalls.run

        def keep(self, layer, query, key, value, scale):
            out = run(self, layer, query, key, value, scale)
            # the table as the call read it; the layer's step tensors copied (the step reuses their buffers)
            if out is not None:
                calls.append((array.array("q", self.head[0]), query.clone(), self.keys.clone(),
                              self.values.clone(), out, self))  # fmt: skip
            return out

        pagecalls.StepCalls.run = keep
        try:
            forward_pages(model, pool, [([5 + i], r) for i, r in enumerate(rows)])
        finally:
            pagecalls.StepCalls.run = run
    if not calls:
        raise SystemExit(f"{a.config}: the step made no laid-out pool calls (pagecalls does not apply)")
    outs = {}
    for name, _ in libs:  # each build its own tables and outputs
        outs[name] = []
        for head, q, k, v, out, _ in calls:
            o = torch.empty_like(out)
            t = array.array("q", head)
            t[paged.HEAD_QUERY], t[paged.HEAD_OUT], t[paged.HEAD_KNEW], t[paged.HEAD_VNEW] = (
                q.data_ptr(), o.data_ptr(), k.data_ptr(), v.data_ptr(),
            )  # fmt: skip
            outs[name].append((t, o))
    weights = [torch.randn(6144, 576) for _ in range(4)]  # 14 MB each (docstring)
    x = torch.randn(a.rows, 576)
    y = torch.empty(a.rows, 6144)
    products = [array.array("q", [x.data_ptr(), a.rows, 576, 576, w.data_ptr(), 6144, 576, 0, y.data_ptr(), 6144,
                                  a.threads]) for w in weights]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name, _ in libs}
    for r in range(a.rounds):
        for name, lib in libs if r % 2 == 0 else libs[::-1]:
            spent = 0.0
            for _ in range(a.reps):
                for n, (t, _) in enumerate(outs[name]):
                    if a.warm:
                        t = outs[name][0][0]
                    if not a.no_product and lib.kv_linear(products[n % len(products)].buffer_info()[0]):
                        raise SystemExit(f"{name}: kv_linear refused the product")
                    start = time.perf_counter()
                    rc = lib.kvp_attend(t.buffer_info()[0])
                    spent += time.perf_counter() - start
                    if rc:
                        raise SystemExit(f"{name}: kvp_attend returned {rc}")
            times[name].append(spent / a.reps * 1e3)
    after = load_average()
    first = libs[0][0]
    print(
        f"{a.rows} rows x {a.length} tokens, {a.config}, {len(calls)} calls a step"
        f"{' (the first, warm)' if a.warm else ''}{', no product between' if a.no_product else ''}, {a.threads} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; load average {before} -> {after}"
    )
    _header(first, "the step")
    n = 1 if a.warm else len(calls)  # (--warm writes the first call's output only)
    for name, _ in libs:
        same = all(torch.equal(o, p) for (_, o), (_, p) in zip(outs[first][:n], outs[name][:n], strict=True))
        step = all(torch.equal(o, c[4]) for (_, o), c in zip(outs[name][:n], calls[:n], strict=True))
        _line(name, times, first, same, step)


def _header(first: str, reference: str) -> None:
    print(
        f"{'build':24s} {'median ms':>10s} {'fastest':>8s} {'ratio':>6s} {'q1':>6s} {'q3':>6s}  same bits as "
        f"{first} / {reference}"
    )


def _line(name: str, times: dict, first: str, same: bool, step: bool) -> None:
    ratios = statistics.quantiles([b / a_ for a_, b in zip(times[first], times[name], strict=True)], n=4)
    print(
        f"{name:24s} {statistics.median(times[name]):10.3f} {min(times[name]):8.3f} {ratios[1]:6.3f} "
        f"{ratios[0]:6.3f} {ratios[2]:6.3f}  {same} / {step}"
    )


def _products(a, libs: list, model, before) -> None:
    """``--products``: a pass of the model's products through every build in turn (module docstring)."""
    from kvslim.engine.linears import _routable
    from kvslim.kernels import linear as klin
    from kvslim.threads import load_average

    mods = [m for m in model.modules() if _routable(m, (torch.float32,))]
    if not mods:
        raise SystemExit("the model has no float32 products kvslim's linear kernel takes")
    g = torch.Generator().manual_seed(0)
    xs = {i: torch.randn(a.rows, i, generator=g) for i in sorted({m.weight.shape[1] for m in mods})}
    with torch.inference_mode():
        ref = [klin.linear(xs[m.weight.shape[1]], m.weight, m.bias) for m in mods]
    calls = []
    for m in mods:
        w, (o, i) = m.weight, m.weight.shape
        calls.append((xs[i], w, m.bias, o, i))
    outs = {name: [torch.empty(a.rows, o) for _, _, _, o, _ in calls] for name, _ in libs}
    args = {name: [array.array("q", [x.data_ptr(), a.rows, i, x.stride(0), w.data_ptr(), o, w.stride(0),
                                     0 if b is None else b.data_ptr(), y.data_ptr(), y.stride(0), a.threads])
                   for (x, w, b, o, i), y in zip(calls, outs[name], strict=True)] for name, _ in libs}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name, _ in libs}
    for r in range(a.rounds):
        for name, lib in libs if r % 2 == 0 else libs[::-1]:
            start = time.perf_counter()
            for _ in range(a.reps):
                for t in args[name]:
                    if lib.kv_linear(t.buffer_info()[0]):
                        raise SystemExit(f"{name}: kv_linear refused a product")
            times[name].append((time.perf_counter() - start) / a.reps * 1e3)
    after = load_average()
    first = libs[0][0]
    print(
        f"{a.rows} rows, a pass of the model's {len(calls)} products, {a.threads} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; load average {before} -> {after}"
    )
    _header(first, "the library's")
    for name, _ in libs:
        same = all(torch.equal(o, p) for o, p in zip(outs[first], outs[name], strict=True))
        mine = all(torch.equal(o, p) for o, p in zip(outs[name], ref, strict=True))
        _line(name, times, first, same, mine)


if __name__ == "__main__":
    main()
