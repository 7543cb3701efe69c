"""Range clipping of the affine formats (kvslim.formats.clip): the searched range against a brute-force reference,
never a worse squared error than min-max, min-max kept where it is best, the stored layout unchanged (every
decoder reads clipped codes), and the spec's ``clip`` lever: auto as measured, refusals, report, prompt caches."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import tiny_config
from kvslim.formats import affine, clip


def _brute(x: torch.Tensor, bits: int) -> tuple[float, float]:
    """The least-error range of one 1-D slice by plain loops in float64: the reference for clipped_range."""
    levels = (1 << bits) - 1
    mn, mx = float(x.min()), float(x.max())
    best = None
    for r in clip.RATIOS:
        cut = (1 - r) / 2 * (mx - mn)
        lo, hi = mn + cut, mx - cut
        s = max((hi - lo) / levels, affine.EPS)
        err = sum((min(max(round((v - lo) / s), 0), levels) * s + lo - v) ** 2 for v in x.double().tolist())
        if best is None or err < best[0] - 1e-9 * max(1.0, best[0]):
            best = (err, lo, hi)
    return best[1], best[2]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_clipped_range_matches_a_brute_force_search_per_slice(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 5, 64, generator=g) * torch.rand(6, 5, 1, generator=g) * 3  # slices along the last dim
    x[0, 0, 7] = 40.0  # an outlier: clipping pays
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    lo, hi = clip.clipped_range(x, -1, bits, mn, mx, affine.EPS)
    assert lo.shape == mn.shape and hi.shape == mx.shape
    chosen = []
    for i in range(6):
        for j in range(5):
            rlo, rhi = _brute(x[i, j], bits)
            assert lo[i, j, 0].item() == pytest.approx(rlo, abs=1e-5) and hi[i, j, 0].item() == pytest.approx(
                rhi, abs=1e-5
            )
            chosen.append(round((rhi - rlo) / (float(mx[i, j]) - float(mn[i, j])), 2))
    assert min(chosen) < 1.0  # some slices really were clipped
    # along another dim (K per channel: over a group's tokens)
    lo2, hi2 = clip.clipped_range(x, 1, bits, x.amin(1, keepdim=True), x.amax(1, keepdim=True), affine.EPS)
    rlo, rhi = _brute(x[2, :, 9], bits)
    assert lo2[2, 0, 9].item() == pytest.approx(rlo, abs=1e-5) and hi2[2, 0, 9].item() == pytest.approx(
        rhi, abs=1e-5
    )


def test_clipping_never_raises_the_error_and_keeps_min_max_where_it_is_best():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 64, generator=g)
    for bits in (2, 4):
        plain = affine.dequantize_per_token(*affine.quantize_per_token(x, bits), bits, None, torch.float32)
        clipped = affine.dequantize_per_token(
            *affine.quantize_per_token(x, bits, clip=True), bits, None, torch.float32
        )
        e_plain, e_clip = (plain - x).square().sum(-1), (clipped - x).square().sum(-1)
        assert bool((e_clip <= e_plain * (1 + 1e-3) + 1e-6).all())  # the stored fp16 rounding aside
        assert e_clip.mean() < 0.9 * e_plain.mean() if bits == 2 else e_clip.mean() <= e_plain.mean()
    # four exact levels: min-max reconstructs them exactly and is kept
    steps = torch.tensor([0.0, 1.0, 2.0, 3.0]).repeat(16)[None, None, None]  # (1, 1, 1, 64)
    codes, scale, zero = affine.quantize_per_token(steps, 2, clip=True)
    assert torch.equal(affine.dequantize_per_token(codes, scale, zero, 2, None, torch.float32), steps)
    # per channel (K) too: the same stored layout
    codes, scale, zero = affine.quantize_per_channel(x, 2, 8, clip=True)
    ref = affine.quantize_per_channel(x, 2, 8)
    assert codes.shape == ref[0].shape and scale.shape == ref[1].shape and scale.dtype == ref[1].dtype


def test_the_clip_lever_auto_as_measured_and_its_refusals():
    def report(spec):
        return kvslim.SlimCache.from_config(kvslim.parse_spec(spec), config=tiny_config()).report()["clip"]

    assert {("v", 2)} == set(clip.AUTO)
    assert report("int2") == "v" and report("k4v2") == "v" and report("int4") == "none"
    assert (
        report("int2,clip=off") == "none" and report("int4,clip=kv") == "kv" and report("int2,clip=k") == "k"
    )
    assert report("int2,varnorm=on") == "none"  # auto leaves a variance-normalized stream alone
    for spec, msg in [
        ("q4_0,clip=v", "clip=v applies to the affine formats"),
        ("int2,clip=v,varnorm=on", "clip=v and varnorm=on do not combine"),
        ("int2,clip=yes", "clip"),
    ]:
        with pytest.raises(ValueError, match=msg):
            kvslim.parse_spec(spec)
    assert kvslim.parse_spec("int4,clip=v").to_spec() == "int4,clip=v"


def test_a_clipped_cache_encodes_clipped_and_a_prompt_cache_records_it(tmp_path):
    """A cache with clip=v stores V with clipped ranges (the same layout, other scales), K as without; a prompt
    cache saved with it records the lever and loads with it."""
    import json

    g = torch.Generator().manual_seed(3)
    cfg = tiny_config()
    caches = {
        c: kvslim.SlimCache.from_config(kvslim.parse_spec(f"int2,residual=0,group=8,sink=0,clip={c}"), config=cfg)
        for c in ("v", "off")
    }
    k, v = torch.randn(1, 2, 16, 32, generator=g), torch.randn(1, 2, 16, 32, generator=g) * 3
    for cache in caches.values():
        cache.layers[0].store.append(k, v)
    sv, so = (caches[c].layers[0].store for c in ("v", "off"))
    assert torch.equal(sv.k.body().token["codes"], so.k.body().token["codes"])
    clipped, plain = sv.v.body().token, so.v.body().token
    assert clipped["scale"].shape == plain["scale"].shape and clipped["codes"].shape == plain["codes"].shape
    assert bool((clipped["scale"].float() <= plain["scale"].float()).all()) and not torch.equal(
        clipped["scale"], plain["scale"]
    )  # ranges only ever shrink
    path = tmp_path / "p.safetensors"
    header = caches["v"].save(path)
    assert (header if isinstance(header, dict) else json.loads(header))["levers"]["clip"] == "v"
    restored = kvslim.SlimCache.load(path, config=cfg)
    assert restored.report()["clip"] == "v"
    assert torch.equal(restored.layers[0].store.v.body().token["scale"], clipped["scale"])
