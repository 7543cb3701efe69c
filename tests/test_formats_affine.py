"""KIVI affine formats against a float64 reference: error bound per slice, exact constants, full code
range, bit packing, property tests over shapes, scales and input dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslim.formats import make_codec
from kvslim.formats.affine import (
    EPS,
    dequantize_per_channel,
    dequantize_per_token,
    pack_bits,
    quantize_per_channel,
    quantize_per_token,
    unpack_bits,
)

BITS = [8, 4, 3, 2]
#: codes per packing unit along the head dim (int3: 8 codes in 3 bytes)
PER = {8: 1, 4: 2, 3: 8, 2: 4}
F32_SLACK = 2.0**-22  # a few fp32 roundings, relative to the magnitudes involved


# --------------------------------------------------------------------------- float64 reference


def grouped(x: torch.Tensor, axis: str, g: int) -> torch.Tensor:
    """x (..., T, D) as float64 slices: per-channel (..., T/g, g, D) reduced over -2, per-token
    (..., T, D/g, g) reduced over -1."""
    *lead, t, d = x.shape
    x64 = x.double()
    return x64.reshape(*lead, t // g, g, d) if axis == "channel" else x64.reshape(*lead, t, d // g, g)


def check_against_reference(x, bits, axis, g, scale_dtype=torch.float16):
    """Quantize ``x`` and check scale/zero/codes/reconstruction against float64 arithmetic."""
    levels = 2**bits - 1
    if axis == "channel":
        packed, scale, zero = quantize_per_channel(x, bits, g, scale_dtype)
        y = dequantize_per_channel(packed, scale, zero, bits, g, torch.float32)
        red, s, z = -2, scale.double().unsqueeze(-2), zero.double().unsqueeze(-2)
    else:
        packed, scale, zero = quantize_per_token(x, bits, g, scale_dtype)
        y = dequantize_per_token(packed, scale, zero, bits, g, torch.float32)
        red, s, z = -1, scale.double().unsqueeze(-1), zero.double().unsqueeze(-1)
    assert scale.dtype == zero.dtype == scale_dtype
    assert packed.dtype == torch.uint8 and packed.shape[-1] == x.shape[-1] * bits // 8
    xg = grouped(x, axis, g)
    mn, mx = xg.amin(red, keepdim=True), xg.amax(red, keepdim=True)

    # zero: the largest storable value <= min; scale: the smallest storable value >= the range / levels.
    assert (z <= mn).all()
    assert (torch.nextafter(zero, torch.full_like(zero, float("inf"))).double().unsqueeze(red) > mn).all()
    need = torch.clamp((mx - z) / levels, min=EPS)
    assert (s >= need * (1 - F32_SLACK)).all()
    below = torch.nextafter(scale, torch.full_like(scale, float("-inf"))).double().unsqueeze(red)
    assert (below < need * (1 + F32_SLACK)).all()

    # codes: round((x - zero) / scale) in float64, except where fp32 may flip a near-tie.
    codes = unpack_bits(packed, bits, x.shape[-1]).double()
    codes = grouped(codes, axis, g)
    exact = ((xg - z) / s).clamp(0, levels)
    near_tie = ((exact - exact.floor()) - 0.5).abs() < 1e-4
    ref_codes = torch.round(exact)
    assert ((codes == ref_codes) | (near_tie & ((codes - ref_codes).abs() <= 1))).all()
    assert codes.min() >= 0 and codes.max() <= levels

    # reconstruction: |x - x'| <= scale / 2 (+ fp32 rounding), per slice.
    err = (grouped(y, axis, g) - xg).abs()
    bound = s / 2 + F32_SLACK * (xg.abs() + z.abs() + levels * s)
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():g}"
    return packed, scale, zero


# --------------------------------------------------------------------------- packing


def bitstream(codes: list[int], bits: int) -> list[int]:
    """The packing's definition, written independently with Python integers: the row's codes as one
    little-endian bit stream, element d in bits bits * d .. bits * d + bits - 1."""
    stream = sum(c << (bits * d) for d, c in enumerate(codes))
    return list(stream.to_bytes(len(codes) * bits // 8, "little"))


@pytest.mark.parametrize("bits", BITS)
def test_pack_is_byte_exact_with_the_bit_stream_definition(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, 64), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (5, 64 * bits // 8)
    assert [bitstream(row, bits) for row in codes.tolist()] == packed.tolist()
    assert torch.equal(unpack_bits(packed, bits, 64), codes)


def test_int3_unit_layout_by_hand():
    """8 codes in 3 bytes: w = c0 | c1 << 3 | ... | c7 << 21, bytes w & 0xff, (w >> 8) & 0xff, w >> 16."""
    assert pack_bits(torch.arange(8, dtype=torch.uint8), 3).tolist() == [0x88, 0xC6, 0xFA]
    assert pack_bits(torch.tensor([7, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8), 3).tolist() == [7, 0, 0]
    # code 2 straddles bytes 0 and 1 (bits 6..8), code 5 bytes 1 and 2 (bits 15..17)
    assert pack_bits(torch.tensor([0, 0, 7, 0, 0, 0, 0, 0], dtype=torch.uint8), 3).tolist() == [0xC0, 0x01, 0]
    assert pack_bits(torch.tensor([0, 0, 0, 0, 0, 7, 0, 0], dtype=torch.uint8), 3).tolist() == [0, 0x80, 0x03]
    assert pack_bits(torch.tensor([0] * 7 + [7], dtype=torch.uint8), 3).tolist() == [0, 0, 0xE0]
    assert unpack_bits(torch.tensor([0xFF, 0xFF, 0xFF], dtype=torch.uint8), 3, 8).tolist() == [7] * 8


def test_int3_every_code_in_every_slot():
    """Unit u holds code (u + i) % 8 in slot i: 8 units put every code in every slot of the 3-byte unit."""
    codes = ((torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 8).to(torch.uint8).reshape(1, 64)
    packed = pack_bits(codes, 3)
    assert packed.shape == (1, 24)
    assert torch.equal(unpack_bits(packed, 3, 64), codes)
    for slot in range(8):
        assert set(unpack_bits(packed, 3, 64)[..., slot::8].unique().tolist()) == set(range(8))
    # every 3-byte value decodes to some 8 codes and packs back to itself (the unit has no spare bits)
    gen = torch.Generator().manual_seed(0)
    units = torch.randint(0, 256, (4096, 3), generator=gen, dtype=torch.uint8)
    assert torch.equal(pack_bits(unpack_bits(units, 3, 8), 3), units)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_round_trips_every_code_in_every_slot(bits):
    per = 8 // bits
    # Every byte value is one combination of `per` codes: together they put every code in every slot.
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    codes = unpack_bits(all_bytes, bits, 128 * per)
    assert codes.shape == (2, 128 * per) and int(codes.max()) == 2**bits - 1
    for slot in range(per):
        assert set(codes[..., slot::per].unique().tolist()) == set(range(2**bits))
    assert torch.equal(pack_bits(codes, bits), all_bytes)
    assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, 128 * per), codes)


def test_pack_layout_is_low_bits_first():
    assert pack_bits(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]
    assert pack_bits(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack_bits(torch.tensor([7, 200], dtype=torch.uint8), 8).tolist() == [7, 200]


def test_pack_validation():
    with pytest.raises(ValueError, match="multiple of 2"):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_bits(torch.zeros(6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="uint8"):
        pack_bits(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(
        ValueError, match=r"int3 packs 8 codes in 3 bytes: head dim must be a multiple of 8, got 12"
    ):
        pack_bits(torch.zeros(12, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match=r"bits must be one of \(8, 4, 3, 2\), got 5"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(torch.zeros(4, dtype=torch.uint8), 4, 10)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(torch.zeros(4, dtype=torch.uint8), 3, 8)  # 8 int3 codes take 3 bytes


# --------------------------------------------------------------------------- reference checks


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis,g", [("channel", 32), ("channel", 8), ("token", 64), ("token", 16)])
def test_matches_float64_reference_on_normal_data(bits, axis, g):
    torch.manual_seed(bits + g)
    x = torch.randn(2, 3, 64, 64)
    x[..., 5] = x[..., 5] * 20 + 50  # an outlier channel with a large mean and spread
    x[..., 9] = x[..., 9] * 1e-3 + 7.3  # a large mean with a tiny spread: zero's fp16 rounding matters
    check_against_reference(x, bits, axis, g)


@pytest.mark.parametrize("bits", BITS)
def test_other_scale_dtypes(bits):
    torch.manual_seed(0)
    x = torch.randn(1, 2, 32, 16) * 3 + 1
    check_against_reference(x, bits, "channel", 16, torch.float32)
    check_against_reference(x, bits, "token", 8, torch.bfloat16)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis,g", [("channel", 32), ("token", 64)])
def test_codes_use_the_full_range(bits, axis, g):
    """Bug class 3: the slice min maps to code 0 and the max to 2^bits - 1."""
    levels = 2**bits - 1
    torch.manual_seed(1)
    for x in (torch.randn(2, 2, 64, 64), torch.rand(2, 2, 64, 64) * 10 - 3):
        quant = quantize_per_channel if axis == "channel" else quantize_per_token
        packed, _, _ = quant(x, bits, g)
        codes = grouped(unpack_bits(packed, bits, 64), axis, g)
        xg = grouped(x, axis, g)
        red = -2 if axis == "channel" else -1
        at_min = codes.gather(red, xg.argmin(red, keepdim=True))
        at_max = codes.gather(red, xg.argmax(red, keepdim=True))
        assert (at_min == 0).all() and (at_max == levels).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_constant_slices_reconstruct_exactly(bits, dtype):
    """Bug class 1: min == max gives scale = eps, not 0, and no NaN."""
    x = torch.zeros(1, 2, 32, 16, dtype=dtype)
    x[0, 0, :, 3] = 1.5
    x[0, 0, :, 4] = -3.25
    x[0, 1, :, 7] = 1000.0
    x[0, 1, :, 8] = torch.tensor(0.1, dtype=torch.float16).to(dtype)  # fp16-representable
    k_packed, k_scale, k_zero = quantize_per_channel(x, bits, 32)
    assert torch.equal(dequantize_per_channel(k_packed, k_scale, k_zero, bits, 32, dtype), x)
    consts = torch.tensor([0.0, 1.5, -3.25, 1000.0, 0.1, -0.0]).to(torch.float16).to(dtype)
    v = consts.reshape(1, 1, 6, 1).expand(1, 2, 6, 16).contiguous()  # each token's vector is constant
    v_packed, v_scale, v_zero = quantize_per_token(v, bits)
    assert torch.equal(dequantize_per_token(v_packed, v_scale, v_zero, bits, None, dtype), v.to(dtype))
    assert (k_scale > 0).all() and (v_scale > 0).all()


@pytest.mark.parametrize("bits", BITS)
def test_constant_slice_not_representable_in_fp16_stays_within_bound(bits):
    x = torch.full((1, 1, 32, 8), 0.1) + torch.arange(8) * 1234.567  # fp32 constants per channel
    check_against_reference(x, bits, "channel", 32)
    check_against_reference(x.transpose(-1, -2).contiguous(), bits, "token", 32)


@pytest.mark.parametrize("bits", BITS)
def test_dequantized_dtype_follows_the_caller(bits):
    x = torch.randn(1, 1, 8, 8, dtype=torch.bfloat16)
    p, s, z = quantize_per_channel(x, bits, 4)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert dequantize_per_channel(p, s, z, bits, 4, dtype).dtype == dtype
        pt, st_, zt = quantize_per_token(x, bits, 4)
        assert dequantize_per_token(pt, st_, zt, bits, 4, dtype).dtype == dtype


# --------------------------------------------------------------------------- offsets (evicted tokens)


@pytest.mark.parametrize("bits", BITS)
def test_per_channel_offset_matches_full_decode(bits):
    torch.manual_seed(2)
    g = 8
    x = torch.randn(2, 3, 4 * g, 16)
    p, s, z = quantize_per_channel(x, bits, g)
    full = dequantize_per_channel(p, s, z, bits, g)
    for evicted in range(0, 3 * g + 1):
        first = evicted // g
        got = dequantize_per_channel(
            p[..., evicted:, :], s[..., first:, :], z[..., first:, :], bits, g, offset=evicted % g
        )
        assert torch.equal(got, full[..., evicted:, :])


def test_dequantize_validation():
    p, s, z = quantize_per_channel(torch.randn(1, 1, 16, 8), 4, 8)
    with pytest.raises(ValueError, match="offset"):
        dequantize_per_channel(p, s, z, 4, 8, offset=8)
    with pytest.raises(ValueError, match="do not match"):
        # 15 tokens at offset 1 span 2 groups
        dequantize_per_channel(p[..., 1:, :], s[..., :1, :], z[..., :1, :], 4, 8, offset=1)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_per_channel(p, s[..., :1, :], z[..., :1, :], 4, 8)
    pt, st_, zt = quantize_per_token(torch.randn(1, 1, 4, 8), 4, 4)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_per_token(pt, st_, zt, 4, 8)


# --------------------------------------------------------------------------- validation


def test_quantize_validation():
    x = torch.randn(1, 1, 12, 8)
    with pytest.raises(ValueError, match="T a multiple of group_size=8"):
        quantize_per_channel(x, 4, 8)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        quantize_per_channel(x, 4, 0)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_per_channel(x, 5, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_per_channel(torch.randn(1, 1, 4, 12), 3, 4)
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        quantize_per_token(x, 4, 3)
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize_per_token(torch.randn(1, 1, 2, 6), 2)
    with pytest.raises(ValueError, match="floating point"):
        quantize_per_token(torch.ones(1, 1, 2, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_per_token(x, 4, None, torch.float64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_non_finite_input_raises(bad, axis):
    x = torch.randn(1, 2, 8, 8)
    x[0, 1, 3, 2] = bad
    quant = quantize_per_channel if axis == "channel" else quantize_per_token
    with pytest.raises(ValueError, match="non-finite"):
        quant(x, 4, 8)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_non_finite_anywhere_in_a_slice_raises(axis):
    """The check reads only the slice statistics: a NaN or inf in any slot must reach them."""
    quant = quantize_per_channel if axis == "channel" else quantize_per_token
    for slot in range(8):
        for bad in (float("nan"), float("inf"), float("-inf")):
            x = torch.randn(1, 1, 8, 8)
            x[0, 0, slot, slot] = bad
            with pytest.raises(ValueError, match="non-finite"):
                quant(x, 4, 8, torch.float32)


def test_fp16_range_overflow_raises_and_fp32_scales_store_it():
    x = torch.randn(1, 1, 8, 8)
    x[0, 0, 0, 0] = -1e5  # a min fp16 cannot hold
    with pytest.raises(ValueError, match="scale_dtype=torch.float32"):
        quantize_per_channel(x, 4, 8)
    y = torch.randn(1, 1, 8, 8)
    y[0, 0, 0, 0] = 3e5  # (max - min) / 3 overflows fp16 for int2
    with pytest.raises(ValueError, match="cannot store values spanning"):
        quantize_per_token(y, 2)
    check_against_reference(x, 4, "channel", 8, torch.float32)
    check_against_reference(y, 2, "token", 8, torch.float32)


# --------------------------------------------------------------------------- codecs


def test_codec_bits_and_layout():
    k = make_codec("int4", "k", group_size=32)
    v = make_codec("int4", "v")
    assert k.token_group == 32 and v.token_group == 1 and not k.symmetric and not v.symmetric
    assert k.bits_per_element(64) == 5.0 and v.bits_per_element(64) == 4.5
    assert make_codec("int8", "k").bits_per_element(64) == 9.0
    assert make_codec("int2", "k", group_size=64).bits_per_element(64) == 2.5
    assert (
        make_codec("int3", "k").bits_per_element(64) == 4.0
        and make_codec("int3", "v").bits_per_element(64) == 3.5
    )
    e3 = make_codec("int3", "k").encode(torch.randn(1, 2, 32, 64))
    assert e3.token["codes"].shape == (1, 2, 32, 24) and e3.token["codes"].dtype == torch.uint8
    assert make_codec("int4", "v", v_group_size=32).bits_per_element(64) == 5.0
    x = torch.randn(2, 3, 64, 64)
    ek, ev = k.encode(x), v.encode(x)
    assert set(ek.token) == {"codes"} and set(ek.group) == {"scale", "zero"}
    assert ek.token["codes"].shape == (2, 3, 64, 32) and ek.group["scale"].shape == (2, 3, 2, 64)
    assert set(ev.token) == {"codes", "scale", "zero"} and not ev.group
    assert ev.token["scale"].shape == (2, 3, 64, 1)


def test_codec_check_head_dim():
    make_codec("int2", "k").check_head_dim(64)
    with pytest.raises(ValueError, match="multiple of 4"):
        make_codec("int2", "k").check_head_dim(66)
    with pytest.raises(ValueError, match="multiple of 2"):
        make_codec("int4", "v").check_head_dim(63)
    with pytest.raises(ValueError, match="multiple of 8"):
        make_codec("int3", "k").check_head_dim(36)
    make_codec("int3", "v").check_head_dim(80)
    with pytest.raises(ValueError, match="must divide head_dim"):
        make_codec("int8", "v", v_group_size=48).check_head_dim(64)
    with pytest.raises(ValueError, match="group_size"):
        make_codec("int8", "k", group_size=0)


# --------------------------------------------------------------------------- properties


@st.composite
def cases(draw):
    bits = draw(st.sampled_from(BITS))
    axis = draw(st.sampled_from(["channel", "token"]))
    d = PER[bits] * draw(st.integers(1, 64 // PER[bits]))
    if axis == "channel":
        g = draw(st.sampled_from([1, 2, 4, 8, 32]))
        t = g * draw(st.integers(1, 3))
    else:
        g = draw(st.sampled_from([x for x in range(1, d + 1) if d % x == 0]))
        t = draw(st.integers(1, 9))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    scale = 10.0 ** draw(st.floats(-3, 3))
    shift = draw(st.floats(-10, 10)) * scale
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return bits, axis, g, (*lead, t, d), scale, shift, dtype, seed


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(BITS), st.integers(1, 16), st.integers(0, 2**31 - 1))
def test_property_pack_is_the_bit_stream(bits, units, seed):
    gen = torch.Generator().manual_seed(seed)
    d = PER[bits] * units
    codes = torch.randint(0, 2**bits, (3, d), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.tolist() == [bitstream(row, bits) for row in codes.tolist()]
    assert torch.equal(unpack_bits(packed, bits, d), codes)


@settings(max_examples=50, deadline=None)
@given(cases())
def test_property_error_bound(case):
    bits, axis, g, shape, scale, shift, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * scale + shift).to(dtype)
    packed, s, z = check_against_reference(x, bits, axis, g)
    if axis == "channel":
        y = dequantize_per_channel(packed, s, z, bits, g, dtype)
    else:
        y = dequantize_per_token(packed, s, z, bits, g, dtype)
    assert y.dtype == dtype and y.shape == x.shape and torch.isfinite(y).all()
