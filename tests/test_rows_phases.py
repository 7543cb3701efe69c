"""scripts/rows_phases.py's measuring build: the phase timers exist only there (never in the library kvslim loads),
and they change no result: the measuring build's rows call gives the library's bits."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest
import torch

from kvslim.kernels import bench, cpu

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rows_phases.py"


@pytest.fixture(scope="module")
def script():
    ok, why = cpu.status()
    if not ok:
        pytest.skip(f"C kernels unavailable: {why}")
    spec = importlib.util.spec_from_file_location("rows_phases", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_library_has_no_phase_timers(script):
    with pytest.raises(ValueError):
        (ctypes.c_double * 6).in_dll(cpu.library(), "kv_phase")


def test_the_measuring_build_times_the_phases_and_changes_no_result(script):
    if not cpu.library().kv_has_openmp():
        pytest.skip("the phase timers need OpenMP")
    lib, phase = script._build()
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the call's region on two threads (enough work for both): every mark's barriers met
    try:
        for fmt in ("int4", "q4_0"):
            rows = bench._row_layers(fmt, 3, [700, 2000, 330], 16, 3, 64, 1, 32, gen)[0]
            q = torch.randn(3, 3, 3, 64, generator=gen) * 0.125
            want, got = torch.zeros_like(q), torch.zeros_like(q)
            assert cpu.attend_rows(q, rows, want) == []
            for j in range(6):
                phase[j] = 0.0
            assert cpu.attend_rows(q, rows, got, lib=lib) == []
            assert torch.equal(want, got), fmt
            assert phase[1] > 0 and phase[3] > 0  # K and V were timed
            assert all(phase[j] >= 0 for j in range(5))
    finally:
        torch.set_num_threads(threads)
