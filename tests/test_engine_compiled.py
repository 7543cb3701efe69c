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


def _logprobs(engine: Engine, first: Request, later: Request | None = None, after: int = 3) -> list[float]:
    """``first``'s logprob for each of its tokens, stepping ``engine`` until it is idle; ``later`` is submitted once
    ``first`` has ``after`` tokens (its prompt's chunks then ride in ``first``'s decode steps)."""
    rid = engine.submit(first)
    got: list[float] = []
    while not engine.idle:
        for event in engine.step():
            if event.request_id == rid and event.token is not None:
                got.append(event.logprob)
        if later is not None and len(got) >= after:
            engine.submit(later)
            later = None
    return got


def test_a_joining_prompt_changes_no_decoding_rows_bits(model, step):
    """A decoding request's logprobs are the same bits whether or not a prompt's chunks join its steps: the chunks
    run in a forward of their own, the decoding row through the compiled graph either way (an engine that ran a mixed
    step eagerly fails this)."""
    g = torch.Generator().manual_seed(11)
    first = Request(torch.randint(3, 128, (40,), generator=g).tolist(), max_new_tokens=12, logprobs=0)
    later = Request(torch.randint(3, 128, (100,), generator=g).tolist(), max_new_tokens=4)

    def engine():
        return Engine(model, cache="int4", max_batch=2, prefill_chunk=32, pages=64, compile=step)

    alone = _logprobs(engine(), first)
    joined = engine()
    together = _logprobs(joined, first, later)
    assert len(alone) == 12 and together == alone
    assert joined.prefilled_tokens == 140 and joined.pool.rows_alive == 0


def test_warm_up_compiles_every_bucket_and_leaves_the_pool_as_it_was(model):
    """warm_up() compiles the buckets of 1 to max_batch rows on filler rows only: no page taken, no row; requests
    afterwards compile nothing more."""
    from torch._dynamo.utils import counters

    engine = Engine(model, cache="int4", max_batch=5, prefill_chunk=32, pages=48, compile=True)
    free = engine.pool.free_pages
    done = engine.warm_up()
    with engine.linears.routed() as route:
        want = sorted({engine.compiled.rows_for(n, route.row_multiple()) for n in range(1, 6)})
    assert done == want and sorted(engine.compiled.buckets) == want
    assert engine.pool.free_pages == free and engine.pool.rows_alive == 0
    assert engine.warm_up() == []  # nothing left to compile
    before, graphs = engine.compiled.compile_s, counters["stats"]["unique_graphs"]
    engine.run(_requests(5, seed=3))
    assert sorted(engine.compiled.buckets) == want and engine.compiled.compile_s == before
    # no bucket compiled again (a guard that failed would)
    assert counters["stats"]["unique_graphs"] == graphs
    assert Engine(model, cache="int4", pages=8).warm_up() == []  # no compile: nothing to warm


def test_what_the_compiled_engine_cannot_serve_is_refused_in_one_line(model, step):
    with pytest.raises(ValueError, match="compile compiles the paged step: give pages=N or pages='auto'"):
        Engine(model, cache="int4", compile=True)
    with pytest.raises(ValueError, match="compile must be True, False, a wrapper \\('python', 'cpp'\\) or a CompiledStep"):
        Engine(model, cache="int4", pages=8, compile="yes")
    assert Engine(model, cache="int4", pages=8, compile="cpp").compiled.wrapper == "cpp"  # (compiles at its first step)
    assert Engine(model, cache="int4", pages=8, compile=True).compiled.wrapper == "python"
    other = kvslim.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match="compiles another model's step"):
        Engine(other, cache="int4", pages=8, compile=step)
    torch_products = paged_compiled.CompiledStep(other)
    torch_products.own_products = False  # as where kvslim's linear kernel does not run
    with pytest.raises(
        ValueError, match="compile: kvslim's linear kernel does not run here.*rows decoding beside it"
    ):
        Engine(other, cache="int4", pages=8, compile=torch_products)
    hooked = kvslim.enable(tiny_model("llama"))
    handle = hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(
            ValueError, match="cannot compile the paged step: the direct paged step does not serve it"
        ):
            Engine(hooked, cache="int4", pages=8, compile=True)
    finally:
        handle.remove()
