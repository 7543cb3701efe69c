"""kvslim.heap: the startup heap frozen out of the collector's passes, and the passes recorded."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from kvslim import heap


class _Node:
    pass


@pytest.fixture
def unfrozen():
    """Each test leaves the process's collector as it found it (a frozen heap would outlive the test)."""
    yield
    gc.unfreeze()


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_freeze_keeps_startup_objects_out_and_collects_new_cycles(unfrozen):
    old = _cycle()  # alive only through its own cycle: garbage, which the freeze's collection frees first
    frozen = heap.freeze_startup_heap()
    assert old() is None
    # the interpreter's, pytest's and kvslim's objects; a frozen object can still be freed (a thread an earlier test
    # left winding down dropped two between the calls once), never one added: the count only falls
    assert 1000 < gc.get_freeze_count() <= frozen
    young = _cycle()  # made after the freeze: the collector still reaches it
    assert young() is not None
    gc.collect()
    assert young() is None


def test_the_flag(unfrozen):
    gc.unfreeze()  # whatever an earlier test left
    assert heap.apply_gc_flag("off") == "gc: the collector as Python sets it (--gc-freeze off)"
    assert gc.get_freeze_count() == 0
    line = heap.apply_gc_flag("on")
    assert line.startswith("gc: ") and line.endswith("startup objects frozen out of the collector's passes")
    assert f"{gc.get_freeze_count():,}" in line


def test_pauses_are_recorded_while_recording_only():
    pauses = heap.GcPauses()
    gc.collect(0)
    assert pauses.counts == [0, 0, 0]  # not started
    with pauses:
        gc.collect(0)
        gc.collect(1)
        gc.collect()
    gc.collect()
    assert pauses.counts == [1, 1, 1]
    d = pauses.to_dict()
    assert set(d) == {"passes", "ms", "longest_ms", "frozen_objects"} and d["passes"] == [1, 1, 1]
    assert all(x >= 0 for x in d["ms"]) and d["longest_ms"] == pytest.approx(max(d["ms"]), abs=1e-3)
    assert pauses._callback not in gc.callbacks


def test_no_leak_report_at_exit():
    """Frozen objects are unfrozen at exit: the interpreter's last collection reaches them, so an extension that
    counts its objects at shutdown (Triton's nanobind bindings) reports no leak."""
    pytest.importorskip("triton")
    code = "import triton, kvslim.heap as h; h.freeze_startup_heap(); print('done')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]
    assert "leaked" not in out.stderr, out.stderr[-2000:]
