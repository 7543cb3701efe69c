"""The engine's route for a model's linear layers (kvslim.engine.linears): oneDNN, with the weights as they are
or packed, installed around a step and removed after it; rows still bit-identical whatever shares the step."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import blas_row_identity, tiny_model
from kvslim.engine import Engine, Request
from kvslim.engine import linear_probe as probe
from kvslim.engine import linears as lin

pytestmark = pytest.mark.skipif(not lin.onednn_ready(), reason="this torch has no oneDNN")

ROUTED = ("onednn", "packed", pytest.param("kvslim", marks=pytest.mark.skipif(not lin.kvslim_ready(), reason="no AVX2 kernels")))
needs_mkl = pytest.mark.skipif(not lin.mkl_ready(), reason="this torch has no MKL")


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _onednn(x, w, b=None):
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _product(route, x, w, b=None):
    """What ``route`` computes for one product (packed: oneDNN's bits on the same weight)."""
    return probe._product("kvslim" if route == "kvslim" else "onednn", x, w, b)


def test_routes_and_their_errors(model):
    """The default, the error for an unknown route, and an engine that refuses a route before it touches the model."""
    assert lin.Linears(model).asked == "auto" and lin.Linears(model).route in ("torch", "onednn", "kvslim")  # the default
    assert lin.Linears(model, "torch").modules == [] and lin.Linears(model, "torch").reason == ""
    n = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert len(lin.Linears(model, "onednn").modules) == n
    with pytest.raises(ValueError, match="linears must be one of auto, torch, onednn, packed, mkl, kvslim, got 'blas'"):
        lin.Linears(model, "blas")
    with pytest.raises(ValueError, match="linears must be one of"):
        Engine(model, linears="fast")
    fresh = tiny_model("llama", seed=5)
    with pytest.raises(ValueError, match="linears='onednn' routes float32"):
        Engine(fresh.half(), linears="onednn")
    assert fresh.config._attn_implementation == "sdpa"  # refused before kvslim.enable


def _auto(model, torch_ok: bool, onednn_ok: bool, monkeypatch, ready: bool = True, ms=(10.0, 10.0), kvslim=None):
    """auto's choice with the rows' bits (torch_ok, onednn_ok; kvslim: None where kvslim's route does not run, else
    whether it keeps them), readiness and the products' times (torch, oneDNN[, kvslim]) given."""
    ok = {"torch": torch_ok, "onednn": onednn_ok, "kvslim": kvslim}
    monkeypatch.setattr(lin, "rows_invariant", lambda modules, route, rows: ok[route])
    monkeypatch.setattr(lin, "onednn_ready", lambda: ready)
    monkeypatch.setattr(lin, "kvslim_ready", lambda: kvslim is not None)
    asked = []

    def products(modules, rows, routes, exact=False):
        asked.append((tuple(routes), exact))
        return {r: t for r, t in zip(("torch", "onednn", "kvslim"), ms, strict=False) if r in routes}

    monkeypatch.setattr(lin, "products_ms", products)
    got = lin.Linears(model, "auto", batch_hint=8)
    got.timed = asked
    return got


def test_auto_takes_torch_where_its_rows_are_invariant_else_onednn(model, monkeypatch):
    """auto: torch where torch's linear rounds a row alike at every step size (and no other route is faster); else
    the route that does; else torch, saying why (and so does the route's line in a banner)."""
    got = _auto(model, True, True, monkeypatch)
    assert (got.asked, got.route, got.modules) == ("auto", "torch", []) and "alike" in got.reason
    assert "no other route is 1.25x faster (a step's products at 8 rows: torch 10.0 ms, oneDNN 10.0 ms)" in got.reason
    got = _auto(model, False, True, monkeypatch)
    assert got.route == "onednn" and len(got.modules) > 0 and "oneDNN does not" in got.reason
    assert str(got).startswith("linear layers: onednn (") and "auto: torch's linear (MKL) rounds" in str(got)
    assert got.timed == [(("onednn",), False)]  # torch's rows round otherwise: not timed, not taken
    got = _auto(model, False, False, monkeypatch)
    assert got.route == "torch" and "no route rounds a row alike" in got.reason
    got = _auto(model, False, True, monkeypatch, ready=False)
    assert got.route == "torch" and "no other route runs here" in got.reason
    got = _auto(model, True, True, monkeypatch, ready=False)
    assert got.route == "torch" and got.reason == "torch's linear rounds a row alike at every step size here, and no other route runs here"
    got = _auto(model, True, False, monkeypatch, kvslim=False)
    assert got.route == "torch" and got.reason.endswith("and no other route does here")  # they run, but round otherwise
    half = tiny_model("llama", seed=5).half()
    got = lin.Linears(half, "auto")  # nothing to route: torch, never an error (an explicit onednn is one)
    assert got.route == "torch" and "no float32" in got.reason


def test_auto_takes_the_faster_route_where_both_keep_a_rows_bits(model, monkeypatch):
    """Where torch's linear and another route both round a row alike at every step size, auto takes the other only
    where its products are FASTER times quicker (an AMD CPU's MKL), and torch where the other does not keep a row's
    bits however fast it is."""
    got = _auto(model, True, True, monkeypatch, ms=(20.0, 10.0))
    assert got.route == "onednn" and len(got.modules) > 0
    assert got.reason == (
        "oneDNN and torch both round a row alike at every step size here, and oneDNN is faster (a step's products "
        "at 8 rows: oneDNN 10.0 ms, torch 20.0 ms)"
    )
    assert _auto(model, True, True, monkeypatch, ms=(12.4, 10.0)).route == "torch"  # under the margin (1.25x)
    assert _auto(model, True, True, monkeypatch, ms=(12.6, 10.0)).route == "onednn"
    assert _auto(model, True, False, monkeypatch, ms=(99.0, 1.0)).route == "torch"
    assert _auto(model, True, True, monkeypatch, ready=False, ms=(99.0, 1.0)).route == "torch"


def test_auto_weighs_kvslims_route_beside_the_others(model, monkeypatch):
    """kvslim's own linear is one more candidate: timed beside the others where it keeps a row's bits, taken where
    it is the fastest (by the margin over torch), left where another is faster or it does not keep the bits."""
    got = _auto(model, True, True, monkeypatch, ms=(30.0, 20.0, 15.0), kvslim=True)
    assert got.route == "kvslim" and got.timed == [(("torch", "onednn", "kvslim"), False)]
    assert "kvslim and torch both round" in got.reason and "kvslim 15.0 ms, oneDNN 20.0 ms, torch 30.0 ms" in got.reason
    assert _auto(model, True, True, monkeypatch, ms=(30.0, 14.0, 15.0), kvslim=True).route == "onednn"
    assert _auto(model, True, True, monkeypatch, ms=(30.0, 20.0, 15.0), kvslim=False).route == "onednn"
    assert _auto(model, True, False, monkeypatch, ms=(20.0, 1.0, 17.0), kvslim=True).route == "torch"  # 1.18x
    got = _auto(model, False, False, monkeypatch, ms=(20.0, 1.0, 17.0), kvslim=True)
    assert got.route == "kvslim" and got.timed == [(("kvslim",), False)]


def test_auto_for_one_stream_is_speed_alone(model, monkeypatch):
    """A single stream's rows never share a product with another's: no bits to keep alike, every route that runs is
    timed at the stream's own row count (not a step's multiple of 4), the fastest taken by the margin over torch."""
    monkeypatch.setattr(lin, "rows_invariant", lambda *a: pytest.fail("a single stream probes no step sizes"))
    monkeypatch.setattr(lin, "onednn_ready", lambda: True)
    monkeypatch.setattr(lin, "kvslim_ready", lambda: True)
    seen = []

    def products(modules, rows, routes, exact=False):
        seen.append((rows, tuple(routes), exact))
        return dict(zip(routes, (50.0, 35.0, 27.0), strict=True))

    monkeypatch.setattr(lin, "products_ms", products)
    got = lin.Linears(model, "auto", batch_hint=1, single=True)
    assert got.route == "kvslim" and seen == [(1, ("torch", "onednn", "kvslim"), True)]
    assert got.reason == (
        "one stream, and kvslim is faster (a step's products at 1 row: kvslim 27.0 ms, oneDNN 35.0 ms, torch 50.0 ms)"
    )


def test_products_ms_times_both_routes_once(model, monkeypatch):
    """The speed probe runs every routable module's product through both routes, interleaved, and remembers it."""
    modules = [m for m in model.modules() if lin._routable(m)]
    calls = []
    real = probe._product
    def product(route, x, w, b):
        calls.append((route, x.shape[0]))
        return real(route, x, w, b)

    monkeypatch.setattr(probe, "_product", product)
    monkeypatch.setattr(probe, "_PROBED", {})
    times = lin.products_ms(modules, 6)
    assert list(times) == ["torch", "onednn"] and min(times.values()) > 0
    timed = calls[2:]  # after one untimed product through each route
    assert [r for r, _ in calls[:2]] == ["torch", "onednn"]
    assert len(timed) == 2 * lin.PASSES * len(modules) and {n for _, n in calls} == {8}  # step_rows(6) rows
    assert [r for r, _ in timed[:: len(modules)]] == ["torch", "onednn", "onednn", "torch", "torch", "onednn"]
    assert lin.products_ms(modules, 6) == times and len(calls) == 2 + 2 * lin.PASSES * len(modules)
    calls.clear()
    if lin.kvslim_ready():  # three routes, each pass rotating which goes first; a single stream's exact rows
        lin.products_ms(modules, 1, ("torch", "onednn", "kvslim"), exact=True)
        assert {n for _, n in calls} == {1}
        timed = [r for r, _ in calls[3:]][:: len(modules)]
        assert timed[:9] == ["torch", "onednn", "kvslim", "onednn", "kvslim", "torch", "kvslim", "torch", "onednn"]


def test_auto_is_the_default_of_the_engine_and_the_clis():
    import inspect

    from kvslim.bench import concurrency
    from kvslim.serve import build_app

    for fn in (Engine.__init__, concurrency.measure_concurrency, concurrency.run_concurrency, build_app):
        assert inspect.signature(fn).parameters["linears"].default == "auto", fn


def test_rows_invariant_probes_the_models_shapes_once(model, monkeypatch):
    """The probe compares a row's bits at every multiple of 4 up to the step's rows and at the mixed steps' sizes,
    once per process; a product that rounds a row by the step's size is found."""
    modules = [m for m in model.modules() if lin._routable(m)]
    shapes = {tuple(m.weight.shape) for m in modules}
    calls = []
    real = probe._product

    def spy(route, x, w, bias):
        calls.append((route, x.shape[0], tuple(w.shape)))
        return real(route, x, w, bias)

    monkeypatch.setattr(probe, "_product", spy)
    monkeypatch.setattr(probe, "_PROBED", {})
    assert lin.rows_invariant(modules, "onednn", 12)  # oneDNN: every multiple of 4 alike (tested below too)
    sizes = {n for _, n, _ in calls}
    assert {8, 12, *lin.PROBE_ROWS} <= sizes and {s for _, _, s in calls} == shapes
    assert {n for n in sizes if n > 12} == set(lin.PROBE_ROWS)
    n = len(calls)
    assert lin.rows_invariant(modules, "onednn", 12) and len(calls) == n  # remembered

    def by_size(route, x, w, bias):  # a product whose rounding depends on the row count
        return real(route, x, w, bias) * (1 + 1e-7 * (x.shape[0] > 8))

    monkeypatch.setattr(probe, "_product", by_size)
    assert not lin.rows_invariant(modules, "torch", 12)

    def by_place(route, x, w, bias):  # rows past the first 4 of a bigger product rounded otherwise
        out = real(route, x, w, bias)
        return torch.cat([out[:4], out[4:] * (1 + 1e-7)]) if x.shape[0] > 4 else out

    monkeypatch.setattr(probe, "_product", by_place)
    assert not lin.rows_invariant(modules, "onednn", 8)
    monkeypatch.setattr(probe, "_product", by_size)
    assert not lin.rows_invariant(modules, "torch", 4)  # steps of 4 rows alone: found at PROBE_ROWS
    assert not lin.rows_invariant(modules, "onednn", 16)


def test_the_cli_offers_the_routes():
    from kvslim.cli.common import LINEAR_ROUTES

    assert LINEAR_ROUTES == lin.ROUTES


@pytest.mark.parametrize("route", ROUTED)
def test_routed_only_inside_the_block(model, route):
    """Inside routed(): oneDNN's product (close to torch's); after it, even after an error, the modules' own
    forward again."""
    routes = lin.Linears(model, route)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, 8, layer.in_features)
    with torch.inference_mode():
        ref = layer(x)
        with routes.routed():
            assert "forward" in layer.__dict__
            got = layer(x)
        assert "forward" not in layer.__dict__
        assert torch.equal(got, _product(route, x, layer.weight, layer.bias))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="boom"), routes.routed():
            raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_packed_weights_follow_the_model(model):
    """A weight changed in place, or replaced, after packing is packed again before it is used: never stale."""
    m = tiny_model("llama", seed=3)
    routes = lin.Linears(m, "packed", batch_hint=4)
    assert routes.nbytes >= sum(x.weight.numel() * 4 for x in routes.modules)
    layer = m.model.layers[1].self_attn.o_proj
    x = torch.randn(4, layer.in_features)
    with torch.inference_mode():
        with routes.routed():
            before = layer(x)
        assert torch.equal(before, _onednn(x, layer.weight))
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with torch.inference_mode(), routes.routed():
        assert torch.equal(layer(x), _onednn(x, layer.weight))
        assert not torch.equal(layer(x), before)
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
    with torch.inference_mode(), routes.routed():
        assert torch.equal(layer(x), _onednn(x, layer.weight))


@pytest.mark.skipif(not lin.kvslim_ready(), reason="kvslim's linear needs the C kernels with AVX2 and FMA")
def test_kvslims_route_follows_the_weights():
    """kvslim's route checks a weight once (kernels.linear.Prepared): a weight changed in place is read as it is
    now, one replaced (a new Parameter, or new data under the same one) is checked again, never read stale."""
    from kvslim.kernels import linear as kernel

    m = tiny_model("llama", seed=3)
    routes = lin.Linears(m, "kvslim", batch_hint=4)
    layer = m.model.layers[1].self_attn.o_proj
    x = torch.randn(4, layer.in_features)

    def check():
        with torch.inference_mode(), routes.routed():
            assert torch.equal(layer(x), kernel.linear(x, layer.weight, layer.bias))
            assert torch.equal(layer(x), kernel.linear(x, layer.weight, layer.bias))  # (the second through Prepared)

    check()
    assert id(layer) in routes._prepared
    with torch.no_grad():
        layer.weight.mul_(2.0)
    check()
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
    check()
    layer.weight.data = torch.randn_like(layer.weight)
    check()
    with routes.routed():  # autograd recording: torch's own forward, with its backward
        y = layer(x.requires_grad_())
    assert y.requires_grad and y.grad_fn is not None


def test_the_route_holds_only_in_the_thread_that_opened_it():
    """Another thread calling the model while a block is open runs torch's forward; a torch block inside an oneDNN
    one runs torch's; one thread closing its block leaves another thread's block routed."""
    import threading

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(576, 1536))
    x = torch.randn(16, 576)
    stock = torch.nn.functional.linear(x, net[0].weight, net[0].bias)
    onednn = _onednn(x, net[0].weight, net[0].bias)
    assert not torch.equal(stock, onednn)  # the two routes are told apart by their bits here
    a, b = lin.Linears(net, "onednn"), lin.Linears(net, "packed")
    seen: dict = {}
    opened, closed, done = threading.Event(), threading.Event(), threading.Event()

    def other():
        with torch.inference_mode():
            seen["outside"] = net(x)  # while the main thread's block is open
            with b.routed():
                opened.set()
                closed.wait(10)
                seen["own block"] = net(x)  # the main thread's block has closed meanwhile
        done.set()

    with torch.inference_mode():
        with a.routed():
            t = threading.Thread(target=other)
            t.start()
            opened.wait(10)
            assert torch.equal(net(x), onednn)
            with lin.Linears(net, "torch").routed():
                assert torch.equal(net(x), stock)
        closed.set()
        done.wait(10)
        t.join()
    assert torch.equal(seen["outside"], stock)
    assert torch.equal(seen["own block"], _onednn(x, net[0].weight, net[0].bias))
    assert "forward" not in net[0].__dict__ and not lin._INSTALLED


def test_what_is_not_routed():
    """A subclass with its own forward, a half-precision weight, and a call with a half-precision input keep
    torch's route."""

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    net = torch.nn.Sequential(Scaled(32, 32), torch.nn.Linear(32, 32).half(), torch.nn.Linear(32, 32))
    routes = lin.Linears(net, "onednn")
    assert routes.modules == [net[2]]
    x = torch.randn(4, 32)
    with torch.inference_mode(), routes.routed():
        assert torch.equal(net[0](x), 2 * torch.nn.functional.linear(x, net[0].weight, net[0].bias))
        y = net[2](x.half().float())
        assert torch.equal(y, _onednn(x.half().float(), net[2].weight, net[2].bias))
        with pytest.raises(RuntimeError):  # torch's own error for a half input against a float weight
            net[2](x.half())
    # a non-contiguous bias, autograd recording, an inference-mode weight, a model with nothing to route
    odd = torch.nn.Linear(32, 16)
    odd.bias = torch.nn.Parameter(torch.randn(32)[::2], requires_grad=False)
    with torch.inference_mode(), lin.Linears(odd, "onednn").routed():
        assert torch.equal(odd(x), torch.nn.functional.linear(x, odd.weight, odd.bias))
    xg = x.clone().requires_grad_()
    with lin.Linears(net, "onednn").routed():
        net[2](xg).sum().backward()
    assert xg.grad is not None and net[2].weight.grad is not None
    with torch.inference_mode():
        frozen = torch.nn.Linear(32, 8)
    routes = lin.Linears(frozen, "packed")
    with torch.inference_mode(), routes.routed():
        assert torch.equal(frozen(x), _onednn(x, frozen.weight, frozen.bias))
    with pytest.raises(ValueError, match="linears='onednn' routes float32 CPU nn.Linear layers, and this model has none"):
        lin.Linears(torch.nn.Linear(4, 4).half(), "onednn")


def test_a_parametrized_linear_is_not_routed_and_the_step_keeps_its_filler_rows():
    """A parametrized module (torch.nn.utils.parametrize; here its bias, its weight still a plain Parameter) is not
    routed, and where it is parametrized after the route was made, row_multiple sees a product the route does not
    run (filler rows again)."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, b):
            return 2 * b

    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    parametrize.register_parametrization(net[0], "bias", Double())
    assert lin.Linears(net, "kvslim").modules == [net[1]]
    plain = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    routes = lin.Linears(plain, "kvslim")
    x = torch.randn(4, 32)
    with torch.inference_mode(), routes.routed() as r:
        assert r.row_multiple() == 1
    parametrize.register_parametrization(plain[0], "bias", Double())
    with torch.inference_mode(), routes.routed() as r:
        assert r.row_multiple() == 4
        want = torch.nn.functional.linear(x, plain[0].weight, 2 * plain[0].parametrizations.bias.original)
        torch.testing.assert_close(plain[0](x), want)  # the parametrized bias, whoever multiplies


@pytest.mark.parametrize("shape", [(576, 576), (576, 192), (576, 1536), (1536, 576), (128, 256)])
@pytest.mark.parametrize("route", ROUTED)
def test_a_row_rounds_the_same_for_every_multiple_of_4(shape, route):
    """What the engine's bit-identity rests on (kvslim.cache.ragged, "Filler rows"): through oneDNN, a row of
    a product is the same bits whatever multiple of 4 rows the product has."""
    k, n = shape
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(1100, k, generator=g)
    routes = lin.Linears(net, route, batch_hint=16)
    with torch.inference_mode(), routes.routed():
        ref = net(x[:4])
        for m in (8, 12, 16, 20, 36, 64, 132, 260, 1028, 1100):
            assert torch.equal(net(x[:m])[:4], ref), m


@pytest.mark.parametrize("route", [*ROUTED, pytest.param("mkl", marks=[blas_row_identity, needs_mkl])])
def test_engine_greedy_equals_each_request_alone(model, route):
    """The engine under each route: every request's tokens equal the request run alone through it, and the
    model is left on torch's route between steps."""
    from test_engine import _requests

    reqs = _requests(n_new=12)[:6]
    engine = Engine(model, max_batch=3, prefill_chunk=32, linears=route)
    seen = []  # whether each q_proj call of the engine's steps went through the route
    hook = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append("forward" in m.__dict__))
    try:
        together = engine.run(reqs)
    finally:
        hook.remove()
    assert seen and all(seen)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert (engine.memory()["packed_weight_bytes"] > 0) == (route in ("packed", "mkl"))
    for req, got in zip(reqs, together, strict=True):
        alone = Engine(model, prefill_chunk=32, linears=route).run([req])[0]
        assert got.tokens == alone.tokens, req.cache.to_spec()


def test_concurrency_bench_takes_the_route(model):
    from kvslim.bench.concurrency import measure_concurrency
    from kvslim.bench.modes import build_modes

    modes, _ = build_modes(model, ["int4"])
    for route in ("torch", "packed"):
        rows = measure_concurrency(model, modes, 24, 4, 1, warmup=0, continuous_batching=False, linears=route)
        assert [r.mode for r in rows] == [m.name for m in modes] and all(r.aggregate_tok_s > 0 for r in rows)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_engine_requests_of_the_real_route_match_torch_route_tokens(model):
    """On the tiny model the routes' rounding differences do not change greedy tokens (a guard that the route
    computes the same products, not a promise for every model)."""
    req = Request(list(range(3, 40)), max_new_tokens=10, cache="int4")
    routes = ("torch", "onednn", "packed", *(("mkl",) if lin.mkl_ready() else ()), *(("kvslim",) if lin.kvslim_ready() else ()))
    got = {r: Engine(model, prefill_chunk=16, linears=r).run([req])[0].tokens for r in routes}
    assert all(tokens == got["torch"] for tokens in got.values()), got


@needs_mkl
@pytest.mark.parametrize("shape", [(576, 576), (576, 192), (576, 1536), (1536, 576), (128, 256), (64, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_mkl_packed_products_are_torchs_bits(shape, threads):
    """The mkl route's claim: at its batch_hint rows MKL's packed sgemm gives the bits of torch's linear (the
    unpacked MKL product) on the same rows; at any other row count it is torch's linear. So the route changes the
    speed, never a row."""
    k, n = shape
    g = torch.Generator().manual_seed(1)
    net = torch.nn.Linear(k, n, bias=n != 64)
    with torch.no_grad():
        net.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(1, 40, k, generator=g)  # the engine's layout: one packed sequence of rows
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        routes = lin.Linears(net, "mkl", batch_hint=16)
        assert routes.nbytes == n * k * 4  # the weight's bytes (MKL reserves more than it fills)
        with torch.inference_mode():
            stock = {m: net(x[:, :m]) for m in (4, 12, 16, 20, 40)}
            with routes.routed():
                for m, ref in stock.items():
                    assert torch.equal(net(x[:, :m]), ref), m
    finally:
        torch.set_num_threads(before)


@needs_mkl
def test_mkl_route_packs_and_follows_the_weights():
    """The packed weight is what a product of batch_hint rows reads (a weight changed in place is packed again,
    never stale), only inside the block; the packed copies are counted."""
    net = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 32))
    routes = lin.Linears(net, "mkl", batch_hint=8)
    assert routes.nbytes == (64 * 96 + 96 * 32) * 4 and "mkl" in str(routes)
    x = torch.randn(8, 64)
    with torch.inference_mode():
        with routes.routed():
            first = net(x)
        assert torch.equal(first, net(x))
    with torch.no_grad():
        net[0].weight.mul_(-1.0)
    with torch.inference_mode():
        with routes.routed():
            again = net(x)
        assert torch.equal(again, net(x)) and not torch.equal(again, first)
        key = id(net[0])
        packed = routes._packed[key][0]
        with routes.routed():  # the packed product really runs: a packed weight of another matrix shows in the bits
            routes._packed[key] = (torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(96, 64), 8), routes._packed[key][1], 0)
            assert torch.equal(net[0](x), torch.zeros(8, 96))
            assert not torch.equal(net[0](x[:4]), torch.zeros(4, 96))  # another row count: torch's own linear
        routes._packed[key] = (packed, routes._packed[key][1], 0)
    assert not any("forward" in m.__dict__ for m in net.modules())
    with torch.inference_mode(), routes.routed(), pytest.raises(RuntimeError):
        net(torch.randn(8, 32))  # a width that does not fit: torch's own error (never a read past the input)
    assert lin.step_rows(1) == 4 and lin.step_rows(6) == 8 and lin.step_rows(16) == 16


def test_mkl_route_refused_without_mkl(monkeypatch):
    monkeypatch.setattr(lin, "mkl_ready", lambda: False)
    with pytest.raises(ValueError, match="linears='mkl' needs torch built with MKL"):
        lin.Linears(torch.nn.Linear(4, 4), "mkl")
