"""The direct paged step (kvslim.cache.paged_direct): a Llama, Mistral or Qwen2 model's paged forward written out
without transformers' module stack gives the model's own logits bit for bit, in decode steps, prompt chunks and
filler rows, through every route of the linear layers; a model or a state it cannot vouch for (a hook, a subclass,
training, autograd, another attention, another family) runs the model's own forward, and says why."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import family_model, tiny_model
from kvslim.cache import paged_direct
from kvslim.cache.paged_adapter import forward_pages
from kvslim.cache.pagepool import pool_for
from kvslim.engine.linears import Linears


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def direct_on():
    was = paged_direct.ENABLED
    paged_direct.ENABLED = True
    yield
    paged_direct.ENABLED = was


def _run(model, spec: str, direct: bool, route: str | None = None) -> list[torch.Tensor]:
    """Two rows prefilled (one in two chunks), then steps mixing their decode tokens with a third row's prompt
    chunks, with and without filler rows: every step's logits."""
    was = paged_direct.ENABLED
    paged_direct.ENABLED = direct
    out = []
    try:
        with torch.inference_mode():
            pool = pool_for(model, spec, pages=30, max_rows=3)
            a, b, c = pool.new_row(), pool.new_row(), pool.new_row()
            out.append(forward_pages(model, pool, [(_ids(40, 1), a)]))
            out.append(forward_pages(model, pool, [(_ids(30, 2), b)]))
            out.append(forward_pages(model, pool, [(_ids(9, 3), b)], row_multiple=1))
            c_prompt = _ids(45, 4)
            for i, (ta, tb) in enumerate(zip(_ids(8, 5), _ids(8, 6), strict=True)):
                feeds = [([ta], a), ([tb], b)]
                if i < 3:
                    feeds.append((c_prompt[15 * i : 15 * (i + 1)], c))
                if route is None:
                    out.append(forward_pages(model, pool, feeds, row_multiple=4 if i % 2 else 1))
                else:
                    lin = Linears(model, route, batch_hint=4)
                    with lin.routed() as r:
                        out.append(forward_pages(model, pool, feeds, row_multiple=r.row_multiple()))
    finally:
        paged_direct.ENABLED = was
    return out


@pytest.mark.parametrize(
    ("arch", "spec"),
    [
        ("llama", "none"),
        ("llama", "int4"),
        ("llama", "q4_0,sink=4,window=24,residual=0,positions=original"),
        ("mistral", "int4"),
        ("qwen2", "q8_0"),  # biases on q, k and v
    ],
)
def test_the_direct_step_gives_the_models_own_logits_bit_for_bit(arch, spec):
    model = kvslim.enable(tiny_model(arch))
    with torch.inference_mode():
        assert paged_direct.why_not(model) is None
    want = _run(model, spec, direct=False)
    got = _run(model, spec, direct=True)
    assert len(got) == len(want) == 11
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("route", ["torch", "kvslim"])
def test_the_direct_step_keeps_the_linear_route(route):
    from kvslim.engine.linears import kvslim_ready

    if route == "kvslim" and not kvslim_ready():
        pytest.skip("kvslim's linear kernel is not built here")
    model = kvslim.enable(tiny_model("llama"))
    assert all(
        torch.equal(g, w) for g, w in zip(_run(model, "int4", True, route), _run(model, "int4", False, route))
    )


def test_the_direct_step_renews_the_workers_spin_three_times_a_layer(monkeypatch):
    """Before each of a layer's three long stretches of Python (kvslim.kernels.clib.pool_renewer); the logits are
    the same with it off."""
    model = kvslim.enable(tiny_model("llama"))
    calls = []
    monkeypatch.setattr(paged_direct, "_renewer", lambda on: (lambda: calls.append(1)) if on else (lambda: None))
    with_renew = _run(model, "int4", True)
    steps = len(with_renew)
    assert len(calls) == 3 * model.config.num_hidden_layers * steps, (len(calls), steps)
    monkeypatch.setattr(paged_direct, "RENEW", False)
    calls.clear()
    assert all(torch.equal(g, w) for g, w in zip(_run(model, "int4", True), with_renew, strict=True))
    assert not calls


def test_the_direct_step_in_bfloat16():
    model = kvslim.enable(tiny_model("llama", dtype=torch.bfloat16))
    assert all(
        torch.equal(g, w) for g, w in zip(_run(model, "int4", True), _run(model, "int4", False), strict=True)
    )


def test_the_direct_step_is_taken(direct_on):
    """The step runs without the decoder layers' __call__."""
    model = kvslim.enable(tiny_model("llama"))
    layer_calls = []
    orig = type(model.model.layers[0]).__call__

    def spy(self, *a, **k):
        layer_calls.append(1)
        return orig(self, *a, **k)

    with torch.inference_mode():
        pool = pool_for(model, "int4", pages=8, max_rows=1)
        row = pool.new_row()
        try:
            type(model.model.layers[0]).__call__ = spy
            forward_pages(model, pool, [(_ids(20, 0), row)])
        finally:
            type(model.model.layers[0]).__call__ = orig
    assert layer_calls == []


def test_the_attention_name_is_kvslims():
    from kvslim.attention import NAME

    assert paged_direct.ATTENTION == NAME


def _why(model) -> str | None:
    with torch.inference_mode():
        return paged_direct.why_not(model)


def test_what_the_direct_step_leaves_to_the_model(direct_on):
    model = kvslim.enable(tiny_model("llama"))
    assert _why(model) is None
    assert paged_direct.why_not(model) == "autograd is recording"
    handle = model.model.layers[1].register_forward_pre_hook(lambda *a: None)
    assert "layer 1's modules are not plain LlamaDecoderLayer ones" in _why(model)
    handle.remove()
    handle = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda *a: None)
    assert "a module of layer 1 has a hook" in _why(model)
    handle.remove()
    handle = model.lm_head.register_forward_pre_hook(lambda *a: None)
    assert "final norm or head has a hook" in _why(model)
    handle.remove()
    handle = model.register_forward_hook(lambda *a: None)
    assert "the model or its decoder has a forward or hook of its own" in _why(model)
    handle.remove()
    model.train()
    assert "is training" in _why(model)
    model.eval()
    model.model.layers[0].mlp.forward = lambda x: x
    assert "layer 0's modules" in _why(model)
    del model.model.layers[0].mlp.forward
    assert _why(model) is None
    paged_direct.ENABLED = False
    assert "off" in _why(model)
    paged_direct.ENABLED = True
    plain = tiny_model("llama")  # sdpa: the paged step would refuse it in the model's own forward too
    assert "attention implementation is 'sdpa'" in _why(plain)
    assert "Qwen3ForCausalLM is not one of" in _why(kvslim.enable(tiny_model("qwen3")))
    assert "sliding window" in _why(kvslim.enable(family_model("mistral_sliding")))


@pytest.mark.parametrize("path", [
    "input_layernorm", "post_attention_layernorm", "mlp.act_fn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
])  # fmt: skip
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_a_hook_on_any_module_the_step_calls_is_seen(direct_on, path, kind):
    model = kvslim.enable(tiny_model("llama"))
    module = model.model.layers[1].get_submodule(path)
    handle = getattr(module, f"register_{kind}_hook")(lambda *a: None)
    assert _why(model) == "a module of layer 1 has a hook"
    handle.remove()
    assert _why(model) is None


def test_a_submodule_shadowed_in_the_instance_dict_is_the_one_checked(direct_on):
    model = kvslim.enable(tiny_model("llama"))
    layer = model.model.layers[0]
    hooked = type(layer.mlp)(model.config).eval()
    hooked.gate_proj.register_forward_hook(lambda *a: None)
    object.__setattr__(layer, "mlp", hooked)  # in __dict__, ahead of _modules: what `layer.mlp` now returns
    try:
        assert _why(model) == "a module of layer 0 has a hook"
    finally:
        del layer.__dict__["mlp"]
    assert _why(model) is None


@pytest.mark.parametrize("where", ["layer", "q_proj"])
def test_a_hooked_module_runs_the_models_forward_and_its_hook(direct_on, where):
    model = kvslim.enable(tiny_model("llama"))
    fired = []
    layer = model.model.layers[0]
    (layer if where == "layer" else layer.self_attn.q_proj).register_forward_hook(lambda *a: fired.append(1))
    want = _run(model, "int4", direct=False)
    fired.clear()
    got = _run(model, "int4", direct=True)
    assert len(fired) == 11 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.slow
def test_the_embedded_model_direct_step_is_its_forward_bit_for_bit():
    from kvslim.models.load import load_model

    model = kvslim.enable(load_model(None)[0])
    prompt = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = []
    for direct in (False, True):
        paged_direct.ENABLED = direct
        try:
            with torch.inference_mode():
                pool = pool_for(model, "int4", pages=24, max_rows=2)
                rows = [pool.new_row(), pool.new_row()]
                logits = [
                    forward_pages(model, pool, [(prompt, rows[0])]),
                    forward_pages(model, pool, [(prompt[:200], rows[1])]),
                ]
                toks = [int(logits[0].argmax()), int(logits[1].argmax())]
                for _ in range(16):
                    out = forward_pages(model, pool, [([t], r) for t, r in zip(toks, rows)], row_multiple=1)
                    logits.append(out)
                    toks = out.argmax(-1).tolist()
            runs.append(logits)
        finally:
            paged_direct.ENABLED = True
    assert all(torch.equal(g, w) for g, w in zip(runs[1], runs[0], strict=True))
