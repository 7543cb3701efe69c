"""The engine with the compiled paged step (``Engine(pages=..., compile=True)``, ``kvslim serve --compile``): decode
steps run through the compiled graph and prompt chunks eagerly in a forward of their own, so every request's greedy
output equals the request run alone through a compiled engine whatever joins its steps; the warm-up compiles every
bucket of rows without touching the pool, and steps never compile again; what it cannot serve is refused in one line."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim.cache import paged_compiled
from kvslim.engine import Engine, Request


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


@pytest.fixture(scope="module")
def step(model):
    return paged_compiled.CompiledStep(model)


def _requests(n: int = 5, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 37, 80, 120, 9, 200][:n]
    return [
        Request(torch.randint(3, 128, (m,), generator=g).tolist(), max_new_tokens=8 + 3 * i)
        for i, m in enumerate(lengths)
    ]


def _counting(monkeypatch) -> list[int]:
    """Patches CompiledStep.run to count its calls' rows."""
    seen: list[int] = []
    run = paged_compiled.CompiledStep.run

    def counted(self, pool, plan, input_ids):
        seen.append(int(input_ids.shape[0]))
        return run(self, pool, plan, input_ids)

    monkeypatch.setattr(paged_compiled.CompiledStep, "run", counted)
    return seen


@pytest.mark.parametrize("spec", ["int4", "q8_0,sink=4,window=96,residual=0,positions=original"])
def test_compiled_engine_greedy_equals_each_request_alone(model, step, spec, monkeypatch):
    """Five requests, at most three rows at once, prompts read in chunks of 32 while other rows decode: every decode
    step goes through the compiled step, and each request's tokens equal it alone through a compiled engine."""
    seen = _counting(monkeypatch)
    reqs = _requests()
    engine = Engine(model, cache=spec, max_batch=3, prefill_chunk=32, pages=64, compile=step)
    together = engine.run(reqs)
    decode_steps = len(seen)
    assert decode_steps >= max(r.max_new_tokens for r in reqs) - 1
    assert set(seen) <= step.buckets and engine.compiled is step
    for req, got in zip(reqs, together, strict=True):
        alone = Engine(model, cache=spec, prefill_chunk=32, pages=16, compile=step).run([req])[0]
        assert got.tokens == alone.tokens, spec
        assert got.finish_reason == "length" and len(got.tokens) == req.max_new_tokens
    assert len(seen) > decode_steps  # the lone runs decoded through it too
    assert engine.pool.free_pages == 64 and engine.pool.rows_alive == 0


def test_a_joining_prompt_changes_no_decoding_rows_bits(model, step):
    """Two decoding rows' logits in a step that a prompt chunk joins are the same bits as their twins' in a step
    without it: the chunk runs in a forward of its own, the decode rows through the compiled graph either way."""
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.engine import step as engine_step
    from kvslim.engine.pages import PooledCache
    from kvslim.engine.scheduler import Row

    engine = Engine(model, cache="int4", max_batch=4, prefill_chunk=32, pages=64, compile=step)
    pool = engine.pool

    def decoding(rows):
        out = []
        for i, (row, token) in enumerate(zip(rows, (7, 9), strict=True)):
            r = Row(request_id=f"r{i}", request=Request([1], max_new_tokens=4), reserved=0)
            r.cache, r.pending = PooledCache(pool, row), token
            out.append(r)
        return out

    with torch.inference_mode():
        a, b = pool.new_row(), pool.new_row()
        forward_pages(model, pool, [(list(range(3, 60)), a)])
        forward_pages(model, pool, [(list(range(5, 40)), b)])
        twins = [pool.copy_row(a), pool.copy_row(b)]
        joiner = Row(request_id="p", request=Request(list(range(10, 50)), max_new_tokens=4), reserved=0)
        joiner.cache = PooledCache(pool, pool.new_row())
        ends, mixed = engine_step.forward(model, [joiner], decoding([a, b]), 32, {}, 1, pool, step)
        _, plain = engine_step.forward(model, [], decoding(twins), 32, {}, 1, pool, step)
    assert ends == [32] and mixed.shape[0] == 3
    assert torch.equal(mixed[1:], plain)


def test_warm_up_compiles_every_bucket_and_leaves_the_pool_as_it_was(model):
    """warm_up() compiles the buckets of 1 to max_batch rows on filler rows only: no page taken, no row; requests
    afterwards compile nothing more."""
    engine = Engine(model, cache="int4", max_batch=5, prefill_chunk=32, pages=48, compile=True)
    free = engine.pool.free_pages
    done = engine.warm_up()
    want = sorted({engine.compiled.rows_for(n, engine.linears.row_multiple()) for n in range(1, 6)})
    assert done == want and sorted(engine.compiled.buckets) == want
    assert engine.pool.free_pages == free and engine.pool.rows_alive == 0
    assert engine.warm_up() == []  # nothing left to compile
    before = engine.compiled.compile_s
    engine.run(_requests(5, seed=3))
    assert sorted(engine.compiled.buckets) == want and engine.compiled.compile_s == before
    assert Engine(model, cache="int4", pages=8).warm_up() == []  # no compile: nothing to warm


def test_what_the_compiled_engine_cannot_serve_is_refused_in_one_line(model, step):
    with pytest.raises(ValueError, match="compile compiles the paged step: give pages=N or pages='auto'"):
        Engine(model, cache="int4", compile=True)
    with pytest.raises(ValueError, match="compile must be True, False or a CompiledStep"):
        Engine(model, cache="int4", pages=8, compile="yes")
    other = kvslim.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match="compiles another model's step"):
        Engine(other, cache="int4", pages=8, compile=step)
    hooked = kvslim.enable(tiny_model("llama"))
    handle = hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(
            ValueError, match="cannot compile the paged step: the direct paged step does not serve it"
        ):
            Engine(hooked, cache="int4", pages=8, compile=True)
    finally:
        handle.remove()
