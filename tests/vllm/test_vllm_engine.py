"""vLLM itself, with kvslim's plugin, on the embedded model's converted directory (make vllm-test).

One engine per spec for the whole module, in this process (eager, offline, VLLM_CPU_KVCACHE_SPACE=1), and the stock
backend once in a child process with the plugin left out (VLLM_PLUGINS=none). Every engine runs the same batch
(:func:`vllm_helpers.run`): greedy prompts, one long enough to be prefilled in chunks alongside the others'
decode steps, and teacher-forced text segments whose full logits are recorded each step; then the long prompt
again, which continues from vLLM's prefix cache.

- ``none`` in fp32 equals the stock CPU backend token for token, and its logits are the stock logits;
- q4_0 pages hold the same bytes as kvslim's own q4_0 cache, and through vLLM give the KL divergence kvslim's
  own cache gives on the same text (both against the transformers model without a cache);
- capacity: vLLM's own count at start-up, q4_0 / int8 against the stock bf16 pages;
- a bad spec fails at engine start with kvslim's one-line message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# vllm.version, not vllm: without vLLM installed, "vllm" resolves to this directory (tests/ is on sys.path)
pytest.importorskip(
    "vllm.version", reason="vLLM is not installed (make vllm builds .venv-vllm; make vllm-test runs these)"
)

import vllm_helpers as helpers  # noqa: E402  (tests/vllm on sys.path: rootdir-relative test imports)

pytestmark = pytest.mark.slow

PREFILL, FORCED = 24, 16
#: The specs run in this process, one engine each (None: no kvslim spec, so vLLM's own backend runs).
SPECS = ("none", "q4_0", "int8", "q4_0,rotate=none", "fp8", None)


def _kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    from kvslim.evaluate.perplexity import kl_from_log_probs

    return kl_from_log_probs(
        torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    )


@pytest.fixture(scope="module")
def reference():
    """The text segments, the transformers model's logits for them without a cache, and kvslim's own caches' KL
    (teacher-forced through a SlimCache, as ``kvslim eval`` measures; residual 0 and group 1: every token encoded
    as it arrives, as in a vLLM page — with kvslim's default group of 32, residual 0 still keeps up to 31 newest
    tokens at full precision until their group fills)."""
    from kvslim.config import parse_spec
    from kvslim.evaluate.modes import cache_maker
    from kvslim.evaluate.perplexity import perplexity_through_cache
    from kvslim.models import load_model
    from kvslim.vllm import basis

    model, tokenizer = load_model(None)
    ids = tokenizer(helpers.TEXT.read_text(encoding="utf-8")).input_ids
    segments = [ids[s : s + PREFILL + FORCED] for s in (0, 400, 1200)]
    make = cache_maker(model, None)
    with torch.inference_mode():
        logits = [model(torch.tensor([s])).logits[0, PREFILL - 1 : -1].float() for s in segments]
        own = {}
        # rotate=auto (Hadamard, as the pages' own auto: kvslim.vllm.basis) or none; group=1: every token encoded as
        # it arrives, as a page is; "g32": kvslim's default group, its newest <= 31 tokens at full precision
        owns = (
            ("q4_0", "q4_0,group=1,rotate=none"),
            ("q8_0", "q8_0,group=1,rotate=none"),
            ("q4_0,g32", "q4_0" if basis.AUTO else "q4_0,rotate=none"),
            ("q4_0,g32,rotate=none", "q4_0,rotate=none"),
            ("fp8,g32", "fp8" if basis.AUTO else "fp8,rotate=none"),
        )
        for name, spec in owns:
            own[name] = torch.cat(
                [
                    perplexity_through_cache(
                        model,
                        torch.tensor([s]),
                        # sink=0: pages keep no sink page unless asked (sink=auto is none in vLLM)
                        lambda spec=spec: make(parse_spec(f"{spec},residual=0,sink=0")),
                        prefill=PREFILL,
                        reference_logits=ref,
                        progress=False,
                    ).kld
                    for s, ref in zip(segments, logits)
                ]
            )
    return {"segments": segments, "logits": torch.cat(logits), "own_kl": own}


@pytest.fixture(scope="module")
def stock(reference, tmp_path_factory):
    """The stock CPU backend (kvslim's plugin left out) on the same batch, in a child process."""
    out = tmp_path_factory.mktemp("stock") / "stock.pt"
    env = {
        **os.environ,
        "VLLM_PLUGINS": "none",
        "KVSLIM_TEST_SEGMENTS": json.dumps(reference["segments"]),
        "KVSLIM_TEST_PREFILL": str(PREFILL),
    }
    helper = Path(helpers.__file__)
    proc = subprocess.run(
        [sys.executable, str(helper), "stock", "float32", str(out)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


class _Engines(dict):
    """Each spec's :func:`vllm_helpers.run` result and capacity, its engine started in this process the first time a
    test asks for the spec, and shut down before the next one starts (so ``-k`` runs only the engines it needs)."""

    def __init__(self, segments):
        super().__init__()
        self.segments = segments

    def __missing__(self, spec):
        assert spec in SPECS, spec
        llm = helpers.start(spec)
        try:
            result = helpers.run(llm, self.segments, PREFILL)
            result["capacity"] = helpers.capacity(llm)
            result["staged_capacity"] = helpers.staged_capacity(llm)
        finally:
            helpers.stop(llm)
        self[spec] = result
        return result


@pytest.fixture(scope="module")
def engines(reference):
    """Each spec's engine, in this process, on first use: its :func:`vllm_helpers.run` result and capacity."""
    return _Engines(reference["segments"])


def test_none_fp32_is_the_stock_backend_token_for_token(engines, stock):
    ours = engines["none"]
    assert ours["tokens"] == stock["tokens"]
    assert ours["rerun"] == stock["rerun"] == stock["tokens"][-1]
    kl = _kl(stock["logits"], ours["logits"])
    assert kl.max() < 1e-6, kl.max()
    assert ours["logits"].argmax(-1).tolist() == stock["logits"].argmax(-1).tolist()


def test_without_a_spec_the_plugin_leaves_vllms_own_backend(engines, stock):
    ours = engines[None]
    assert ours["capacity"] == stock["capacity"]
    assert ours["tokens"] == stock["tokens"]
    assert torch.equal(ours["logits"], stock["logits"])  # the same kernel: bit for bit


def test_prefix_cache_and_chunked_prefill_continue_over_kvslim_pages(engines):
    """The long prompt (> MAX_BATCHED_TOKENS) was prefilled in chunks; its rerun found its first pages cached.

    Lossless pages give the same tokens again. Lossy pages need not: which of a prompt's tokens a later token saw at
    full precision (its own chunk, a staged partly filled page) or on codes depends on where the chunks fell, and
    the rerun's chunks fall elsewhere (it starts at the cached 128 tokens, alone); so the rerun starts like the
    first run (here 5 of 8 greedy tokens agree for q4_0) rather than equal it token for token."""
    for spec in ("none", "q4_0", "int8"):
        r = engines[spec]
        assert r["rerun_cached"] >= 128, (spec, r["rerun_cached"])
        if spec == "none":
            assert r["rerun"] == r["tokens"][-1], spec
        else:
            assert r["rerun"][:4] == r["tokens"][-1][:4], (spec, r["rerun"], r["tokens"][-1])


def test_a_request_on_reused_page_ids_gives_the_same_logits_bit_for_bit(reference):
    """vLLM reuses freed block ids; a freed partly filled page keeps its staging slot until its id starts a page
    again. q4_0 on a KV pool of 3 usable blocks (override 4: block 0 is vLLM's null block) with prefix caching off:
    a 64-token prompt (two whole pages filled in its one prefill step) teacher-forced for 16 tokens; then the three
    short greedy prompts, which take all three blocks and leave each block's first page partly filled and staged;
    then the 64-token prompt again, whose block is now one of those: its prefill fills the stale staged page in one
    step. The same logits bit for bit, so no stale staged copy was read."""
    from vllm import SamplingParams

    ids = [t for s in reference["segments"] for t in s][: 64 + FORCED]
    llm = helpers.start("q4_0", num_gpu_blocks_override=4, max_model_len=128, enable_prefix_caching=False)
    try:
        first = helpers.run(llm, [ids], 64, greedy=False)["logits"]
        llm.generate(list(helpers.PROMPTS[:3]), SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        again = helpers.run(llm, [ids], 64, greedy=False)["logits"]
    finally:
        helpers.stop(llm)
    assert first.shape[0] == FORCED and torch.equal(again, first)


def test_lossy_pages_give_coherent_text(engines, stock):
    colors = ("red", "orange", "yellow", "green", "blue", "indigo", "violet", "purple")
    for spec in ("q4_0", "int8", "fp8"):
        texts = engines[spec]["texts"]
        assert "Paris" in texts[0], (spec, texts)
        assert "if" in texts[1] or "return" in texts[1], (spec, texts)
        assert any(c in texts[2].lower() for c in colors) or texts[2] == stock["texts"][2], (spec, texts)


def test_kl_through_vllm_is_kvslims_own_on_the_same_codes(engines, stock, reference):
    """q4_0 through vLLM within 10% of kvslim's own default q4_0 (group 32: a partly filled group of up to 31
    newest tokens unencoded): the backend keeps a partly filled page staged at full precision (kvslim.vllm.staging)
    and attends a step's own tokens on their raw K/V (docs/vllm.md)."""
    ref = reference["logits"]
    stock_kl = _kl(ref, stock["logits"]).mean().item()  # vLLM's model against transformers', no quantization
    q4 = _kl(ref, engines["q4_0"]["logits"]).mean().item()
    own = reference["own_kl"]["q4_0,g32"].mean().item()
    q4_plain = _kl(ref, engines["q4_0,rotate=none"]["logits"]).mean().item()
    own_plain = reference["own_kl"]["q4_0,g32,rotate=none"].mean().item()
    int8 = _kl(ref, engines["int8"]["logits"]).mean().item()
    print(
        f"\nKL vs transformers (mean over {ref.shape[0]} forced tokens): stock vLLM {stock_kl:.2e}, "
        f"kvslim-in-vLLM q4_0 {q4:.4f} (rotate=none {q4_plain:.4f}), kvslim's own q4_0 (default group 32) {own:.4f} "
        f"(rotate=none {own_plain:.4f}), kvslim-in-vLLM int8 "
        f"{int8:.5f}, kvslim's own q8_0 group 1 {reference['own_kl']['q8_0'].mean().item():.5f}, kvslim's own "
        f"q4_0 group 1 (every token encoded as it arrives) {reference['own_kl']['q4_0'].mean().item():.4f}"
    )
    # per forced token (rows: segments): the forced token i is read at position PREFILL - 1 + i
    per_vllm = _kl(ref, engines["q4_0"]["logits"]).view(-1, FORCED)
    per_own = reference["own_kl"]["q4_0,g32"].view(-1, FORCED)
    for name, per in (("kvslim-in-vLLM q4_0", per_vllm), ("kvslim's own q4_0", per_own)):
        print(
            f"{name} per forced token:\n"
            + "\n".join(" ".join(f"{x:.3f}" for x in row) for row in per.tolist())
        )
    assert stock_kl < 0.1 * own
    assert q4 <= 1.10 * own, (q4, own)
    assert q4_plain <= 1.10 * own_plain, (q4_plain, own_plain)
    assert int8 < q4
    # every key at full precision until the first page fills (the prompt's 24 tokens and the next ones, staged),
    # including the step of its 32nd token (position 31, forced token 8): as exact as stock vLLM; then its codes
    full = 32 - PREFILL + 1
    assert per_vllm[:, :full].max() < 1e-6, per_vllm[:, :full]
    assert (per_vllm[:, full:].mean(1) > 1e-3).all()


def test_fp8_pages_through_vllm_are_kvslims_own_fp8(engines, reference):
    """fp8 pages (kvslim's fp8: e4m3 codes and a per-token fp32 scale, Hadamard-rotated by default) through vLLM
    within 10% of kvslim's own fp8 cache on the same tokens, and far below q4_0's KL."""
    ref = reference["logits"]
    fp8 = _kl(ref, engines["fp8"]["logits"]).mean().item()
    own = reference["own_kl"]["fp8,g32"].mean().item()
    q4 = _kl(ref, engines["q4_0"]["logits"]).mean().item()
    print(f"\nKL vs transformers: kvslim-in-vLLM fp8 {fp8:.5f}, kvslim's own fp8 {own:.5f}, kvslim-in-vLLM q4_0 {q4:.4f}")
    assert fp8 <= 1.10 * own + 1e-6, (fp8, own)
    assert fp8 < 0.5 * q4, (fp8, q4)


def test_capacity_is_vllms_own_count(engines, stock):
    fp32 = stock["capacity"]
    assert engines["none"]["capacity"] == fp32  # same bytes per token, same count
    bf16 = 2 * fp32  # stock bf16 pages are half its fp32 pages (docs/vllm.md has vLLM's own bf16 count)
    q4, int8 = engines["q4_0"], engines["int8"]
    print(
        f"\ncapacity (tokens) in 1 GiB: stock fp32 {fp32}, q4_0 {q4['capacity']} ({q4['capacity'] / bf16:.2f}x bf16; "
        f"{q4['staged_capacity'] / bf16:.2f}x with the staging pools counted), int8 {int8['capacity']} "
        f"({int8['capacity'] / bf16:.2f}x bf16; {int8['staged_capacity'] / bf16:.2f}x with the pools counted)"
    )
    assert engines["none"]["staged_capacity"] == fp32  # lossless pages: no staging pool
    assert q4["capacity"] >= 3.5 * bf16
    assert int8["capacity"] >= 1.9 * bf16  # symmetric int8 pages: 66 bytes per role at D = 64
    # the pools (64 slots: max_num_seqs here) cost whole blocks of pages: fp32 K+V of 64 x 32 tokens per layer/head
    for r, row in ((q4, 72), (int8, 132)):
        pool_tokens = 64 * 32 * 2 * 64 * 4 // row
        assert r["capacity"] - pool_tokens - 128 < r["staged_capacity"] <= r["capacity"] - pool_tokens


def test_a_bad_spec_fails_at_engine_start_in_one_line(engines):
    with pytest.raises(Exception) as e:
        helpers.start("q4_0,window=64")
    text = str(e.value)
    assert "kvslim: window=64 is not supported in vLLM" in text, text
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def test_a_layers_kv_is_rotated_once_a_step(monkeypatch):
    """do_kv_cache_update rotates the step's K/V into the pages' basis; forward, handed the same tensors, takes
    what it rotated instead of rotating them again: one rotation per layer and step, not two. The text is the one
    the engine gives with forward rotating them again itself."""
    from vllm import SamplingParams

    from kvslim.vllm import backend
    from kvslim.vllm.basis import PageBasis

    calls = {"stored": 0, "update": 0, "forward": 0}
    stored, update, forward = PageBasis.stored, backend.KvslimCPUImpl.do_kv_cache_update, backend.KvslimCPUImpl.forward

    def count(name, fn):
        def counted(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return counted

    monkeypatch.setattr(PageBasis, "stored", count("stored", stored))
    monkeypatch.setattr(backend.KvslimCPUImpl, "do_kv_cache_update", count("update", update))
    monkeypatch.setattr(backend.KvslimCPUImpl, "forward", count("forward", forward))
    params = SamplingParams(max_tokens=helpers.GREEDY_TOKENS, temperature=0)
    llm = helpers.start("q4_0")
    try:
        once = [o.outputs[0].token_ids for o in llm.generate(list(helpers.PROMPTS[:3]), params, use_tqdm=False)]
        counted = dict(calls)
        # forward rotating again, as before: the same tokens
        monkeypatch.setattr(backend.KvslimCPUImpl, "_in_basis", _rotate_always)
        twice = [o.outputs[0].token_ids for o in llm.generate(list(helpers.PROMPTS[:3]), params, use_tqdm=False)]
    finally:
        helpers.stop(llm)
    assert counted["update"] > 0 and counted["forward"] >= counted["update"], counted
    assert counted["stored"] == counted["update"], counted  # none of forward's calls rotated again
    assert once == twice


def _rotate_always(self, key, value, layer_idx, keep=False):
    keys, values, _ = self.basis.stored(key, value, layer_idx)
    return keys, values
