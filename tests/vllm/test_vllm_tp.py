"""Tensor parallel on CPU with kvslim's pages (make vllm-test): three workers (SmolLM2's 9 query / 3 KV heads split
one KV head a rank), each in its own process, each loading the plugin and storing its own KV head's pages.

``none`` gives the stock backend's greedy tokens at the same tensor-parallel size exactly, and q4_0 pages give
tokens of their own (checked coherent by their first tokens matching the stock run's). The workers are not bound
to cores (``VLLM_CPU_OMP_THREADS_BIND=nobind``: vLLM binds one NUMA node a rank, and this machine has one). About
a minute and a half on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# vllm.version, not vllm: without vLLM installed, "vllm" resolves to this directory (tests/ is on sys.path)
pytest.importorskip(
    "vllm.version", reason="vLLM is not installed (make vllm builds .venv-vllm; make vllm-test runs these)"
)

import vllm_helpers as helpers  # noqa: E402  (tests/vllm on sys.path: rootdir-relative test imports)

pytestmark = pytest.mark.slow

TP = 3


def _tokens(spec: str, tmp_path: Path) -> list[list[int]]:
    out = tmp_path / f"{spec}.json"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    if spec == "stock":
        env["VLLM_PLUGINS"] = "none"
    proc = subprocess.run(
        [sys.executable, helpers.__file__, "tp", str(TP), spec, str(out)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert len(got["ranks"]) == TP
    for dtype, shape in got["ranks"]:  # every rank stores its own KV head: kvslim's uint8 rows, or stock's fp32
        if spec == "stock":
            assert dtype == "torch.float32", got["ranks"]
        else:
            assert dtype == "torch.uint8" and shape[-1] == {"none": 2 * 64 * 4, "q4_0": 2 * 36}[spec], got["ranks"]
    return got["tokens"]


def test_tensor_parallel_none_equals_stock_and_q4_0_runs(tmp_path):
    stock = _tokens("stock", tmp_path)
    assert _tokens("none", tmp_path) == stock
    q4 = _tokens("q4_0", tmp_path)
    assert all(len(t) == 32 for t in q4)
    assert all(a[:4] == b[:4] for a, b in zip(q4, stock)), (q4, stock)
