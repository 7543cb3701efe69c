"""Where a vLLM step's time goes with kvslim pages: cProfile of a small in-process engine on the embedded model.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 .venv-vllm/bin/python tests/vllm/paged_profile.py \
        --spec q4_0 --prompts 4 --length 512 --steps 8

``--spec stock`` runs vLLM's own backend (the plugin left out of the engine: no spec). The prefill steps and the
decode steps are profiled apart; for each, the step time and the shares of the functions that matter to the
backend (the attention kernel, the writes, the staging plan, the metadata, the rest of the layer) are printed,
then the top of the profile by own time. Load on the machine scales every share alike; absolute times are not
speed measurements.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

#: (label, function name as cProfile names it, file suffix): the shares printed.
WATCH = [
    ("kvp_attend / stock attention op", "attend", "kvslim/vllm/attend.py"),
    ("stock attention op", "cpu_attention_with_kv_cache", "_custom_ops.py"),
    ("page writes (encode + scatter)", "do_kv_cache_update", "kvslim/vllm/backend.py"),
    ("stock page writes", "do_kv_cache_update", "backends/cpu_attn.py"),
    ("backend forward (all of it)", "forward", "kvslim/vllm/backend.py"),
    ("staging plan", "plan", "kvslim/vllm/staging.py"),
    ("metadata build", "build", "kvslim/vllm/backend.py"),
    ("stock metadata build", "build", "backends/cpu_attn.py"),
    ("linear layers (matmuls)", "<built-in method torch._C._nn.linear>", "~"),
]


def shares(prof: cProfile.Profile, total: float) -> list[str]:
    st = pstats.Stats(prof)
    lines = []
    for label, name, suffix in WATCH:
        cum = 0.0
        for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in st.stats.items():
            if func == name and file.endswith(suffix):
                cum += ct
        if cum:
            lines.append(f"    {label:34s} {cum:8.3f} s  {100 * cum / total:5.1f}%")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="q4_0", help="a kvslim spec, or 'stock'")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))  # vllm_helpers, beside this script
    import vllm_helpers as helpers

    for k, v in helpers.ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams

    import kvslim

    print(f"kvslim from {kvslim.__file__}")
    extra = {} if a.spec == "stock" else {"additional_config": {"kvslim": a.spec}}
    llm = LLM(
        model=helpers.converted_model_dir(),
        enforce_eager=True,
        dtype="float32",
        seed=0,
        max_model_len=a.length + a.steps + 64,
        max_num_seqs=a.prompts,
        enable_prefix_caching=False,
        max_num_batched_tokens=a.length + a.prompts + 8,
        **extra,
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=a.steps + 2, ignore_eos=True, temperature=0.0)
    text = helpers.TEXT.read_text(encoding="utf-8")
    ids = llm.get_tokenizer()(text)["input_ids"]
    for i in range(a.prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids[i * 7 : i * 7 + a.length]}, params)
    phases = {"prefill": (cProfile.Profile(), []), "decode": (cProfile.Profile(), [])}
    got = {str(i): 0 for i in range(a.prompts)}  # tokens generated per request
    while engine.has_unfinished_requests():
        phase = "decode" if all(got.values()) else "prefill"  # until every prompt has its first token
        prof, times = phases[phase]
        t = time.perf_counter()
        prof.enable()
        outs = engine.step()
        prof.disable()
        times.append(time.perf_counter() - t)
        for o in outs:
            got[o.request_id] = len(o.outputs[0].token_ids)
    print(
        f"spec {a.spec}: {a.prompts} prompts x {a.length} tokens, float32, threads {os.environ.get('OMP_NUM_THREADS')}"
    )
    for phase, (prof, times) in phases.items():
        if not times:
            continue
        total = sum(times)
        print(f"  {phase}: {len(times)} steps, {total:.3f} s ({1e3 * total / len(times):.1f} ms a step)")
        print("\n".join(shares(prof, total)))
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print("\n".join(s.getvalue().splitlines()[6 : 8 + a.top]))


if __name__ == "__main__":
    main()
