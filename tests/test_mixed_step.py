"""Prefill mixed into the decode step (issue 30, item 2): a joining request's prompt chunks ride in the same
forward as every decoding row's token (generate.forward_step, kvslim.cache.ragged's packed layout), every row's
logits are bit for bit what they are in a step of its own, greedy output equals each request run alone, and a
bad prompt chunk in a mixed step ends only its row."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import blas_row_identity, family_model, tiny_model
from kvslim import SlimCache
from kvslim import generate as gen
from kvslim.engine import Engine, Request
from kvslim.engine.linears import Linears


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(model, spec: str):
    return SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)


class Forwards:
    """Counts the model's forwards (a forward pre-hook) and the tokens each carried."""

    def __init__(self, model):
        self.tokens: list[int] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.tokens.append(int(kwargs["input_ids"].shape[1]))

    def take(self) -> list[int]:
        got, self.tokens = self.tokens, []
        return got

    def close(self):
        self._handle.remove()


#: (cache spec, history fed before the step, chunk fed in it): chunks past FAST_MAX_QUERY (materialized K/V,
#: sdpa) and within it (Segments), first chunks (no history) and later ones, a window the chunk crosses,
#: lossy and lossless caches, a one-token chunk (the rows kernel's path, as a decode token)
CHUNKS = [
    ("int4", 0, 40),
    ("int4,sink=4,window=60", 50, 33),
    ("q8_0", 20, 12),
    ("none", 7, 16),
    ("int8,residual=32", 64, 1),
    ("int2,sink=2,window=40", 100, 64),
]


def test_prompt_chunks_and_decode_tokens_in_one_forward_are_bit_identical(model):
    """forward_step with 4 decode rows and 6 prompt chunks in ONE forward: every row's logits, and its cache's
    next decode step, equal the same row fed in a step of its own (torch.equal), the linear layers on the engine's
    default route (a row's bits alike at every step size, on any CPU: kvslim.engine.linears)."""
    with Linears(model, "auto").routed():
        _chunks_and_tokens_in_one_forward(model)


@blas_row_identity
def test_prompt_chunks_and_decode_tokens_on_torchs_route(model):
    """The same on torch's own route: bit for bit only where its BLAS rounds a row alike at every row count."""
    _chunks_and_tokens_in_one_forward(model)


def _chunks_and_tokens_in_one_forward(model):
    decode_specs = ["int4", "q4_0,sink=4,window=50", "none", "int8"]

    def build():
        dec, pro = [], []
        with torch.inference_mode():
            for i, spec in enumerate(decode_specs):
                c = _cache(model, spec)
                gen.forward_step(model, [(_ids(30 + 17 * i, i), c)])
                dec.append(c)
            for i, (spec, hist, _) in enumerate(CHUNKS):
                c = _cache(model, spec)
                if hist:
                    gen.forward_step(model, [(_ids(hist, 50 + i), c)])
                pro.append(c)
        return dec, pro

    chunks = [_ids(n, 90 + i) for i, (_, _, n) in enumerate(CHUNKS)]
    dec, pro = build()
    forwards = Forwards(model)
    with torch.inference_mode():
        feeds = [(chunk, c) for chunk, c in zip(chunks, pro, strict=True)] + [([5 + b], c) for b, c in enumerate(dec)]
        together = gen.forward_step(model, feeds)
        n_tokens = sum(len(c) for c in chunks) + len(dec)
        assert forwards.take() == [n_tokens + (-n_tokens % gen.ROW_MULTIPLE)]  # one forward, packed, no padding
        after = gen.forward_rows(model, [9] * (len(pro) + len(dec)), pro + dec)
    forwards.close()
    dec2, pro2 = build()
    with torch.inference_mode():
        for i, (chunk, c) in enumerate(zip(chunks, pro2, strict=True)):
            assert torch.equal(gen.forward_step(model, [(chunk, c)])[0], together[i]), CHUNKS[i]
        for b, c in enumerate(dec2):
            assert torch.equal(gen.forward_rows(model, [5 + b], [c])[0], together[len(pro) + b]), decode_specs[b]
        for i, c in enumerate(pro2 + dec2):
            assert torch.equal(gen.forward_rows(model, [9], [c])[0], after[i])
    # and close to kvslim's single-stream prefill (another BLAS path for one row: equal up to rounding)
    with torch.inference_mode():
        for i, (spec, hist, _) in enumerate(CHUNKS):
            c = _cache(model, spec)
            history = _ids(hist, 50 + i)
            want = gen.prefill(model, torch.tensor([history + chunks[i]]), c, chunk_size=hist or None)[0]
            torch.testing.assert_close(together[i], want, rtol=1e-4, atol=1e-4)


def test_a_joining_prompt_rides_in_the_decode_forward(model):
    """Three rows decode; a 6-chunk prompt joins. Every step while it prefills is ONE forward carrying its chunk
    and the three decode tokens (no step pauses the decoding rows); each request's tokens equal the request run
    alone through the engine and through kvslim's single-stream loop."""
    chunk = 16
    early = [
        Request(_ids(9, 1), max_new_tokens=20, cache="int4,sink=4,window=60"),
        Request(_ids(13, 2), max_new_tokens=20, cache="q8_0"),
        Request(_ids(5, 3), max_new_tokens=20),
    ]
    late = Request(_ids(6 * chunk - 3, 4), max_new_tokens=6, cache="int4")
    engine = Engine(model, max_batch=4, prefill_chunk=chunk)
    ids = [engine.submit(r) for r in early]
    engine.step()  # the three short prompts in one step (9 + 13 + 5 > 16: two steps)
    engine.step()
    assert all(engine.results[i].tokens for i in ids)
    late_id = engine.submit(late)
    forwards = Forwards(model)
    per_step, got_first = [], None
    while got_first is None:
        events = engine.step()
        per_step.append(forwards.take())
        got_first = next((e for e in events if e.request_id == late_id), None)
        assert {e.request_id for e in events} >= set(ids)  # every decoding row got its token in this step
    forwards.close()
    assert len(per_step) == 6
    # one forward a step: the prompt's chunk (16, the last 13) + 3 decode tokens, rounded up to the route's row
    # multiple (4 with filler rows; 1 where auto timed kvslim's own linear layers fastest, which a busy machine
    # can change: the choice is timed)
    with engine.linears.routed() as route:
        m = route.row_multiple()
    assert per_step == [[-(-19 // m) * m]] * 5 + [[16]], (per_step, m)
    list(engine.events())
    for rid, req in zip([*ids, late_id], [*early, late], strict=True):
        got = engine.results[rid].tokens
        assert got == Engine(model, prefill_chunk=chunk).run([req])[0].tokens, req.cache
        cache = SlimCache.from_config(req.cache or kvslim.parse_spec("none"), config=model.config)
        single = gen.greedy(model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=chunk)
        assert got == single, req.cache


def test_several_short_prompts_and_decode_rows_share_one_forward(model):
    """The step's budget (prefill_chunk prompt tokens) takes several short prompts whole, in the same forward as
    the decoding rows; outputs equal each request alone."""
    reqs = [Request(_ids(40, 10), max_new_tokens=8, cache="q4_0")] + [
        Request(_ids(5 + i, 11 + i), max_new_tokens=5, cache=spec)
        for i, spec in enumerate(["none", "int4", "int8,sink=4,window=30"])
    ]
    engine = Engine(model, prefill_chunk=32)
    first = engine.submit(reqs[0])
    engine.step()
    engine.step()  # 40 tokens: two chunks, the first token with the second
    assert len(engine.results[first].tokens) == 1
    ids = [engine.submit(r) for r in reqs[1:]]
    forwards = Forwards(model)
    events = engine.step()
    assert len(forwards.take()) == 1
    forwards.close()
    assert {e.request_id for e in events} == {first, *ids}  # three first tokens and a decode token, one forward
    list(engine.events())
    for rid, req in zip([first, *ids], reqs, strict=True):
        assert engine.results[rid].tokens == Engine(model, prefill_chunk=32).run([req])[0].tokens


def test_a_bad_prompt_chunk_in_a_mixed_step_ends_only_its_row():
    """A prompt whose token has a NaN embedding joins decoding rows: in the mixed forward its K/V are not finite,
    its store refuses them, it is dropped from the step and ends with an error naming prefill; the decode rows
    that shared the forward finish exactly as they do alone. And a decode row refused in a mixed step ends
    alone while the prompt chunk beside it goes on."""
    model = kvslim.enable(tiny_model("llama", vocab_size=130))
    with torch.no_grad():
        model.model.embed_tokens.weight[129] = float("nan")  # token 129: a hidden state of NaN
    good = [
        Request(_ids(9, 1), max_new_tokens=12, cache="int4,sink=4,window=60"),
        Request(_ids(7, 2), max_new_tokens=12, cache="q8_0"),
    ]
    bad = Request(_ids(20, 3)[:10] + [129] + _ids(20, 3)[10:], max_new_tokens=4, cache="int4")
    engine = Engine(model, prefill_chunk=16)
    ids = [engine.submit(r) for r in good]
    engine.step()
    engine.step()
    bad_id = engine.submit(bad)
    forwards = Forwards(model)
    events = engine.step()  # the bad prompt's first chunk beside the two decode tokens: one forward
    assert len(forwards.take()) == 1
    forwards.close()
    final = [e for e in events if e.request_id == bad_id]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason == "error"
    assert final[0].error.startswith("prefill failed:") and "non-finite" in final[0].error, final[0].error
    assert {e.request_id for e in events if not e.finished} == set(ids)
    list(engine.events())
    for rid, req in zip(ids, good, strict=True):
        assert engine.results[rid].finish_reason == "length"
        assert engine.results[rid].tokens == Engine(model, prefill_chunk=16).run([req])[0].tokens
    assert engine.memory()["row_errors"] == 1 and engine.memory()["reserved_bytes"] == 0

    # the other way round: a decode row's store refuses in a mixed step; the prompt beside it is exact
    engine = Engine(model, prefill_chunk=16)
    victim = engine.submit(good[0])
    engine.step()
    joiner = Request(_ids(40, 5), max_new_tokens=5, cache="q4_0")
    jid = engine.submit(joiner)
    store = next(r for r in engine.scheduler.active if r.request_id == victim).cache.layers[1].store

    def refuse(*args, **kwargs):
        raise ValueError("keys hold non-finite values (nan) in layer 1")

    store.append = refuse
    events = engine.step()
    gone = [e for e in events if e.request_id == victim]
    assert gone and gone[0].finish_reason == "error" and gone[0].error.startswith("the decode step failed:")
    list(engine.events())
    assert engine.results[jid].tokens == Engine(model, prefill_chunk=16).run([joiner])[0].tokens


@pytest.mark.parametrize("family", ["mistral_sliding", "gemma3"])
def test_sliding_window_layers_mask_a_mixed_chunk_as_alone(family):
    """Models with sliding-window layers (a window of 8 tokens, chunks of 12 crossing it): the chunk's mask in
    the packed step is the one transformers builds for it alone; greedy output equals the single-stream loop."""
    model = family_model(family, attn_implementation="sdpa")
    try:
        engine = Engine(model, prefill_chunk=12)
    except ValueError as e:
        pytest.skip(f"the engine does not serve {family}: {e}")
    reqs = [Request(_ids(30, 1), max_new_tokens=10), Request(_ids(41, 2), max_new_tokens=8)]
    first = engine.submit(reqs[0])
    engine.step()
    engine.step()
    engine.step()
    assert engine.results[first].tokens
    second = engine.submit(reqs[1])
    list(engine.events())
    for rid, req in zip([first, second], reqs, strict=True):
        cache = SlimCache.from_config(kvslim.parse_spec("none"), config=model.config)
        single = gen.greedy(model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=12)
        assert engine.results[rid].tokens == single, family


def test_forward_step_refuses_what_it_cannot_pack(model):
    c = _cache(model, "int4")
    with pytest.raises(ValueError, match="at least one"):
        gen.forward_step(model, [])
    with pytest.raises(ValueError, match="no tokens"):
        gen.forward_step(model, [([], c)])
    with pytest.raises(ValueError, match="at most once"):
        gen.forward_step(model, [([3], c), ([4], c)])
