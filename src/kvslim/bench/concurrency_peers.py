"""The serving peers of ``kvslim bench --concurrency --peers``: OpenVINO GenAI and vLLM's CPU build, each in
its own venv, run as a subprocess on the same model directory, prompt, threads and new tokens.

A peer is found as ``.venv-openvino`` / ``.venv-vllm`` (built by ``make openvino`` / ``make vllm``) in the
source checkout kvslim runs from or in the current directory, or at ``$KVSLIM_OPENVINO_VENV`` /
``$KVSLIM_VLLM_VENV``; a missing one is one line saying how to build it, never an error. The runner scripts
(:mod:`.peer_openvino`, :mod:`.peer_vllm`) import nothing of kvslim; they get a JSON job and write JSON
rows, which become :class:`~.concurrency.ConcurrencyRow`\\ s here.

OpenVINO computes in kvslim's model dtype (``INFERENCE_PRECISION_HINT`` ``f32``, or ``bf16`` beside a bfloat16
model: ``--dtype bfloat16``). Cache specs map to the peer's own cache: OpenVINO's KV precision is ``f32`` for ``none``
(``bf16`` beside a bfloat16 model: OpenVINO computing in bf16 refuses f32 KV), ``u8`` for the
8-bit formats, ``u4`` for the 4-bit ones, and a windowed spec becomes its cache eviction (start 32 tokens,
recent up to 128, capped at sink + window rounded up to its 32-token blocks: what it can do, not StreamingLLM);
vLLM runs its stock KV (``auto``: the model's dtype, bf16; ``KVSLIM_VLLM_DTYPE=float32`` runs its model and KV in
float32, for a CPU without bf16 instructions, where vLLM's bf16 is emulated) for the unwindowed specs only. Specs
a peer has no counterpart for are skipped with a note. Each peer is given a token budget of one prompt a step and
``concurrency + 2`` more new tokens than the timed window, so every stream decodes in the window
(:mod:`.peer_common`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .concurrency import ConcurrencyRow
from .timing import quiet

#: peer -> (venv directory name, environment variable naming it, runner script, how to install it)
PEERS = {
    "openvino": (".venv-openvino", "KVSLIM_OPENVINO_VENV", "peer_openvino.py", "make openvino"),
    "vllm": (".venv-vllm", "KVSLIM_VLLM_VENV", "peer_vllm.py", "make vllm"),
}
#: seconds one peer's whole job may take (an export, pipelines, 16 prompts of 4,096 tokens on 2 cores)
PEER_TIMEOUT = 4 * 3600


def venv_python(peer: str) -> Path | None:
    """The peer venv's python, or None where none is built."""
    name, var, _, _ = PEERS[peer]
    checkout = Path(__file__).resolve().parents[3]  # src/kvslim/bench/ -> the checkout (editable installs)
    places = [Path(os.environ[var])] if os.environ.get(var) else [checkout / name, Path.cwd() / name]
    for venv in places:
        python = venv / "bin" / "python"
        if python.exists() and (venv / ".installed").exists():
            return python
    return None


def peer_cache(peer: str, spec: str) -> tuple[dict | None, str]:
    """``({"kv", "eviction"}, "")`` for the peer's counterpart of ``spec``, or ``(None, why not)``."""
    from ..config import parse_spec
    from ..formats import get_format

    cfg = parse_spec(spec)
    if cfg.k_quantize or cfg.v_quantize or cfg.keep_layers:
        return None, "per-K/V or per-layer formats have no counterpart"
    bits = None if cfg.kv_quantize == "none" else getattr(get_format(cfg.kv_quantize), "bits", None)
    if peer == "vllm":
        if cfg.window is not None:
            return None, "vLLM has no sinks + window (eviction is its KV-cache manager's)"
        if cfg.kv_quantize == "none":
            return {"kv": "auto", "eviction": None}, ""
        from ..vllm.spec import check_supported

        try:  # kvslim's pages inside vLLM (the plugin, installed in vLLM's venv by `make vllm`)
            check_supported(cfg)
        except ValueError as e:
            return None, str(e)
        return {"kv": "auto", "eviction": None, "kvslim": spec}, ""
    kv = None if cfg.kv_quantize.startswith("fp") else {None: "f32", 8: "u8", 4: "u4"}.get(bits)
    if kv is None:
        return None, f"OpenVINO has no {cfg.kv_quantize} KV (f32, u8, u4)"
    eviction = None
    if cfg.window is not None:
        most = -(-(cfg.sink_tokens + cfg.window) // 32) * 32
        recent = max(32, min(128, (most - 32) // 64 * 32))
        eviction = [32, recent, max(most, 32 + recent + 32)]  # it needs max > start + recent
    return {"kv": kv, "eviction": eviction}, ""


def model_dir(model) -> str | None:
    """The transformers directory ``model`` was loaded from (the embedded model's converted copy), or None."""
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else None


def run_peers(
    peers: Sequence[str],
    model,
    specs: Sequence[str],
    prompt: Callable[[int], Sequence[int]],
    lengths: Sequence[int],
    concurrencies: Sequence[int],
    steps: int,
    *,
    warmup: int = 1,
    threads: int = 1,
    log: Callable[[str], None] | None = None,
) -> tuple[list[ConcurrencyRow], dict[str, str]]:
    """Every peer's rows (each spec it has a counterpart for, at every length and concurrency) and one line per
    peer (what ran, or why not and how to install it)."""
    log = log or quiet
    rows: list[ConcurrencyRow] = []
    notes: dict[str, str] = {}
    directory = model_dir(model)
    for peer in peers:
        python = venv_python(peer)
        name, var, script, install = PEERS[peer]
        if python is None:
            notes[peer] = f"peer {peer}: not installed: run `{install}` (builds {name}) or set {var}"
            continue
        if directory is None:
            notes[peer] = f"peer {peer}: needs the model as a transformers directory (--model DIR or the embedded one)"
            continue
        runs, skipped = [], []
        precision = "bf16" if getattr(model, "dtype", None) == torch.bfloat16 else "f32"
        for spec in specs:
            cache, why = peer_cache(peer, spec)
            if cache is None:
                skipped.append(f"{spec} ({why})")
                continue
            if cache["kv"] == "f32" and precision == "bf16":  # (OpenVINO computing in bf16 takes bf16 KV, not f32)
                cache = {**cache, "kv": "bf16"}
            runs += [{"spec": spec, **cache, "length": n, "concurrency": c, "prompt": list(prompt(n))}
                     for n in lengths for c in concurrencies]
        rows_here, error = (
            _run(peer, python, script, directory, runs, steps, warmup, threads, log, precision) if runs else ([], "")
        )
        rows += rows_here
        notes[peer] = (f"peer {peer}: {python.parent.parent.name}, {len(rows_here)} rows"
                       + (f"; failed: {error}" if error else "") + (f"; skipped {', '.join(skipped)}" if skipped else ""))
    return rows, notes


def _export_name(directory: str) -> str:
    """The export's directory name: the model directory's name and a digest of its path and files' sizes and
    times (another model saved under the same name gets its own export)."""
    import hashlib

    h = hashlib.sha256(os.path.abspath(directory).encode())
    for name in sorted(os.listdir(directory)):
        st = os.stat(os.path.join(directory, name))
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{Path(directory).name}-fp32-{h.hexdigest()[:12]}"


def _run(
    peer, python, script, directory, runs, steps, warmup, threads, log, precision="f32"
) -> tuple[list[ConcurrencyRow], str]:
    from ..models.converted import cache_dir

    job = {"model_dir": directory, "ir_dir": str(cache_dir() / "openvino" / _export_name(directory)),
           "threads": threads, "steps": steps, "warmup": warmup, "runs": runs,
           # OpenVINO's inference precision: kvslim's model dtype (f32; bf16 for a bfloat16 model)
           "precision": precision,
           # vLLM's model dtype: its CPU build's bf16 by default; float32 where the CPU has no bf16 instructions
           "dtype": os.environ.get("KVSLIM_VLLM_DTYPE", "bfloat16")}
    with tempfile.TemporaryDirectory(prefix=f"kvslim-peer-{peer}-") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "rows.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        log(f"peer {peer}: {len(runs)} runs in {python.parent.parent}")
        try:
            proc = subprocess.run(
                [str(python), str(Path(__file__).with_name(script)), "--job", job_path, "--out", out_path],
                capture_output=True, text=True, timeout=PEER_TIMEOUT, env=env, stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return [], f"no answer in {PEER_TIMEOUT} s"
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return [], f"exit {proc.returncode}: {tail[0][:200]}"
        with open(out_path) as f:
            raw = json.load(f)
    rows = []
    fields = set(ConcurrencyRow.__dataclass_fields__)
    for r in raw:
        if "error" in r:
            r = {"steps": 0, "ms_median": float("nan"), "ms_q1": float("nan"), "ms_q3": float("nan"),
                 "aggregate_tok_s": 0.0, "ratio_to_dynamic": None, "bytes_per_stream": None, "cache_bytes": None,
                 **r, "note": f"failed: {r['error']}"}
        rows.append(ConcurrencyRow(**{k: v for k, v in r.items() if k in fields}))
    return rows, ""
