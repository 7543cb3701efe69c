"""The affine encoders in C (kvslim.kernels.encode, csrc/kvslim_encode.c): the very bytes of the torch reference
(quantize_per_channel / quantize_per_token through the codecs) for int8/int4/int3/int2 K and V, every group setting,
on data that reaches each rounding rule: a tie (x.5 codes), a constant slice (the 1e-5 scale floor), a zero's sign,
an fp16 step down for the zero and up for the scale, subnormal ranges, a float16 input; refusal (None) for what it
does not take, so the codec encodes and raises its own errors; and the cache's flushes going through it."""

from __future__ import annotations

import pytest
import torch

from kvslim.cache import basis as cache_basis
from kvslim.formats import make_codec
from kvslim.kernels import encode
from kvslim.kernels.clib import status

pytestmark = pytest.mark.skipif(not status()[0], reason="the C library is not built here")


def _codecs() -> list:
    out = []
    for name in ("int8", "int4", "int3", "int2"):
        for grp in (32, 8):
            out.append(pytest.param(make_codec(name, "k", group_size=grp), id=f"{name}-k-g{grp}"))
        for grp in (None, 32, 16):
            out.append(pytest.param(make_codec(name, "v", v_group_size=grp), id=f"{name}-v-g{grp}"))
    return out


def _data(kind: str, shape, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    d = shape[-1]
    return {
        "normal": x,
        "shifted": x * 1000 + 50,
        "constant": torch.full(shape, 1.2345),
        "narrow": 1 + x * 1e-6,  # a range below the 1e-5 scale floor
        "ties": torch.randint(0, 31, shape, generator=gen).float() * 0.5,  # codes landing on x.5
        "float16": x.half(),
        "channels": x * torch.logspace(-3, 3, d),
        "subnormal": x * 1e-6,
        # slices whose min is a zero, of both signs in one slice (amin's choice of sign is its own: +0 is stored)
        "zeros": torch.where(x > 0, x, torch.where(torch.rand(shape, generator=gen) < 0.5, 0.0, -0.0)),
    }[kind]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.uint8 else t.view(torch.int16)


KINDS = ["normal", "shifted", "constant", "narrow", "ties", "float16", "channels", "subnormal", "zeros"]


@pytest.mark.parametrize("codec", _codecs())
@pytest.mark.parametrize("kind", KINDS)
def test_the_c_encoder_gives_the_references_bytes(codec, kind):
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    for shape in ((1, 3, 32, 64), (16, 3, 32, 64), (2, 2, 64, 128)):
        x = _data(kind, shape, gen)
        ref, got = codec.encode(x), encode.affine(codec, x)
        assert got is not None, shape
        for part in ("token", "group"):
            want, have = getattr(ref, part), getattr(got, part)
            assert list(want) == list(have)
            for name in want:
                assert want[name].shape == have[name].shape and want[name].dtype == have[name].dtype, name
                assert torch.equal(_bits(want[name]), _bits(have[name])), (shape, part, name)


def test_what_it_does_not_take_goes_to_the_codec():
    x = torch.randn(1, 3, 32, 64)
    assert encode.affine(make_codec("q4_0", "k"), x) is None
    clipped = make_codec("int4", "v")
    clipped.clip = True
    assert encode.affine(clipped, x) is None
    bf = make_codec("int4", "k")
    bf.scale_dtype = torch.bfloat16
    assert encode.affine(bf, x) is None
    assert encode.affine(make_codec("int4", "k"), torch.randn(1, 3, 30, 64)) is None  # not whole groups
    assert encode.affine(make_codec("int4", "k"), torch.randn(3, 32, 64)) is None  # not (B, H, T, D)
    k = make_codec("int4", "k")
    for bad, match in ((torch.full((1, 3, 32, 64), float("nan")), "non-finite"), (torch.randn(1, 3, 32, 64) * 1e6, "cannot store")):
        assert encode.affine(k, bad) is None  # refused in C: the codec raises its own error
        with pytest.raises(ValueError, match=match):
            cache_basis.encode(k, bad)


def test_the_cache_encodes_through_it(monkeypatch):
    """A stream's flush (cache.basis.encode_in_basis) takes the C encoder, and its bytes are the codec's."""
    calls = []
    real = encode.affine

    def spy(codec, x):
        out = real(codec, x)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(encode, "affine", spy)
    codec = make_codec("int4", "v")
    x = torch.randn(1, 3, 32, 64)
    got = cache_basis.encode_in_basis(codec, None, x)
    assert calls == [True]
    assert all(torch.equal(got.token[n], codec.encode(x).token[n]) for n in got.token)
    monkeypatch.setattr(cache_basis, "tracing", lambda: True)  # inside a compiled graph: the codec's own
    cache_basis.encode_in_basis(codec, None, x)
    assert calls == [True]


#: head widths off the 8-lane loops (a tail of single values) and V channel groups under 8 or not a multiple of it:
#: (format, D, V groups)
ODD = [("int8", 20, (1, 2, 4, 5, None)), ("int4", 12, (1, 2, 4, 12)), ("int3", 8, (1, 2, 4, None)),
       ("int2", 36, (1, 2, 4, 12, 36)), ("int4", 72, (12, 24, None))]


@pytest.mark.parametrize("name, d, v_groups", ODD, ids=[f"{n}-d{d}" for n, d, _ in ODD])
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "shifted"])
def test_odd_widths_and_small_groups_give_the_references_bytes(name, d, v_groups, kind):
    """The single-value tails of the C loops (a width not a multiple of 8, V groups of 1-5 or 12 channels)."""
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    codecs = [make_codec(name, "k", group_size=g) for g in (32, 8)]
    codecs += [make_codec(name, "v", v_group_size=g) for g in v_groups]
    for codec in codecs:
        x = _data(kind, (2, 3, 32, d), gen)
        ref, got = codec.encode(x), encode.affine(codec, x)
        assert got is not None, (codec.role, d)
        for part in ("token", "group"):
            want, have = getattr(ref, part), getattr(got, part)
            for key in want:
                assert torch.equal(_bits(want[key]), _bits(have[key])), (codec.role, getattr(codec, "group_size", None), key)
