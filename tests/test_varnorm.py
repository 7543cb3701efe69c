"""Variance normalization of the affine formats (kvslim.formats.varnorm): the encoding against a float64
reference with its stated bound, byte-exact packing, the factor bytes, honest bytes, the C kernels against the
torch reference, the option's validation and a cache that uses it."""

from __future__ import annotations

import pytest
import torch

from kvslim.config import CacheConfig, parse_spec
from kvslim.formats import make_codec
from kvslim.formats.affine import pack_bits, unpack_bits
from kvslim.formats.varnorm import (
    FACTOR_TABLE,
    balance,
    dequantize_k,
    dequantize_v,
    factor_code,
    factor_of,
    quantize_k,
    quantize_v,
    resolve,
    varnorm_codec,
)

BITS = [8, 4, 3, 2]
SLACK = 2.0**-20  # a few fp32 roundings, relative to the magnitudes involved


def sample(seed: int = 0, t: int = 64, d: int = 64) -> torch.Tensor:
    """(1, 2, t, d): token magnitudes spread over 30x, channel means, an outlier channel and an outlier token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, t, d, generator=g) * (0.1 + 3 * torch.rand(1, 2, t, 1, generator=g))
    x = x + torch.randn(1, 2, 1, d, generator=g)
    x[..., 5] *= 10
    x[..., 7, :] *= 20
    return x


# --------------------------------------------------------------------------- factors


def test_factor_bytes_are_exact_quarter_octaves():
    e = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    want = torch.tensor([2.0 ** ((i - 128) / 4) for i in range(256)], dtype=torch.float64).float()
    assert torch.equal(
        factor_of(e), want
    )  # the table x power-of-two construction is fp32's rounding of 2^(k/4)
    assert tuple(float(want[128 + i]) for i in range(4)) == FACTOR_TABLE
    assert torch.equal(factor_code(factor_of(e)), e)  # every byte round-trips
    assert factor_code(torch.tensor([0.0, 1e30])).tolist() == [0, 255]  # clamped to the storable range


def test_balance_equalizes_both_axes():
    x = sample()[0, 0, :32]  # (32, 64)
    r, c = balance(x)
    y = x / (r * c)
    rms_t, rms_d = y.square().mean(1).sqrt(), y.square().mean(0).sqrt()
    # before: the outlier token / channel dominate; after: both axes within a small spread
    assert rms_t.max() / rms_t.min() < 1.5 and rms_d.max() / rms_d.min() < 1.5
    assert abs(float(r.log().mean())) < 1e-5 and abs(float(c.log().mean())) < 1e-5  # geometric mean 1


# --------------------------------------------------------------------------- the encodings against float64


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", [0, 1])
def test_k_matches_float64_reference(bits, seed):
    x = sample(seed)
    g, half = 32, (2**bits - 1) / 2
    packed, rnorm, scale, zero = quantize_k(x, bits, g)
    assert packed.dtype == rnorm.dtype == torch.uint8 and scale.dtype == zero.dtype == torch.float16
    assert rnorm.shape == (1, 2, 64, 1) and scale.shape == zero.shape == (1, 2, 2, 64)
    x64 = x.double().reshape(1, 2, 2, g, 64)
    r = factor_of(rnorm).double().reshape(1, 2, 2, g, 1)
    s, z = scale.double().unsqueeze(-2), zero.double().unsqueeze(-2)
    # the grid covers every element: |x - zero| / r <= half * scale
    assert ((x64 - z).abs() / r <= half * s * (1 + SLACK)).all()
    # codes: round((x - zero) / (r * scale) + half) in float64, except where fp32 may flip a near-tie
    codes = unpack_bits(packed, bits, 64).double().reshape(1, 2, 2, g, 64)
    exact = ((x64 - z) / r / s + half).clamp(0, 2 * half)
    tie = ((exact - exact.floor()) - 0.5).abs() < 1e-4
    ref = torch.round(exact)
    assert ((codes == ref) | (tie & ((codes - ref).abs() <= 1))).all()
    # byte-exact packing of those codes
    assert torch.equal(packed, pack_bits(codes.reshape(1, 2, 64, 64).to(torch.uint8), bits))
    # reconstruction: the float64 formula, and the stated bound |x - x'| <= r * scale / 2
    y = dequantize_k(packed, rnorm, scale, zero, bits, g)
    y64 = z + r * s * (codes - half)
    assert torch.allclose(y.double().reshape(y64.shape), y64, rtol=0, atol=1e-5 * float(x.abs().max()))
    err = (y.double().reshape(y64.shape) - x64).abs()
    assert (err <= r * s / 2 + SLACK * (x64.abs() + z.abs() + r * s * half)).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("v_group", [None, 16])
def test_v_matches_float64_reference(bits, v_group):
    x = sample(3)
    g, levels = 32, 2**bits - 1
    vg = 64 if v_group is None else v_group
    packed, scale, zero, cnorm = quantize_v(x, bits, g, v_group)
    assert cnorm.dtype == torch.uint8 and cnorm.shape == (1, 2, 2, 64) and scale.shape == (1, 2, 64, 64 // vg)
    c = factor_of(cnorm).double().unsqueeze(-2).expand(1, 2, 2, g, 64).reshape(1, 2, 64, 64)
    u = (x.double() / c).reshape(1, 2, 64, 64 // vg, vg)  # the normalized values, per-token slices
    s, z = scale.double().unsqueeze(-1), zero.double().unsqueeze(-1)
    assert (z <= u.amin(-1, keepdim=True)).all() and (
        z + levels * s >= u.amax(-1, keepdim=True) * (1 - SLACK)
    ).all()
    codes = unpack_bits(packed, bits, 64).double().reshape(u.shape)
    exact = ((u - z) / s).clamp(0, levels)
    tie = ((exact - exact.floor()) - 0.5).abs() < 1e-4
    ref = torch.round(exact)
    assert ((codes == ref) | (tie & ((codes - ref).abs() <= 1))).all()
    assert torch.equal(packed, pack_bits(codes.reshape(1, 2, 64, 64).to(torch.uint8), bits))
    y = dequantize_v(packed, scale, zero, cnorm, bits, g)
    y64 = ((codes * s + z).reshape(1, 2, 64, 64)) * c
    assert torch.allclose(y.double(), y64, rtol=0, atol=1e-5 * float(x.abs().max()))
    bound = (c * s.expand(u.shape).reshape(1, 2, 64, 64)) / 2 + SLACK * (y64.abs() + x.double().abs())
    assert ((y.double() - x.double()).abs() <= bound).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("role", ["k", "v"])
def test_never_worse_than_plain_by_squared_error(bits, role):
    """Each group keeps the strength (0: no normalization) of least squared error."""
    x = sample(5)
    plain = make_codec(f"int{bits}", role, group_size=32)
    vn = varnorm_codec(plain, 32)
    e_plain = (plain.decode(plain.encode(x), torch.float32) - x).square().sum()
    e_vn = (vn.decode(vn.encode(x), torch.float32) - x).square().sum()
    assert e_vn <= e_plain * 1.01


@pytest.mark.parametrize("role", ["k", "v"])
def test_partly_evicted_first_group_decodes_as_the_full_body(role):
    x = sample(2, t=96)
    codec = varnorm_codec(make_codec("int3", role, group_size=32), 32)
    enc = codec.encode(x)
    full = codec.decode(enc, torch.float32)
    for start in (1, 31, 33, 70):
        part, off = enc.narrow(start, 96, 0, codec.token_group)
        assert torch.equal(codec.decode(part, torch.float32, off), full[:, :, start:])


# --------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("bits", BITS)
def test_nbytes_and_bits_per_element_count_the_factors(bits):
    x = sample(1)
    for role, extra in (("k", 8 / 64), ("v", 8 / 32)):
        plain = make_codec(f"int{bits}", role, group_size=32)
        vn = varnorm_codec(plain, 32)
        enc = vn.encode(x)
        assert vn.nbytes(1, 2, 64, 64) == enc.nbytes()  # every stored tensor, counted
        assert vn.nbytes(1, 2, 64, 64) == plain.nbytes(1, 2, 64, 64) + 2 * 64 * extra * 64 // 8
        assert vn.bits_per_element(64) == plain.bits_per_element(64) + extra
        assert vn.bits_per_element(64) * 2 * 64 * 64 / 8 == enc.nbytes()
    with pytest.raises(ValueError, match="whole groups of 32 tokens"):
        varnorm_codec(make_codec("int2", "v"), 32).nbytes(1, 1, 40, 64)


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("bits", BITS)
def test_c_kernels_equal_the_torch_reference(bits):
    from kvslim.cache.hadamard import Hadamard
    from kvslim.kernels import KeyTransform, cpu, reference

    if not cpu.status()[0]:
        pytest.skip(f"C kernels unavailable: {cpu.status()[1]}")
    x = sample(4, t=96)
    kc = varnorm_codec(make_codec(f"int{bits}", "k", group_size=32), 32)
    vc = varnorm_codec(make_codec(f"int{bits}", "v", group_size=32), 32)
    ek, ev = kc.encode(x), vc.encode(x)
    g = torch.Generator().manual_seed(9)
    tr = KeyTransform(hadamard=Hadamard.for_head_dim(64))
    for start in (0, 5, 40):
        nk, ok = ek.narrow(start, 96, 0, 32)
        nv, ov = ev.narrow(start, 96, 0, 32)
        n = 96 - start
        q = torch.randn(1, 2, 3, 64, generator=g)
        p = torch.softmax(torch.randn(1, 2, 3, n, generator=g), -1)
        scale = float(x.abs().max()) * 64
        assert torch.allclose(
            cpu.k_affine(q, kc, nk, ok), reference.k_scores(q, kc, nk, ok), atol=1e-6 * scale
        )
        assert torch.allclose(
            cpu.k_affine_transformed(q, kc, nk, ok, tr),
            reference.k_scores_transformed(q, kc, nk, ok, tr),
            atol=1e-6 * scale,
        )
        assert torch.allclose(
            cpu.v_affine(p, vc, nv, ov), reference.v_weighted(p, vc, nv, ov), atol=1e-5 * scale / 64
        )
        ks, vs, kr, vr = (torch.randn(1, 2, m, 64, generator=g) for m in (4, 4, 7, 7))
        out = cpu.attend(q / 8, ks, vs, kr, vr, kc, nk, ok, vc, nv, v_offset=ov)
        keys = torch.cat([ks, kc.decode(nk, torch.float32, ok), kr], 2)
        values = torch.cat([vs, vc.decode(nv, torch.float32, ov), vr], 2)
        want = torch.softmax(q / 8 @ keys.transpose(-1, -2), -1) @ values
        assert torch.allclose(out, want, atol=1e-5 * float(want.abs().max()) + 1e-5)


def _triton_cases():
    """(bits, role, v_group, token group): every width, both roles, whole-head and 16-channel V scales."""
    return [(b, r, vg, g) for b in BITS for r, vg in (("k", None), ("v", None), ("v", 16)) for g in (8, 32)]


@pytest.mark.parametrize("bits,role,v_group,group", _triton_cases())
def test_triton_kernels_equal_the_torch_reference(bits, role, v_group, group, monkeypatch):
    """The Triton programs decode the factors in place (Triton's interpreter on CPU tensors, as
    tests/test_triton.py runs the other layouts): K scores and V sums equal the torch reference to the bound of
    tests/kernel_helpers.py, over partly evicted first groups and bodies narrowed out of bigger buffers."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'kvslim[gpu]')")
    from kernel_helpers import assert_scaled_close, encoded_view, probs, queries
    from kvslim import kernels
    from kvslim.kernels import gpu, reference

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.set_backend("triton")
    try:
        codec = varnorm_codec(make_codec(f"int{bits}", role, group_size=group, v_group_size=v_group), group)
        gen = torch.Generator().manual_seed(bits * 100 + group)
        for (b, h, m, t, d), offset in (((1, 2, 3, 37, 64), group - 1), ((2, 1, 9, 70, 128), group // 2)):
            enc = encoded_view(codec, b, h, t, offset, gen, d)
            assert gpu.supported(codec, enc)
            full = codec.decode(enc, torch.float32, offset)
            q, p = queries(b, h, m, gen, d), probs(b, h, m, t, gen)
            what = f"int{bits} {role} v_group={v_group} G={group} T={t} {offset=}"
            assert kernels.select(q, codec, enc)[0] == "triton", what
            ref = reference.k_scores(q, codec, enc, offset)
            assert_scaled_close(
                kernels.k_scores(q, codec, enc, offset), ref, q.abs() @ full.abs().mT, f"K {what}"
            )
            ref = reference.v_weighted(p, codec, enc, offset)
            assert_scaled_close(
                kernels.v_weighted(p, codec, enc, offset), ref, p.abs() @ full.abs(), f"V {what}"
            )
    finally:
        kernels.set_backend(None)


def test_triton_factor_bytes_are_exact(monkeypatch):
    """Every factor byte, read by one-hot probabilities from a V of unit codes: the kernel's 2^((e - 128) / 4)
    equals factor_of bit for bit."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'kvslim[gpu]')")
    from kvslim import kernels
    from kvslim.formats import Encoded

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.set_backend("triton")
    try:
        codec = varnorm_codec(make_codec("int8", "v", group_size=1), 1)
        codes = torch.ones(
            1, 1, 256, 64, dtype=torch.uint8
        )  # code 1, scale 1, zero 0: the value is the factor
        cnorm = (
            torch.arange(256, dtype=torch.int64)
            .to(torch.uint8)[:, None]
            .expand(256, 64)
            .reshape(1, 1, 256, 64)
        )
        one = torch.ones(1, 1, 256, 1, dtype=torch.float32)
        enc = Encoded(
            token={"codes": codes, "scale": one, "zero": one * 0}, group={"cnorm": cnorm.contiguous()}
        )
        out = kernels.v_weighted(torch.eye(256).reshape(1, 1, 256, 256), codec, enc)
        assert torch.equal(out, factor_of(cnorm))
    finally:
        kernels.set_backend(None)


def test_many_rows_call_reads_normalized_rows_in_place():
    """kv_attend_rows reads a normalized row's factors in place, as kv_attend does: K token factors and V channel
    factors entered mid-group (v_offset), the body whole or cut into pieces (a cut inside a factor group), bit for
    bit the per-row call; a factor offset outside its group is handed back."""
    from kvslim.kernels import cpu

    if not cpu.status()[0]:
        pytest.skip(f"C kernels unavailable: {cpu.status()[1]}")
    x = sample(7, t=96)
    kc = varnorm_codec(make_codec("int2", "k", group_size=32), 32)
    vc = varnorm_codec(make_codec("int4", "v", group_size=32), 32)
    kb, vb = kc.encode(x[:1]), vc.encode(x[:1])
    k_enc, k_off = kb.narrow(5, 96, 0, 32)  # the first 5 tokens evicted: 27 left in the first group
    v_enc, v_off = vb.narrow(5, 96, 0, 32)
    res = x[:1, :, :4]
    q = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(1)) / 8
    alone = cpu.attend(q, None, None, res, res, kc, k_enc, k_off, vc, v_enc, v_offset=v_off)
    row = cpu.AttendRow(0, None, None, res, res, ((kc, k_enc, k_off),), ((vc, v_enc, v_off),))
    out = torch.zeros_like(q)
    assert cpu.attend_rows(q, [row], out) == []
    assert torch.equal(out, alone)
    cut = []
    for codec, enc, off in ((kc, k_enc, k_off), (vc, v_enc, v_off)):
        bounds = [0, 10, 27, 40, 91]  # 10 and 40: inside a group
        cut.append(tuple((codec, *enc.narrow(lo, hi, off, 32)) for lo, hi in zip(bounds, bounds[1:])))
    pieces = torch.zeros_like(q)
    assert cpu.attend_rows(q, [row._replace(k_body=cut[0], v_body=cut[1])], pieces) == []
    assert torch.equal(pieces, alone)
    plain = cpu.attend(q, None, None, res, res, kc, k_enc, k_off, vc, v_enc, v_offset=0)
    assert not torch.equal(plain, alone)  # the V factors' offset is read
    bad = row._replace(v_body=((vc, v_enc, 32),))  # outside the group: the row is handed back
    assert cpu.attend_rows(q, [bad], torch.zeros_like(q)) == [0]


# --------------------------------------------------------------------------- the option


def test_option_parses_validates_and_round_trips():
    assert CacheConfig().varnorm == "auto"
    c = parse_spec("int2,varnorm=on")
    assert c.varnorm == "on" and parse_spec(c.to_spec()) == c and "varnorm=on" in c.to_spec()
    assert parse_spec("k4v2,varnorm=off").varnorm == "off"
    assert parse_spec("q4_0,k=int2,varnorm=on").varnorm == "on"  # one affine stream is enough
    with pytest.raises(ValueError) as e:
        parse_spec("q4_0,varnorm=on")
    msg = str(e.value)
    assert "\n" not in msg and "varnorm=on applies to the affine formats" in msg and "q4_0" in msg
    with pytest.raises(ValueError) as e:
        parse_spec("int2,varnorm=maybe")
    assert "\n" not in str(e.value) and "varnorm must be one of auto, off, on" in str(e.value)
    from kvslim.config import SPEC_KEYS

    assert SPEC_KEYS["varnorm"].flag == "--kv-varnorm"


def test_resolve_wraps_only_affine_streams():
    plain = make_codec("int2", "k", group_size=32)
    assert getattr(resolve("on", plain, 32), "varnorm", False)
    assert resolve("off", plain, 32) is plain
    q = make_codec("q4_0", "k")
    assert resolve("on", q, 32) is q


def test_cache_with_varnorm_counts_its_bytes_and_stays_close():
    from conftest import tiny_model
    from kvslim import SlimCache

    model = tiny_model()
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    out = {}
    for vn in ("off", "on"):
        cache = SlimCache(kv_quantize="int2", residual=32, varnorm=vn, config=model.config)
        with torch.no_grad():
            out[vn] = model(ids, past_key_values=cache).logits
            step = model(ids[:, -1:], past_key_values=cache).logits
        assert torch.isfinite(step).all()
        assert cache.report()["varnorm"] == ("kv" if vn == "on" else "none")
        out[vn + "_bytes"] = cache.nbytes()
    # the factors cost bytes: K one per token and head, V one per channel per group of 32 tokens
    assert out["on_bytes"] > out["off_bytes"]
    ref = model(ids).logits
    assert (out["on"] - ref).abs().max() < 5 * (out["off"] - ref).abs().max() + 1e-3


# --------------------------------------------------------------------------- the static cache and prompt-cache files

STATIC_SPECS = [
    dict(kv_quantize="int2", group_size=8, residual=8, window=32),  # groups evicted, the ring wraps
    dict(kv_quantize="int4", group_size=8, residual=0, sink=4, window=40),  # every group encoded on arrival
    # a per-token K (no group parts) next to a normalized V (channel factors per group of 8 tokens)
    dict(k_quantize="fp8", v_quantize="int2", group_size=8, residual=8, sink=2, window=30),
    dict(k_quantize="q8_0", v_quantize="int3", group_size=8, residual=8),  # unbounded (max_cache_len)
]


@pytest.fixture(scope="module")
def kvslim_model():
    from conftest import tiny_model

    return tiny_model(attn_implementation="kvslim")


@pytest.mark.parametrize("spec", STATIC_SPECS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_static_cache_with_varnorm_equals_a_slimcache(kvslim_model, spec):
    """A StaticSlimCache stores the same normalized codes and factors as a SlimCache, through prefill and 45 decode
    steps (as tests/test_static.py checks for the other formats)."""
    from kvslim import SlimCache, StaticSlimCache
    from kvslim.compiled import uncompile
    from kvslim.generate import decode_one_token, prefill

    model = kvslim_model
    uncompile(model)
    ref = SlimCache(config=model.config, pre_rope=False, varnorm="on", **spec)
    kw = {} if spec.get("window") else {"max_cache_len": 256}
    static = StaticSlimCache(config=model.config, varnorm="on", **spec, **kw)
    assert ref.report()["varnorm"] == static.report()["varnorm"] == ("kv" if "kv_quantize" in spec else "v")
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(3, 128, (2, 45), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(
            prefill(model, ids, static), prefill(model, ids, ref), atol=1e-4, rtol=1e-4
        )
        for i in range(45):
            a = decode_one_token(model, tokens[:, i : i + 1], ref)
            b = decode_one_token(model, tokens[:, i : i + 1], static)
            # (deeper layers' K/V carry the attention path's rounding, which may flip an int2 code or a group's
            # strength: 1e-3, as tests/test_static.py allows for chunks)
            torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
    assert static.stored_tokens() == ref.stored_tokens()
    # layer 0's K/V depend on the tokens alone: the same codes and factors, decoded the same way, bit for bit
    assert torch.equal(static.layers[0].keys, ref.layers[0].keys)
    assert torch.equal(static.layers[0].values, ref.layers[0].values)
    body = static.stores()[0].v_body
    assert body.group["cnorm"].shape[2] * 8 == body.token["codes"].shape[2]  # one factor row per group of 8


@pytest.mark.parametrize("bits", BITS)
def test_encoders_inside_a_trace_write_the_eager_bytes(bits, monkeypatch):
    """The branch-free paths the encoders take inside torch.compile (a compiled static step) give the eager bytes."""
    import kvslim.formats.affine as affine
    import kvslim.formats.varnorm as varnorm

    x = sample(6)
    x[0, 0, :8] = 0.0  # an all-zero group of tokens
    x[0, 1, :, 3] = 0.0  # a zero channel
    for role in ("k", "v"):
        codec = varnorm_codec(make_codec(f"int{bits}", role, group_size=32), 32)
        eager = codec.encode(x)
        for mod in (affine, varnorm):
            monkeypatch.setattr(mod, "tracing", lambda: True)
        traced = codec.encode(x)
        monkeypatch.undo()
        for part in ("token", "group"):
            a, b = getattr(eager, part), getattr(traced, part)
            assert set(a) == set(b)
            for key in a:
                assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), (role, part, key)


@pytest.mark.parametrize("spec", ["int2,residual=32,varnorm=on", "fp8,v=int3,residual=32,varnorm=on"])
def test_prompt_cache_file_restores_bit_for_bit(kvslim_model, tmp_path, spec):
    """Save a normalized cache, load it: the same stored tensors (factors included) and the same logits after."""
    from kvslim import SlimCache
    from kvslim import promptcache as pc
    from kvslim.generate import decode_one_token, prefill

    model = kvslim_model
    cache = SlimCache.from_config(parse_spec(spec), config=model.config)
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefill(model, ids, cache, chunk_size=23)
    path = tmp_path / "p.safetensors"
    cache.save(path, token_ids=ids)
    tensors, header = pc.to_state(cache)
    names = {n.split(".", 2)[2] for n in tensors if n.startswith("layers.0.")}
    assert "v.group.cnorm" in names and ("k.token.rnorm" in names) == spec.startswith("int2")
    restored = pc.load(path, new_cache=SlimCache.from_config, config=model.config).cache
    assert restored.report()["varnorm"] == cache.report()["varnorm"]
    assert pc.to_state(restored)[1]["sha256"] == header["sha256"]
    assert restored.live_nbytes() == cache.live_nbytes()
    tokens = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for i in range(40):  # past a group boundary: the residual fills and a new normalized group is encoded
            a = decode_one_token(model, tokens[:, i : i + 1], cache)
            b = decode_one_token(model, tokens[:, i : i + 1], restored)
            assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max()}"
    # a file of a normalized cache does not load into a cache that would store it plain (one clear line)
    with pytest.raises(ValueError) as e:
        pc.load(
            path,
            new_cache=SlimCache.from_config,
            config=model.config,
            cache_config=spec.replace("=on", "=off"),
        )
    assert "\n" not in str(e.value)


def test_prompt_cache_records_what_auto_resolved(kvslim_model, monkeypatch):
    """A file records the normalized streams: loading it where ``auto`` resolves otherwise (another AUTO, i.e. another
    kvslim version) is refused naming varnorm; a file from before the record loads as it did."""
    import kvslim.formats.varnorm as varnorm
    from kvslim import SlimCache
    from kvslim import promptcache as pc
    from kvslim.generate import prefill

    model = kvslim_model
    monkeypatch.setattr(varnorm, "AUTO", frozenset())
    cache = SlimCache.from_config(parse_spec("int2,residual=32"), config=model.config)  # varnorm=auto
    with torch.inference_mode():
        prefill(model, torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(0)), cache)
    tensors, header = pc.to_state(cache)  # (16 sinks: sink=auto, a group of 32 encoded)
    assert header["levers"]["varnorm"] == "none"
    old = {**header, "levers": {k: v for k, v in header["levers"].items() if k not in ("varnorm", "clip")}}
    old["sha256"] = pc.content_sha256(tensors, old)
    for h in (header, old):
        assert (
            pc.from_state(tensors, h, new_cache=SlimCache.from_config, config=model.config).cache.report()[
                "varnorm"
            ]
            == "none"
        )
    monkeypatch.setattr(varnorm, "AUTO", frozenset({("k", 2), ("v", 2)}))
    with pytest.raises(
        ValueError, match="saved with varnorm='none', but its settings resolve to varnorm='kv'"
    ):
        pc.from_state(tensors, header, new_cache=SlimCache.from_config, config=model.config)
    with pytest.raises(ValueError, match=r"k token parts \['codes'\] are not what int2 writes"):
        pc.from_state(tensors, old, new_cache=SlimCache.from_config, config=model.config)
