"""Lloyd-Max codebooks of the 2- and 3-bit affine formats (kvslim.formats.codebook): the level table against the
published values and an independent centroid check, the round trip against a float64 reference, the kernels
declining a codebook body (so every decode path equals the torch decode), the spec's ``codebook`` lever and its
refusals, and prompt-cache files."""

from __future__ import annotations

import math

import pytest
import torch

import kvslim
from conftest import tiny_config
from kvslim import parse_spec
from kvslim.formats import affine, codebook
from kvslim.formats.varnorm import cache_codec

#: Max (1960), Table I: the positive Lloyd-Max levels of N(0, 1), 4 and 8 levels, to 4 decimals
PUBLISHED = {4: (0.4528, 1.5104), 8: (0.2451, 0.7560, 1.3439, 2.1519)}


@pytest.mark.parametrize("n", [4, 8])
def test_gaussian_levels_match_the_published_values_and_are_centroids(n):
    levels = codebook.gaussian_levels(n)
    assert len(levels) == n and list(levels) == sorted(levels)
    half = levels[n // 2 :]
    for got, want in zip(half, PUBLISHED[n], strict=True):
        assert got == pytest.approx(want, abs=6e-5)
    assert all(a == pytest.approx(-b, abs=1e-12) for a, b in zip(levels, reversed(levels)))
    # independently: each level is the mean of N(0, 1) between the midpoints (trapezoid rule, float64)
    cuts = [-12.0, *((a + b) / 2 for a, b in zip(levels, levels[1:])), 12.0]
    for lvl, a, b in zip(levels, cuts, cuts[1:]):
        x = torch.linspace(a, b, 200_001, dtype=torch.float64)
        w = torch.exp(-0.5 * x * x)
        assert float(torch.trapezoid(x * w, x) / torch.trapezoid(w, x)) == pytest.approx(lvl, abs=1e-7)


def test_code_levels_span_the_code_range():
    for bits in (2, 3):
        t = codebook.code_levels(bits)
        top = (1 << bits) - 1
        assert len(t) == top + 1 and t[0] == 0.0 and t[-1] == float(top)
        assert all(b > a for a, b in zip(t, t[1:]))
        g = codebook.gaussian_levels(top + 1)
        for v, lvl in zip(t, g):  # an affine image of the Gaussian levels
            assert v == pytest.approx(top * (lvl - g[0]) / (g[-1] - g[0]), abs=1e-6)
        assert min(b - a for a, b in zip(t, t[1:])) < 1.0 < max(b - a for a, b in zip(t, t[1:]))
    assert codebook.code_levels(2)[1] == pytest.approx(1.0503, abs=1e-4)
    assert codebook.code_levels(3)[1:4] == pytest.approx((1.3142, 2.2704, 3.1014), abs=1e-4)
    for bits in (4, 8):
        with pytest.raises(ValueError, match="defined for"):
            codebook.code_levels(bits)


def _reference_slice(x: list[float], bits: int, clip: bool) -> float:
    """The least squared error of one slice under the codebook scheme, by plain loops in float64 (min-max, or the
    ranges of codebook.RATIOS when clipped; nearest levels; without the fp16 rounding of the stored scale and zero)."""
    top = (1 << bits) - 1
    table = codebook.code_levels(bits)
    mn, mx = min(x), max(x)
    best = math.inf
    for r in codebook.RATIOS if clip else (1.0,):
        cut = (1 - r) / 2 * (mx - mn)
        lo, s = mn + cut, max((mx - cut - (mn + cut)) / top, affine.EPS)
        best = min(best, sum(min((lo + s * t - v) ** 2 for t in table) for v in x))
    return best


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("clip", [False, True])
def test_round_trip_against_a_float64_reference(bits, role, clip):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(1, 2, 16, 64, generator=g) * (1 + 3 * torch.rand(1, 2, 16, 1, generator=g))
    x[0, 1, 3, 5] = 30.0  # an outlier
    levels = codebook.code_levels(bits)
    if role == "v":
        codes, scale, zero = affine.quantize_per_token(x, bits, clip=clip, levels=levels)
        y = affine.dequantize_per_token(codes, scale, zero, bits, levels=levels)
        s, z = scale.double().expand(x.shape), zero.double().expand(x.shape)  # one scale per token
        slices = x.reshape(-1, 64)  # one slice per token
        got = (y - x).square().double().reshape(-1, 64).sum(-1)
    else:
        codes, scale, zero = affine.quantize_per_channel(x, bits, 8, clip=clip, levels=levels)
        y = affine.dequantize_per_channel(codes, scale, zero, bits, 8, levels=levels)
        s = scale.double().repeat_interleave(8, -2)
        z = zero.double().repeat_interleave(8, -2)
        slices = x.reshape(1, 2, 2, 8, 64).transpose(-1, -2).reshape(-1, 8)  # a channel over a group of 8
        got = (y - x).square().double().reshape(1, 2, 2, 8, 64).transpose(-1, -2).reshape(-1, 8).sum(-1)
    # decode is exactly zero + scale * T[code] in float64 (no hidden grid)
    c = affine.unpack_bits(codes, bits, 64).long()
    t64 = torch.tensor(levels, dtype=torch.float64)
    want = z + s * t64[c]
    assert torch.allclose(y.double(), want, rtol=1e-6, atol=1e-6)
    if not clip:  # min-max: the outermost levels cover every value (zero rounded down, scale up)
        assert bool((z <= x.double()).all()) and bool((z + s * t64[-1] >= x.double() - 1e-6).all())
    # every code is its value's nearest level under the stored scale and zero
    dist = (z[..., None] + s[..., None] * t64 - x.double()[..., None]).abs()  # (..., levels)
    chosen = dist.gather(-1, c[..., None])[..., 0]
    assert bool((chosen <= dist.min(-1).values + 1e-6 * s).all())
    # the range's error is the float64 reference's, up to the fp16 rounding of the stored scale and zero
    ref = torch.tensor(
        [_reference_slice(sl.tolist(), bits, clip) for sl in slices.double()], dtype=torch.float64
    )
    assert bool((got <= ref * 1.02 + 1e-4).all()), float((got / ref).max())
    assert float(got.sum()) == pytest.approx(float(ref.sum()), rel=0.01)


def test_on_gaussian_slices_the_codebook_beats_the_even_grid():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 256, 64, generator=g)
    for bits, margin in ((2, 1.0), (3, 0.97)):
        err = {}
        table = codebook.code_levels(bits)
        for name, kw in (
            ("plain", {}),
            ("clip", {"clip": True}),
            ("pinned", {"levels": table}),
            ("lloyd", {"clip": True, "levels": table}),
        ):
            enc = affine.quantize_per_token(x, bits, **kw)
            y = affine.dequantize_per_token(*enc, bits, levels=kw.get("levels"))
            err[name] = float((y - x).square().mean())
        assert err["lloyd"] < 0.8 * err["plain"] and err["pinned"] < err["plain"], err
        assert err["lloyd"] < margin * err["clip"], err  # 3 bits: > 3% below the best even grid


def _codecs(spec: str):
    cfg = parse_spec(spec)
    return cache_codec(cfg, cfg.k_format, "k"), cache_codec(cfg, cfg.v_format, "v")


def test_the_kernels_decline_a_codebook_body_and_every_path_decodes_as_torch():
    from kvslim import kernels
    from kvslim.formats.layout import body_layout
    from kvslim.kernels import cpu, gpu, ops, reference

    kc, vc = _codecs("int3,codebook=kv")
    plain_k, _ = _codecs("int3,codebook=off")
    assert kc.levels == codebook.code_levels(3) and plain_k.levels is None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 64, 64, generator=g)
    ek, ev = kc.encode(x), vc.encode(x)
    assert not cpu.affine_k_supported(kc, ek) and not cpu.affine_v_supported(vc, ev)
    assert (
        not cpu.attend_supported(kc, ek, vc, ev) and not gpu.supported(kc, ek) and not gpu.supported(vc, ev)
    )
    with pytest.raises(ValueError, match="Lloyd-Max level table"):
        body_layout(kc, ek, 1, 2, 64)
    assert ops.codec_key(kc, ek) != ops.codec_key(
        plain_k, plain_k.encode(x)
    )  # the compiled ops tell them apart
    q = torch.randn(1, 2, 3, 64, generator=g)
    p = torch.softmax(torch.randn(1, 2, 3, 64, generator=g), -1)
    for backend in ("auto", "cpu", "torch"):
        kernels.set_backend(backend)
        try:
            assert kernels.select(q, kc, ek)[0] == "torch"
            assert torch.equal(kernels.k_scores(q, kc, ek), reference.k_scores(q, kc, ek))
            assert torch.equal(kernels.v_weighted(p, vc, ev), reference.v_weighted(p, vc, ev))
        finally:
            kernels.set_backend(None)
    # the decode the reference uses is the table's, not the even grid's
    assert not torch.allclose(
        kc.decode(ek, torch.float32),
        affine.dequantize_per_channel(ek.token["codes"], ek.group["scale"], ek.group["zero"], 3, 32),
    )


@pytest.mark.parametrize("fused", [True, False])
def test_a_codebook_cache_decodes_the_same_through_every_attention_path(fused, monkeypatch):
    """Decode steps of a tiny model with codebook K and V, a uniform-K mix, and the kvslim attention (fused call or
    op by op, C kernels allowed) give the logits of the same cache attended by the torch reference alone."""
    from conftest import tiny_model
    from kvslim import SlimCache, attention, kernels
    from kvslim.generate import decode_one_token, prefill

    model = tiny_model(attn_implementation="kvslim")
    monkeypatch.setattr(attention, "FUSED_DECODE", fused)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    for spec in ("int2,residual=32,codebook=kv", "k4v2,residual=32,codebook=v", "int3,residual=0,codebook=k"):
        logits = {}
        for backend in ("auto", "torch"):
            kernels.set_backend(backend)
            try:
                cache = SlimCache.from_config(parse_spec(spec), config=model.config)
                with torch.inference_mode():
                    prefill(model, ids[:, :60], cache)
                    logits[backend] = torch.stack(
                        [decode_one_token(model, ids[:, i : i + 1], cache) for i in range(60, 100)]
                    )
            finally:
                kernels.set_backend(None)
        assert torch.allclose(logits["auto"], logits["torch"], atol=1e-4), spec


def test_the_lever_auto_as_measured_and_its_refusals():
    def report(spec):
        return kvslim.SlimCache.from_config(parse_spec(spec), config=tiny_config()).report()["codebook"]

    assert set(codebook.AUTO) == set()  # docs/quality.md, "Lloyd-Max codebooks": no measured gain by default
    assert report("int2") == "none" and report("int3") == "none"
    assert report("int2,codebook=kv") == "kv" and report("int3,codebook=k") == "k"
    assert report("k4v2,codebook=v") == "v" and report("int2,codebook=off") == "none"
    for spec, msg in [
        ("int4,codebook=v", "codebook=v applies to the 2- and 3-bit affine formats .* stores V as int4"),
        ("q4_0,codebook=kv", "stores K as q4_0"),
        ("k4v2,codebook=k", "stores K as int4"),
        ("k4v2,codebook=kv", "stores K as int4"),
        ("int2,codebook=v,varnorm=on", "codebook=v and varnorm=on do not combine"),
        ("int2,codebook=lloyd", "codebook"),
    ]:
        with pytest.raises(ValueError, match=msg) as e:
            parse_spec(spec)
        assert "\n" not in str(e.value)
    assert parse_spec("int2,codebook=v").to_spec() == "int2,codebook=v"
    assert (
        parse_spec("int2,codebook=auto,varnorm=on").codebook == "auto"
    )  # auto leaves a normalized stream alone
    # the same bytes: a codebook changes what the codes mean, not how many there are
    a = kvslim.SlimCache.from_config(parse_spec("int2,codebook=kv"), config=tiny_config())
    b = kvslim.SlimCache.from_config(parse_spec("int2,codebook=off"), config=tiny_config())
    assert a.projected_nbytes(4096) == b.projected_nbytes(4096)


def test_vllm_refuses_the_lever():
    from kvslim.vllm.spec import check_supported

    with pytest.raises(ValueError, match="codebook='v' is not supported in vLLM"):
        check_supported(parse_spec("int2,codebook=v"))


def test_a_prompt_cache_file_round_trips_and_records_the_lever(tmp_path, monkeypatch):
    from conftest import tiny_model
    from kvslim import SlimCache
    from kvslim import promptcache as pc
    from kvslim.generate import decode_one_token, prefill

    model = tiny_model(attn_implementation="kvslim")
    spec = "int3,residual=32,codebook=kv"
    cache = SlimCache.from_config(parse_spec(spec), config=model.config)
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefill(model, ids, cache, chunk_size=23)
    path = tmp_path / "p.safetensors"
    cache.save(path, token_ids=ids)
    tensors, header = pc.to_state(cache)
    assert header["levers"]["codebook"] == "kv"
    restored = pc.load(path, new_cache=SlimCache.from_config, config=model.config).cache
    assert restored.report()["codebook"] == "kv"
    assert pc.to_state(restored)[1]["sha256"] == header["sha256"]
    tokens = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for i in range(40):  # past a group boundary: a new group is encoded with the table
            a = decode_one_token(model, tokens[:, i : i + 1], cache)
            b = decode_one_token(model, tokens[:, i : i + 1], restored)
            assert torch.equal(a, b), f"step {i}"
    # a file of uniform codes (written before the lever, or with it off) does not load where auto reads a table
    plain = SlimCache.from_config(parse_spec("int3,residual=32"), config=model.config)
    with torch.inference_mode():
        prefill(model, ids, plain)
    tensors, header = pc.to_state(plain)
    old = {**header, "levers": {k: v for k, v in header["levers"].items() if k != "codebook"}}
    old["sha256"] = pc.content_sha256(tensors, old)
    monkeypatch.setattr(codebook, "AUTO", frozenset({("k", 3), ("v", 3)}))
    for h in (header, old):
        with pytest.raises(
            ValueError, match="saved with codebook='none', but its settings resolve to codebook='kv'"
        ):
            pc.from_state(tensors, h, new_cache=SlimCache.from_config, config=model.config)


def test_a_static_cache_with_a_codebook_equals_a_slimcache():
    """A StaticSlimCache (the compiled step's fixed buffers, its kernels through the custom ops keyed with the
    table) stores and reads the same codebook codes as a SlimCache, through prefill and decode steps."""
    from conftest import tiny_model
    from kvslim import SlimCache, StaticSlimCache
    from kvslim.generate import decode_one_token, prefill

    model = tiny_model(attn_implementation="kvslim")
    spec = dict(kv_quantize="int2", group_size=8, residual=8, window=32, codebook="kv")
    ref = SlimCache(config=model.config, pre_rope=False, **spec)
    static = StaticSlimCache(config=model.config, **spec)
    assert ref.report()["codebook"] == static.report()["codebook"] == "kv"
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(
            prefill(model, ids, static), prefill(model, ids, ref), atol=1e-4, rtol=1e-4
        )
        for i in range(30):
            a = decode_one_token(model, tokens[:, i : i + 1], ref)
            b = decode_one_token(model, tokens[:, i : i + 1], static)
            torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
    assert torch.equal(static.layers[0].keys, ref.layers[0].keys)
    assert torch.equal(static.layers[0].values, ref.layers[0].values)
