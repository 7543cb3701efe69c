"""The vLLM (CPU build) peer of ``kvslim bench --concurrency``: run in its own venv (``make vllm``), never
imported by kvslim.

    .venv-vllm/bin/python src/kvslim/bench/peer_vllm.py --job JOB.json --out ROWS.json

JOB.json as for :mod:`kvslim.bench.peer_openvino` (``ir_dir`` unused; each run's ``kv`` is vLLM's
``kv_cache_dtype``: ``auto`` -- its stock KV, the model's dtype --; eviction is not vLLM's and such runs are
refused by the caller). Each run is one in-process ``LLMEngine`` (``dtype`` from the job, bf16 by default as
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
import statistics
import sys
import time


def pct(xs, q):
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_one(job: dict, run: dict) -> dict:
    from vllm import EngineArgs, LLMEngine, SamplingParams

    c, length = run["concurrency"], run["length"]
    new = job["warmup"] + job["steps"] + 1
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=job["model_dir"], dtype=job.get("dtype", "bfloat16"), max_num_seqs=max(c, 1),
        max_model_len=length + new + 16, kv_cache_dtype=run["kv"], enable_prefix_caching=False,
        seed=0,
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
    timed = decode[job["warmup"]:]
    row = {"mode": f"vllm {run['spec']}", "kind": "peer", "length": length, "concurrency": c,
           "steps": len(timed), "ms_median": float("nan"), "ms_q1": float("nan"), "ms_q3": float("nan"),
           "aggregate_tok_s": 0.0, "ratio_to_dynamic": None, "bytes_per_stream": None, "cache_bytes": None,
           "note": f"{job.get('dtype', 'bfloat16')}, KV {run['kv']}"
           + (f"; every prefill done at {first_all:.1f} s" if first_all is not None else "")}
    if not timed:
        row["note"] += "; no decode step with every stream running (raise --steps)"
        return row
    med = statistics.median(timed)
    row.update(ms_median=med * 1e3, ms_q1=pct(timed, 25) * 1e3, ms_q3=pct(timed, 75) * 1e3,
               aggregate_tok_s=c / med, itl_p50_ms=med * 1e3, itl_p90_ms=pct(timed, 90) * 1e3,
               itl_p99_ms=pct(timed, 99) * 1e3)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    with open(a.job) as f:
        job = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: steps timed here
    rows = []
    for run in job["runs"]:
        try:
            rows.append(run_one(job, run))
        except Exception as e:  # noqa: BLE001 - one run that does not go is a note in its row
            rows.append({"mode": f"vllm {run['spec']}", "kind": "peer", "length": run["length"],
                         "concurrency": run["concurrency"], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
