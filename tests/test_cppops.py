"""kvslim's C++ ops (kvslim.kernels.cppops): ``kvslim_cpp::linear`` gives kvslim's linear kernel's bits where that
kernel takes the call and torch's linear's where it does not; a build that fails, or ``$KVSLIM_CPP_OPS=0``, leaves
the ops off with one reason and the compiled step on its Python ops."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvslim.kernels import cppops
from kvslim.kernels import linear as lin

needs_ops = pytest.mark.skipif(not cppops.ready(), reason=f"no C++ ops here: {cppops.status()[1]}")


def _op(x, w, b=None):
    return torch.ops.kvslim_cpp.linear(x, w, b)


@pytest.fixture(autouse=True)
def _bound():
    cppops.bind()
    yield
    cppops.bind()


@needs_ops
@pytest.mark.skipif(not lin.ready(), reason="kvslim's linear kernel does not run here")
@pytest.mark.parametrize("bias", [True, False])
def test_the_op_is_kvslims_linear_bit_for_bit(bias):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    inputs = [
        torch.randn(1, 24, generator=g),
        torch.randn(5, 24, generator=g),
        torch.randn(2, 3, 24, generator=g),  # more than two dims
        torch.randn(24, 6, generator=g).T,  # a column stride that is not 1
        torch.randn(5, 48, generator=g)[:, ::2],
        torch.randn(0, 24, generator=g),
    ]
    with torch.no_grad():
        for x in inputs:
            got, want = _op(x, w, b), lin.linear(x, w, b)
            assert got.shape == want.shape and torch.equal(got, want)
        x = inputs[1]  # (the check below can fail: torch's linear rounds otherwise)
        assert not torch.equal(lin.linear(x, w, b), torch.nn.functional.linear(x, w, b))


@needs_ops
def test_torchs_linear_runs_where_the_kernel_does_not_take_the_call(monkeypatch):
    g = torch.Generator().manual_seed(4)
    w, b, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(5, 24, generator=g)
    f = torch.nn.functional.linear
    with torch.no_grad():
        cases = [
            (x.double(), w.double(), b.double()),  # another dtype
            (x, torch.randn(24, 40, generator=g).T, b),  # a weight whose rows are not contiguous
            (x, w, torch.randn(80, generator=g)[::2]),  # a strided bias
        ]
        for xs, ws, bs in cases:
            assert torch.equal(_op(xs, ws, bs), f(xs, ws, bs))
    with torch.enable_grad():  # autograd recording: the kernel has no backward
        assert torch.equal(_op(x, w, b), f(x, w, b))
    monkeypatch.setattr(lin, "ready", lambda dtype=torch.float32: False)
    cppops.bind()  # no kernel bound: torch's linear for every dtype
    with torch.no_grad():
        assert torch.equal(_op(x, w, b), f(x, w, b))


@needs_ops
def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv(cppops.ENV, "off")
    assert not cppops.ready() and cppops.status() == (False, "$KVSLIM_CPP_OPS is 'off'")
    monkeypatch.setenv(cppops.ENV, "1")
    assert cppops.ready()


def test_a_failed_build_warns_once_and_the_python_ops_run(tmp_path):
    """In a fresh process with a compiler that fails and an empty cache: one warning naming the failure, the ops
    off, and the compiled step made on its Python ops (on any machine: this is the path of one without the ops)."""
    code = (
        "import warnings, kvslim\n"
        "from kvslim.kernels import cppops\n"
        "from kvslim.cache import paged_compiled\n"
        "from conftest import tiny_model\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(cppops.ready(), cppops.ready())\n"
        "print(sum('C++ ops are unavailable' in str(w.message) for w in caught))\n"
        "print(cppops.status()[1])\n"
        "print(paged_compiled.CompiledStep(kvslim.enable(tiny_model('llama'))).cpp_ops)\n"
    )
    env = {**os.environ, "CXX": "false", "KVSLIM_CACHE_DIR": str(tmp_path)}
    env.pop(cppops.ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(__file__),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "False False" and lines[1] == "1"
    assert lines[2].startswith("RuntimeError: false failed to build kvslim's C++ ops") and lines[3] == "False"
