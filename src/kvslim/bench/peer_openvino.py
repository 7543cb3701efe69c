"""The OpenVINO GenAI peer of ``kvslim bench --concurrency``: run in its own venv (``make openvino``), never
imported by kvslim.

    .venv-openvino/bin/python src/kvslim/bench/peer_openvino.py --job JOB.json --out ROWS.json

JOB.json (written by :mod:`kvslim.bench.concurrency_peers`): ``model_dir`` (a transformers directory: the
embedded model's converted copy), ``ir_dir`` (where its OpenVINO export is kept; made with optimum-intel's
``optimum-cli export openvino --weight-format fp32`` when missing), ``threads``, ``steps``, ``warmup``,
``precision`` (OpenVINO's inference precision: ``f32``, or ``bf16`` beside a bfloat16 kvslim model) and ``runs``:
``[{"spec", "kv", "eviction", "length", "concurrency", "prompt"}]``. kv: the KV cache precision (``f32``,
``bf16``, ``u8``, ``u4``); eviction: ``[start, recent, max]`` tokens for OpenVINO's cache eviction (a windowed spec) or null.

Each run is one ``ContinuousBatchingPipeline`` (``precision`` inference, ``threads`` threads, one stream) given
``concurrency`` requests of the prompt's token ids, greedy, ``ignore_eos``, ``warmup + steps + 1`` new tokens,
stepped by hand: a step is timed once every request has its first token (its prefill done, by OpenVINO's
dynamic split-fuse scheduling) and while all still run; the first ``warmup`` such steps are not counted. Rows
as :class:`kvslim.bench.concurrency.ConcurrencyRow` fields, written to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

try:
    from . import peer_common as common
except ImportError:  # run as a script in the peer's venv: the sibling module, not the package
    import peer_common as common

PER_TOKEN_BYTES = {"f32": 4, "bf16": 2, "u8": 1, "u4": 0.5}


def export(model_dir: str, ir_dir: str) -> None:
    """optimum-intel's fp32 export of ``model_dir`` into ``ir_dir`` (a temporary beside it, renamed)."""
    if os.path.exists(os.path.join(ir_dir, "openvino_model.xml")):
        return
    parent = os.path.dirname(os.path.abspath(ir_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    cli = os.path.join(os.path.dirname(sys.executable), "optimum-cli")
    cmd = [cli, "export", "openvino", "--model", model_dir, "--task", "text-generation-with-past",
           "--weight-format", "fp32", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(os.path.join(tmp, "openvino_model.xml")):
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"optimum-cli export failed ({proc.returncode}): {tail[0][:200]}")
    os.replace(tmp, ir_dir)


def run_one(job: dict, run: dict, layers_kv: int) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as g

    c, length = run["concurrency"], run["length"]
    new = common.new_tokens(job, run)
    sc = g.SchedulerConfig()
    tokens = c * (length + new + 64)
    sc.cache_size = max(1, int(tokens * layers_kv * PER_TOKEN_BYTES[run["kv"]] * 1.5 / 2**30) + 1)  # GB
    sc.max_num_seqs = max(c, 1)
    sc.max_num_batched_tokens = common.step_budget(run)
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = False  # every stream prefills its prompt, as kvslim's do
    precision = job.get("precision", "f32")
    note = f"KV {run['kv']}" + (f", {precision} compute" if precision != "f32" else "")
    if run.get("eviction"):
        start, recent, most = run["eviction"]
        sc.use_cache_eviction = True
        sc.cache_eviction_config = g.CacheEvictionConfig(start, recent, most, g.AggregationMode.NORM_SUM)
        note += f", eviction start {start} recent {recent} max {most}"
    props = {"INFERENCE_NUM_THREADS": job["threads"], "INFERENCE_PRECISION_HINT": precision, "NUM_STREAMS": 1,
             "KV_CACHE_PRECISION": run["kv"]}
    pipe = g.ContinuousBatchingPipeline(job["ir_dir"], sc, "CPU", props)
    gc = g.GenerationConfig()
    gc.max_new_tokens = new
    gc.ignore_eos = True
    gc.do_sample = False
    ids = ov.Tensor(np.array([run["prompt"]], dtype=np.int64))
    t0 = time.perf_counter()
    handles = [pipe.add_request(i, ids, gc) for i in range(c)]
    got = [0] * c
    decode: list[float] = []
    first_all = None
    while pipe.has_non_finished_requests():
        all_decoding = all(n >= 1 for n in got) and all(n < new for n in got)
        t = time.perf_counter()
        pipe.step()
        dt = time.perf_counter() - t
        for i, h in enumerate(handles):
            if h.can_read():
                for out in h.read().values():
                    got[i] += len(out.generated_ids)
        if all_decoding:
            decode.append(dt)
        elif first_all is None and all(n >= 1 for n in got):
            first_all = time.perf_counter() - t0
    return common.step_row("openvino", run, job["warmup"], decode, first_all, note)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    with open(a.job) as f:
        job = json.load(f)
    export(job["model_dir"], job["ir_dir"])
    layers_kv = common.kv_elements_per_token(job["model_dir"])
    rows = [common.emit(common.guarded("openvino", run, lambda run=run: run_one(job, run, layers_kv))) for run in job["runs"]]
    common.write_rows(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
