"""The transformers compatibility matrix: what every supported release must do, spelled through
kvslim.compat so the same file runs against the oldest and the newest (``.ci/run`` does), plus the
one-time warning for a lossy cache read through a materializing attention.

The rest of the suite is written for the newest release (``cache=``); this file is the part CI also
runs against the oldest.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import kvslim
from conftest import ARCHS, tiny_model
from kvslim import SlimCache, compat
from kvslim.generate import forward, greedy

ROOT = Path(__file__).resolve().parents[1]


def _ids(length, seed=0, batch=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _run(model, cache, ids, prefill):
    """kvslim's loop: prefill, then one token at a time; all logits (B, T, V)."""
    out = [forward(model, ids[:, :prefill], cache, logits_to_keep=0)]
    for t in range(prefill, ids.shape[1]):
        out.append(forward(model, ids[:, t : t + 1], cache, logits_to_keep=0))
    return torch.cat(out, dim=1)


# -- the supported range is stated once and tested -------------------------------------------------


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def test_supported_range_is_the_one_declared_documented_and_run_by_ci():
    spec = re.search(r'"(transformers[^"]*)"', (ROOT / "pyproject.toml").read_text())[1]
    oldest, newest = compat.OLDEST, compat.NEWEST
    major, minor = (int(x) for x in newest.split(".")[:2])
    assert spec.replace(" ", "") == f"transformers>={_minor(oldest)},<{major}.{minor + 1}", spec
    readme = (ROOT / "README.md").read_text()
    assert f"transformers {_minor(oldest)} to {_minor(newest)}" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"TRANSFORMERS_OLDEST={oldest}" in ci and f"TRANSFORMERS={newest}" in ci, "CI must run both ends"
    makefile = (ROOT / "Makefile").read_text()
    assert f"TRANSFORMERS        ?= {newest}" in makefile and f"TRANSFORMERS_OLDEST ?= {oldest}" in makefile


def test_installed_release_is_in_the_supported_range():
    assert compat.at_least(compat.OLDEST)
    assert not compat.at_least(re.sub(r"^(\d+)\.(\d+).*", lambda m: f"{m[1]}.{int(m[2]) + 1}", compat.NEWEST))


def test_cache_keyword_reaches_the_model():
    model = tiny_model("llama")
    ids = _ids(12)
    cache = SlimCache(config=model.config)
    with torch.no_grad():
        model(ids, **compat.cache_kwargs(cache))
    assert cache.get_seq_length() == 12 == cache.stored_tokens()


def test_mask_query_length_reads_both_forms():
    assert compat.mask_query_length(3) == 3
    assert compat.mask_query_length(torch.arange(10, 13)) == 3  # cache_position, before 5.4


def test_layer_types_are_per_layer_and_windows_only_on_sliding_layers():
    from conftest import tiny_config

    types, kwargs = compat.layer_types_and_kwargs(tiny_config("llama"))
    assert types == ["full_attention"] * 2 and kwargs == [{}, {}]
    import transformers

    sliding = transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, sliding_window=8
    )
    types, kwargs = compat.layer_types_and_kwargs(sliding)
    assert types == ["sliding_attention"] * 2 and kwargs == [{"sliding_window": 8}] * 2


# -- what every supported release must do --------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_cache_matches_dynamic_cache(arch):
    model = tiny_model(arch)
    ids = _ids(20)
    with torch.no_grad():
        ref = _run(model, DynamicCache(config=model.config), ids, 13)
        got = _run(model, SlimCache(config=model.config), ids, 13)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5])
def test_streaming_equals_a_dynamic_cache_cut_by_hand(chunk):
    """sink + window far past the window: the same logits as a plain DynamicCache cut to the kept tokens by
    hand after every forward, fed explicit absolute positions (an independent reference)."""
    model = tiny_model("llama")
    sink, window, n = 2, 6, 30
    ids = _ids(n)
    with torch.no_grad():
        slim = SlimCache(sink=sink, window=window, positions="original", config=model.config)
        got = torch.cat(
            [forward(model, ids[:, s : s + chunk], slim, logits_to_keep=0) for s in range(0, n, chunk)], 1
        )
        ref, plain = [], DynamicCache(config=model.config)
        for s in range(0, n, chunk):
            piece = ids[:, s : s + chunk]
            pos = torch.arange(s, s + piece.shape[1])[None]
            ref.append(model(piece, position_ids=pos, use_cache=True, **compat.cache_kwargs(plain)).logits)
            for layer in plain.layers:
                if layer.keys.shape[2] > sink + window:
                    layer.keys = torch.cat([layer.keys[:, :, :sink], layer.keys[:, :, -window:]], dim=2)
                    layer.values = torch.cat([layer.values[:, :, :sink], layer.values[:, :, -window:]], dim=2)
    torch.testing.assert_close(got, torch.cat(ref, 1), atol=1e-5, rtol=0)
    assert slim.stored_tokens() == sink + window and slim.get_seq_length() == n


@pytest.mark.parametrize("spec", [dict(kv_quantize="int4"), dict(kv_quantize="q4_0", sink=2, window=12)])
def test_compressed_attention_equals_the_materializing_path(spec):
    ids = _ids(40)
    kw = dict(group_size=8, residual=8, **spec)
    model = tiny_model("llama")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _run(model, SlimCache(config=model.config, **kw), ids, 20)
        kvslim.enable(model)
        cache = SlimCache(config=model.config, **kw)
        assert cache.compressed_attention
        got = _run(model, cache, ids, 20)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)


def test_model_generate_with_a_bounded_compressed_cache():
    """transformers' own generate() drives the cache (with the release's cache keyword); the library
    loop gives the same greedy tokens, and the cache stays bounded."""
    model = kvslim.enable(tiny_model("llama"))
    ids = _ids(10)
    kw = dict(kv_quantize="int4", sink=2, window=14, group_size=8, residual=8)
    with torch.no_grad():
        cache = SlimCache(config=model.config, **kw)
        out = model.generate(
            ids, max_new_tokens=30, do_sample=False, pad_token_id=0, **compat.cache_kwargs(cache)
        )
        mine = list(greedy(model, ids, SlimCache(config=model.config, **kw), 30))
    assert out.shape[1] == 40
    assert cache.stored_tokens() <= 16 < cache.get_seq_length()
    assert mine == out[0, 10:].tolist()


# -- the one-time warning -----------------------------------------------------------------------


@pytest.fixture
def fresh_warning(monkeypatch):
    import kvslim.cache.layer_adapter

    monkeypatch.setattr(kvslim.cache.layer_adapter, "_materializing_warned", False)


def _materializing_warnings(model, spec, steps=3):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = SlimCache(config=model.config, **spec)
        with torch.no_grad():
            _run(model, cache, _ids(8 + steps), 8)
            _run(
                model, SlimCache(config=model.config, **spec), _ids(8 + steps), 8
            )  # a second cache: still once
    return [w for w in caught if "kvslim.enable(model)" in str(w.message)]


def test_lossy_cache_under_sdpa_warns_once_with_the_fix(fresh_warning):
    got = _materializing_warnings(tiny_model("llama"), dict(kv_quantize="int4"))
    assert len(got) == 1
    assert "use_compressed_attention(True)" in str(got[0].message)


def test_no_warning_under_kvslim_attention_or_for_a_lossless_cache(fresh_warning):
    assert _materializing_warnings(kvslim.enable(tiny_model("llama")), dict(kv_quantize="int4")) == []
    assert _materializing_warnings(tiny_model("llama"), dict(kv_quantize="none", sink=2, window=8)) == []


def test_no_warning_when_the_materializing_path_is_chosen_explicitly(fresh_warning):
    model = tiny_model("llama")
    assert _materializing_warnings(model, dict(kv_quantize="int4", compressed_attention=False)) == []


def test_the_fix_the_warning_names_switches_a_built_cache_to_the_compressed_path(fresh_warning):
    """``cache.use_compressed_attention(True)`` (public; the warning names it): a cache built before the model
    was switched to the kvslim attention then reads the codes directly, warns no more, and gives the logits
    of a cache built after the switch."""
    model = tiny_model("llama")
    ids, kw = _ids(20), dict(kv_quantize="int4", group_size=8, residual=8)
    cache = SlimCache(config=model.config, **kw)
    assert not cache.compressed_attention
    kvslim.enable(model)
    cache.use_compressed_attention(True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = _run(model, cache, ids, 10)
        ref = _run(model, SlimCache(config=model.config, **kw), ids, 10)
    assert cache.compressed_attention and not [w for w in caught if "kvslim.enable(model)" in str(w.message)]
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    with pytest.raises(ValueError, match="enabled must be True or False"):
        cache.use_compressed_attention("yes")


# -- what a release without position ids at Cache.update loses, said and bounded ---------------------


def test_rebasing_only_where_the_cache_sees_the_position_ids():
    model = tiny_model("llama")
    cache = SlimCache(sink=2, window=8, config=model.config)
    assert (cache.rebase_period is not None) == compat.POSITIONS_REACH_CACHE


@pytest.mark.skipif(compat.POSITIONS_REACH_CACHE, reason="this release hands the cache its position ids")
def test_unseen_padding_of_a_batch_with_sinks_warns_once(monkeypatch):
    monkeypatch.setattr(compat, "_padding_warned", False)
    model = kvslim.enable(tiny_model("llama"))
    ids = _ids(10, batch=2)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        cache = SlimCache(sink=2, window=8, config=model.config)
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **compat.cache_kwargs(cache))
    assert sum("set_left_padding" in str(w.message) for w in caught) == 1
