"""Whole-run throughput of vLLM when its KV space is too small for every request at stock precision: stock KV
against kvslim's pages in the same space (issue 31: "≥ 1.5x once the stock backend's KV space is too small").

    PYTHONPATH=$PWD/src .venv-vllm/bin/python scripts/vllm_queue.py --kv-gib 0.75 --requests 16 --length 2048 \
        --new 256 --config none q4_0 --json out/queue.json

Each config runs in a child process of its own (vLLM's CPU worker keeps its memory until its process ends): one
``LLMEngine`` on the embedded model's converted directory, ``--dtype`` (float32: this CPU has no bf16
instructions), a fixed KV space of ``--kv-gib`` GiB (``kv_cache_memory_bytes``), ``--requests`` requests of the
same ``--length``-token prompt (GPL-3's text, tests/data) arriving at once, each generating ``--new`` tokens greedily
(``ignore_eos``), stepped by hand until every one is done. ``none`` runs vLLM's stock KV with kvslim's plugin left
out (``VLLM_PLUGINS=none``); any other spec runs kvslim's pages (``additional_config={"kvslim": spec}``).

Per config: vLLM's KV capacity in tokens (its start-up count), the most requests decoding at once, the wall time
from the first request added to the last token, the generated tokens per second over that whole run (what
vLLM's ``benchmark_throughput`` reports as output tokens/s), and the decode tokens per second over the steps in
which no prompt finished its prefill (a step may still carry the first few tokens of a prompt that the next step
finishes: the token budget is one prompt and the running requests' tokens). An untimed 64-token request first
pays the first-call costs. When the stock KV cannot hold every request, vLLM
runs the rest as earlier ones finish; kvslim's smaller pages hold more at once. Measure on a quiet machine, alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_one(a, spec: str) -> dict:
    from transformers import AutoTokenizer
    from vllm import EngineArgs, LLMEngine, SamplingParams

    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from vllm_helpers import converted_model_dir

    model_dir = converted_model_dir()
    text = (ROOT / "tests" / "data" / "GPL-3.txt").read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    prompt = (ids * (a.length // len(ids) + 1))[: a.length]
    extra = {} if spec == "none" else {"additional_config": {"kvslim": spec}}
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model_dir, dtype=a.dtype, max_num_seqs=a.requests, max_model_len=a.length + a.new + 16,
        max_num_batched_tokens=a.length + a.requests + 8, enable_prefix_caching=False, seed=0,
        kv_cache_memory_bytes=int(a.kv_gib * (1 << 30)), **extra,
    ))
    cache = engine.vllm_config.cache_config
    capacity = cache.num_gpu_blocks * cache.block_size
    # first-call costs (kernel builds, allocator) paid by an untimed request
    engine.add_request("warm-up", {"prompt_token_ids": prompt[:64]}, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(max_tokens=a.new, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    for i in range(a.requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    got = {str(i): 0 for i in range(a.requests)}
    done: set[str] = set()
    most = steps = decode_tokens = 0
    decode_s = 0.0
    while engine.has_unfinished_requests():
        before = dict(got)
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        for o in outs:
            got[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done.add(o.request_id)
        steps += 1
        most = max(most, sum(1 for r, n in got.items() if n >= 1 and r not in done))
        if not any(before[r] == 0 < got[r] for r in got):  # no prompt finished its prefill here: a decode step
            decode_s += dt
            decode_tokens += sum(got.values()) - sum(before.values())
    wall = time.perf_counter() - t0
    generated = sum(got.values())
    return {"config": spec, "capacity_tokens": capacity, "most_decoding": most, "wall_s": wall, "steps": steps,
            "generated": generated, "tok_s": generated / wall, "decode_s": decode_s, "decode_tokens": decode_tokens,
            "decode_tok_s": decode_tokens / decode_s if decode_s else float("nan")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", nargs="+", default=["none", "q4_0"])
    p.add_argument("--kv-gib", type=float, default=0.75)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # the child: run this one config
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.only is not None:
        with open(a.out, "w") as f:
            json.dump(run_one(a, a.only), f)
        return 0
    rows = []
    for spec in a.config:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": str(a.threads),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if spec == "none":
            env["VLLM_PLUGINS"] = "none"
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = tmp.name
        args = [sys.executable, __file__, "--only", spec, "--out", out, "--kv-gib", str(a.kv_gib), "--requests",
                str(a.requests), "--length", str(a.length), "--new", str(a.new), "--dtype", a.dtype]
        proc = subprocess.run(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        try:
            with open(out) as f:
                rows.append(json.load(f))
        except (OSError, ValueError):
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            rows.append({"config": spec, "error": f"exit {proc.returncode}: {tail[0][:300]}"})
        finally:
            os.remove(out)
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["config"] == "none" and "tok_s" in r), None)
    print(f"\n{a.requests} requests x {a.length} tokens, {a.new} new each, KV space {a.kv_gib} GiB, {a.dtype}, "
          f"{a.threads} threads")
    print(f"{'config':<10} {'KV tokens':>10} {'most decoding':>14} {'wall s':>8} {'tok/s':>8} {'x stock':>8} "
          f"{'decode tok/s':>13} {'x stock':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<10} {r['error']}")
            continue
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}" if base else "-"
        dratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}" if base else "-"
        print(f"{r['config']:<10} {r['capacity_tokens']:>10} {r['most_decoding']:>14} {r['wall_s']:>8.1f} "
              f"{r['tok_s']:>8.2f} {ratio:>8} {r['decode_tok_s']:>13.2f} {dratio:>8}")
    if a.json:
        settings = {k: getattr(a, k) for k in ("kv_gib", "requests", "length", "new", "dtype", "threads")}
        Path(a.json).write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
