"""The batch engine with its rows in one pool of pages (``Engine(pages=...)``, kvslim.engine.pages): greedy output of
every request equals the request run alone, admission is by pages and never runs the pool dry, every page comes
back, a failed forward leaves the pool as it was, and what pages cannot serve is refused in one line."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim import SlimCache
from kvslim import generate as gen
from kvslim.cache.pagepool import PagePool, pool_for
from kvslim.config import parse_spec
from kvslim.engine import BudgetRefusal, ContextRefusal, Engine, Request, SettingsRefusal
from kvslim.engine.pages import pages_for


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _requests(n: int = 6, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 37, 80, 120, 9, 200, 64, 33][:n]
    return [
        Request(torch.randint(3, 128, (m,), generator=g).tolist(), max_new_tokens=10 + 3 * i)
        for i, m in enumerate(lengths)
    ]


@pytest.mark.parametrize("spec", ["int4", "q4_0", "int8,residual=32", "none"])
def test_paged_greedy_equals_each_request_alone(model, spec):
    """Six requests, at most three rows at once, prompts read in chunks of 32 beside decoding rows: every request's
    tokens equal the request alone through a paged engine; every page is back at the end."""
    reqs = _requests()
    engine = Engine(model, cache=spec, max_batch=3, prefill_chunk=32, pages=64)
    together = engine.run(reqs)
    assert engine.steps > max(r.max_new_tokens for r in reqs)
    for req, got in zip(reqs, together, strict=True):
        alone = Engine(model, cache=spec, prefill_chunk=32, pages=16).run([req])[0]
        assert got.tokens == alone.tokens, spec
        assert got.finish_reason == "length" and len(got.tokens) == req.max_new_tokens
        assert got.cache_bytes == pages_for(len(req.prompt) + req.max_new_tokens - 1) * engine.pool.page_bytes()
    mem = engine.memory()
    assert mem["free_pages"] == mem["pages"] == 64 and engine.pool.rows_alive == 0
    assert mem["reserved_bytes"] == 0


def test_lossless_pages_follow_the_slimcache_rows(model):
    """``none`` pages store the model's K/V as they are: the same greedy tokens as the engine's SlimCache rows and as
    kvslim's single-stream loop."""
    reqs = _requests(4, seed=1)
    paged = Engine(model, max_batch=4, prefill_chunk=32, pages=40).run(reqs)
    for req, got in zip(reqs, paged, strict=True):
        cache = SlimCache.from_config(parse_spec("none"), config=model.config)
        single = gen.greedy(model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=32)
        assert got.tokens == single


def _most_at_once(engine: Engine, reqs: list[Request]) -> int:
    """Run ``reqs`` to the end, checking at every step that the reservations stay within the pool and every row's
    pages within its reservation; returns the most rows that ran at once."""
    for r in reqs:
        engine.submit(r)
    most = 0
    while not engine.idle:
        engine.step()
        mem = engine.memory()
        most = max(most, mem["active"])
        assert mem["reserved_bytes"] <= mem["memory_budget"] == mem["pool_bytes"]
        assert mem["cache_bytes"] <= mem["reserved_bytes"]
    return most


def test_admission_is_by_pages_and_never_runs_the_pool_dry(model):
    """A pool of 12 pages holds two rows of 5 pages at once: the third waits until one leaves, and every request's
    tokens are what it produces alone."""
    reqs = [Request(list(range(3, 3 + 100)), max_new_tokens=40) for _ in range(3)]  # 140 tokens: 5 pages
    one = Engine(model, cache="int4", pages=8).run(reqs[:1])[0]
    engine = Engine(model, cache="int4", pages=12, max_batch=3)
    assert _most_at_once(engine, reqs) == 2
    assert all(res.tokens == one.tokens for res in engine.results.values())
    assert engine.pool.free_pages == 12


def test_a_failed_forward_ends_its_rows_and_leaves_the_pool_as_it_was(model, monkeypatch):
    """A forward that raises ends every row of it (pages have no per-row drop), gives their pages back, and the
    engine goes on: the next request's tokens are what it produces alone."""
    engine = Engine(model, cache="int4", pages=32, max_batch=2)
    reqs = _requests(2, seed=2)
    for r in reqs:
        engine.submit(r)
    engine.step()  # both prompts read, first tokens sampled
    def broken(self, *args, **kwargs):
        raise RuntimeError("the kernel broke")

    monkeypatch.setattr(PagePool, "attend", broken)
    events = engine.step()
    monkeypatch.undo()
    assert {e.finish_reason for e in events} == {"error"} and len(events) == 2
    assert all("the kernel broke" in e.error for e in events)
    assert engine.pool.free_pages == 32 and engine.pool.rows_alive == 0
    again = engine.run([reqs[0]])[0]
    assert again.tokens == Engine(model, cache="int4", pages=32).run([reqs[0]])[0].tokens


def test_what_pages_cannot_serve_is_refused_in_one_line(model, tmp_path):
    with pytest.raises(ValueError, match="pages: window=60 in kvslim pages keeps every key at its original position"):
        Engine(model, cache="int4,sink=4,window=60", pages=8)
    with pytest.raises(ValueError, match="pages keep sessions in memory only"):
        Engine(model, cache="int4", pages=8, session_dir=tmp_path)
    with pytest.raises(ValueError, match="give pages=N or memory_budget, not both"):
        Engine(model, cache="int4", pages=8, memory_budget=10**6)
    with pytest.raises(ValueError, match="pages must be a positive number"):
        Engine(model, cache="int4", pages=0)
    with pytest.raises(ValueError, match="holds no page"):
        Engine(model, cache="int4", pages="auto", memory_budget=1000)
    engine = Engine(model, cache="int4", pages=4)
    prompt = list(range(3, 40))
    with pytest.raises(SettingsRefusal, match="cannot bring its own cache settings"):
        engine.submit(Request(prompt, max_new_tokens=4, cache="int8"))
    with pytest.raises(BudgetRefusal, match="needs 5 pages .* more than the whole pool of 4"):
        engine.submit(Request(prompt, max_new_tokens=100))
    with pytest.raises(ContextRefusal, match="past the model's context"):
        engine.submit(Request([3] * 4000, max_new_tokens=200))
    assert engine.submit(Request(prompt, max_new_tokens=4, cache="int4"))  # its own settings, the same: taken


def test_auto_pages_fill_the_budget_up_to_every_row_at_the_context(model):
    engine = Engine(model, cache="int4", pages="auto", max_batch=2)
    ctx = model.config.max_position_embeddings
    assert engine.pool.n_pages == 2 * pages_for(ctx)
    page = engine.pool.page_bytes()
    budget = engine.pool.stage_bytes() + 10 * page + page // 2
    small = Engine(model, cache="int4", pages="auto", max_batch=2, memory_budget=budget)
    assert small.pool.n_pages == 10 and small.memory()["memory_budget"] == 10 * page


def test_a_session_keeps_its_row_and_continues_it(model):
    """A session's row stays in the pool between its turns: the next turn prefills only its new tokens and its tokens
    equal the whole conversation run from scratch; deleting the session gives its pages back, and a session dropped
    to make room does too."""
    engine = Engine(model, cache="int4", pages=24, max_batch=2)
    first = list(range(3, 50))
    one = engine.run([Request(first, max_new_tokens=6, session="chat")])[0]
    held = first + one.tokens[:-1]
    assert engine.sessions.kept["chat"].tokens == tuple(held)
    assert engine.pool.rows_alive == 1 and engine.pool.free_pages == 24 - 2  # 52 tokens: 2 pages
    second = held + [one.tokens[-1], 7, 8, 9]
    two = engine.run([Request(second, max_new_tokens=6, session="chat")])[0]
    assert two.cached_tokens == len(held)
    fresh = Engine(model, cache="int4", pages=24).run([Request(second, max_new_tokens=6)])[0]
    assert two.tokens == fresh.tokens
    assert engine.delete_session("chat") and engine.pool.rows_alive == 0 and engine.pool.free_pages == 24
    # a session that does not continue starts over: its old row is freed
    engine.run([Request(first, max_new_tokens=6, session="a")])
    engine.run([Request([5] + first, max_new_tokens=6, session="a")])
    assert engine.sessions.stats.reset == 1 and engine.pool.rows_alive == 1
    # admission needs the idle session's pages: it is dropped (no session_dir) and its pages come back
    big = engine.run([Request([3 + i % 100 for i in range(640)], max_new_tokens=100)])[0]
    assert big.finish_reason == "length" and engine.sessions.stats.dropped == 1
    assert engine.pool.rows_alive == 0 and engine.pool.free_pages == 24


def test_concurrency_bench_has_a_pages_row_per_spec_pages_can_store(model):
    """``kvslim bench --concurrency --pages``: a ``SPEC+pages`` row beside each spec's SlimCache rows, its bytes the
    rows' pages and their share of the staging pool; a spec pages cannot store says why and gets none."""
    from kvslim.bench.concurrency import run_concurrency
    from kvslim.bench.concurrency_pages import pages_modes
    from kvslim.bench.modes import build_modes

    modes, _ = build_modes(model, ["int4", "q4_0,sink=4,window=28"])
    paged, refused = pages_modes(modes)
    assert [m.name for m in paged] == ["int4+pages"]
    assert "window=28 in kvslim pages keeps every key at its original position" in refused["q4_0,sink=4,window=28"]
    rows = run_concurrency(model, modes + paged, [40], [1, 3], steps=2, warmup=1, continuous_batching=False)
    got = {(r.mode, r.concurrency): r for r in rows}
    probe = pool_for(model, "int4", pages=1, max_rows=4)  # the bench's pool: 3 copies and the prefilled row
    for c in (1, 3):
        r = got["int4+pages", c]
        assert r.kind == "pages" and r.aggregate_tok_s > 0
        held = c * 2 * probe.page_bytes() + probe.stage_bytes() * c // 4  # 40 + 3 tokens: 2 pages a row
        assert r.bytes_per_stream == held // c


def test_a_windowed_pool_reserves_its_window_and_each_request_equals_itself_alone(model):
    """``sink=4,window=192,positions=original`` in pages: a request reserves its sink page, its window and a prefill
    chunk (9 pages here, not the 12 its 360 tokens would fill), so a pool of 27 pages runs three at once; each
    request's tokens equal it alone, and every page comes back."""
    spec = "int4,sink=4,window=192,positions=original"
    g = torch.Generator().manual_seed(5)
    reqs = [Request(torch.randint(3, 128, (300,), generator=g).tolist(), max_new_tokens=60) for _ in range(3)]
    engine = Engine(model, cache=spec, pages=27, max_batch=3, prefill_chunk=32)
    assert _most_at_once(engine, reqs) == 3
    for rid, req in zip(sorted(engine.results), reqs, strict=True):
        got = engine.results[rid]
        assert got.reserved_bytes == 9 * engine.pool.page_bytes()
        assert got.tokens == Engine(model, cache=spec, pages=12, prefill_chunk=32).run([req])[0].tokens
    assert engine.pool.free_pages == 27 and engine.pool.rows_alive == 0
