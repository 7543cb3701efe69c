"""kvslim's own linear layer (csrc/kvslim_linear.c through kvslim.kernels.linear): the product torch computes, to
float32 rounding, and a row's bits fixed by its own input alone, whatever rows share the call, however many threads
run it and whichever tile it falls in; the AVX2 build (8 lanes) checked as well as this machine's."""

from __future__ import annotations

import array
import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from kvslim.kernels import clib
from kvslim.kernels import linear as lin

pytestmark = pytest.mark.skipif(not lin.ready(), reason="kvslim's linear needs the C kernels with AVX2 and FMA")


def _ref(x, w, b=None):
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


@pytest.mark.parametrize(("o", "i"), [(576, 576), (192, 576), (576, 1536), (37, 21), (6, 16), (5, 15), (13, 1), (1, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_torchs_to_rounding(o, i, bias):
    """Every shape (tails of the lanes and of the tiles included) with and without a bias, against a float64
    product: within float32's rounding of a dot product of i terms, as torch's own linear is."""
    g = torch.Generator().manual_seed(o * 1000 + i)
    x, w = torch.randn(19, i, generator=g), torch.randn(o, i, generator=g) / i**0.5
    b = torch.randn(o, generator=g) if bias else None
    got, ref = lin.linear(x, w, b), _ref(x, w, b)
    tol = 4 * i * 2**-24 * (x.abs() @ w.abs().T).max()
    assert got.shape == (19, o) and float((got - ref).abs().max()) <= float(tol) + 1e-6
    assert (got - ref).abs().max() <= (torch.nn.functional.linear(x, w, b) - ref).abs().max() * 4 + 1e-6


def test_a_rows_bits_are_its_own_whatever_shares_the_call():
    """A row alone, a row among 1..70 others at any place (every tile shape and row chunk), the leading dims of a
    packed step, 1 or 2 threads: the same bits (no filler rows needed)."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(150, 100, generator=g) / 10, torch.randn(150, generator=g)
    x = torch.randn(140, 100, generator=g)
    alone = torch.stack([lin.linear(x[r : r + 1], w, b)[0] for r in range(140)])
    for n in (1, 2, 3, 4, 5, 7, 9, 16, 17, 33, 64, 65, 70, 140):
        for start in (0, 1, 70 - n // 2, 140 - n):
            assert torch.equal(lin.linear(x[start : start + n], w, b), alone[start : start + n]), (n, start)
    assert torch.equal(lin.linear(x[None, :80], w, b)[0], alone[:80])  # (1, N, I): the engine's packed step
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(lin.linear(x, w, b), alone), threads
    finally:
        torch.set_num_threads(before)


def test_the_workers_spin_decides_who_waits_never_the_bits(monkeypatch):
    """The workers' spin (kv_pool_spin): set and read back, from $KVSLIM_POOL_SPIN_US when the library loads, a bad
    value refused (set) or warned about (environment: the default kept); products on 2 threads give the same bits
    whether the workers sleep at once or spin."""
    default = clib.pool_spin_us()
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(300, 200, generator=g), torch.randn(5, 200, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ref = lin.linear(x, w)
        assert clib.pool_spin_us(0) == 0
        for _ in range(3):
            assert torch.equal(lin.linear(x, w), ref)
        assert clib.pool_spin_us(default) == default
        for bad in (-1, 100_001, 2.5, True):
            with pytest.raises(ValueError, match="the workers' spin must be a whole number of microseconds 0-100000"):
                clib.pool_spin_us(bad)
        assert clib.pool_spin_us() == default
        monkeypatch.setenv("KVSLIM_POOL_SPIN_US", "7")
        clib._reset_for_tests()
        assert clib.pool_spin_us() == 7 and torch.equal(lin.linear(x, w), ref)
        monkeypatch.setenv("KVSLIM_POOL_SPIN_US", "soon")
        clib._reset_for_tests()
        with pytest.warns(RuntimeWarning, match="KVSLIM_POOL_SPIN_US=soon must be a whole number"):
            clib.library()
        assert clib.pool_spin_us() == 7  # left as it was
    finally:
        torch.set_num_threads(before)
        monkeypatch.delenv("KVSLIM_POOL_SPIN_US")
        clib._reset_for_tests()
        clib.pool_spin_us(default)


_RENEW_CHILD = """
import time, torch
torch.set_num_threads(2)
from kvslim.kernels import clib, linear as lin
renew = clib.pool_renewer()
g = torch.Generator().manual_seed(4)
w, x = torch.randn(300, 200, generator=g), torch.randn(5, 200, generator=g)
def wait(s):
    t = time.perf_counter()
    while time.perf_counter() - t < s:
        pass
def sleeps(renewing):
    # (sleeps, whether this thread kept to its timing: a stretch of Python it was descheduled in is longer than the
    # spin whatever the renewal)
    lin.linear(x, w)
    before, kept = clib.pool_sleeps(), True
    for _ in range(10):
        t = time.perf_counter()
        wait(0.0012)
        if renewing:
            renew()
        r = time.perf_counter()
        wait(0.0012)
        kept = kept and r - t < 0.0016 and time.perf_counter() - r < 0.0016
        lin.linear(x, w)
    return clib.pool_sleeps() - before, kept
clib.pool_spin_us(2000)
for _ in range(8):
    preempted = clib.pool_preempted()
    (plain, _), (renewed, kept) = sleeps(False), sleeps(True)
    if clib.pool_preempted() == preempted and kept:
        print(plain, renewed)
        break
    time.sleep(1.1)  # the guard's second of short spins passes
else:
    print("busy")
"""


def test_a_renewed_spin_keeps_the_worker_awake():
    """kv_pool_renew restarts a spinning worker's spin: with a 2 ms spin, 2.4 ms of Python between two products put
    the worker to sleep every time, and (almost) no time when the spin is renewed half-way (kv_pool_sleeps). In a
    process of its own (one worker, no guard tripped before); tried again where a worker was descheduled meanwhile
    (the guard then shortens the spin) or the calling thread was (its Python then outlasts any spin)."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KVSLIM_POOL_SPIN_US"}
    out = subprocess.run([sys.executable, "-c", _RENEW_CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.split() == ["busy"]:
        pytest.skip("a thread was descheduled in every try (a busy machine)")
    plain, renewed = map(int, out.stdout.split())
    # every stretch without the renewal (a stray wake-up aside), at most a few with it: a renewal that did nothing
    # gives ~10 here
    assert plain >= 9 and renewed <= 3, out.stdout


def _one_cpu_child(seed: int) -> tuple[int, str]:
    """A CPU of this process' and the start of a child's code that runs on it alone, with two threads, a product's
    x (4, 1000) and w (2000, 1000) drawn from seed, and ``clib`` and ``lin`` imported (skips where there is no
    sched_setaffinity)."""
    import os

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity here")
    cpu = min(os.sched_getaffinity(0))
    return cpu, (
        "import os, torch\n"
        f"os.sched_setaffinity(0, {{{cpu}}})\n"
        "torch.set_num_threads(2)\n"
        "from kvslim.kernels import clib, linear as lin\n"
        f"g = torch.Generator().manual_seed({seed})\n"
        "w, x = torch.randn(2000, 1000, generator=g), torch.randn(4, 1000, generator=g)\n"
    )


def test_a_worker_descheduled_in_its_spin_shortens_the_spin():
    """A spin longer than the default, on one CPU shared with a busy loop: a worker is descheduled while it spins,
    sees the gap, and the workers take the short spin (kv_pool_preempted counts it). The products keep their bits."""
    import os
    import sys

    cpu, prelude = _one_cpu_child(5)
    code = prelude + (
        "ref = lin.linear(x, w)\n"
        "assert clib.pool_spin_us() == 100000, clib.pool_spin_us()\n"
        "import time\n"
        "for _ in range(100):\n"
        "    assert torch.equal(lin.linear(x, w), ref)\n"
        "    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < 3e-4:  # Python between two calls, as in a step: the worker spins\n"
        "        pass\n"
        "print(clib.pool_preempted())\n"
    )
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        # the longest spin: it outlasts a time slice of the scheduler, so the busy loop takes the CPU mid-spin
        env = {**os.environ, "KVSLIM_POOL_SPIN_US": "100000"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    finally:
        busy.kill()
        busy.wait()
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 1, out.stdout


def test_a_worker_that_has_not_joined_does_not_hold_up_a_call():
    """Two threads on one CPU: the caller's part takes every chunk before the worker gets the CPU in most calls.
    With fixed shares (kv_pool_balance off) every call waits for the worker to join and run its share; with the
    default balance the caller closes such a call alone (kv_pool_joins counts fewer joins than calls). The products'
    bits are the same under both rules."""
    import os
    import sys

    code = _one_cpu_child(6)[1] + (
        "assert clib.pool_balance(False) is False\n"
        "ref = lin.linear(x, w)\n"
        "counts = []\n"
        "for on, calls in ((False, 40), (True, 200)):\n"
        "    clib.pool_balance(on)\n"
        "    j = clib.pool_joins()\n"
        "    for _ in range(calls):\n"
        "        assert torch.equal(lin.linear(x, w), ref)\n"
        "    counts.append(clib.pool_joins() - j)\n"
        "print(*counts)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVSLIM_POOL_SPIN_US"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    fixed, balanced = map(int, out.stdout.split())
    assert fixed == 40 and balanced < 200, out.stdout


def test_inputs_that_are_not_contiguous_and_the_errors():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 64, generator=g)
    x = torch.randn(10, 128, generator=g)[:, ::2]  # rows 128 apart, elements 2 apart: copied
    assert torch.equal(lin.linear(x, w), lin.linear(x.contiguous(), w))
    wide = torch.randn(24, 96, generator=g)[:, :64]  # weight rows 96 apart: read in place
    assert torch.equal(lin.linear(x, wide), lin.linear(x, wide.contiguous()))
    assert lin.linear(torch.randn(0, 64), w).shape == (0, 24)
    b = torch.randn(24, generator=g)
    assert torch.equal(lin.linear(torch.randn(3, 0), torch.randn(24, 0), b), b.expand(3, 24))  # a width of 0: the bias
    assert torch.equal(lin.linear(torch.randn(3, 0), torch.randn(24, 0)), torch.zeros(3, 24))
    assert torch.equal(lin.linear(x[0], w), lin.linear(x[:1], w)[0])  # one vector: (O,)
    cols = torch.randn(64, 24, generator=g).T  # a weight read across its rows (stride(1) != 1): copied
    assert torch.equal(lin.linear(x, cols), lin.linear(x, cols.contiguous()))
    same = x[:1].expand(5, 64)  # rows 0 apart
    assert torch.equal(lin.linear(same, w), lin.linear(same.contiguous(), w))
    with pytest.raises(ValueError, match="no backward"):
        lin.linear(x, w.clone().requires_grad_())
    with torch.no_grad():
        lin.linear(x, w.clone().requires_grad_())
    with pytest.raises(ValueError, match="does not fit a weight"):
        lin.linear(torch.randn(3, 63), w)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensors"):
        lin.linear(x.half(), w.half())
    with pytest.raises(ValueError, match="bias"):
        lin.linear(x, w, torch.randn(23))


def _avx2_build(tmp_path: Path) -> ctypes.CDLL:
    compiler = clib.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    src = Path(clib.SOURCES) / "kvslim_linear.c"
    out = tmp_path / "avx2.so"
    flags = ["-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast", "-mavx2", "-mfma", "-mno-avx512f", "-fopenmp"]
    res = subprocess.run([*compiler, *flags, "-o", str(out), str(src)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"the compiler does not build AVX2 code here: {res.stderr.strip()[-200:]}")
    lib = ctypes.CDLL(str(out))
    lib.kv_linear.argtypes = [ctypes.c_void_p]
    lib.kv_linear.restype = ctypes.c_int
    return lib


def _call(lib, x, w, b, threads=2):
    y = torch.empty(x.shape[0], w.shape[0])
    args = array.array("q", [x.data_ptr(), x.shape[0], x.shape[1], x.shape[1], w.data_ptr(), w.shape[0], w.shape[1],
                             0 if b is None else b.data_ptr(), y.data_ptr(), w.shape[0], threads])
    assert lib.kv_linear(args.buffer_info()[0]) == 0
    return y


def test_the_c_call_takes_a_product_of_no_outputs_or_no_rows():
    """kv_linear itself (kvslim.kernels.linear never calls it so) returns 0 and writes nothing for a product with no
    outputs or no rows, on one thread or two."""
    for threads in (1, 2):
        assert _call(clib.library(), torch.randn(3, 64), torch.randn(0, 64), None, threads).shape == (3, 0)
        assert _call(clib.library(), torch.randn(0, 64), torch.randn(5, 64), None, threads).shape == (0, 5)


def test_the_avx2_build_keeps_the_same_contract(tmp_path):
    """The 8-lane build (an AVX2 machine's): torch's product to rounding, and a row's bits its own."""
    lib = _avx2_build(tmp_path)
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(45, 77, generator=g) / 9, torch.randn(45, generator=g)
    x = torch.randn(21, 77, generator=g)
    got = _call(lib, x, w, b)
    assert (got - _ref(x, w, b)).abs().max() < 1e-4
    for n in (1, 2, 3, 5, 21):
        assert torch.equal(_call(lib, x[:n], w, b, threads=1), got[:n]), n


def _product_in_child(conn):
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(8, 300, generator=g), torch.randn(200, 300, generator=g)
    conn.send(lin.linear(x, w).tolist())  # plain lists: no shared memory outliving the child


def test_threads_at_once_and_a_forked_child():
    """Calls from several Python threads at once (one holds the workers, the others run alone) and from a child
    forked after the workers started (it starts its own): every result the same bits."""
    import multiprocessing
    import threading

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(8, 300, generator=g), torch.randn(200, 300, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref = lin.linear(x, w)  # the workers are running from here on
        bad = []

        def hammer():
            for _ in range(200):
                if not torch.equal(lin.linear(x, w), ref):
                    bad.append(1)

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not bad and not any(t.is_alive() for t in threads)
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_product_in_child, args=(child,))
        proc.start()
        assert parent.poll(60), "the forked child's product did not return"
        assert parent.recv() == ref.tolist()
        proc.join(10)
    finally:
        torch.set_num_threads(before)


def test_every_thread_of_a_call_rounds_as_the_caller():
    """The workers take the calling thread's floating-point mode (MXCSR: flush-to-zero, denormals) for each call: a
    caller that flushes denormals after the workers started gets the bits it gets on its own thread alone."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode torch can set")
    x = torch.full((4, 64), 1e-20)
    w = torch.full((256, 64), 1e-20)  # products of 1e-40: denormals, flushed to 0 in flush-to-zero mode
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert bool(lin.linear(x, w).abs().max() > 0)  # the workers start, in the ordinary mode
        torch.set_flush_denormal(True)
        together = lin.linear(x, w)
        torch.set_num_threads(1)
        alone = lin.linear(x, w)
        bits = lambda t: t.view(torch.int32)  # noqa: E731 - (compared as integers: the flushing mode reads denormals as 0)
        assert torch.equal(bits(together), bits(alone)) and not bool(bits(alone).any())
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)


@pytest.mark.parametrize(("o", "i"), [(576, 576), (37, 21), (13, 1), (1, 40)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_a_prepared_weight_gives_linears_bits(o, i, bias, rows):
    g = torch.Generator().manual_seed(o * 100 + i)
    w, x = torch.randn(o, i, generator=g), torch.randn(2, rows, i, generator=g)
    b = torch.randn(o, generator=g) if bias else None
    p = lin.Prepared.of(w, b)
    with torch.inference_mode():
        assert torch.equal(p(x), lin.linear(x, w, b))
        assert torch.equal(p(x[:, :, :].transpose(0, 1)), lin.linear(x.transpose(0, 1), w, b))  # rows not contiguous
        assert p(x.double()) is None and p(x[..., :-1] if i > 1 else x.expand(2, rows, 2)) is None
    assert p(x) is None  # autograd recording: the caller's general path decides
    assert p.fits(w, b) and not p.fits(w.clone(), b) and not p.fits(w, None if bias else torch.zeros(o))


def test_what_is_not_prepared_and_a_weight_that_moved():
    w = torch.randn(8, 6)
    assert lin.Prepared.of(w.T.contiguous().T, None) is None  # rows not contiguous (a transposed view)
    assert lin.Prepared.of(w.double(), None) is None and lin.Prepared.of(w[:, :0], None) is None
    assert lin.Prepared.of(w, torch.randn(7)) is None and lin.Prepared.of(w, torch.randn(16)[::2]) is None
    m = torch.nn.Linear(6, 8)
    p = lin.Prepared.of(m.weight, m.bias)
    assert p.fits(m.weight, m.bias)
    m.weight.data = torch.randn(8, 6)  # the same Parameter at another address
    assert not p.fits(m.weight, m.bias)
    m.weight.data = m.weight.data.half()
    assert not lin.Prepared.of(m.weight, m.bias)
