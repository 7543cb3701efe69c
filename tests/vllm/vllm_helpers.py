"""Running vLLM on the embedded model for tests/vllm: one engine at a time in this process, the stock backend in a
child process (``VLLM_PLUGINS=none``: kvslim's plugin left out), teacher forcing that records full logits.

Run as a script (:func:`main`) it starts one engine, runs :func:`run` and saves the result: that is how the stock
backend runs, in a process of its own.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch

#: Engine settings of every test engine: eager, offline, small KV space, in-process.
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
MAX_MODEL_LEN = 512
#: Tokens vLLM schedules per step: a prompt longer than this is prefilled in chunks, each continuing over the
#: pages the previous chunks wrote (chunked prefill), in the same steps as other requests' decodes.
MAX_BATCHED_TOKENS = 64
#: The text segments and the long prompt come from here (tests/data: the GPL, whose license permits verbatim copies).
TEXT = Path(__file__).parents[1] / "data" / "GPL-3.txt"
#: Greedy prompts: short ones, and one of ~250 tokens: prefilled in chunks (> MAX_BATCHED_TOKENS), and long enough
#: to fill a 128-token block that vLLM's prefix cache keeps.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors of the rainbow:",
    TEXT.read_text(encoding="utf-8")[:1100] + "\n\nIn one sentence, the GNU GPL is",
]
GREEDY_TOKENS = 8

#: Logits recorded by :class:`ForceTokens`, by request tag: a list of (V,) float32 rows, one per step.
RECORDED: dict[str, list[torch.Tensor]] = {}


def _logits_processor_base():
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return LogitsProcessor


def make_force_tokens():
    """The teacher-forcing logits processor class (built lazily: it subclasses vLLM's).

    A request with ``extra_args={"force": [ids...], "tag": name}`` records its raw logits at each decode step
    (the model's next-token distribution given the forced tokens so far) and then allows only the next forced
    token, so greedy decoding feeds exactly the text: vLLM's own decode path, one token a step, as kvslim eval's
    teacher forcing does."""

    class ForceTokens(_logits_processor_base()):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.rows: dict[int, tuple[list[int], str, list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update):
            if batch_update is None:
                return
            for i in batch_update.removed:
                self.rows.pop(i, None)
            for i, params, _prompt, output in batch_update.added:
                extra = (params.extra_args or {}) if params is not None else {}
                if "force" in extra:
                    self.rows[i] = (extra["force"], extra["tag"], output)
                else:
                    self.rows.pop(i, None)
            for a, b, direction in batch_update.moved:
                ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
                if ra is not None:
                    self.rows[b] = ra
                if rb is not None and direction.name == "SWAP":
                    self.rows[a] = rb

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for i, (force, tag, output) in self.rows.items():
                step = len(output)
                # by step: a chunked prefill's partial steps are sampled too (and discarded), then overwritten
                steps = RECORDED.setdefault(tag, [])
                del steps[step:]
                steps.append(logits[i].float().clone())
                token = force[min(step, len(force) - 1)]
                logits[i] = float("-inf")
                logits[i, token] = 0.0
            return logits

    return ForceTokens


def converted_model_dir() -> str:
    """The embedded model's converted HF directory (converted by kvslim on first use)."""
    from kvslim.models import converted_dir, load_model
    from kvslim.models.sources import embedded_gguf_path

    path = converted_dir(embedded_gguf_path())
    if not (path / "config.json").is_file():
        load_model(None)  # converts and saves the copy
    return str(path)


def start(spec: str | None, dtype: str = "float32", **overrides):
    """An in-process engine on the embedded model; spec None: no kvslim spec (vLLM's own backend runs, the plugin
    loaded or not); overrides: more of vLLM's engine arguments."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM

    extra = {} if spec is None else {"additional_config": {"kvslim": spec}}
    args = {
        "enforce_eager": True,
        "dtype": dtype,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": MAX_BATCHED_TOKENS,
        "seed": 0,
        "logits_processors": [make_force_tokens()],
        **extra,
        **overrides,
    }
    return LLM(model=converted_model_dir(), **args)


def stop(llm) -> None:
    """Shut an in-process engine down so that the next one can start in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def capacity(llm) -> int:
    """Tokens vLLM's KV-cache manager holds (its start-up count: blocks x block size)."""
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size


def staging_slots(llm) -> int:
    """Staging slots per layer of this engine's kvslim backend (max_num_seqs unless $KVSLIM_VLLM_STAGED_SLOTS)."""
    from kvslim.vllm.staging import slots_from_env

    return slots_from_env(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)


def staged_capacity(llm) -> int:
    """:func:`capacity` with kvslim's staging pools counted (kvslim.vllm.staging): vLLM's count less the blocks
    that the pools' bytes would fill in kvslim's pages (the pools live outside vLLM's KV space). Lossless pages
    (no staging) and stock vLLM: :func:`capacity`."""
    import torch

    from kvslim.vllm.pages import PageLayout
    from kvslim.vllm.spec import from_sources, given
    from kvslim.vllm.staging import pool_bytes

    vc = llm.llm_engine.vllm_config
    if not given(vc.additional_config):
        return capacity(llm)
    mc = vc.model_config
    cfg = from_sources(vc.additional_config)
    layers, heads, d = (
        mc.get_num_layers(vc.parallel_config),
        mc.get_num_kv_heads(vc.parallel_config),
        mc.get_head_size(),
    )
    layout = PageLayout.of(cfg.k_format, cfg.v_format, d, mc.dtype)
    slots = staging_slots(llm)
    if layout.k.family == "cast" and layout.v.family == "cast" or slots == 0:
        return capacity(llm)
    pool = pool_bytes(slots, layers, heads, d, torch.empty(0, dtype=mc.dtype).element_size())
    block = vc.cache_config.block_size
    lost = -(-pool // (layers * heads * layout.row_bytes * block)) * block
    return capacity(llm) - lost


def run(llm, segments: list[list[int]], prefill: int, greedy: bool = True) -> dict:
    """Teacher forcing of ``segments``, one at a time (prefill ``prefill`` tokens in one step, then their tokens
    forced one a step: as ``kvslim eval`` scores kvslim's cache; in a batch with the long prompt, vLLM's scheduler
    could split a segment's prefill into chunks, and a later chunk attends on the earlier ones' codes, which
    kvslim's own prefill never does), then one batch of greedy decoding of :data:`PROMPTS` (the long one prefilled
    in chunks next to the others' decodes), then a rerun of the long prompt.

    Returns tokens / texts (greedy, per prompt), logits (the forced segments' raw next-token logits, (sum of n, V)
    float32, segment after segment), rerun (the long prompt's tokens again) and rerun_cached (the prompt tokens
    the rerun found in vLLM's prefix cache)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if prefill > MAX_BATCHED_TOKENS:
        raise ValueError(f"prefill {prefill} > MAX_BATCHED_TOKENS {MAX_BATCHED_TOKENS}: vLLM would chunk it")
    for j, seg in enumerate(segments):
        RECORDED.pop(f"seg{j}", None)
        force = {"force": seg[prefill:], "tag": f"seg{j}"}
        forced = SamplingParams(
            max_tokens=len(seg) - prefill, temperature=0, ignore_eos=True, extra_args=force
        )
        llm.generate([TokensPrompt(prompt_token_ids=seg[:prefill])], [forced], use_tqdm=False)
    logits = (
        torch.cat([torch.stack(RECORDED.pop(f"seg{j}")) for j in range(len(segments))])
        if segments
        else torch.empty(0)
    )
    if not greedy:
        return {"logits": logits}
    params = [SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0)] * len(PROMPTS)
    outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    again = llm.generate(PROMPTS[-1:], params[:1], use_tqdm=False)[0]
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs[: len(PROMPTS)]],
        "texts": [o.outputs[0].text for o in outs[: len(PROMPTS)]],
        "logits": logits,
        "rerun": list(again.outputs[0].token_ids),
        "rerun_cached": again.num_cached_tokens or 0,
    }


def _kv_info(worker) -> list:
    """A worker's first KV cache tensor's dtype and shape (run on every rank by ``collective_rpc``): kvslim's pages are
    uint8 rows of the format's bytes, the stock backend's the model's dtype."""
    kv = worker.model_runner.kv_caches[0]
    return [str(kv.dtype), list(kv.shape)]


def main(argv: list[str]) -> None:
    """``SPEC DTYPE OUT``: one engine (``stock``: no kvslim spec), :func:`run` on the segments of
    ``$KVSLIM_TEST_SEGMENTS`` (JSON) with prefill ``$KVSLIM_TEST_PREFILL``; the result saved to OUT (torch.save).

    ``capacity DTYPE SPEC...``: start an engine per spec in turn and print vLLM's KV capacity (tokens) of each
    (``stock`` needs ``VLLM_PLUGINS=none``; docs/vllm.md).

    ``tp SIZE SPEC OUT``: an engine of SIZE tensor-parallel workers (multiprocess; ``VLLM_CPU_OMP_THREADS_BIND``
    from the environment), three prompts x 32 greedy tokens (``ignore_eos``); the token ids and each rank's first KV
    cache tensor's dtype and shape (:func:`_kv_info`) saved to OUT (JSON)."""
    if argv[0] == "tp":
        from vllm import SamplingParams

        spec = None if argv[2] == "stock" else argv[2]
        llm = start(spec, logits_processors=[], tensor_parallel_size=int(argv[1]), distributed_executor_backend="mp")
        try:
            prompts = ["The capital of France is", "def fibonacci(n):", "Colors of the rainbow:"]
            res = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
            ranks = llm.collective_rpc(_kv_info)
            Path(argv[3]).write_text(json.dumps({"tokens": [list(r.outputs[0].token_ids) for r in res], "ranks": ranks}))
        finally:
            stop(llm)
        return
    if argv[0] == "capacity":
        for spec in argv[2:]:
            llm = start(None if spec == "stock" else spec, argv[1])
            print(
                f"capacity {spec} {argv[1]}: {capacity(llm)} tokens; with kvslim's staging pools counted "
                f"({staging_slots(llm)} slots): {staged_capacity(llm)}",
                flush=True,
            )
            stop(llm)
        return
    spec = None if argv[0] == "stock" else argv[0]
    llm = start(spec, argv[1])
    segments = json.loads(os.environ["KVSLIM_TEST_SEGMENTS"])
    out = run(llm, segments, int(os.environ["KVSLIM_TEST_PREFILL"]))
    out["capacity"] = capacity(llm)
    torch.save(out, argv[2])
    print(
        f"{argv[0]} {argv[1]}: KV capacity {out['capacity']} tokens; greedy texts {out['texts']}", flush=True
    )


if __name__ == "__main__":
    main(sys.argv[1:])
