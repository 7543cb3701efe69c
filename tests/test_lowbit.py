"""Low bits end to end (issue 32, item 3): the int3 format, the named K/V presets and per-layer precision
(``keep_layers``) through every place a cache format goes — SlimCache on both attention paths, its byte
accounting against the real tensors, prompt-cache files, the static (compiled) cache, the batch engine.

The formats' own contracts (byte-exact packing, the float64 reference, the registry matrix) are in
tests/test_formats_affine.py and tests/test_formats_common.py; the spec and CLI syntax in tests/test_config.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvslim
from conftest import tiny_model
from kvslim import SlimCache
from kvslim import generate as gen
from kvslim import promptcache as pc
from kvslim.config import parse_spec
from kvslim.formats import make_codec
from test_cache import _real_tensor_bytes


@pytest.fixture(scope="module")
def models():
    """The same 3-layer weights behind sdpa (the materializing path) and the kvslim attention (codes)."""
    return {
        "sdpa": tiny_model("llama", num_hidden_layers=3),
        "kvslim": tiny_model("llama", num_hidden_layers=3, attn_implementation="kvslim"),
    }


def _ids(batch=1, length=40, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, cache, ids, prefill=16):
    """A prefill chunk, then one token per step: (B, T, V) logits of every position."""
    with torch.inference_mode():
        out = [model(ids[:, :prefill], cache=cache).logits]
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache).logits)
    return torch.cat(out, dim=1)


def _codecs(cache):
    return [(s.k.codec.name, s.v.codec.name) for s in cache.stores()]


# -- formats and presets in a cache ------------------------------------------------------------------------

SPECS = [
    "int3,group=8,residual=8",
    "int3,group=8,residual=0,v_group=16,sink=4,window=24",
    "k4v3,group=8,residual=8",
    "k4v2,group=8,residual=8,keep_layers=first,last",
    "k3v2,group=8,residual=8,keep_layers=1,keep_format=k8v4",
    "int3,group=8,residual=8,keep_layers=-1,keep_format=fp16,sink=4,window=24",
]


@pytest.mark.filterwarnings("ignore:SlimCache.*decodes every stored token")
@pytest.mark.parametrize("spec", SPECS)
def test_attention_on_the_codes_equals_the_materializing_path(models, spec):
    """The C kernels reading int3 codes (and each layer's own formats) give the logits of decoding every
    stored token and running sdpa, to float rounding; the two caches hold the same bytes."""
    ids = _ids(batch=2, length=50)
    a_cache = SlimCache.from_config(parse_spec(spec), config=models["sdpa"].config)
    b_cache = SlimCache.from_config(parse_spec(spec), config=models["kvslim"].config)
    a = _logits(models["sdpa"], a_cache, ids)
    b = _logits(models["kvslim"], b_cache, ids)
    assert b_cache.compressed_attention and not a_cache.compressed_attention
    torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-4)
    assert a_cache.nbytes() == b_cache.nbytes() and _codecs(a_cache) == _codecs(b_cache)


def test_presets_store_k_and_v_in_their_halves(models):
    cfg = models["kvslim"].config
    assert _codecs(SlimCache(kv_quantize="k4v2", config=cfg)) == [("int4", "int2")] * 3
    assert _codecs(SlimCache(kv_quantize="k4v2", v_quantize="int3", config=cfg)) == [("int4", "int3")] * 3
    assert _codecs(SlimCache(kv_quantize="int3", k_quantize="int8", config=cfg)) == [("int8", "int3")] * 3
    # int3 codes are really 3 bits: 24 bytes per token and head of 64 channels... of head_dim 32: 12
    cache = SlimCache(kv_quantize="int3", group_size=8, residual=0, sink=0, config=cfg)
    with torch.inference_mode():
        models["kvslim"](_ids(length=16), cache=cache)
    codes = cache.layers[0].store.k.tokens["codes"].view()
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 32 * 3 // 8


# -- per-layer precision --------------------------------------------------------------------------------------


def test_kept_layers_store_their_own_format_and_levers(models):
    cfg = models["kvslim"].config
    cache = SlimCache.from_config(parse_spec("int2,keep_layers=first,last"), config=cfg)
    assert cache.kept_layers == frozenset({0, 2})
    assert _codecs(cache) == [("none", "none"), ("int2", "int2"), ("none", "none")]
    assert cache.rotate == "kv" and cache.pre_rope  # the cache's levers (int2: rotated, pre-RoPE K)
    stores = cache.stores()
    assert stores[1].k_hadamard is not None and stores[0].k_hadamard is None and stores[0].k.basis is None
    # fp16 storage of a kept layer is not rotated (a rotation only adds rounding there); int8 is
    fp16 = SlimCache.from_config(parse_spec("int4,keep_layers=0,keep_format=fp16"), config=cfg).stores()
    int8 = SlimCache.from_config(parse_spec("int4,keep_layers=0,keep_format=int8"), config=cfg).stores()
    assert fp16[0].k_hadamard is None and fp16[0].v_hadamard is None and fp16[1].k_hadamard is not None
    assert int8[0].k_hadamard is not None and int8[0].v_hadamard is not None
    # a K bias is held only by the layers whose K format takes one
    bias = [torch.randn(2, 32) for _ in range(3)]
    centered = SlimCache(kv_quantize="q4_0", keep_layers=(1,), mean_center=bias, rotate="none", config=cfg)
    assert [s.k_bias is not None for s in centered.stores()] == [True, False, True]
    q8 = SlimCache(
        kv_quantize="q4_0", keep_layers=(1,), keep_format="q8_0", mean_center=bias, rotate="none", config=cfg
    )
    assert [s.k_bias is not None for s in q8.stores()] == [True, True, True]


def test_every_layer_kept_lossless_is_exactly_the_plain_cache():
    """The identity invariant through keep_layers: int2 everywhere but every layer kept at ``none`` gives
    exactly DynamicCache's logits (a keep that was not applied would quantize)."""
    model = tiny_model("llama")
    ids = _ids(length=30)
    ref = _logits(model, DynamicCache(config=model.config), ids)
    cache = SlimCache(kv_quantize="int2", keep_layers="first,last", config=model.config)
    got = _logits(model, cache, ids)
    assert torch.equal(got, ref)
    half = _logits(model, SlimCache(kv_quantize="int2", keep_layers=(0,), config=model.config), ids)
    assert not torch.equal(half, ref)  # one layer still at int2


@pytest.mark.parametrize(
    "spec",
    [
        "int3,sink=2,window=30,group=8,residual=8,keep_layers=first,last",
        "k4v2,group=8,residual=8,keep_layers=1,keep_format=q8_0",
        "q4_0,sink=2,window=30,group=8,residual=8,keep_layers=0,keep_format=k8v4",
    ],
)
def test_nbytes_of_kept_layers_equals_real_tensors(models, spec):
    """nbytes() counts every tensor the cache holds (found by walking its objects), and each layer holds what
    a cache of that layer's format alone holds: the per-layer sum is exact."""
    model = models["kvslim"]
    cfg = parse_spec(spec)
    cache = SlimCache.from_config(cfg, config=model.config)
    ids = _ids(length=45)
    with torch.inference_mode():
        gen.prefill(model, ids[:, :25], cache)
        for t in range(25, 45):
            gen.decode_one_token(model, ids[:, t : t + 1], cache)
    assert cache.nbytes() == _real_tensor_bytes(cache)
    # the same tokens through caches of one format each: layer i holds what layer i of its format's cache holds
    kept_k, kept_v = cfg.keep_formats
    plain = cfg.replace(keep_layers=(), keep_format="none")
    alone = {
        False: SlimCache.from_config(plain, config=model.config),
        True: SlimCache.from_config(
            plain.replace(kv_quantize="none", k_quantize=kept_k, v_quantize=kept_v, mean_center=None),
            config=model.config,
        ),
    }
    for c in alone.values():
        with torch.inference_mode():
            gen.prefill(model, ids[:, :25], c)
            for t in range(25, 45):
                gen.decode_one_token(model, ids[:, t : t + 1], c)
    for i, store in enumerate(cache.stores()):
        if i == 0:  # layer 0's K/V depend on the tokens alone: the same codes whatever the other layers hold
            assert store.nbytes() == alone[i in cache.kept_layers].stores()[i].nbytes()
        assert store.components().keys() == alone[i in cache.kept_layers].stores()[i].components().keys()
        assert store.nbytes() == sum(store.components().values())


@pytest.mark.parametrize(
    "spec",
    [
        "int3,sink=4,window=60,group=8,residual=16,keep_layers=first,last",
        "k4v2,sink=4,window=60,group=8,residual=16,keep_layers=1,keep_format=q8_0",
        "int3,sink=4,window=60,group=8,residual=16,keep_layers=0,keep_format=fp16",
    ],
)
def test_projected_nbytes_of_kept_layers_is_what_a_bounded_cache_reaches(models, spec):
    """A bounded cache reaches projected_nbytes once full and never exceeds it: with layers of different
    formats too (each layer's projection from its own codecs), exactly."""
    model = models["kvslim"]
    cache = SlimCache.from_config(parse_spec(spec), config=model.config)
    sizes = []
    with torch.inference_mode():
        gen.prefill(model, _ids(length=20), cache)
        for i in range(120):
            gen.decode_one_token(model, torch.tensor([[3 + i % 100]]), cache)
            sizes.append(cache.nbytes())
    assert max(sizes) == cache.projected_nbytes(140) == sizes[-1]
    assert cache.nbytes() == _real_tensor_bytes(cache)
    plain = SlimCache.from_config(
        parse_spec(spec).replace(keep_layers=(), keep_format="none"), config=model.config
    )
    assert cache.projected_nbytes(140) != plain.projected_nbytes(140)  # the kept layers changed it


def test_keep_layers_refusals():
    model_cfg = tiny_model("llama").config  # 2 layers
    with pytest.raises(
        ValueError, match=r"^keep_layers names layer 5, out of range: this model has 2 layers \(0..1"
    ):
        SlimCache(kv_quantize="int4", keep_layers=(5,), config=model_cfg)
    with pytest.raises(ValueError, match=r"needs config=model.config"):
        SlimCache(kv_quantize="int4", keep_layers=(0,))
    assert "\n" not in str(pytest.raises(ValueError, SlimCache, keep_layers=(-3,), config=model_cfg).value)


# -- the other places a format goes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    ["int3,residual=8,group=8", "k4v3,sink=4,window=40,group=8,residual=8,keep_layers=-1,keep_format=int8"],
)
def test_prompt_cache_files_continue_exactly(models, tmp_path, spec):
    model = models["kvslim"]
    cache = SlimCache.from_config(parse_spec(spec), config=model.config)
    ids = _ids(length=70)
    with torch.inference_mode():
        gen.prefill(model, ids, cache, chunk_size=23)
    path = tmp_path / "p.safetensors"
    cache.save(path, token_ids=ids)
    restored = pc.load(path, new_cache=SlimCache.from_config, config=model.config).cache
    assert restored.cache_config == cache.cache_config and _codecs(restored) == _codecs(cache)
    assert restored.live_nbytes() == cache.live_nbytes()
    assert pc.to_state(restored)[1]["sha256"] == pc.to_state(cache)[1]["sha256"]
    nxt = _ids(length=6, seed=3)
    with torch.inference_mode():
        for t in range(6):
            a = gen.decode_one_token(model, nxt[:, t : t + 1], cache)
            b = gen.decode_one_token(model, nxt[:, t : t + 1], restored)
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "spec",
    [
        "int3,sink=4,window=40,group=8,residual=8",
        "k4v2,sink=4,window=40,group=8,residual=8,keep_layers=0,keep_format=int8",
    ],
)
def test_static_cache_reads_what_a_slimcache_does(spec):
    from kvslim.cache.static_adapter import StaticSlimCache

    model = kvslim.enable(tiny_model("llama"))
    cfg = parse_spec(spec).replace(pre_rope=False)
    ref = SlimCache.from_config(cfg, config=model.config)
    static = StaticSlimCache.from_config(cfg, config=model.config)
    assert [(s.k_codec.name, s.v_codec.name) for s in static.stores()] == _codecs(ref)
    ids = _ids(batch=2, length=37)
    tokens = _ids(batch=2, length=30, seed=5)
    with torch.inference_mode():
        a, b = gen.prefill(model, ids, ref), gen.prefill(model, ids, static)
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        for t in range(30):
            a = gen.decode_one_token(model, tokens[:, t : t + 1], ref)
            b = gen.decode_one_token(model, tokens[:, t : t + 1], static)
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert torch.equal(static.layers[0].keys, ref.layers[0].keys)
    assert torch.equal(static.layers[0].values, ref.layers[0].values)


def test_int3_encoder_inside_a_trace_writes_the_eager_bytes(monkeypatch):
    """The branch-free path the affine encoder takes inside torch.compile gives the eager int3 bytes."""
    import kvslim.formats.affine as affine

    x = torch.randn(2, 2, 32, 64, generator=torch.Generator().manual_seed(0))
    x[0, 0, :4] = 0.0
    x[1, 1, 10] *= 1e-6
    for role in ("k", "v"):
        codec = make_codec("int3", role, group_size=8)
        eager = codec.encode(x)
        monkeypatch.setattr(affine, "tracing", lambda: True)
        traced = codec.encode(x)
        monkeypatch.undo()
        for part in ("token", "group"):
            a, b = getattr(eager, part), getattr(traced, part)
            assert set(a) == set(b)
            for key in a:
                assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), (role, part, key)


def test_engine_rows_of_int3_presets_and_kept_layers_equal_each_alone():
    """The batch engine (ragged steps, one C call for every row's attention) with rows of int3, a preset and
    kept layers at once: each request's tokens are those of kvslim's single-stream greedy loop."""
    from kvslim.engine import Engine, Request

    model = kvslim.enable(tiny_model("llama"))
    g = torch.Generator().manual_seed(0)
    specs = [
        "int3,group=8,residual=8",
        "k4v2,sink=4,window=40,group=8,residual=8",
        "int3,keep_layers=-1,keep_format=k8v4,group=8,residual=0",
    ]
    reqs = [
        Request(torch.randint(3, 128, (n,), generator=g).tolist(), max_new_tokens=20, cache=spec)
        for n, spec in zip((30, 55, 12), specs, strict=True)
    ]
    together = Engine(model, max_batch=3, prefill_chunk=32).run(reqs)
    for req, got in zip(reqs, together, strict=True):
        cache = SlimCache.from_config(req.cache, config=model.config)
        single = gen.greedy(model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=32)
        assert got.tokens == single, req.cache.to_spec()
