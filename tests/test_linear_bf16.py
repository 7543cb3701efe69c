"""kvslim's linear in bfloat16 (csrc/kvslim_linear.c's kv_linear_bf16, AVX512-BF16): the product torch's bfloat16
linear computes (a float32 sum rounded once to bfloat16), a row's bits its own whatever shares the call, and the
engine's ``kvslim`` route (and ``auto``) taking a bfloat16 model's linear layers."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from kvslim.engine import Engine, Request
from kvslim.engine import linears as routes
from kvslim.kernels import linear as lin

pytestmark = pytest.mark.skipif(
    not lin.ready(torch.bfloat16), reason="kvslim's bfloat16 linear needs AVX512-BF16"
)
BF = torch.bfloat16


@pytest.mark.parametrize(
    ("o", "i"), [(576, 576), (192, 576), (576, 1536), (37, 21), (6, 32), (5, 33), (13, 1), (1, 95)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_torchs_bfloat16_linear_to_rounding(o, i, bias):
    """Every shape (tails of the 32-element steps, odd widths, the tiles' edges) against the float64 product of the
    same bfloat16 inputs: within float32's summing error plus one rounding to bfloat16, and torch's bits almost
    everywhere (the sums' order differs, so a result near a rounding boundary may land one bfloat16 step apart)."""
    g = torch.Generator().manual_seed(o * 1000 + i)
    x, w = torch.randn(19, i, generator=g).to(BF), (torch.randn(o, i, generator=g) / i**0.5).to(BF)
    b = torch.randn(o, generator=g).to(BF) if bias else None
    got = lin.linear(x, w, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.dtype == BF and got.shape == (19, o)
    tol = ref.abs() * 2**-8 + 4 * i * 2**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert bool(((got.double() - ref).abs() <= tol).all())
    same = (got == torch.nn.functional.linear(x, w, b)).double().mean()
    assert float(same) >= 0.98, float(same)


def test_the_sum_is_rounded_once_to_nearest_even():
    """One product of width 1 and a bias: the float32 sum 1 + 2^-8 is a tie, rounded to the even 1.0; 1 + 3 * 2^-8
    to 1 + 2^-6; a NaN stays NaN and infinity infinity (as torch's float32 -> bfloat16 cast)."""
    x = torch.ones(1, 1, dtype=BF)
    w = torch.tensor([[1.0], [1.0 + 2**-7], [float("nan")], [float("inf")], [-3.0]], dtype=BF)
    b = torch.tensor([2**-8, 2**-8, 0.0, 0.0, 2**-9], dtype=BF)
    got = lin.linear(x, w, b)[0]
    want = (torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, float("nan"), float("inf"), -3 + 2**-9])).to(BF)
    assert torch.equal(got[[0, 1, 3, 4]], want[[0, 1, 3, 4]]) and bool(got[2].isnan())
    assert float(got[0]) == 1.0 and float(got[1]) == 1 + 2**-6


def test_a_rows_bits_are_its_own_whatever_shares_the_call():
    g = torch.Generator().manual_seed(1)
    w, b = (torch.randn(150, 100, generator=g) / 10).to(BF), torch.randn(150, generator=g).to(BF)
    x = torch.randn(140, 100, generator=g).to(BF)
    alone = torch.stack([lin.linear(x[r : r + 1], w, b)[0] for r in range(140)])
    for n in (1, 2, 3, 4, 5, 7, 16, 17, 64, 65, 140):
        for start in (0, 1, 70 - n // 2, 140 - n):
            assert torch.equal(lin.linear(x[start : start + n], w, b), alone[start : start + n]), (n, start)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(lin.linear(x, w, b), alone), threads
    finally:
        torch.set_num_threads(before)


def test_prepared_and_the_errors():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(24, 64, generator=g).to(BF), torch.randn(24, generator=g).to(BF)
    x = torch.randn(2, 5, 64, generator=g).to(BF)
    p = lin.Prepared.of(w, b)
    with torch.inference_mode():
        assert torch.equal(p(x), lin.linear(x, w, b)) and p(x.float()) is None
    assert p.fits(w, b) and not p.fits(w.float(), b)
    assert lin.Prepared.of(w, b.float()) is None  # a bias of another dtype
    assert not lin.ready(torch.float16) and lin.Prepared.of(w.half(), None) is None
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensors, all of one dtype"):
        lin.linear(x.float(), w, b)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensors, all of one dtype"):
        lin.linear(x.half(), w.half())


def test_the_kvslim_route_and_auto_take_a_bfloat16_model():
    """kvslim's route runs a bfloat16 model's products through the kernel; auto times it against torch's (the only
    other route for bfloat16) and says so; oneDNN's route still refuses a bfloat16 model in one line."""
    model = tiny_model("llama", seed=4).to(BF)
    mine = routes.Linears(model, "kvslim", batch_hint=4)
    assert len(mine.modules) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(4, layer.in_features).to(BF)
    with torch.inference_mode(), mine.routed():
        assert torch.equal(layer(x), lin.linear(x, layer.weight, layer.bias))
        assert torch.equal(layer(x), lin.linear(x, layer.weight, layer.bias))  # (through Prepared)
        with pytest.raises(RuntimeError, match="same dtype"):  # another dtype than the weight's: torch's own error
            layer(x.float())
    auto = routes.Linears(model, "auto", batch_hint=4)
    assert auto.route in ("torch", "kvslim") and "kvslim" in auto.reason, auto.reason
    with pytest.raises(ValueError, match="linears='onednn' routes float32 CPU nn.Linear layers"):
        routes.Linears(model, "onednn")


def test_engine_greedy_in_bfloat16_equals_each_request_alone():
    """A bfloat16 model in the engine on kvslim's route: every request's tokens are those it gets alone (a row's
    products its own at any row count: no filler rows)."""
    import kvslim

    model = kvslim.enable(tiny_model("llama", seed=6).to(BF))
    reqs = [
        Request(list(range(3 + k, 30 + 3 * k)), max_new_tokens=10, cache=c)
        for k, c in enumerate(["int4", "none", "int4,sink=2,window=14"])
    ]
    engine = Engine(model, max_batch=3, prefill_chunk=16, linears="kvslim")
    together = engine.run(reqs)
    for req, got in zip(reqs, together, strict=True):
        assert got.tokens == Engine(model, prefill_chunk=16, linears="kvslim").run([req])[0].tokens, req.cache
