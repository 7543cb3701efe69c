"""The batch engine (kvslim.engine) and ragged decode steps (kvslim.cache.ragged, generate.forward_rows):
continuous batching is exact, admission keeps the budget, bad requests fail alone."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import blas_row_identity, family_model, tiny_model
from kvslim import SlimCache
from kvslim import generate as gen
from kvslim.engine import Engine, Request

#: (prompt length, cache spec): different lengths, formats, windows and levers in one batch
MIX = [
    (5, "none"),
    (37, "int4,sink=4,window=60"),
    (80, "int8,residual=32"),
    (120, "int2,sink=2,window=40"),
    (9, "q8_0,sink=4,window=50"),
    (200, "int4"),
    (64, "none,sink=4,window=30"),
    (17, "q4_0,sink=4,window=60,group=16,residual=16"),
]


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _requests(n_new: int = 24, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [
        Request(torch.randint(3, 128, (n,), generator=g).tolist(), max_new_tokens=n_new + 3 * i, cache=spec)
        for i, (n, spec) in enumerate(MIX)
    ]


def test_concurrent_greedy_equals_each_request_alone(model):
    """8 requests of different lengths and settings, at most 3 rows at once (so they join and leave at
    different steps, prefills interleaved with decode steps): every request's tokens equal the request run
    alone through the engine, and kvslim's single-stream greedy loop, token for token."""
    reqs = _requests()
    engine = Engine(model, max_batch=3, prefill_chunk=32)
    together = engine.run(reqs)
    assert engine.steps > max(r.max_new_tokens for r in reqs)  # really interleaved, not one at a time
    for req, got in zip(reqs, together, strict=True):
        alone = Engine(model, prefill_chunk=32).run([req])[0]
        assert got.tokens == alone.tokens, req.cache.to_spec()
        cache = SlimCache.from_config(req.cache, config=model.config)
        single = gen.greedy(model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=32)
        assert got.tokens == single, req.cache.to_spec()
        assert got.finish_reason == "length" and len(got.tokens) == req.max_new_tokens


@pytest.mark.parametrize(
    "route",
    ["auto", pytest.param("torch", marks=blas_row_identity), "onednn", "packed", pytest.param("mkl", marks=blas_row_identity),
     "kvslim"],
)
def test_ragged_rows_are_bit_identical_whatever_shares_the_step(model, route):
    """forward_rows, the linear layers on each route (kvslim.engine.linears): a row's logits do not depend on the
    other rows (filler rows pad small steps). ``auto``, the engine's default, holds it on every CPU (torch's route
    only where its BLAS rounds a row alike at every row count)."""
    from kvslim.engine.linears import Linears, kvslim_ready, mkl_ready, onednn_ready

    if route in ("onednn", "packed") and not onednn_ready() or route == "mkl" and not mkl_ready() or (
        route == "kvslim" and not kvslim_ready()
    ):
        pytest.skip(f"this torch cannot run the {route} route")
    reqs = _requests()[:5]
    caches = [SlimCache.from_config(r.cache, config=model.config) for r in reqs]
    copies = [SlimCache.from_config(r.cache, config=model.config) for r in reqs]
    with torch.inference_mode(), Linears(model, route).routed():
        for r, c, d in zip(reqs, caches, copies, strict=True):
            gen.prefill(model, torch.tensor([r.prompt]), c)
            gen.prefill(model, torch.tensor([r.prompt]), d)
        together = gen.forward_rows(model, [7] * 5, caches)
        for b in range(5):
            alone = gen.forward_rows(model, [7], [copies[b]])
            assert torch.equal(alone[0], together[b])
        # without filler rows a lone row goes through another BLAS path: the padding is what makes it exact
        assert caches[0].get_seq_length() == len(reqs[0].prompt) + 1


def test_sampling_is_per_request_and_reproducible(model):
    reqs = [
        Request(list(range(3, 3 + n)), max_new_tokens=12, temperature=0.8, top_p=0.9, seed=s, cache="int4")
        for n, s in ((10, 1), (30, 2), (50, 3))
    ]
    together = Engine(model, max_batch=3).run(reqs)
    for req, got in zip(reqs, together, strict=True):
        assert Engine(model).run([req])[0].tokens == got.tokens


def test_stop_ids_end_a_request_and_others_go_on(model):
    base = _requests()[0]
    first = Engine(model).run([base])[0].tokens
    stop = first[3]
    reqs = [Request(base.prompt, max_new_tokens=20, stop_ids=[stop], cache=base.cache), _requests()[1]]
    a, b = Engine(model).run(reqs)
    assert a.finish_reason == "stop" and a.tokens == first[: first.index(stop) + 1]
    assert b.finish_reason == "length" and len(b.tokens) == reqs[1].max_new_tokens


def test_memory_budget_admits_what_fits_and_never_exceeds_it(model):
    reqs = [Request(list(range(3, 40)), max_new_tokens=30, cache="int4,sink=4,window=32") for _ in range(5)]
    one = Engine(model).run(reqs[:1])[0]
    assert 0 < one.cache_bytes <= one.reserved_bytes
    budget = 2 * one.reserved_bytes + one.reserved_bytes // 2  # room for two at a time
    engine = Engine(model, memory_budget=budget, max_batch=8)
    for r in reqs:
        engine.submit(r)
    most = 0
    while not engine.idle:
        engine.step()
        mem = engine.memory()
        most = max(most, mem["active"])
        assert mem["reserved_bytes"] <= budget and mem["cache_bytes"] <= mem["reserved_bytes"]
    assert most == 2
    assert all(res.tokens == one.tokens for res in engine.results.values())


def test_bad_requests_fail_alone_with_one_clear_error(model):
    engine = Engine(model, memory_budget=200_000)
    ok = engine.submit(Request(list(range(3, 20)), max_new_tokens=5, cache="int4"))
    cases = [
        (Request([3] * 4000, max_new_tokens=200, cache="none"), "past the model's context of 4096 tokens"),
        (Request([3] * 100, max_new_tokens=3000, cache="none"), "more than the whole memory budget"),
        (Request([3, 500], max_new_tokens=5), "outside the model's vocabulary"),
        (Request([3], max_new_tokens=5, cache="q4_0,k=q4_0"), None),  # head_dim 32: fine
        (Request([3], max_new_tokens=5, request_id="dup"), None),
        (Request([3], max_new_tokens=5, request_id="dup"), "already in use"),
    ]
    for req, message in cases:
        if message is None:
            engine.submit(req)
            continue
        with pytest.raises(ValueError, match=message):
            engine.submit(req)
    for bad, message in [
        (dict(prompt=[], max_new_tokens=5), "prompt must be a non-empty"),
        (dict(prompt=[1, -2], max_new_tokens=5), "token ids"),
        (dict(prompt=[1], max_new_tokens=0), "max_new_tokens"),
        (dict(prompt=[1], max_new_tokens=5, top_p=0), "top_p"),
        (dict(prompt=[1], max_new_tokens=5, cache="int9"), "int9"),
        (dict(prompt="hello", max_new_tokens=5), "sequence of token ids"),
    ]:
        with pytest.raises(ValueError, match=message):
            Request(**bad)
    results = {e.request_id for e in engine.events() if e.finished}
    assert ok in results and "dup" in results


def test_engine_refuses_what_it_cannot_serve_exactly():
    """RoPE whose frequencies follow the batch's longest position (dynamic NTK, longrope) would make one row
    change the others; a seed beyond a generator's range is refused with the request, not mid-step."""
    dyn = kvslim.enable(tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        Engine(dyn)
    with pytest.raises(ValueError, match="seed"):
        Request([3], max_new_tokens=2, temperature=1.0, seed=2**64)


def test_windowed_requests_past_the_context_need_bounded_position_ids(model):
    """A window keeps the cache bounded, but past the model's context only re-based position ids stay inside
    it: the tiny model's context is 4096 and its re-base period 4096, so ids could reach 4096 + a chunk."""
    engine = Engine(model, prefill_chunk=64)
    with pytest.raises(ValueError, match="position ids are not kept bounded"):
        engine.submit(Request([3] * 100, max_new_tokens=4050, cache="int4,sink=4,window=60"))
    engine.submit(Request([3] * 100, max_new_tokens=3000, cache="int4,sink=4,window=60"))


def test_settings_the_model_cannot_take_are_refused_at_submit():
    small = kvslim.enable(tiny_model("llama", hidden_size=64))  # head_dim 16
    engine = Engine(small)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):
        engine.submit(Request([3, 4], max_new_tokens=2, cache="q4_0"))
    assert engine.run([Request([3, 4], max_new_tokens=2, cache="int4")])[0].finish_reason == "length"


def test_cancel_frees_the_row(model):
    engine = Engine(model, max_batch=2)
    a = engine.submit(Request(list(range(3, 30)), max_new_tokens=50, cache="int4"))
    b = engine.submit(Request(list(range(3, 30)), max_new_tokens=5, cache="int4"))
    engine.step()
    engine.step()
    assert engine.cancel(a) and not engine.cancel("nobody")
    events = list(engine.events())
    final = [e for e in events if e.request_id == a]
    assert final and final[0].finish_reason == "cancelled" and final[0].token is None
    assert engine.results[b].finish_reason == "length"
    assert engine.memory()["reserved_bytes"] == 0


def test_models_without_kv_in_every_layer_are_refused():
    model = family_model("qwen3_next")
    with pytest.raises(ValueError, match="every layer stores K/V"):
        Engine(model)


# -- bounded storage ------------------------------------------------------------------------------


def test_bounded_cache_allocates_its_capacity_once():
    """sink 4 + window 1020, int4, KV of the embedded model's shape (3 heads x 64): after the cache is full
    its bytes never change, stay within 5% of the stored tokens' bytes at their largest (just before a
    group leaves the residual), and never exceed projected_nbytes."""
    m = kvslim.enable(tiny_model("llama", hidden_size=192, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=1))
    cache = SlimCache(kv_quantize="int4", sink=4, window=1020, config=m.config)
    assert cache.report()["residual"] == 128  # auto: min(128, window / 4) in whole groups
    sizes, lives = [], []
    with torch.inference_mode():
        gen.prefill(m, torch.randint(3, 128, (1, 1500)), cache, chunk_size=512)
        for i in range(80):
            gen.decode_one_token(m, torch.tensor([[3 + i % 100]]), cache)
            sizes.append(cache.nbytes())
            lives.append(cache.live_nbytes())
    assert len(set(sizes)) == 1
    assert sizes[0] <= 1.05 * max(lives)
    assert sizes[0] <= cache.projected_nbytes(1580)


def test_residual_auto_follows_the_window():
    from kvslim.config import CacheConfig

    assert CacheConfig(kv_quantize="int4").residual_tokens == 128
    assert CacheConfig(kv_quantize="int4", window=1020).residual_tokens == 128
    assert CacheConfig(kv_quantize="int4", window=124).residual_tokens == 0
    assert CacheConfig(kv_quantize="int4", window=300).residual_tokens == 64
    assert CacheConfig(kv_quantize="int4", window=32, residual=32).residual_tokens == 32  # explicit wins
    assert CacheConfig(kv_quantize="int4", residual="auto").to_spec() == "int4"


@pytest.mark.parametrize(("window", "group"), [(60, 32), (124, 32), (500, 32), (32, 16), (16, 8)])
def test_every_lossy_bounded_cache_is_smaller_than_fp16(window, group):
    """With residual auto the window is mostly encoded: a bounded int4 cache is smaller than an fp16 cache
    of the same tokens for every window of at least two groups (with the old default residual of 128,
    windows up to 160 encoded nothing and cost 1.10x fp16). A window shorter than that keeps up to a group
    at full precision beside it (known gap: window 32 with group 32 is 1.3x fp16)."""
    m = kvslim.enable(tiny_model("llama", hidden_size=192, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=1))
    cache = SlimCache(kv_quantize="int4", sink=4, window=window, group_size=group, config=m.config)
    with torch.inference_mode():
        gen.prefill(m, torch.randint(3, 128, (1, 20)), cache)
        for i in range(window + 40):
            gen.decode_one_token(m, torch.tensor([[3 + i % 100]]), cache)
    assert cache.nbytes() < cache.fp16_full_cache_bytes(cache.stored_tokens())


@pytest.mark.slow
def test_engine_on_the_real_model(real_model):
    """The embedded model: 8 concurrent greedy requests, joining at different steps, each equal to the request
    decoded alone by kvslim's single-stream loop."""
    model, tok = real_model
    kvslim.enable(model)
    text = "The night sky is full of stars, planets and distant galaxies. " * 6
    ids = tok(text)["input_ids"]
    specs = ["int4,sink=4,window=64", "q4_0", "none", "int8,sink=4,window=100", "int2", "int4", "q8_0", "none,sink=4,window=40"]
    reqs = [Request(ids[: 10 + 9 * i], max_new_tokens=16 + 2 * i, cache=s) for i, s in enumerate(specs)]
    got = Engine(model, max_batch=4, prefill_chunk=32).run(reqs)
    for req, res in zip(reqs, got, strict=True):
        cache = SlimCache.from_config(req.cache, config=model.config)
        single = gen.greedy(model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=32)
        assert res.tokens == single, req.cache.to_spec()


def test_concurrency_bench_rows(model):
    """kvslim.bench.concurrency: one row per mode, length and concurrency, with the JSON keys the docs
    name; transformers' continuous batching runs here or says why not."""
    from kvslim.bench.concurrency import render_concurrency, run_concurrency
    from kvslim.bench.modes import build_modes

    modes, _ = build_modes(model, ["int4", "q4_0,sink=4,window=28"])
    rows = run_concurrency(model, modes, [40], [1, 3], steps=2, warmup=1, continuous_batching=False)
    assert [(r.mode, r.concurrency) for r in rows] == [
        (m, c) for c in (1, 3) for m in ("dynamic", "int4", "q4_0,sink=4,window=28")
    ]
    for r in rows:
        d = r.to_dict()
        assert {"mode", "length", "concurrency", "aggregate_tok_s"} <= set(d) and d["length"] == 40
        assert r.aggregate_tok_s > 0 or r.note
    bounded = [r for r in rows if r.mode.startswith("q4_0")]
    assert bounded[0].bytes_per_stream == bounded[1].bytes_per_stream  # per stream, whatever the concurrency
    assert "agg tok/s" in render_concurrency(rows)


@pytest.mark.slow
def test_concurrency_bench_runs_transformers_continuous_batching(model):
    """The peer: transformers' generate_batch (about 30 s of set-up even for a tiny model)."""
    from kvslim.bench.concurrency import measure_concurrency
    from kvslim.bench.modes import build_modes

    modes, _ = build_modes(model, ["int4"])
    rows = measure_concurrency(model, modes, 40, 3, 2, warmup=1)
    peer = rows[-1]
    assert peer.mode == "continuous-batching" and peer.aggregate_tok_s > 0, peer.note
    assert model.config._attn_implementation == "kvslim"  # the peer's attention switch is undone
