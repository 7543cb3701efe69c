"""scripts/paged_kernel_ab.py: builds of the pool's attention kernel from git revisions, replayed on one real step's
calls, and (--products) of the linear kernel on the model's products; every build gives the step's own bits (the
loaded library's), and a revision git does not know fails in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvslim.kernels import cpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "paged_kernel_ab.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    ok, why = cpu.status()
    if not ok:
        pytest.skip(f"C kernels unavailable: {why}")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and this repository's history")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, env=env
    )


def test_an_unknown_revision_fails_in_one_line():
    res = _run("--revs", "no-such-revision-xyz", "HEAD")
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    assert "git archive no-such-revision-xyz" in res.stderr


def _two_builds(*argv: str) -> str:
    """The script's stdout for builds of HEAD and the working tree, each of whose lines ends "True / True": the first
    build's bits, and the step's (the loaded library's, with --products)."""
    res = _run(*argv, "--revs", "HEAD", "worktree", "--rounds", "2", "--reps", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    builds = [line for line in res.stdout.splitlines() if line.startswith(("0:HEAD", "1:worktree"))]
    assert len(builds) == 2, res.stdout
    for line in builds:
        assert line.rstrip().endswith("True / True"), line
    return res.stdout


@pytest.mark.slow
def test_two_builds_replay_the_step_with_its_bits():
    assert "30 calls a step" in _two_builds("--rows", "2", "--length", "80")


@pytest.mark.slow
def test_two_builds_of_the_linear_kernel_give_the_librarys_bits():
    assert "a pass of the model's 211 products" in _two_builds("--products", "--rows", "3")


@pytest.mark.slow
def test_a_warm_replay_without_products_checks_the_first_calls_bits():
    out = _two_builds("--rows", "2", "--length", "80", "--warm", "--no-product")
    assert "30 calls a step (the first, warm), no product between" in out
