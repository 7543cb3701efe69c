"""GGML block formats: bytes identical to gguf-py (itself bit-exact with llama.cpp), dequantized
values equal to gguf-py's, including the rounding quirks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslim.formats import GGML_KINDS, dequantize_ggml, make_codec, quantize_ggml

KINDS = list(GGML_KINDS)


def gguf_bytes(x: torch.Tensor, kind: str) -> np.ndarray:
    return quants.quantize(x.float().numpy(), GGMLQuantizationType[kind.upper()])


def gguf_values(data: np.ndarray, kind: str) -> np.ndarray:
    return quants.dequantize(data, GGMLQuantizationType[kind.upper()])


def assert_same_as_gguf(x: torch.Tensor, kind: str) -> None:
    ours = quantize_ggml(x, kind)
    ref = gguf_bytes(x, kind)
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == ref.shape
    bad = np.flatnonzero((ours.numpy() != ref).reshape(-1))
    assert bad.size == 0, f"{bad.size} bytes differ, first at flat index {bad[:8].tolist()}"
    values = dequantize_ggml(torch.from_numpy(ref), kind)
    assert values.dtype == torch.float32
    np.testing.assert_array_equal(values.numpy(), gguf_values(ref, kind))


def test_kinds_table():
    assert GGML_KINDS == {
        "q8_0": (32, 34),
        "q4_0": (32, 18),
        "q4_1": (32, 20),
        "q5_0": (32, 22),
        "q5_1": (32, 24),
    }
    for kind, (size, nbytes) in GGML_KINDS.items():
        assert quants.GGML_QUANT_SIZES[GGMLQuantizationType[kind.upper()]] == (size, nbytes)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [1e-3, 1e-1, 1.0, 10.0, 1e3])
def test_random_bytes_equal_gguf(kind, scale):
    gen = torch.Generator().manual_seed(int(scale * 1000) % 9973)
    x = torch.randn(3, 2, 5, 128, generator=gen) * scale
    x[0, 0, 0] += 3 * scale  # a block whose values all share a sign
    assert_same_as_gguf(x, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_special_blocks_equal_gguf(kind):
    rows = [
        torch.zeros(32),  # all zero: d = 0, id = 0
        torch.full((32,), 0.75),  # constant positive
        torch.full((32,), -2.5),  # constant negative
        torch.zeros(32).index_fill_(0, torch.tensor([7]), 50.0),  # single positive outlier
        torch.randn(32).index_fill_(0, torch.tensor([31]), -300.0),  # single negative outlier, last slot
        torch.tensor([5.0, -5.0] * 16),  # |max| tie between signs: the first one wins
        torch.tensor([-5.0, 5.0] * 16),
        torch.linspace(-1, 1, 32),
        torch.full((32,), 1e-30),  # tiny but normal
    ]
    assert_same_as_gguf(torch.stack(rows), kind)


def _signed_zero_rows() -> torch.Tensor:
    """Blocks whose extreme is a zero of either sign: all +0, all -0, mixed signs (as tiny values
    rounded to zero give), zeros of both signs as the minimum beside positive values, and as the
    maximum beside negative ones."""
    gen = torch.Generator().manual_seed(11)
    z = torch.zeros(32)
    rows = [z, -z, torch.where(torch.arange(32) % 2 == 0, -z, z), torch.where(torch.arange(32) < 31, -z, z)]
    for _ in range(12):  # random sign patterns
        rows.append(torch.where(torch.rand(32, generator=gen) < 0.5, -z, z))
    for _ in range(6):  # a zero minimum (or maximum) of mixed signs among non-zero values
        signs = torch.where(torch.rand(32, generator=gen) < 0.5, -z, z)
        pos = torch.rand(32, generator=gen) * (torch.rand(32, generator=gen) < 0.5)
        row = torch.where(pos > 0, pos, signs)
        rows += [row, torch.where(pos > 0, -pos, signs)]
    return torch.stack(rows)


def _numpy_keeps_last_of_equal() -> bool:
    """Whether numpy's min/max give the last of equal values (x86; gguf-py inherits it)."""
    x = np.zeros((64, 32), np.float32)
    rng = np.random.default_rng(0)
    x[rng.random(x.shape) < 0.5] = -0.0
    return bool((np.signbit(x.min(-1)) == np.signbit(x[:, -1])).all())


@pytest.mark.parametrize("kind", KINDS)
def test_signed_zero_blocks_equal_gguf(kind):
    """Blocks of -0.0 and 0.0: q4_1 and q5_1 store a zero minimum with gguf-py's sign bit."""
    if GGML_KINDS[kind][1] in (20, 24) and not _numpy_keeps_last_of_equal():
        pytest.skip(
            "this numpy's min/max do not keep the last of equal values; gguf-py's sign of a zero min differs"
        )
    rows = _signed_zero_rows()
    assert_same_as_gguf(rows, kind)
    ours = quantize_ggml(rows, kind)
    # Either sign decodes to the same values.
    np.testing.assert_array_equal(
        dequantize_ggml(ours, kind).numpy(), gguf_values(gguf_bytes(rows, kind), kind)
    )
    assert_same_as_gguf(
        torch.cat([torch.randn(3, 32), rows[:5]]).reshape(4, 64), kind
    )  # mixed with real blocks


def _tie_row(kind: str) -> torch.Tensor:
    """A block whose scale d is exactly 1 (id = 1), so x * id lands exactly on halves."""
    if kind in ("q4_1", "q5_1"):
        top = 15.0 if kind == "q4_1" else 31.0  # min 0 and max top: d = top / top = 1
        return torch.cat([torch.tensor([0.0, top]), torch.arange(30.0) % top + 0.5])
    first = {"q8_0": 127.0, "q4_0": -8.0, "q5_0": -16.0}[kind]  # d = amax / 127, max / -8, max / -16 = 1
    halves = torch.arange(31.0) % 16 - 7.5  # -7.5 ... 7.5: x * id = x lands on .5 for every element
    return torch.cat([torch.tensor([first]), halves])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("power", [0, -6, 5])
def test_rounding_ties_equal_gguf(kind, power):
    row = _tie_row(kind) * 2.0**power  # powers of two keep every product exact
    assert_same_as_gguf(row.reshape(1, 32), kind)


def test_q8_0_rounds_half_away_from_zero():
    row = _tie_row("q8_0")  # d = 1
    q = quantize_ggml(row, "q8_0")[2:].view(torch.int8)
    halves = row[1:]
    expected = torch.sign(halves) * torch.floor(halves.abs() + 0.5)  # exact for these halves
    assert torch.equal(q[1:].float(), expected)
    assert int(q[torch.nonzero(halves == 2.5)[0, 0] + 1]) == 3  # torch.round would give 2
    # floor(a + 0.5) would round 0.49999997 up to 1 in fp32; roundf does not.
    x = torch.zeros(32)
    x[0], x[1] = 127.0, float(np.nextafter(np.float32(0.5), np.float32(0)))
    assert int(quantize_ggml(x, "q8_0")[3].view(torch.int8)) == 0
    assert_same_as_gguf(x.reshape(1, 32), "q8_0")


def test_q4_0_reference_rounding_is_half_up():
    row = _tie_row("q4_0")  # d = 1, codes = trunc(x + 8.5) -> x = -0.5 maps to 8 (value 0), 0.5 to 9
    values = dequantize_ggml(quantize_ggml(row, "q4_0"), "q4_0")
    halves = row[1:]
    keep = halves.abs() < 7  # away from the clamped top code
    assert torch.equal(values[1:][keep], torch.floor(halves[keep] + 0.5))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_arbitrary_codes_equals_gguf(kind):
    """Every code pattern (random bytes) under finite fp16 scales and mins."""
    _, nbytes = GGML_KINDS[kind]
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (64, 4 * nbytes), dtype=torch.uint8, generator=gen)
    blocks = data.view(64, 4, nbytes)
    meta = 4 if kind in ("q4_1", "q5_1") else 2
    blocks[..., :meta] = (torch.randn(64, 4, meta // 2, generator=gen) * 3).half().view(torch.uint8)
    ours = dequantize_ggml(data, kind)
    np.testing.assert_array_equal(ours.numpy(), gguf_values(data.numpy(), kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_quantize_as_their_fp32_values(kind, dtype):
    x = torch.randn(4, 64).to(dtype)
    assert_same_as_gguf(x, kind)


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    lead=st.lists(st.integers(1, 3), max_size=2),
    blocks=st.integers(1, 4),
    log_scale=st.floats(-3, 3),
    shift=st.floats(-3, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_bytes_equal_gguf(kind, lead, blocks, log_scale, shift, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, 32 * blocks, generator=gen) + shift) * 10.0**log_scale
    assert_same_as_gguf(x, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_validation(kind):
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_ggml(torch.randn(2, 48), kind)
    with pytest.raises(ValueError, match="floating point"):
        quantize_ggml(torch.ones(32, dtype=torch.int64), kind)
    with pytest.raises(ValueError, match="multiple of"):
        dequantize_ggml(torch.zeros(GGML_KINDS[kind][1] + 1, dtype=torch.uint8), kind)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_ggml(torch.zeros(GGML_KINDS[kind][1]), kind)
    with pytest.raises(ValueError, match="unknown GGML kind"):
        quantize_ggml(torch.randn(32), "q3_k")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(kind, bad):
    x = torch.randn(2, 64)
    x[1, 40] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize_ggml(x, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_anywhere_in_a_block_raises(kind):
    """The check reads only the block metadata: a NaN or inf in any slot must reach it."""
    for slot in range(32):
        for bad in (float("nan"), float("inf"), float("-inf")):
            x = torch.randn(1, 64)
            x[0, 32 + slot] = bad
            x[0, 32 + (slot + 7) % 32] = 1e3  # a larger finite value elsewhere in the block
            with pytest.raises(ValueError, match="non-finite"):
                quantize_ggml(x, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_overflow_of_scale_raises(kind):
    x = torch.randn(1, 32)
    x[0, 3] = -1e7  # every kind's d (or m) exceeds 65504
    with pytest.raises(ValueError, match="overflow"):
        quantize_ggml(x, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_codec(kind):
    for role in ("k", "v"):
        codec = make_codec(kind, role, group_size=16)
        assert codec.token_group == 1 and codec.name == kind
        assert codec.symmetric == (kind in ("q8_0", "q4_0", "q5_0"))
        x = torch.randn(2, 3, 5, 64)
        enc = codec.encode(x)
        assert set(enc.token) == {"blocks"} and not enc.group
        assert enc.token["blocks"].shape == (2, 3, 5, 2 * GGML_KINDS[kind][1])
        y = codec.decode(enc, torch.bfloat16)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        with pytest.raises(ValueError, match="multiple of 32"):
            codec.check_head_dim(48)
        codec.check_head_dim(64)
    expected = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0}[kind]
    assert make_codec(kind, "k").bits_per_element(64) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_cpu(kind):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 17, 128, generator=gen) * 7
    x[0, 0, 0, :32] = _tie_row(kind)
    x[1, 0, :8, :32] = _signed_zero_rows()[:8]
    cpu = quantize_ggml(x, kind)
    gpu = quantize_ggml(x.cuda(), kind)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(dequantize_ggml(gpu, kind).cpu(), dequantize_ggml(cpu, kind))
