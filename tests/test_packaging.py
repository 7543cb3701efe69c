"""The distribution as a user gets it: ``python -m build`` makes the sdist and then the wheel *from the
sdist* (so a file the sdist forgets is missing from the wheel too); the wheel goes into a fresh virtual
environment, and from a directory outside the source tree ``kvslim --version``, the C kernels (compiled on
first use from the source shipped as package data) and a tiny ``kvslim sample`` must work.

The fresh environment borrows this one's dependencies through a ``.pth`` file instead of installing
torch again (minutes, and a multi-GB download wherever the CPU wheel is not at hand); the wheel itself
goes in alone (``--no-deps``) and the test checks that ``kvslim`` is imported from it, not from src/.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert res.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return res


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    if importlib.util.find_spec("build") is None:
        pytest.skip("building needs the 'build' package (pip install build; the test extra has it)")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", out, ROOT], cwd=ROOT)
    return out


def test_sdist_and_wheel_carry_the_package_the_kernel_source_and_the_entry_point(dist):
    (sdist,) = dist.glob("kvslim-*.tar.gz")
    (wheel,) = dist.glob("kvslim-*.whl")
    assert sdist.stat().st_size > 0
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvslim/__init__.py" in names and "kvslim/compat.py" in names
    assert any(n.startswith("kvslim/kernels/csrc/") and n.endswith(".c") for n in names), names
    assert "kvslim/kernels/csrc/kvslim_ops.cpp" in names  # the C++ ops' source (kvslim.kernels.cppops)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvslim = kvslim.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    assert not any(n.startswith(("tests/", "src/")) for n in names)


def _tiny_model_dir(path: Path) -> Path:
    from tokenizers import Tokenizer
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    from conftest import tiny_model

    tiny_model("llama").save_pretrained(path)
    vocab = {f"t{i}": i for i in range(128)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, unk_token="t0")))
    fast.save_pretrained(path)
    return path


def test_wheel_installs_alone_and_runs_outside_the_source_tree(dist, tmp_path):
    (wheel,) = dist.glob("kvslim-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel])
    # this environment's dependencies (torch, transformers, ...), after the venv's own site-packages
    purelib = Path(
        _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_kvslim_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(KVSLIM_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    where = _run([py, "-c", "import kvslim, os; print(os.path.dirname(kvslim.__file__))"], cwd=work, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    version = _run([venv / "bin" / "kvslim", "--version"], cwd=work, env=env)
    assert version.stdout.strip().startswith("kvslim 0.")

    if shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang"):
        built = _run(
            [
                py,
                "-c",
                "from kvslim.kernels import cpu; ok, why = cpu.status(); print(ok, why); assert ok, why",
            ],
            cwd=work,
            env=env,
        )
        assert any((tmp_path / "cache" / "kernels").glob("*.so")), built.stdout

    model = _tiny_model_dir(tmp_path / "tiny")
    sample = _run(
        [venv / "bin" / "kvslim", "sample", "--model", model, "--prompt", "t5 t6 t7", "--tokens", "6"]
        + [
            "--temperature",
            "0",
            "--ignore-eos",
            "--kv-quantize",
            "int4",
            "--kv-residual",
            "0",
            "--kv-group-size",
            "1",
        ],
        cwd=work,
        env=env,
    )
    assert "generated 6 tokens" in sample.stderr, sample.stderr
