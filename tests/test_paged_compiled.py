"""The compiled paged step (kvslim.cache.paged_compiled): a decode step as one torch.compile graph per bucket of rows
gives the eager direct step's logits within rounding and its greedy tokens, compiles once per bucket and never again
in steady state, keeps a row's logits the same bits in a bucket of 1 and of 4, leaves prompt chunks to the eager step,
and refuses (or steps eagerly where) it cannot serve a model."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim.cache import paged_compiled
from kvslim.cache.paged_adapter import forward_pages
from kvslim.cache.pagepool import pool_for


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(model, spec: str, compiled, rows: int = 3, steps: int = 6, multiple: int = 1):
    """``rows`` rows prefilled with prompts of different lengths (eagerly), then greedy decode steps of them all:
    (every step's logits, every row's tokens)."""
    with torch.inference_mode():
        pool = pool_for(model, spec, pages=8 * rows + 8, max_rows=rows + 4)
        live = [pool.new_row() for _ in range(rows)]
        last = [forward_pages(model, pool, [(_ids(20 + 13 * i, i), r)])[0] for i, r in enumerate(live)]
        tokens = [[int(x.argmax())] for x in last]
        out = []
        for _ in range(steps):
            feeds = [([t[-1]], r) for t, r in zip(tokens, live, strict=True)]
            logits = forward_pages(model, pool, feeds, row_multiple=multiple, compiled=compiled)
            out.append(logits)
            for t, x in zip(tokens, logits, strict=True):
                t.append(int(x.argmax()))
    return out, tokens


@pytest.mark.parametrize(
    ("arch", "spec"), [("llama", "int4"), ("qwen2", "q8_0,sink=4,window=24,residual=0,positions=original")]
)
def test_compiled_decode_steps_match_the_eager_step(arch, spec):
    """The same greedy tokens and logits within 1e-4 of the eager direct step's; three rows run in a bucket of 4,
    compiled once over every step (and once more for the bucket of 1)."""
    model = kvslim.enable(tiny_model(arch))
    step = paged_compiled.CompiledStep(model)
    want, want_tokens = _decode(model, spec, None)
    got, got_tokens = _decode(model, spec, step)
    assert got_tokens == want_tokens
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (3, model.config.vocab_size)
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert step.buckets == {4} and step.compiles == 1 and step.compile_s > 0
    _decode(model, spec, step, rows=1, steps=2)
    _decode(model, spec, step, rows=4, steps=2)  # bucket 4 again: no compile
    assert step.buckets == {1, 4}


def test_a_rows_logits_are_the_same_bits_alone_and_in_a_bucket():
    """One row stepped alone (bucket 1) and the same row beside three copies (bucket 4): the same bits."""
    model = kvslim.enable(tiny_model("llama"))
    step = paged_compiled.CompiledStep(model)
    with torch.inference_mode():
        pool = pool_for(model, "int4", pages=40, max_rows=6)
        src = pool.new_row()
        forward_pages(model, pool, [(_ids(45, 9), src)])
        alone = pool.copy_row(src)
        group = [pool.copy_row(src) for _ in range(4)]
        for t in _ids(4, 10):
            a = forward_pages(model, pool, [([t], alone)], row_multiple=1, compiled=step)
            b = forward_pages(model, pool, [([t], r) for r in group], row_multiple=1, compiled=step)
            assert torch.equal(a[0], b[0]) and torch.equal(b[0], b[3])
    assert step.buckets == {1, 4}


def test_the_compiled_step_renews_the_workers_spin_once_a_layer(monkeypatch):
    """Before each layer's page attention through the Python ops (the pool's Python there can outlast the spin), as
    the direct step does; off with :data:`kvslim.cache.paged_direct.RENEW`, and the logits the same bits either way.
    (The C++ ops renew it at a step's first layer only: the later layers run no Python.)"""
    from kvslim.cache import paged_direct

    model = kvslim.enable(tiny_model("llama"))
    step = paged_compiled.CompiledStep(model, cpp_ops=False)
    calls = []
    monkeypatch.setattr(paged_direct, "_renewer", lambda on: (lambda: calls.append(1)) if on else (lambda: None))
    _decode(model, "int4", step, steps=0)  # the prompts alone: the eager direct step's renewals
    prompts = len(calls)
    calls.clear()
    with_renew, _ = _decode(model, "int4", step, steps=3)
    assert len(calls) - prompts == model.config.num_hidden_layers * 3
    monkeypatch.setattr(paged_direct, "RENEW", False)
    calls.clear()
    without, _ = _decode(model, "int4", step, steps=3)
    assert not calls and step.compiles == 1
    assert all(torch.equal(a, b) for a, b in zip(with_renew, without, strict=True))


def test_the_steps_dynamo_settings_hold_for_its_call():
    """A step runs its graph with the bucket limit in force (a recompile past it fails, never falls back to eager)
    and leaves dynamo's settings as they were."""
    config = torch._dynamo.config
    before = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    model = kvslim.enable(tiny_model("llama"))
    step = paged_compiled.CompiledStep(model)
    seen = []
    fn = step._fn
    step._fn = lambda *a: seen.append((config.recompile_limit, config.fail_on_recompile_limit_hit)) or fn(*a)
    _decode(model, "int4", step, steps=1)
    assert seen == [(step.MAX_BUCKETS, True)]
    assert (config.recompile_limit, config.fail_on_recompile_limit_hit) == before


def test_prompt_chunks_and_unserved_models_step_eagerly():
    """A step with a prompt chunk runs the eager step (nothing compiled); a model the direct step does not serve (a
    hook) is refused at construction in one line, and a CompiledStep handed to forward_pages then steps eagerly."""
    model = kvslim.enable(tiny_model("llama"))
    step = paged_compiled.CompiledStep(model)
    with torch.inference_mode():
        pool = pool_for(model, "int4", pages=20, max_rows=3)
        a, b = pool.new_row(), pool.new_row()
        forward_pages(model, pool, [(_ids(30, 1), a)], compiled=step)
        forward_pages(model, pool, [([5], a), (_ids(7, 2), b)], compiled=step)
        assert step.compiles == 0
        handle = model.model.norm.register_forward_hook(lambda *args: None)
        try:
            assert "hook" in paged_compiled.why_not(model)
            with pytest.raises(
                ValueError, match="cannot compile the paged step: the direct paged step does not"
            ):
                paged_compiled.CompiledStep(model)
            forward_pages(model, pool, [([5], a), ([6], b)], compiled=step)
            assert step.compiles == 0
        finally:
            handle.remove()


def test_buckets():
    assert [paged_compiled.bucket(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]
    assert [paged_compiled.bucket(n, 4) for n in (1, 2, 3, 5)] == [4, 4, 4, 8]


def test_the_concurrency_bench_has_a_compiled_pages_row():
    """``kvslim bench --concurrency --pages --compile``: a ``SPEC+pages+compiled`` row beside ``SPEC+pages``, its
    steps through the model's one compiled paged step (a graph per bucket of rows: 1, and 4 for 3 rows)."""
    from kvslim.bench.concurrency import run_concurrency
    from kvslim.bench.concurrency_pages import compiled_step, pages_modes
    from kvslim.bench.modes import build_modes

    model = kvslim.enable(tiny_model("llama"))
    modes, _ = build_modes(model, ["int4"])
    paged, _ = pages_modes(modes, compiled=True)
    assert [(m.name, m.compiled) for m in paged] == [("int4+pages", False), ("int4+pages+compiled", "python")]
    rows = run_concurrency(model, modes + paged, [40], [1, 3], steps=2, warmup=1, continuous_batching=False)
    got = {(r.mode, r.concurrency): r for r in rows}
    for c in (1, 3):
        assert got["int4+pages+compiled", c].aggregate_tok_s > 0
        assert got["int4+pages+compiled", c].bytes_per_stream == got["int4+pages", c].bytes_per_stream
    assert compiled_step(model).buckets == {1, 4}


def test_torchs_linear_runs_where_kvslims_kernel_does_not(monkeypatch):
    """A CPU without kvslim's linear kernel (no AVX2/FMA, or bfloat16 without AVX512-BF16): the products are torch's
    linear, every step (the route's row multiple then applies to the bucket), with the eager step's greedy tokens."""
    from kvslim.kernels import linear

    monkeypatch.setattr(linear, "ready", lambda dtype=torch.float32: False)
    monkeypatch.setattr(paged_compiled, "_prepared", {})
    model = kvslim.enable(tiny_model("llama"))
    step = paged_compiled.CompiledStep(model)
    assert not step.own_products and not step.cpp_ops  # (the C++ op would run torch's linear too: not needed)
    want, want_tokens = _decode(model, "int4", None, multiple=4)
    got, got_tokens = _decode(model, "int4", step, multiple=4)
    assert got_tokens == want_tokens and step.buckets == {4}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert set(paged_compiled._prepared.values()) == {False}


def test_the_cpp_wrapper_steps_the_python_wrappers_bits(monkeypatch):
    """``wrapper="cpp"``: the same graph called from a C++ wrapper Inductor generates and builds (the loader of such
    wrappers runs for it, not for the Python wrapper's), so each step's logits are the same bits as the Python
    wrapper's; a wrapper it does not know is refused in one line."""
    from torch._inductor import codecache

    model = kvslim.enable(tiny_model("llama"))
    python = paged_compiled.CompiledStep(model)
    cpp = paged_compiled.CompiledStep(model, wrapper="cpp")
    assert (python.wrapper, cpp.wrapper) == ("python", "cpp")
    loaded = []
    load = codecache.CppWrapperCodeCache.load_pybinding
    monkeypatch.setattr(
        codecache.CppWrapperCodeCache, "load_pybinding", classmethod(lambda c, *a, **k: loaded.append(1) or load(*a, **k))
    )
    with torch._inductor.config.patch(force_disable_caches=True):  # (a cached graph would skip the loader)
        want, want_tokens = _decode(model, "int4", python, steps=3)
        assert not loaded
        got, got_tokens = _decode(model, "int4", cpp, steps=3)
    assert loaded and got_tokens == want_tokens and cpp.buckets == {4}
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="the compiled step's wrapper is one of python, cpp, got 'c'"):
        paged_compiled.CompiledStep(model, wrapper="c")


def test_the_cpp_ops_step_the_python_ops_bits(monkeypatch):
    """Where kvslim's C++ ops build, the graph's products are ``kvslim_cpp::linear`` (the Python op never runs for the
    model's weights) and its attention ``kvslim_cpp::page_attend`` (the pool's Python at a step's first layer only),
    with the Python ops' bits at every step, through both wrappers; ``cpp_ops=True`` where they are off is refused in
    one line."""
    from kvslim.cache.pagepool import PagePool
    from kvslim.kernels import cppops

    if not cppops.ready():
        pytest.skip(f"no C++ ops here: {cppops.status()[1]}")
    model = kvslim.enable(tiny_model("llama", num_hidden_layers=3))
    monkeypatch.setattr(paged_compiled, "_prepared", {})
    seen = []
    attend = PagePool.attend
    monkeypatch.setattr(PagePool, "attend", lambda self, plan, layer, *a: seen.append(layer) or attend(self, plan, layer, *a))
    python = paged_compiled.CompiledStep(model, cpp_ops=False)
    _decode(model, "int4", python, steps=0)  # the prompts (eager)
    prompts = len(seen)
    want, want_tokens = _decode(model, "int4", python, steps=3)
    assert len(seen) - 2 * prompts == 3 * 3
    weights = {p.data_ptr() for p in model.parameters()}
    assert weights & {key[0] for key in paged_compiled._prepared}  # the Python op ran for them
    paged_compiled._prepared.clear()
    for wrapper in paged_compiled.WRAPPERS:
        step = paged_compiled.CompiledStep(model, wrapper=wrapper)
        assert step.cpp_ops
        seen.clear()
        got, got_tokens = _decode(model, "int4", step, steps=3)
        assert len(seen) - prompts == 3  # a step's first layer
        assert got_tokens == want_tokens and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not weights & {key[0] for key in paged_compiled._prepared}
    monkeypatch.setenv(cppops.ENV, "0")
    assert not paged_compiled.CompiledStep(model).cpp_ops
    with pytest.raises(ValueError, match=r"the compiled step's C\+\+ ops are unavailable: \$KVSLIM_CPP_OPS"):
        paged_compiled.CompiledStep(model, cpp_ops=True)
    with pytest.raises(ValueError, match="cpp_ops is None"):
        paged_compiled.CompiledStep(model, cpp_ops="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_attention_gives_a_layer_its_tables_do_not_serve_to_the_python_op(monkeypatch, dtype):
    """``kvslim_cpp::page_attend``: a step's first layer goes to the Python op (which lays out the step's tables and
    hands them over), a later layer of the same forms runs in C++ (a bfloat16 model's widened to float32 first, as
    the Python op widens them), one of other strides or another scale goes to the Python op; the same bits as the
    Python op's at every layer of the same scale, the layers after a refused one included."""
    from kvslim.cache.pagepool import PagePool
    from kvslim.kernels import cppops

    if not cppops.ready():
        pytest.skip(f"no C++ ops here: {cppops.status()[1]}")
    model = kvslim.enable(tiny_model("llama", dtype=dtype, num_hidden_layers=3))
    c = model.config
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    seen = []
    attend = PagePool.attend
    monkeypatch.setattr(PagePool, "attend", lambda self, plan, layer, *a: seen.append(layer) or attend(self, plan, layer, *a))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    strided = torch.zeros(1, hq, d + 8, dtype=dtype)
    strided[..., :d] = q
    strided = strided[..., :d]  # the same values, other strides
    with torch.inference_mode():
        pool = pool_for(model, "int4", pages=16, max_rows=2)
        row = pool.new_row()
        forward_pages(model, pool, [(_ids(40, 1), row)])

        def step(op, layers, keys=(k, k, k)):
            seen.clear()
            plan = pool.plan([row], [1])
            paged_compiled._steps[99] = (pool, plan, lambda: None, True)
            try:
                return [op(x, kk, v, 99, i, s) for i, ((x, s), kk) in enumerate(zip(layers, keys, strict=False))], list(seen)
            finally:
                cppops.end(99)
                del paged_compiled._steps[99]
                pool.abandon(plan)

        layers = [(q, 0.125), (q, 0.125), (q, 0.125)]
        want, _ = step(torch.ops.kvslim.page_attend, layers)
        assert all(w.dtype == torch.float32 for w in want)
        for variant, python_layers in (
            (layers, [0]),
            # (widened, the strided query is a dense float32 one: the tables serve it, in Python as in C++)
            ([(q, 0.125), (strided, 0.125), (q, 0.125)], [0, 1] if dtype == torch.float32 else [0]),
            ([(q, 0.125), (q, 0.125), (q, 0.25)], [0, 2]),
        ):
            got, ran = step(torch.ops.kvslim_cpp.page_attend, variant)
            assert ran == python_layers
            for (_, scale), a, b in zip(variant, got, want, strict=True):
                assert torch.equal(a, b) == (scale == 0.125)  # (another scale: the check can fail)
        if dtype == torch.float32:  # (a bfloat16 model stages in bfloat16)
            assert pool.stage_dtype == torch.float16
            with pytest.raises(ValueError, match="a key value is not finite in float16"):  # the Python op's own error
                step(torch.ops.kvslim_cpp.page_attend, layers, (k, k * 1e5))  # past float16's range at layer 1
            assert seen == [0, 1]
