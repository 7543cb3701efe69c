"""Registry-wide contract of every format (floats, affine, GGML): honest bytes, shapes and dtypes,
non-finite input, and the ``offset`` of a partly evicted token group."""

from __future__ import annotations

import pytest
import torch

from kvslim.formats import FORMATS, Encoded, format_names, get_format, make_codec

ALL = format_names()
ROLES = ["k", "v"]
B, H, D = 2, 3, 64


def codecs():
    return [pytest.param(name, role, id=f"{name}-{role}") for name in ALL for role in ROLES]


def test_registry_holds_every_format():
    assert ALL[:13] == [
        "none",
        "fp16",
        "bf16",
        "fp8",
        "int8",
        "int4",
        "int3",
        "int2",
        "q8_0",
        "q4_0",
        "q4_1",
        "q5_0",
        "q5_1",
    ]
    assert set(ALL) == set(FORMATS)
    for name in ALL:
        assert get_format(name).name == name and get_format(name).summary
    with pytest.raises(ValueError, match="unknown KV format"):
        get_format("int5")
    with pytest.raises(ValueError, match="role"):
        make_codec("int4", "q")


def _tokens(codec, multiple: int = 2) -> int:
    return codec.token_group * multiple


@pytest.mark.parametrize("name,role", codecs())
def test_nbytes_equals_real_tensor_bytes(name, role):
    codec = make_codec(name, role, group_size=16)
    codec.check_head_dim(D)
    t = _tokens(codec, 3)
    x = torch.randn(B, H, t, D)  # fp32: ``none`` stores it as given
    enc = codec.encode(x)
    real = sum(p.numel() * p.element_size() for p in (*enc.token.values(), *enc.group.values()))
    assert enc.nbytes() == real == codec.nbytes(B, H, t, D)
    # bits/element is the same cost per element, metadata included
    assert codec.bits_per_element(D) * B * H * t * D / 8 == pytest.approx(real, rel=1e-12)


@pytest.mark.parametrize("name,role", codecs())
def test_group_parts_are_per_token_group(name, role):
    codec = make_codec(name, role, group_size=8)
    t = _tokens(codec, 2)
    enc = codec.encode(torch.randn(B, H, t, D))
    assert all(p.shape[:3] == (B, H, t) for p in enc.token.values())
    assert all(p.shape[:3] == (B, H, t // codec.token_group) for p in enc.group.values())


@pytest.mark.parametrize("name,role", codecs())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_shape_and_dtype(name, role, dtype):
    codec = make_codec(name, role, group_size=8)
    x = torch.randn(B, H, _tokens(codec, 2), D).to(dtype)
    for out_dtype in (dtype, torch.float32):
        y = codec.decode(codec.encode(x), out_dtype)
        assert y.shape == x.shape and y.dtype == out_dtype
        assert torch.isfinite(y).all()
        # every format keeps N(0, 1) data within a step of its coarsest grid (int2: range / 3)
        assert (y.float() - x.float()).abs().max() < 2.5


def _lossy():
    out = []
    for name in ALL:
        if name == "none":
            continue  # stores the model's tensor as given, by definition
        out += [pytest.param(name, role, id=f"{name}-{role}") for role in ROLES]
    return out


@pytest.mark.parametrize("name,role", _lossy())
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_raises(name, role, bad):
    codec = make_codec(name, role, group_size=8)
    x = torch.randn(1, 2, _tokens(codec, 1), D)
    x[0, 1, 0, 5] = bad
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(x)


def _evict(enc: Encoded, k: int, group: int) -> Encoded:
    """Drop the oldest ``k`` tokens the way a cache layer does: token parts lose ``k`` rows, group
    parts lose only the groups with no surviving token."""
    return Encoded(
        token={n: p[:, :, k:] for n, p in enc.token.items()},
        group={n: p[:, :, k // group :] for n, p in enc.group.items()},
    )


@pytest.mark.parametrize("name,role", codecs())
def test_decode_offset_after_eviction(name, role):
    codec = make_codec(name, role, group_size=8)
    g = codec.token_group
    t = 3 * g
    x = torch.randn(B, H, t, D)
    enc = codec.encode(x)
    full = codec.decode(enc, torch.float32)
    for k in range(0, t):
        got = codec.decode(_evict(enc, k, g), torch.float32, offset=k % g)
        assert torch.equal(got, full[:, :, k:]), f"evicted {k}"


GROUPED = [(n, r) for n in ALL for r in ROLES if make_codec(n, r, group_size=8).token_group > 1]


def test_affine_keys_are_the_grouped_codecs():
    assert GROUPED == [("int8", "k"), ("int4", "k"), ("int3", "k"), ("int2", "k")]


@pytest.mark.parametrize("name,role", GROUPED)
def test_encode_rejects_partial_token_groups(name, role):
    codec = make_codec(name, role, group_size=8)
    with pytest.raises(ValueError, match="multiple of group_size"):
        codec.encode(torch.randn(1, 1, codec.token_group + 1, D))


@pytest.mark.parametrize("name", ALL)
def test_check_head_dim_of_odd_sizes(name):
    for role in ROLES:
        codec = make_codec(name, role)
        codec.check_head_dim(64)
        codec.check_head_dim(128)
        if name.startswith("q"):
            with pytest.raises(ValueError, match="multiple of 32"):
                codec.check_head_dim(80)
        if name in ("int4", "int3", "int2"):
            with pytest.raises(ValueError, match="multiple of"):
                codec.check_head_dim(63)
        if name == "int3":
            with pytest.raises(ValueError, match="multiple of 8"):
                codec.check_head_dim(36)


@pytest.mark.parametrize("name,role", codecs())
def test_appended_chunks_decode_like_separate_chunks(name, role):
    """A cache layer appends encoded chunks along dim 2; decoding the concatenation must equal
    decoding each chunk."""
    codec = make_codec(name, role, group_size=8)
    a, b = torch.randn(B, H, _tokens(codec, 2), D), torch.randn(B, H, _tokens(codec, 1), D) * 5
    ea, eb = codec.encode(a), codec.encode(b)
    joined = Encoded(
        token={n: torch.cat([ea.token[n], eb.token[n]], dim=2) for n in ea.token},
        group={n: torch.cat([ea.group[n], eb.group[n]], dim=2) for n in ea.group},
    )
    want = torch.cat([codec.decode(ea, torch.float32), codec.decode(eb, torch.float32)], dim=2)
    assert torch.equal(codec.decode(joined, torch.float32), want)
    assert joined.nbytes() == codec.nbytes(B, H, a.shape[2] + b.shape[2], D)


@pytest.mark.parametrize("name,role", codecs())
def test_zero_tokens(name, role):
    codec = make_codec(name, role, group_size=8)
    enc = codec.encode(torch.randn(1, 2, 0, D))
    assert codec.decode(enc, torch.float16).shape == (1, 2, 0, D)
    assert enc.nbytes() == codec.nbytes(1, 2, 0, D) == 0


def test_error_table_covers_every_format_and_role(capsys):
    from kvslim.formats.report import format_error_table, main

    rows = format_error_table(shape=(1, 2, 64, 64))
    assert [(r["format"], r["role"]) for r in rows] == [(n, r) for n in ALL for r in ROLES]
    by = {(r["format"], r["role"]): r for r in rows}
    assert by[("none", "k")]["max_abs_err"] == 0
    assert by[("int4", "k")]["bits_per_element"] == 5.0 and by[("q4_0", "v")]["bits_per_element"] == 4.5
    for role in ROLES:
        rmse = [by[(f"int{b}", role)]["rmse"] for b in (8, 4, 3, 2)]
        assert 0 < rmse[0] < rmse[1] < rmse[2] < rmse[3], (role, rmse)
    assert main(["--shape", "1", "1", "32", "64"]) == 0
    assert "q5_1" in capsys.readouterr().out


# --------------------------------------------------------------------------- registry facts


def test_registry_facts():
    """The facts other modules read (bench: bits; config: symmetric, mean_center; kernels: family)."""
    facts = {n: (get_format(n).bits, get_format(n).symmetric, get_format(n).mean_center) for n in ALL}
    assert facts == {
        "none": (None, True, False),
        "fp16": (16, True, False),
        "bf16": (16, True, False),
        "fp8": (8, True, False),
        "int8": (8, False, False),
        "int4": (4, False, False),
        "int3": (3, False, False),
        "int2": (2, False, False),
        "q8_0": (8, True, True),
        "q4_0": (4, True, True),
        "q4_1": (4, False, False),
        "q5_0": (5, True, True),
        "q5_1": (5, False, False),
    }
    for name in ALL:
        fmt = get_format(name)
        assert set(fmt.family) == set(ROLES) and fmt.lossy == (name != "none")
        assert (fmt.block is not None) == (fmt.family["k"] == "ggml")
        assert (fmt.pack is not None) == (fmt.family["k"] == "affine_k")
        if fmt.pack is not None:  # a packing unit is whole bytes of whole codes, no spare bit
            assert fmt.pack.elements * fmt.bits == 8 * fmt.pack.nbytes
        assert not fmt.mean_center or fmt.symmetric  # centering gives back what a zero point would


@pytest.mark.parametrize("name,role", codecs())
def test_registry_facts_match_what_codecs_store(name, role):
    """bits, block and symmetric against the encoded tensors: the codes take exactly ``bits`` per
    element, a GGML block takes ``block.nbytes`` bytes (codes + an fp16 scale, + an fp16 min when not
    symmetric), and only formats with a zero point store a zero."""
    fmt = get_format(name)
    codec = make_codec(name, role, group_size=16)
    assert codec.format is fmt and codec.name == name and codec.family == fmt.family[role]
    assert (codec.bits, codec.symmetric, codec.lossy) == (fmt.bits, fmt.symmetric, fmt.lossy)
    t = _tokens(codec, 2)
    x = torch.randn(B, H, t, D)
    enc = codec.encode(x)
    n = B * H * t * D
    assert enc.nbytes() * 8 / n == pytest.approx(codec.bits_per_element(D), rel=1e-12)
    if fmt.bits is None:  # ``none``: the tensor as given
        assert enc.token["x"] is x
        return
    if fmt.block is not None:
        (blocks,) = enc.token.values()
        assert blocks.dtype == torch.uint8 and blocks.shape[-1] == D // fmt.block.elements * fmt.block.nbytes
        meta = 2 if fmt.symmetric else 4  # fp16 d (and m)
        assert fmt.block.nbytes == meta + fmt.block.elements * fmt.bits // 8
        return
    codes = enc.token["codes" if "codes" in enc.token else "x"]
    assert codes.numel() * codes.element_size() * 8 == n * fmt.bits
    if fmt.pack is not None:
        assert codes.shape[-1] == D // fmt.pack.elements * fmt.pack.nbytes
    has_zero = "zero" in enc.token or "zero" in enc.group
    assert has_zero == (not fmt.symmetric)


@pytest.mark.parametrize("name,role", [p for p in codecs() if p.values[0] != "none"])
def test_symmetric_formats_spend_resolution_on_an_offset(name, role):
    """What ``symmetric`` means for mean-centering: values 64 and 64 + 2^-8 are resolved exactly by a
    format with a zero point (the grid starts at the minimum) and not by a zero-point free one (its
    grid is anchored at 0, so the offset eats the range)."""
    codec = make_codec(name, role, group_size=16)
    step = 2.0**-8
    gen = torch.Generator().manual_seed(0)
    x = 64 + step * torch.randint(0, 2, (1, 2, _tokens(codec, 2), D), generator=gen).float()
    err = (codec.decode(codec.encode(x), torch.float32) - x).abs().max().item()
    if get_format(name).symmetric:
        assert err >= step / 2
    else:
        assert err < step / 4
