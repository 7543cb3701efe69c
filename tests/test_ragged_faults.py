"""A ragged step keeps one row's failure to that row (kvslim.cache.ragged, generate.forward_rows(errors=)): the
row is dropped from the step and the other rows' logits are bit-identical to the step without it."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim import SlimCache
from kvslim import generate as gen

SPECS = ["int4,sink=4,window=60", "none", "q8_0,residual=32", "int8"]
PROMPTS = [37, 9, 80, 20]


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _caches(model):
    g = torch.Generator().manual_seed(3)
    caches = []
    with torch.inference_mode():
        for spec, n in zip(SPECS, PROMPTS, strict=True):
            cache = SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
            gen.prefill(model, torch.randint(3, 128, (1, n), generator=g), cache)
            caches.append(cache)
    return caches


def _fail_at(cache, layer: int, exc: Exception):
    """Make ``cache``'s store of ``layer`` refuse its next append, as non-finite K/V would."""
    store = cache.layers[layer].store

    def refuse(*args, **kwargs):
        raise exc

    store.append = refuse


@pytest.mark.parametrize("layer", [0, 1])
def test_a_failing_row_is_dropped_and_the_others_are_exact(model, layer):
    bad, good = _caches(model), _caches(model)
    _fail_at(bad[1], layer, ValueError("keys hold non-finite values"))
    errors: dict = {}
    with torch.inference_mode():
        got = gen.forward_rows(model, [5, 6, 7, 8], bad, errors=errors)
        ref = gen.forward_rows(model, [5, 6, 7, 8], good)
    assert set(errors) == {1} and "non-finite" in str(errors[1])
    for b in (0, 2, 3):
        assert torch.equal(got[b], ref[b]), b
    # the rows that went on stored their token; the dropped row's store took nothing in the failing layer
    for b in (0, 2, 3):
        assert bad[b].get_seq_length() == good[b].get_seq_length()


def test_real_non_finite_keys_drop_only_that_row(model):
    """A NaN in one row's hidden state (through its token's embedding) reaches its K/V: that row alone fails."""
    bad, good = _caches(model), _caches(model)
    emb = model.get_input_embeddings()
    saved = emb.weight[9].clone()
    errors: dict = {}
    try:
        with torch.no_grad():
            emb.weight[9] = float("nan")
        with torch.inference_mode():
            got = gen.forward_rows(model, [5, 9, 7, 8], bad, errors=errors)
    finally:
        with torch.no_grad():
            emb.weight[9] = saved
    with torch.inference_mode():
        ref = gen.forward_rows(model, [5, 9, 7, 8], good)
    assert set(errors) == {1}
    for b in (0, 2, 3):
        assert torch.equal(got[b], ref[b]), b


def test_without_errors_the_first_failure_raises(model):
    bad = _caches(model)
    _fail_at(bad[2], 0, ValueError("values hold non-finite values"))
    with torch.inference_mode(), pytest.raises(ValueError, match="non-finite"):
        gen.forward_rows(model, [5, 6, 7, 8], bad)


def test_every_row_failing_raises(model):
    bad = _caches(model)
    for c in bad:
        _fail_at(c, 0, ValueError("keys hold non-finite values"))
    errors: dict = {}
    with torch.inference_mode(), pytest.raises(ValueError, match="non-finite"):
        gen.forward_rows(model, [5, 6, 7, 8], bad, errors=errors)
    assert set(errors) == {0, 1, 2, 3}


def test_a_key_beyond_float16_drops_only_its_row(model):
    """The step casts its whole layer to float16 at once (kvslim.cache.ragged._halves); a finite key beyond float16's
    range in one row (its residual keeps float16) makes that row alone fail, with the batch-1 cache's error."""
    bad, good = _caches(model), _caches(model)

    def huge(module, args, out):
        out = out.clone()
        out[:, 3] = 1e5  # row 3's token (one token a row, packed in row order); its int8 cache keeps a float16 residual
        return out

    hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(huge)
    errors: dict = {}
    try:
        with torch.inference_mode():
            got = gen.forward_rows(model, [5, 6, 7, 8], bad, errors=errors)
    finally:
        hook.remove()
    with torch.inference_mode():
        ref = gen.forward_rows(model, [5, 6, 7, 8], good)
    assert set(errors) == {3} and "beyond float16's range" in str(errors[3])
    for b in (0, 1, 2):
        assert torch.equal(got[b], ref[b]), b


def test_the_layer_wide_cast_stores_each_rows_own_bits(model, monkeypatch):
    """Cast once for the layer or row by row: every row stores the same float16 residual, the same logits."""
    from kvslim.cache import ragged

    once, alone = _caches(model), _caches(model)
    with torch.inference_mode():
        got = [gen.forward_rows(model, [5 + s, 6, 7, 8 + s], once) for s in range(3)]
        monkeypatch.setattr(ragged, "_halves", lambda k, v: None)
        ref = [gen.forward_rows(model, [5 + s, 6, 7, 8 + s], alone) for s in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    for c, d in zip(once, alone, strict=True):
        for la, lb in zip(c.layers, d.layers, strict=True):
            for role in ("k", "v"):
                x, y = getattr(la.store, role).fp.view(), getattr(lb.store, role).fp.view()
                assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))
