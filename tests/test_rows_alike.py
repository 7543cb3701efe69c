"""Products that round a row alike at any row count (kvslim's own kernel, kvslim.kernels.linear), and what rests on
them: the Hadamard basis' small products (a re-based row's moved queries, a flushed group) run there, rows rotated
together get the bits each gets alone, and an engine step whose every product is kvslim's carries no filler rows
(kvslim.cache.ragged, "Filler rows"): a row's logits alone in a step of 1 equal its logits among 2, 3 or 5."""

from __future__ import annotations

import copy

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim import SlimCache
from kvslim import generate as gen
from kvslim.cache import hadamard as had
from kvslim.cache.hadamard import Hadamard, sylvester
from kvslim.engine import linears as lin
from kvslim.engine.linears import Linears

own = pytest.mark.skipif(not lin.kvslim_ready(), reason="kvslim's linear kernel needs AVX2 and FMA (or AVX-512)")


@own
@pytest.mark.parametrize("dim", [32, 64, 96])
def test_hadamard_rows_rotate_alike_at_any_row_count(dim):
    """Each row of a product of 1-13 rows is bit for bit that row rotated alone, at every place, and the
    rotation is H x up to float32 rounding (torch's mm with the Sylvester matrix)."""
    h = Hadamard.for_head_dim(dim)
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(13, 3, dim, generator=g) * torch.logspace(-3, 3, dim)  # channels over six decades
    assert Hadamard.row_invariant(x)
    for n in range(1, 14):
        together = h.apply(x[:n])
        for i in range(n):
            assert torch.equal(together[i], h.apply(x[i : i + 1])[0]), (n, i)
    blocks = torch.block_diag(*[sylvester(h.block).float()] * (dim // h.block))
    ref = torch.mm(x.reshape(-1, dim), blocks).view(x.shape)
    torch.testing.assert_close(h.apply(x), ref, rtol=1e-5, atol=1e-5 * float(x.abs().max()))
    torch.testing.assert_close(h.inverse(h.apply(x)), x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))


def test_hadamard_keeps_torch_where_the_kernel_cannot_serve():
    """Autograd and float16 stay correct: a tensor that needs a gradient goes through torch's mm (kvslim's kernel has
    no backward), even after the block's matrix was first built inside inference_mode, and the product's dtype is
    float32 whatever came in."""
    h = Hadamard.for_head_dim(32)
    had._BLOCKS.clear()
    had._block_f32.cache_clear()
    with torch.inference_mode():
        h.apply(torch.randn(2, 32))
    x = torch.randn(4, 32, requires_grad=True)
    y = h.apply(x)
    assert y.grad_fn is not None and not Hadamard.row_invariant(x)
    y.sum().backward()
    assert x.grad is not None
    z = h.apply(torch.randn(4, 32).half())
    assert z.dtype == torch.float32
    with torch.no_grad():
        assert Hadamard.row_invariant(x) == lin.kvslim_ready()


def test_the_kernel_is_resolved_once(monkeypatch):
    """Whether the build has the kernel is probed once per library load (every eager CPU rotation of a process rounds
    alike), probed again after the library is reset, and a tensor subclass keeps torch's mm."""
    from kvslim.kernels import linear

    monkeypatch.setattr(had, "_OWN", [])
    x = torch.randn(2, 32)
    Hadamard.for_head_dim(32).apply(x)
    assert [linear] == had._OWN and Hadamard.row_invariant(x) == lin.kvslim_ready()
    if lin.kvslim_ready():
        assert torch.float32 in linear._READY
        from kvslim.kernels import clib

        clib._reset_for_tests()
        assert torch.float32 not in linear._READY
        assert Hadamard.row_invariant(x) and torch.float32 in linear._READY
    assert not Hadamard.row_invariant(torch.nn.Parameter(x))  # a subclass: no memory of its own to hand to C


def test_row_multiple_is_1_only_where_every_product_is_kvslims():
    model = kvslim.enable(tiny_model("llama"))
    with Linears(model, "torch").routed() as r:
        assert r.row_multiple() == gen.ROW_MULTIPLE
    if lin.onednn_ready():
        with Linears(model, "onednn").routed() as r:
            assert r.row_multiple() == gen.ROW_MULTIPLE
    if not lin.kvslim_ready():
        return
    route = Linears(model, "kvslim")
    with route.routed() as r:
        assert r.row_multiple() == 1
    assert route.row_multiple() == gen.ROW_MULTIPLE  # outside its block nothing is routed
    # a weight replaced by another dtype since: that module's products are torch's again
    head = model.lm_head
    kept = head.weight
    head.weight = torch.nn.Parameter(kept.detach().double())
    try:
        with route.routed() as r:
            assert r.row_multiple() == gen.ROW_MULTIPLE
    finally:
        head.weight = kept
    # a module whose forward is somebody else's is not routed: its products round as torch's do
    other = model.model.layers[0].mlp.up_proj
    other.__dict__["forward"] = lambda x: torch.nn.functional.linear(x, other.weight)
    try:
        with route.routed() as r:
            assert r.row_multiple() == gen.ROW_MULTIPLE
    finally:
        del other.__dict__["forward"]
    # a weight product that is no nn.Linear (an expert's 3-D weights, a quantized linear's packed weights kept as
    # buffers): fillers stay
    mlp = model.model.layers[0].mlp
    mlp.register_buffer("qweight", torch.zeros(4, 4, dtype=torch.int32))
    with Linears(model, "kvslim").routed() as r:
        assert r.row_multiple() == gen.ROW_MULTIPLE
    del mlp._buffers["qweight"]
    with Linears(model, "kvslim").routed() as r:
        assert r.row_multiple() == 1
    mlp.register_parameter("experts", torch.nn.Parameter(torch.zeros(2, 4, 4)))
    with Linears(model, "kvslim").routed() as r:
        assert r.row_multiple() == gen.ROW_MULTIPLE


#: rows of several formats: a Hadamard K basis (int4, int2), GGML blocks, a window whose rows sit in two RoPE frames
#: after the re-base at 4,096 (their moved queries rotated together), copies that flush together
ROWS = [
    ("int4,group=8,residual=8", 45),
    ("int4,group=8,residual=8", 45),
    ("q8_0,k=int8,group=8,residual=8", 40),
    ("int2,group=8,residual=8", 33),
    ("int4,sink=4,window=48,group=8,residual=8", 4090),
    ("int4,sink=4,window=48,group=8,residual=8", 4093),
]


@own
def test_steps_without_fillers_give_each_row_its_own_bits(monkeypatch):
    """Through kvslim's route a step carries exactly its rows (no filler token in the forward), and every row's
    logits, step after step, are bit for bit the row's alone (a forward of one token) — across flushes, the window's
    evictions and the re-base, with the moved queries of rows in two frames rotated in one product."""
    model = kvslim.enable(tiny_model(num_hidden_layers=3, max_position_embeddings=8192))
    g = torch.Generator().manual_seed(11)
    caches = []
    for spec, n in ROWS:
        cache = SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
        with torch.inference_mode():
            gen.prefill(model, torch.randint(3, 120, (1, n), generator=g), cache, chunk_size=2048)
        caches.append(cache)
    alone = [copy.deepcopy(c) for c in caches]
    widths = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[-1]))
    rotated = []
    real = Hadamard.apply
    monkeypatch.setattr(Hadamard, "apply", lambda self, x: rotated.append(tuple(x.shape)) or real(self, x))
    route = Linears(model, "kvslim")
    tokens = torch.randint(3, 120, (12, len(caches)), generator=g).tolist()
    try:
        with torch.inference_mode(), route.routed() as r:
            for s in range(12):
                n = (1, 2, 3, 5, 6)[s % 5]  # rows in the step: none a multiple of 4 but one
                widths.clear()
                rotated.clear()
                together = gen.forward_rows(model, tokens[s][:n], caches[:n], row_multiple=r.row_multiple())
                assert widths == [n], (s, widths)  # no filler rows
                if n == 6 and s >= 6:  # both windowed rows past 4,096: their moved queries in one product a layer
                    assert rotated.count((2, 2, 2, 32)) == 3, (s, rotated)
                for b in range(n):
                    one = gen.forward_rows(model, [tokens[s][b]], [alone[b]], row_multiple=r.row_multiple())
                    assert torch.equal(together[b], one[0]), (s, b, ROWS[b][0])
                for b in range(n, len(caches)):  # the rows left out of this step keep in step alone
                    gen.forward_rows(model, [tokens[s][b]], [caches[b]], row_multiple=r.row_multiple())
                    gen.forward_rows(model, [tokens[s][b]], [alone[b]], row_multiple=r.row_multiple())
    finally:
        hook.remove()
