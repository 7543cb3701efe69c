"""A paged step's pool calls with their argument tables laid out once a step (kvslim.cache.pagecalls): the same
logits and the same pages as the general path, bit for bit; one table built a step, not one a layer; the general
path where a layer's tensors do not fit the step's tables, or where the path does not apply."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim.cache import pagecalls
from kvslim.cache.paged_adapter import forward_pages
from kvslim.cache.pagepool import PagePool, pool_for
from kvslim.vllm import attend as paged

pytestmark = pytest.mark.skipif(paged.library() is None, reason="the paged C kernel is not built here")


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama", num_hidden_layers=3))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _general_only(monkeypatch) -> None:
    monkeypatch.setattr(pagecalls.StepCalls, "of", classmethod(lambda cls, *args: None))


def _run(model, spec: str) -> tuple[list[torch.Tensor], PagePool]:
    """Two rows prefilled, then mixed steps: both decoding, a third joining in chunks, filler rows."""
    with torch.inference_mode():
        pool = pool_for(model, spec, pages=40, max_rows=3)
        a, b, c = pool.new_row(), pool.new_row(), pool.new_row()
        got = [forward_pages(model, pool, [(_ids(130, 1), a)]), forward_pages(model, pool, [(_ids(97, 2), b)])]
        prompt = _ids(50, 3)
        for i in range(12):
            feeds = [([_ids(12, 10)[i]], a), ([_ids(12, 11)[i]], b)]
            if i < 5:
                feeds.append((prompt[10 * i : 10 * i + 10], c))
            else:
                feeds.append(([_ids(12, 12)[i]], c))
            got.append(forward_pages(model, pool, feeds))
    return got, pool


@pytest.mark.parametrize(
    "spec",
    [
        "int4",  # (most of these short rows staged: residual 128)
        "int4,residual=32",  # (from here on most of every row is read from its codes)
        "q4_0,residual=32",
        "q8_0,sink=32,residual=0",
        "q4_0,residual=32,sink=32",
        "int4,sink=4,window=64,residual=32,positions=original",
        "k4v2,residual=32",
        # where the path does not apply (no rotation; lossless pages): the general path, the same either way
        "int8,k=q4_0,rotate=none",
        "none",
    ],
)
def test_the_steps_tables_give_the_general_paths_bits(model, spec, monkeypatch):
    fast, fast_pool = _run(model, spec)
    with monkeypatch.context() as m:
        _general_only(m)
        slow, slow_pool = _run(model, spec)
    assert all(torch.equal(x, y) for x, y in zip(fast, slow, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(fast_pool.pages, slow_pool.pages, strict=True))


def test_one_table_a_step_and_every_layer_attends_through_it(model, monkeypatch):
    built, calls = [], []
    real_args = paged.attend_args
    monkeypatch.setattr(paged, "attend_args", lambda *a, **k: built.append(1) or real_args(*a, **k))
    real_run = pagecalls.StepCalls.run

    def run(self, *args):
        out = real_run(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(pagecalls.StepCalls, "run", run)
    with torch.inference_mode():
        pool = pool_for(model, "int4", pages=16, max_rows=2)
        a, b = pool.new_row(), pool.new_row()
        for steps, feeds in enumerate(([(_ids(40, 1), a)], [(_ids(33, 2), b)], [([5], a), ([6], b)]), 1):
            forward_pages(model, pool, feeds)
            layers = model.config.num_hidden_layers
            assert (len(built), len(calls), all(calls)) == (steps, steps * layers, True)


def test_a_layer_that_does_not_fit_takes_the_general_path():
    """Layer 1's query is a strided view (another layout than layer 0's): the step's tables are not used for it, and
    every layer's output and pages equal a pool's that never lays them out."""
    g = torch.Generator().manual_seed(0)
    q = [torch.randn(3, 4, 32, generator=g) for _ in range(2)]
    q[1] = torch.randn(4, 3, 32, generator=g).transpose(0, 1)  # (3, 4, 32), token stride 32
    k = [torch.randn(3, 2, 32, generator=g) for _ in range(2)]
    v = [torch.randn(3, 2, 32, generator=g) for _ in range(2)]
    outs, pools = [], []
    for fast in (True, False):
        pool = PagePool("q4_0", n_layers=2, kv_heads=2, head_dim=32, dtype=torch.float32, pages=4, max_rows=1)
        row = pool.new_row()
        with torch.inference_mode():
            plan = pool.plan([row], [3])
            if not fast:
                plan.calls = pagecalls.NONE
            outs.append([pool.attend(plan, i, q[i], k[i], v[i], 0.2) for i in range(2)])
            pool.commit(plan)
            if fast:
                tables = plan.calls
                assert isinstance(tables, pagecalls.StepCalls)
                assert tables.run(1, q[1], k[1], v[1], 0.2) is None  # does not fit: nothing written
                assert tables.run(0, q[0], k[0], v[0], 0.3) is None  # another scale
        pools.append(pool)
    assert all(torch.equal(x, y) for x, y in zip(outs[0], outs[1], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(pools[0].pages, pools[1].pages, strict=True))


@pytest.mark.parametrize("spec", ["int4,residual=32", "q4_0,residual=32,sink=32"])
def test_a_bfloat16_model_takes_the_tables_with_the_general_paths_bits(spec, monkeypatch):
    """A bfloat16 model's query, key and value are widened to float32 for the tables, as the general path widens
    them: the same logits and pages, and every layer goes through the tables."""
    bf = kvslim.enable(tiny_model("llama", num_hidden_layers=3, seed=7).to(torch.bfloat16))
    ran = []
    real_run = pagecalls.StepCalls.run
    monkeypatch.setattr(pagecalls.StepCalls, "run", lambda self, *a: ran.append(a[1].dtype) or real_run(self, *a))
    fast, fast_pool = _run(bf, spec)
    assert ran and set(ran) == {torch.float32}
    with monkeypatch.context() as m:
        _general_only(m)
        slow, slow_pool = _run(bf, spec)
    assert fast_pool.pages[0].dtype == torch.uint8
    assert all(torch.equal(x, y) for x, y in zip(fast, slow, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(fast_pool.pages, slow_pool.pages, strict=True))
