"""The vLLM (CPU build) peer of ``kvslim bench --concurrency``: run in its own venv (``make vllm``), never
imported by kvslim.

    .venv-vllm/bin/python src/kvslim/bench/peer_vllm.py --job JOB.json --out ROWS.json

JOB.json as for :mod:`kvslim.bench.peer_openvino` (``ir_dir`` unused; each run's ``kv`` is vLLM's
``kv_cache_dtype``: ``auto`` -- its stock KV, the model's dtype --, or with ``kvslim`` a spec the plugin stores
(``additional_config={"kvslim": spec}``, :mod:`kvslim.vllm`: kvslim's pages in the same KV space); eviction is not
vLLM's and such runs are refused by the caller). Each run is one ``LLMEngine`` in a process of its own (vLLM's CPU worker keeps its
memory until the process ends: a second engine in the same process finds none free), its KV space sized to
the run (``kv_cache_memory_bytes``: the run's tokens at the model's KV bytes per token, 1.5x and 1 GiB over)
instead of vLLM's default of 92% of the machine's memory; each engine (``dtype`` from the job, bf16 by default as
vLLM's CPU build runs; ``VLLM_CPU_OMP_THREADS_BIND`` left to vLLM, ``threads`` given as
``OMP_NUM_THREADS``) given ``concurrency`` requests of the prompt's token ids, greedy, ``ignore_eos``, stepped
by hand; a step is timed once every request has its first token and while all still run, the first
``warmup`` not counted. Written against vLLM's LLMEngine API (add_request / step / has_unfinished_requests);
not run in kvslim's CI (no vLLM there): a failure is a note in its row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

try:
    from . import peer_common as common
except ImportError:  # run as a script in the peer's venv: the sibling module, not the package
    import peer_common as common


def kv_space(model_dir: str, tokens: int) -> int:
    """Bytes of KV space for ``tokens`` tokens of the model in ``model_dir`` (bf16/fp16 K and V of every layer),
    1.5x and 1 GiB over (vLLM's blocks round up, and its profiler wants room)."""
    per_token = 2 * common.kv_elements_per_token(model_dir)
    return int(1.5 * tokens * per_token) + (1 << 30)


def run_one(job: dict, run: dict) -> dict:
    from vllm import EngineArgs, LLMEngine, SamplingParams

    c, length = run["concurrency"], run["length"]
    new = common.new_tokens(job, run)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=job["model_dir"], dtype=job.get("dtype", "bfloat16"), max_num_seqs=max(c, 1),
        max_model_len=length + new + 16, max_num_batched_tokens=common.step_budget(run), kv_cache_dtype=run["kv"], enable_prefix_caching=False,
        seed=0, kv_cache_memory_bytes=kv_space(job["model_dir"], c * (length + new + 16)),
        **({"additional_config": {"kvslim": run["kvslim"]}} if run.get("kvslim") else {}),
    ))
    params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    for i in range(c):
        engine.add_request(str(i), {"prompt_token_ids": list(run["prompt"])}, params)
    got = {str(i): 0 for i in range(c)}
    decode: list[float] = []
    first_all = None
    while engine.has_unfinished_requests():
        all_decoding = all(n >= 1 for n in got.values()) and all(n < new for n in got.values())
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        for o in outs:
            got[o.request_id] = len(o.outputs[0].token_ids)
        if all_decoding:
            decode.append(dt)
        elif first_all is None and all(n >= 1 for n in got.values()):
            first_all = time.perf_counter() - t0
    kv = f"kvslim {run['kvslim']} pages" if run.get("kvslim") else f"KV {run['kv']}"
    return common.step_row("vllm", run, job["warmup"], decode, first_all, f"{job.get('dtype', 'bfloat16')}, {kv}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--only", type=int, default=None, help="run only this run of the job (the per-run child)")
    a = p.parse_args()
    with open(a.job) as f:
        job = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: steps timed here
    if a.only is not None:
        run = job["runs"][a.only]
        rows = [common.guarded("vllm", run, lambda: run_one(job, run))]
    else:
        rows = [common.emit(_child(a.job, a.out, i, run)) for i, run in enumerate(job["runs"])]
    common.write_rows(a.out, rows)
    return 0


def _child(job_path: str, out: str, i: int, run: dict) -> dict:
    """Run ``i`` in a child process of its own (its memory back when it ends); its row, or an error row."""
    import subprocess

    child_out = f"{out}.{i}"
    proc = subprocess.run([sys.executable, __file__, "--job", job_path, "--out", child_out, "--only", str(i)],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with open(child_out) as f:
            return json.load(f)[0]
    except (OSError, ValueError, IndexError):
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return common.error_row("vllm", run, f"exit {proc.returncode}: {tail[0][:200]}")
    finally:
        if os.path.exists(child_out):
            os.remove(child_out)


if __name__ == "__main__":
    sys.exit(main())
