"""Attention kernels on the encoded store: the torch reference equals a float64 decode + matmul written
from each layout's definition; the C kernels equal the reference; both to fp32 rounding, for every
(format, role), on views narrowed out of bigger buffers (as the cache hands them out); the C side's
row decoders against the format registry; the dispatch, the build cache and the fallbacks."""

from __future__ import annotations

import ctypes
import platform
import threading
import warnings

import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernel_helpers import assert_scaled_close, case_codec, cases, encoded_view, probs, queries
from kvslim import kernels
from kvslim.formats import FORMATS, Block, Encoded, get_format, make_codec
from kvslim.kernels import clib, cpu, reference

D = 64
#: (B, H_kv, M, T): batch 1/2, KV heads 1/3, queries 1/3/9, tokens 1/7/64/300
SHAPES = [
    (1, 1, 1, 1),
    (1, 3, 3, 7),
    (2, 1, 9, 64),
    (2, 3, 1, 300),
    (1, 3, 9, 300),
    (2, 3, 3, 64),
    (1, 1, 3, 300),
]


@pytest.fixture
def c_kernels():
    ok, why = cpu.status()
    if not ok:
        pytest.skip(f"C kernels unavailable: {why}")
    kernels.set_backend("cpu")
    yield cpu.library()
    kernels.set_backend(None)


@pytest.fixture(autouse=True)
def _one_thread_default_backend():
    """Single-threaded (small shapes; the machine may be shared), default backend afterwards.
    The threaded C path has its own test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    kernels.set_backend(None)


def _offsets(codec):
    g = codec.token_group
    return [0] if g == 1 else sorted({0, 1, g // 2, g - 1})


def _unpack64(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed KIVI codes (..., D * bits / 8) -> float64 (..., D): each row one little-endian bit stream,
    element d in bits bits * d .. bits * d + bits - 1 (read from two bytes: an int3 code may straddle)."""
    n = codes.shape[-1]
    d = n * 8 // bits
    padded = torch.cat([codes.long(), torch.zeros_like(codes[..., :1], dtype=torch.long)], dim=-1)
    first = torch.arange(d) * bits  # each element's first bit
    pair = padded[..., first // 8] | (padded[..., first // 8 + 1] << 8)  # (..., D)
    return ((pair >> (first % 8)) & ((1 << bits) - 1)).double()


def decode64(codec, enc: Encoded, offset: int) -> torch.Tensor:
    """(B, H, T, D) float64 from the stored parts, written from each layout's definition and not with
    kvslim's decoders (GGML through gguf-py's)."""
    family, t = codec.family, next(iter(enc.token.values())).shape[2]
    if family == "cast":
        return enc.token["x"].double()
    if family == "fp8":
        return enc.token["codes"].double() * enc.token["scale"].double()
    if family == "ggml":
        blocks = enc.token["blocks"].contiguous().numpy()
        values = quants.dequantize(blocks, GGMLQuantizationType[codec.name.upper()])
        return torch.from_numpy(values.copy()).double()
    codes = _unpack64(enc.token["codes"], codec.bits)
    if family == "affine_k":
        group = (offset + torch.arange(t)) // codec.token_group  # each token's scale row
        scale, zero = (enc.group[k].double().index_select(2, group) for k in ("scale", "zero"))
        return codes * scale + zero
    assert family == "affine_v", family
    g = codes.shape[-1] // enc.token["scale"].shape[-1]  # channels per scale
    scale, zero = (enc.token[k].double().repeat_interleave(g, dim=-1) for k in ("scale", "zero"))
    return codes * scale + zero


@pytest.mark.parametrize("name,role,group", cases())
def test_reference_equals_float64_decode_and_matmul(name, role, group):
    """The reference against scores and sums computed in float64 from an independent decode, within
    fp32 rounding of the products' magnitudes."""
    codec = case_codec(name, role, group)
    gen = torch.Generator().manual_seed(1)
    for offset in _offsets(codec):
        enc = encoded_view(codec, 2, 3, 13, offset, gen)
        full = decode64(codec, enc, offset)  # (B, H, T, D)
        q, p = queries(2, 3, 3, gen), probs(2, 3, 3, 13, gen)
        what = f"{name}-{role} {offset=}"
        ref = q.double() @ full.mT
        assert_scaled_close(
            reference.k_scores(q, codec, enc, offset), ref.float(), q.abs() @ full.abs().mT.float(), what
        )
        ref = p.double() @ full
        assert_scaled_close(
            reference.v_weighted(p, codec, enc, offset), ref.float(), p.abs() @ full.abs().float(), what
        )


@pytest.mark.parametrize("name,role,group", cases(k_groups=(8, 32)))
def test_c_kernels_equal_reference(c_kernels, name, role, group):
    codec = case_codec(name, role, group)
    gen = torch.Generator().manual_seed(sum(map(ord, f"{name}{role}{group}")))
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if name == "none" else [torch.float32]
    for i, (b, h, m, t) in enumerate(SHAPES):
        offset = _offsets(codec)[i % len(_offsets(codec))]
        enc = encoded_view(codec, b, h, t, offset, gen, dtype=dtypes[i % len(dtypes)])
        full = codec.decode(enc, torch.float32, offset)  # (B, H, T, D)
        what = f"{name}-{role} B={b} H={h} M={m} T={t} offset={offset}"
        if role == "k":
            q = queries(b, h, m, gen)
            backend, kernel = kernels.select(q, codec, enc)
            assert backend == "cpu" and kernel.k_scores is not reference.k_scores, what
            out = kernels.k_scores(q, codec, enc, offset)
            ref = reference.k_scores(q, codec, enc, offset)
            assert_scaled_close(out, ref, q.abs() @ full.abs().transpose(-1, -2), what)
        else:
            p = probs(b, h, m, t, gen)
            backend, kernel = kernels.select(p, codec, enc)
            assert backend == "cpu" and kernel.v_weighted is not reference.v_weighted, what
            out = kernels.v_weighted(p, codec, enc, offset)
            ref = reference.v_weighted(p, codec, enc, offset)
            assert_scaled_close(out, ref, p.abs() @ full.abs(), what)


def test_c_kernels_every_offset_and_long_query_axis(c_kernels):
    """Every offset of a partly evicted K group; M at the C limit (C) and beyond it (reference)."""
    codec = make_codec("int4", "k", group_size=8)
    gen = torch.Generator().manual_seed(3)
    for offset in range(8):
        enc = encoded_view(codec, 1, 2, 37, offset, gen)
        full = codec.decode(enc, torch.float32, offset)
        q = queries(1, 2, 5, gen)
        out = kernels.k_scores(q, codec, enc, offset)
        assert_scaled_close(
            out, reference.k_scores(q, codec, enc, offset), q.abs() @ full.abs().mT, f"{offset=}"
        )
    for m, backend in ((cpu.MAX_M, "cpu"), (cpu.MAX_M + 1, "torch")):
        q = queries(1, 2, m, gen)
        assert kernels.select(q, codec, enc)[0] == backend
        assert_scaled_close(
            kernels.k_scores(q, codec, enc, 7),
            reference.k_scores(q, codec, enc, 7),
            q.abs() @ full.abs().mT,
            f"M={m}",
        )


@pytest.mark.parametrize("d", [32, 36, 80, 128])
def test_c_kernels_other_head_dims(c_kernels, d):
    """Head dims off the vectorized fast paths (not a multiple of 8 or 32 floats per plane) and bigger."""
    gen = torch.Generator().manual_seed(d)
    names = (
        ["int8", "int4", "int2", "fp16", "bf16", "fp8"]
        + (["q8_0", "q4_1", "q5_0"] if d % 32 == 0 else [])
        + (["int3"] if d % 8 == 0 else [])  # int3 packs 8 codes in 3 bytes
    )
    for name in names:
        for role in ("k", "v"):
            codec = make_codec(name, role, group_size=8)
            offset = 3 if codec.token_group > 1 else 0
            enc = encoded_view(codec, 1, 3, 45, offset, gen, d=d)
            full = codec.decode(enc, torch.float32, offset)
            what = f"{name}-{role} D={d}"
            if role == "k":
                q = queries(1, 3, 3, gen, d)
                assert kernels.select(q, codec, enc)[0] == "cpu", what
                out, ref = kernels.k_scores(q, codec, enc, offset), reference.k_scores(q, codec, enc, offset)
                assert_scaled_close(out, ref, q.abs() @ full.abs().mT, what)
            else:
                p = probs(1, 3, 3, 45, gen)
                assert kernels.select(p, codec, enc)[0] == "cpu", what
                out, ref = kernels.v_weighted(p, codec, enc), reference.v_weighted(p, codec, enc)
                assert_scaled_close(out, ref, p.abs() @ full.abs(), what)


def _threaded(fn, *args):
    torch.set_num_threads(2)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(1)


def test_c_kernels_threaded(c_kernels):
    """Shapes big enough to split over threads and token chunks (partial sums of V reduced); only the
    C calls run threaded (torch's own ops on a busy shared machine would dominate the test time)."""
    gen = torch.Generator().manual_seed(8)
    for name, role, group, offset in (
        ("int4", "k", 32, 5),
        ("int8", "v", 32, 0),
        ("q4_1", "k", None, 0),
        ("q5_0", "v", None, 0),
        ("int2", "v", None, 0),
        ("int3", "k", 32, 7),
        ("int3", "v", 16, 0),
    ):
        codec = case_codec(name, role, group)
        for b, h, m, t in ((1, 3, 3, 2500), (2, 3, 9, 700)):
            enc = encoded_view(codec, b, h, t, offset, gen)
            full = codec.decode(enc, torch.float32, offset)
            if role == "k":
                q = queries(b, h, m, gen)
                out, ref = (
                    _threaded(kernels.k_scores, q, codec, enc, offset),
                    reference.k_scores(q, codec, enc, offset),
                )
                assert_scaled_close(out, ref, q.abs() @ full.abs().mT, f"{name}-{role} {t}")
            else:
                p = probs(b, h, m, t, gen)
                out, ref = _threaded(kernels.v_weighted, p, codec, enc), reference.v_weighted(p, codec, enc)
                assert_scaled_close(out, ref, p.abs() @ full.abs(), f"{name}-{role} {t}")


def test_unsupported_layouts_fall_back_to_the_reference(c_kernels):
    """int2 V with 2-channel groups (not whole bytes of codes): the C kernel declines, the result is the same."""
    codec = make_codec("int2", "v", v_group_size=2)
    gen = torch.Generator().manual_seed(4)
    enc = encoded_view(codec, 1, 3, 20, 0, gen)
    p = probs(1, 3, 3, 20, gen)
    assert kernels.select(p, codec, enc)[0] == "torch"
    assert torch.equal(kernels.v_weighted(p, codec, enc), reference.v_weighted(p, codec, enc))
    meta = torch.empty(1, 3, 3, 20, device="meta")  # any non-CPU device: the reference
    assert (
        kernels.select(
            meta, make_codec("q4_0", "v"), encoded_view(make_codec("q4_0", "v"), 1, 3, 20, 0, gen)
        )[0]
        == "torch"
    )


def test_half_and_fp8_conversions_are_exact(c_kernels):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)  # every fp16 bit pattern
    want = bits.view(torch.float16).float()
    for portable in (False, True):
        got = cpu.half_to_float(bits, portable)
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32)), f"{portable=}"
    # every float8_e4m3fn code through the fp8 row decoder: p one-hot picks each row of V
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    nan = (raw & 0x7F) == 0x7F
    codes = torch.where(nan, 0, raw).view(torch.float8_e4m3fn).reshape(1, 1, 4, 64)
    codec, p = make_codec("fp8", "v"), torch.eye(4).reshape(1, 1, 4, 4)
    out = kernels.v_weighted(p, codec, Encoded(token={"codes": codes, "scale": torch.ones(1, 1, 4, 1)}))
    assert torch.equal(out, codes.float())
    nan_row = raw[nan].view(torch.float8_e4m3fn).repeat(32).reshape(1, 1, 1, 64)  # the two NaN codes
    out = kernels.v_weighted(
        torch.ones(1, 1, 1, 1), codec, Encoded(token={"codes": nan_row, "scale": torch.ones(1, 1, 1, 1)})
    )
    assert out.isnan().all()


def test_fp16_specials_in_a_cast_body(c_kernels):
    """Subnormal, huge and signed-zero fp16 tokens decode exactly (the body of an fp16 stream)."""
    vals = torch.tensor([6e-8, -6e-8, 1e-5, 65504.0, -65504.0, -0.0, 1.0, 3.140625], dtype=torch.float16)
    x = vals.repeat(8).reshape(1, 1, 1, 64).expand(1, 1, 3, 64).contiguous()
    enc = Encoded(token={"x": x})
    p = torch.eye(3).reshape(1, 1, 3, 3)
    assert torch.equal(kernels.v_weighted(p, make_codec("fp16", "v"), enc), x.float())


def test_c_row_decoders_match_the_registry(monkeypatch):
    """The C library decodes every registered GGML / fp8 format and cast dtype, with the GGML block
    layouts of the registry; a layout that disagrees is refused. Loads the library directly: a refusal
    would make the c_kernels fixture skip, and must fail here instead."""
    if clib.find_compiler() is None:
        pytest.skip("no C compiler")
    lib = ctypes.CDLL(str(clib.build()[0]))
    clib._declare(lib)
    codes = clib.row_codes(lib)
    named = [f for f in FORMATS.values() if {"ggml", "fp8"} & set(f.family.values())]
    assert {f.name for f in named} == {"fp8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"}
    assert set(codes) == {f.name for f in named} | {torch.float32, torch.float16, torch.bfloat16}
    assert len(set(codes.values())) == len(codes)  # distinct decoders
    q4_0 = type(get_format("q4_0"))
    monkeypatch.setattr(q4_0, "block", Block(32, 19))
    with pytest.raises(
        RuntimeError,
        match="q4_0 as blocks of 32 elements in 18 bytes, the format registry says 32 elements in 19",
    ):
        clib.row_codes(lib)


# --------------------------------------------------------------------------- dispatch


def test_backend_choice_and_available():
    codec = make_codec("q8_0", "k")
    gen = torch.Generator().manual_seed(5)
    enc = encoded_view(codec, 1, 3, 10, 0, gen)
    q = queries(1, 3, 3, gen)
    kernels.set_backend("torch")
    assert kernels.get_backend() == "torch" and kernels.select(q, codec, enc)[0] == "torch"
    assert kernels.available()["active"] == "torch"
    kernels.set_backend(None)
    info = kernels.available()
    assert info["requested"] == "auto" and set(info["backends"]) >= {"cpu", "torch"}
    assert info["active"] == ("cpu" if info["backends"]["cpu"]["available"] else "torch") and info["why"]
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.set_backend("cuda")
    assert (
        kernels.codec_family(codec) == "ggml" and kernels.codec_family(make_codec("int4", "k")) == "affine_k"
    )


def test_env_var_selects_backend(monkeypatch):
    monkeypatch.setenv("KVSLIM_KERNELS", "torch")
    assert kernels.get_backend() == "torch"
    monkeypatch.setenv("KVSLIM_KERNELS", "bogus")
    with pytest.raises(ValueError, match="KVSLIM_KERNELS"):
        kernels.get_backend()
    kernels.set_backend("auto")  # an explicit choice wins over the environment
    assert kernels.get_backend() == "auto"


def test_validation_messages():
    codec = make_codec("int4", "k", group_size=8)
    gen = torch.Generator().manual_seed(6)
    enc = encoded_view(codec, 1, 3, 8, 0, gen)
    with pytest.raises(ValueError, match="batch x heads"):
        kernels.k_scores(torch.zeros(1, 2, 1, D), codec, enc)
    with pytest.raises(ValueError, match=r"\(B, H_kv, M, D\)"):
        kernels.k_scores(torch.zeros(3, 1, D), codec, enc)
    with pytest.raises(ValueError, match="tokens along its last dim"):
        kernels.v_weighted(
            torch.zeros(1, 3, 1, 9),
            make_codec("int4", "v"),
            encoded_view(make_codec("int4", "v"), 1, 3, 8, 0, gen),
        )
    if cpu.status()[0]:
        with pytest.raises(ValueError, match="offset"):
            cpu.k_affine(torch.zeros(1, 3, 1, D), codec, enc, 8)
        with pytest.raises(ValueError, match="K codes"):
            cpu.k_affine(torch.zeros(1, 3, 1, 2 * D), codec, enc, 0)


def test_empty_body():
    codec = make_codec("q4_0", "k")
    enc = Encoded(token={"blocks": torch.zeros(1, 3, 0, 36, dtype=torch.uint8)})
    assert kernels.k_scores(torch.zeros(1, 3, 2, D), codec, enc).shape == (1, 3, 2, 0)
    assert kernels.v_weighted(torch.zeros(1, 3, 2, 0), codec, enc).shape == (1, 3, 2, D)


# --------------------------------------------------------------------------- build


def test_build_is_cached_and_safe_when_concurrent(monkeypatch, tmp_path):
    """Two builds at once into an empty cache: one file, no temp files left, then reused as is.
    (A one-line source stands in for the kernels: the machinery is what is tested here.)"""
    if clib.find_compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text("int kv_abi_version(void) { return 1; }\n")
    monkeypatch.setattr(clib, "SOURCES", src)
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    results, errors = [], []

    def build():
        try:
            results.append(clib.build())
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    (path, flags), (path2, _) = results
    assert path == path2 and path.parent == tmp_path / "cache" / "kernels" and path.suffix == ".so"
    assert "-O3" in flags
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [path.name, path.stem + ".flags"]
    )  # no temp left
    mtime = path.stat().st_mtime_ns
    assert clib.build()[0] == path and path.stat().st_mtime_ns == mtime  # cached: not rebuilt
    (src / "k.c").write_text("int kv_abi_version(void) { return 2; }\n")
    assert clib.build()[0] != path  # a changed source is a new build


def test_a_build_without_the_preferred_flags_says_why(monkeypatch, tmp_path):
    """A source the first flag set cannot compile (an #error under -msse2 stands in for a bug, or a compiler
    without -march=native) is built with the next set, with one warning naming the first error; a cached build
    loads without one."""
    if clib.find_compiler() is None:
        pytest.skip("no C compiler")
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text(
        "#ifdef __SSE2__\n#error the preferred build fails here\n#endif\nint kv_abi_version(void) { return 1; }\n"
    )
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the stand-in failure needs x86's -msse2 / -mno-sse2")
    monkeypatch.setattr(clib, "SOURCES", src)
    monkeypatch.setattr(clib, "FLAG_VARIANTS", [["-msse2"], ["-mno-sse2"]])
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match=r"built with -mno-sse2 because -msse2 failed: .*the preferred build fails"):
        path, flags = clib.build()
    assert flags.endswith("-mno-sse2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clib.build() == (path, flags)  # cached: no warning


def test_build_failure_warns_once_and_uses_the_reference(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    clib._reset_for_tests()
    try:
        with pytest.warns(RuntimeWarning, match="C kernels unavailable"):
            ok, why = cpu.status()
        assert not ok and why
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            assert cpu.status()[0] is False
            codec = make_codec("q4_0", "k")
            gen = torch.Generator().manual_seed(7)
            enc = encoded_view(codec, 1, 3, 10, 0, gen)
            q = queries(1, 3, 3, gen)
            assert kernels.select(q, codec, enc)[0] == "torch"
            assert torch.equal(kernels.k_scores(q, codec, enc), reference.k_scores(q, codec, enc))
            assert kernels.available()["active"] == "torch"
    finally:
        clib._reset_for_tests()  # the next use loads the real build again


def test_kernel_bench_takes_lengths_that_are_not_whole_groups():
    """python -m kvslim.kernels.bench times any history length: a per-channel K body of 100 tokens (3 groups
    of 32 and 4 tokens of a fourth) is encoded with the slack that rounds it to whole groups."""
    from kvslim.kernels import bench, cpu

    if not cpu.status()[0]:
        pytest.skip("no C compiler: the kernel bench times the C kernels")
    rows = bench.bench(formats=("int4", "q4_0"), lengths=(16, 100), layers=1, repeats=1)
    assert {(r["format"], r["tokens"]) for r in rows} == {(f, t) for f in ("int4", "q4_0") for t in (16, 100)}


def test_to_half_finite_casts_as_torch_does_and_says_whether_all_is_finite():
    """kernels.cpu.to_half_finite (a decode token's float16 residual cast and check in one C call): the bits of
    torch's cast (round to nearest even, subnormals, the overflow boundary), False for an inf, a NaN or a
    finite value that rounds past 65504, and None where it cannot (another dtype, a non-contiguous view)."""
    from kvslim.kernels import cpu

    if not cpu.status()[0]:
        pytest.skip("no C compiler")
    edge = torch.tensor([65504.0, 65519.0, -65519.99, 6e-8, 3e-8, 2.0**-25, 1.5 * 2.0**-24, 0.0, -0.0, 1e-3, 2049.0])
    x = torch.cat([torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 300, edge])
    out = cpu.to_half_finite(x, x[:7].clone())
    if out is None:
        pytest.skip("the C library was built without F16C")
    (h, h7), finite = out
    assert finite and torch.equal(h.view(torch.int16), x.to(torch.float16).view(torch.int16))
    assert torch.equal(h7.view(torch.int16), x[:7].to(torch.float16).view(torch.int16))
    for bad in (65520.0, -1e6, float("inf"), float("nan")):
        assert cpu.to_half_finite(x, torch.tensor([1.0, bad]))[1] is False
    assert cpu.to_half_finite(x.to(torch.float64)) is None
    assert cpu.to_half_finite(torch.randn(4, 6)[:, ::2]) is None


def test_fused_attend_refuses_parts_that_do_not_fit():
    """kernels.cpu.attend validates before it hands pointers to C: sink keys and values of different counts,
    K and V covering different tokens, a full-precision part of another width, a q that is not float32."""
    from kvslim.formats import make_codec
    from kvslim.kernels import cpu

    if not cpu.status()[0]:
        pytest.skip("no C compiler")
    kc, vc = make_codec("int4", "k", group_size=8), make_codec("int4", "v", group_size=32)
    k, v = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
    kb, vb = kc.encode(k), vc.encode(v)
    q = torch.randn(1, 2, 3, 32)
    fp = lambda n, d=32: torch.randn(1, 2, n, d)  # noqa: E731
    out = cpu.attend(q, fp(2), fp(2), fp(3), fp(3), kc, kb, 0, vc, vb)
    assert out.shape == (1, 2, 3, 32) and torch.isfinite(out).all()
    for args, match in (
        ((q, fp(2), fp(3), fp(3), fp(3)), "2 sink keys but 3 sink values"),
        ((q, None, None, fp(3), fp(4)), "K holds 16 \\+ 3 tokens after the sinks, V 16 \\+ 4"),
        ((q, None, None, fp(3, 16), fp(3)), "does not fit q"),
        ((q.double(), None, None, fp(3), fp(3)), "float32"),
    ):
        with pytest.raises(ValueError, match=match):
            cpu.attend(*args, kc, kb, 0, vc, vb)
