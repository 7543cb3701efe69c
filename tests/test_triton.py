"""The Triton kernels (kvslim.kernels.gpu), run on CPU by Triton's interpreter, equal the torch
reference for every (format, role) on small shapes: batch 1/2, KV heads 1/3, query rows 1/3/9 (and
70, past one row tile), tokens 1/7/64/65/130/300 (not multiples of the tiles), head dims 64/128,
every offset into a partly evicted K group, views narrowed out of bigger buffers as the cache hands
them out, the V sum split over the tokens. Exact cases (one-hot probabilities) check every fp8 code
and fp16 special value. The compiled programs of every layout are built to a cubin (no GPU needed
for that either). Plus the dispatch: the interpreter only when asked for by name.

The interpreter is switched on here, after Triton was imported (by importorskip): that works because
gpu.programs() decorates its own copy of the programs under the flag, and the programs call only
triton.language builtins (see kernels/triton_kernels.py).

Tolerance: |out - ref| <= 1e-5 * sum_d |q_d| |K_td| (and sum_t p_t |V_td| for V), about 84 fp32 ulps
of the magnitude of the sum: both sides round each product and sum in a different order (the split V
sum adds its partials last), and the worst case of an n-term fp32 sum is n ulps of that magnitude.
Observed: 3e-7 (K) and 1.1e-6 (V).

Skipped, with the reason, where Triton is not installed (``pip install 'kvslim[gpu]'``). No GPU is
needed: these tests are the bar for the GPU path before any GPU runs it; test_cuda_equals_reference
runs the same cases on a GPU where there is one.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install 'kvslim[gpu]')")

from kernel_helpers import assert_scaled_close, case_codec, cases, encoded_view, interpreted, probs, queries  # noqa: E402
from kvslim import kernels  # noqa: E402
from kvslim.formats import Block, Encoded, format_names, make_codec  # noqa: E402
from kvslim.kernels import gpu, reference  # noqa: E402

#: (name, role, group): K token groups 8/32 for per-channel K, V channel groups for affine V (2 = a group
#: smaller than a byte of int2 codes)
CASES = cases(k_groups=(8, 32), v_groups=(None, 16, 2))
#: (B, H_kv, M, T, D): cycled through per case, with the case's offsets
SHAPES = [
    (1, 1, 1, 1, 64),
    (1, 3, 3, 7, 128),
    (2, 1, 9, 64, 64),
    (2, 3, 1, 130, 64),  # V: 5 token tiles in 2 splits of 3, the last tile wholly past T
    (1, 3, 9, 300, 128),
    (2, 3, 3, 65, 128),
]


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    with interpreted(lambda: gpu.programs().k_scores_kernel):
        yield

@pytest.fixture
def triton_backend():
    kernels.set_backend("triton")
    yield
    kernels.set_backend(None)


def _offsets(codec):
    g = codec.token_group
    return [0] if g == 1 else [1, g - 1, 0, g // 2]


def _check(codec, enc, offset, b, h, m, t, d, gen, what):
    """K scores and V sums of this body through the dispatcher (which must pick triton) vs the reference."""
    full = codec.decode(enc, torch.float32, offset)  # (B, H, T, D)
    q, p = queries(b, h, m, gen, d), probs(b, h, m, t, gen)
    for x in (q, p):
        assert kernels.select(x, codec, enc)[0] == "triton", what
    ref = reference.k_scores(q, codec, enc, offset)
    assert_scaled_close(kernels.k_scores(q, codec, enc, offset), ref, q.abs() @ full.abs().mT, f"K {what}")
    ref = reference.v_weighted(p, codec, enc, offset)
    assert_scaled_close(kernels.v_weighted(p, codec, enc, offset), ref, p.abs() @ full.abs(), f"V {what}")


@pytest.mark.parametrize("name,role,group", CASES)
def test_triton_equals_reference(triton_backend, name, role, group):
    codec = case_codec(name, role, group)
    gen = torch.Generator().manual_seed(sum(map(ord, f"{name}{role}{group}")))
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if name == "none" else [torch.float32]
    offsets = _offsets(codec)
    for i, (b, h, m, t, d) in enumerate(SHAPES):
        offset = offsets[i % len(offsets)]
        dtype = dtypes[i % len(dtypes)]
        enc = encoded_view(codec, b, h, t, offset, gen, d, dtype)
        _check(
            codec, enc, offset, b, h, m, t, d, gen, f"{name}-{role} B={b} H={h} M={m} T={t} D={d} {offset=}"
        )


def test_every_offset_of_a_partly_evicted_group(triton_backend):
    codec = make_codec("int4", "k", group_size=8)
    gen = torch.Generator().manual_seed(3)
    for offset in range(8):
        enc = encoded_view(codec, 1, 2, 37, offset, gen, 64)
        _check(codec, enc, offset, 1, 2, 5, 37, 64, gen, f"{offset=}")


def test_scale_dtypes_and_query_rows_past_one_tile(triton_backend):
    """bf16 and fp32 affine scales; M = 70 called directly (the dispatcher stops at gpu.MAX_M), so the
    programs run two query-row tiles."""
    gen = torch.Generator().manual_seed(9)
    for scale_dtype in (torch.bfloat16, torch.float32):
        for role in ("k", "v"):
            codec = make_codec("int4", role, group_size=8, v_group_size=16)
            codec.scale_dtype = scale_dtype  # the codecs' constructor argument; formats build fp16
            enc = encoded_view(codec, 1, 2, 40, 3 if role == "k" else 0, gen, 64)
            assert (enc.group or enc.token)["scale"].dtype == scale_dtype
            _check(codec, enc, 3 if role == "k" else 0, 1, 2, 3, 40, 64, gen, f"{role} {scale_dtype}")
    codec = make_codec("q4_1", "k")
    enc = encoded_view(codec, 1, 2, 50, 0, gen, 64)
    full = codec.decode(enc, torch.float32)
    q, p = queries(1, 2, 70, gen, 64), probs(1, 2, 70, 50, gen)
    assert kernels.select(q, codec, enc)[0] == "torch"  # past MAX_M
    assert_scaled_close(
        gpu.k_scores(q, codec, enc, 0), reference.k_scores(q, codec, enc), q.abs() @ full.abs().mT, "K M=70"
    )
    assert_scaled_close(
        gpu.v_weighted(p, codec, enc, 0), reference.v_weighted(p, codec, enc), p.abs() @ full.abs(), "V M=70"
    )


def test_v_sum_is_split_over_the_tokens():
    """The split count fills the (interpreter's) program target, each split at least one tile."""
    assert gpu.splits(10, 1, torch.device("cpu")) == (5, 2)  # target 8 -> 8 splits -> 2 tiles each -> 5
    assert gpu.splits(10, 6, torch.device("cpu")) == (2, 5)
    assert gpu.splits(1, 1, torch.device("cpu")) == (1, 1)
    assert gpu.splits(3, 100, torch.device("cpu")) == (1, 3)


def test_fp8_codes_and_fp16_specials_are_exact(triton_backend):
    """One-hot probabilities pick rows of V: every float8_e4m3fn code (NaN codes give NaN) and fp16
    subnormal / huge values come out exactly (a zero's sign does not survive the sum with other rows' 0 * v)."""
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    nan = (raw & 0x7F) == 0x7F
    codes = torch.where(nan, 0, raw).view(torch.float8_e4m3fn).reshape(1, 1, 4, 64)
    codec, p = make_codec("fp8", "v"), torch.eye(4).reshape(1, 1, 4, 4)
    out = kernels.v_weighted(p, codec, Encoded(token={"codes": codes, "scale": torch.ones(1, 1, 4, 1)}))
    assert torch.equal(out, codes.float())
    nan_row = raw[nan].view(torch.float8_e4m3fn).repeat(32).reshape(1, 1, 1, 64)
    out = kernels.v_weighted(
        torch.ones(1, 1, 1, 1), codec, Encoded(token={"codes": nan_row, "scale": torch.ones(1, 1, 1, 1)})
    )
    assert out.isnan().all()
    vals = torch.tensor([6e-8, -6e-8, 1e-5, 65504.0, -65504.0, -0.0, 1.0, 3.140625], dtype=torch.float16)
    x = vals.repeat(8).reshape(1, 1, 1, 64).expand(1, 1, 3, 64).contiguous()
    out = kernels.v_weighted(
        torch.eye(3).reshape(1, 1, 3, 3), make_codec("fp16", "v"), Encoded(token={"x": x})
    )
    assert torch.equal(out, x.float())


def test_ggml_block_fields_are_read_where_they_are():
    """A q5_1 block built by hand (d, m, qh, qs at their byte offsets) decodes element by element."""
    codec = make_codec("q5_1", "v")
    q = torch.arange(32) % 32  # every 5-bit code once
    qh = sum(int(q[i] >> 4) << i for i in range(32)).to_bytes(4, "little")
    qs = bytes(int(q[j] & 15) | (int(q[j + 16] & 15) << 4) for j in range(16))
    d_m = torch.tensor([0.5, -3.0], dtype=torch.float16).view(torch.uint8).tolist()  # fp16 d, m
    block = torch.tensor(d_m + list(qh) + list(qs), dtype=torch.uint8).reshape(1, 1, 1, 24)
    out = kernels.v_weighted(torch.ones(1, 1, 1, 1), codec, Encoded(token={"blocks": block}))
    assert out.shape == (1, 1, 1, 32)
    assert torch.equal(out.flatten(), 0.5 * q.float() - 3.0)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the interpreter tests run without)"
)
def test_cuda_equals_reference(monkeypatch):
    """The compiled programs on a GPU, chosen by "auto", against the reference on the same GPU, for
    every case above plus a long body (many V splits). One test: one skip on a CPU machine, not 33."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels.set_backend("auto")
    for case in CASES:
        name, role, group = case.values
        codec = case_codec(name, role, group)
        gen = torch.Generator().manual_seed(sum(map(ord, f"{name}{role}{group}")))
        offsets = _offsets(codec)
        for i, (b, h, m, t, d) in enumerate([*SHAPES, (1, 2, 8, 5000, 128)]):
            offset = offsets[i % len(offsets)]
            enc = encoded_view(codec, b, h, t, offset, gen, d)
            enc = Encoded(
                {k: v.cuda() for k, v in enc.token.items()}, {k: v.cuda() for k, v in enc.group.items()}
            )
            full = codec.decode(enc, torch.float32, offset)
            q, p = queries(b, h, m, gen, d).cuda(), probs(b, h, m, t, gen).cuda()
            what = f"{case.id} B={b} H={h} M={m} T={t} D={d} {offset=}"
            assert kernels.select(q, codec, enc)[0] == "triton", what
            ref = reference.k_scores(q, codec, enc, offset)
            assert_scaled_close(
                kernels.k_scores(q, codec, enc, offset), ref, q.abs() @ full.abs().mT, f"K {what}"
            )
            ref = reference.v_weighted(p, codec, enc, offset)
            assert_scaled_close(
                kernels.v_weighted(p, codec, enc, offset), ref, p.abs() @ full.abs(), f"V {what}"
            )


#: torch dtype -> Triton's pointer type, for compiling without a launch
_PTR = {torch.uint8: "*u8", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def test_programs_compile_for_the_gpu(monkeypatch, tmp_path):
    """Without a GPU: the compiled (not interpreted) programs of every layout build to a cubin with
    Triton's own compiler and the ptxas its wheel ships, so the GPU path's front end, types and
    lowering are checked too, not only its arithmetic. One compile per layout (its branch is inlined
    into either program; ~1 s each on a busy 2-core machine), alternating K scores for sm_80 and V
    sums for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvslim.formats.varnorm import varnorm_codec

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip(f"the ASTSource signature this test builds is Triton >= 3.4's, got {triton.__version__}")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold compile, nothing left in $HOME
    programs = gpu.programs()
    assert not gpu.interpreting() and programs is not gpu._programs[("triton_kernels", True)]
    gen = torch.Generator().manual_seed(10)
    cases = [("int2", "k"), ("int4", "v"), ("q8_0", "k"), ("q4_0", "v"), ("q4_1", "k")]
    cases += [("q5_0", "v"), ("q5_1", "k"), ("fp8", "v"), ("bf16", "k"), ("int3", "k"), ("int3", "v")]
    cases = [(name, role, False) for name, role in cases] + [("int2", "v", True), ("int3", "k", True)]
    for i, (name, role, vn) in enumerate(cases):
        codec = make_codec(name, role, group_size=8, v_group_size=16)
        if vn:  # variance-normalized (kvslim.formats.varnorm): the factor reader too
            codec = varnorm_codec(codec, 8)
        lay, _ = gpu._layout(codec, encoded_view(codec, 1, 2, 8, 0, gen, 64), 1, 2, 8, None, 0)
        kernel, arch = ((programs.k_scores_kernel, 80), (programs.v_partial_kernel, 90))[i % 2]
        names = list(kernel.arg_names)
        const = dict(FMT=lay.fmt, BITS=lay.bits, NB=lay.nb, VN=lay.vn, BLOCK_M=16, BLOCK_T=32, BLOCK_D=64)
        signature = {n: "i32" for n in names}  # sizes, offset, group, strides
        signature.update({n: "*fp32" for n in names if n.endswith("_ptr")})  # q or p, out
        signature.update(x_ptr=_PTR[lay.x.dtype], s_ptr=_PTR[lay.s.dtype], z_ptr=_PTR[lay.z.dtype])
        signature.update(n_ptr=_PTR[lay.factors.dtype])
        signature.update({n: "constexpr" for n in const})
        src = ASTSource(
            fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in const.items()}
        )
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=gpu.COMPILE_OPTIONS)
        assert compiled.asm["cubin"], (name, role, vn, kernel.__name__, arch)


# --------------------------------------------------------------------------- dispatch


def test_every_registered_format_is_read():
    """Every registered format but the generic ones has a Triton reader, GGML blocks of the
    registry's (elements, bytes); a block layout that disagrees is declined, not misread."""
    gen = torch.Generator().manual_seed(2)
    for name in format_names():
        for role in ("k", "v"):
            codec = make_codec(name, role, group_size=8)
            enc = encoded_view(codec, 1, 1, 8, 0, gen, 64)
            assert gpu.supported(codec, enc) == (codec.family != "generic"), (name, role)
            if codec.family == "ggml":
                assert tuple(codec.format.block) == (32, gpu.GGML_LAYOUT[name])
    q4_0 = make_codec("q4_0", "k")
    enc = encoded_view(q4_0, 1, 1, 8, 0, gen, 64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(q4_0.format), "block", Block(32, 19))
        assert not gpu.supported(q4_0, enc)


def test_dispatch_takes_cpu_tensors_only_when_asked_by_name(monkeypatch):
    codec = make_codec("q8_0", "k")
    gen = torch.Generator().manual_seed(5)
    enc = encoded_view(codec, 1, 3, 10, 0, gen, 64)
    q = queries(1, 3, 3, gen, 64)
    kernels.set_backend("auto")
    assert kernels.select(q, codec, enc)[0] in ("cpu", "torch")  # never the interpreter by default
    kernels.set_backend("triton")
    assert kernels.select(q, codec, enc)[0] == "triton"
    info = kernels.available()
    assert info["active"] == "triton" and info["backends"]["triton"]["available"]
    assert set(info["backends"]["triton"]["families"]) == {"affine_k", "affine_v", "ggml", "fp8", "cast"}
    assert kernels.select(queries(1, 3, gpu.MAX_M + 1, gen, 64), codec, enc)[0] == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.select(q, codec, enc)[0] == "torch"  # no interpreter: CPU tensors are not Triton's
    if not torch.cuda.is_available():
        assert not gpu.status()[0] and "no CUDA device" in gpu.status()[1]
        assert kernels.available()["active"] == "torch"
    kernels.set_backend(None)
    monkeypatch.setenv("KVSLIM_KERNELS", "triton")
    assert kernels.get_backend() == "triton"


def test_layouts_are_checked_before_any_pointer_is_read(triton_backend):
    codec = make_codec("int4", "k", group_size=8)
    gen = torch.Generator().manual_seed(6)
    enc = encoded_view(codec, 1, 3, 8, 0, gen, 64)
    with pytest.raises(ValueError, match="offset"):
        gpu.k_scores(torch.zeros(1, 3, 1, 64), codec, enc, 8)
    with pytest.raises(ValueError, match="K codes"):
        gpu.k_scores(torch.zeros(1, 3, 1, 128), codec, enc, 0)
    with pytest.raises(ValueError, match="K scale"):
        gpu.k_scores(torch.zeros(1, 3, 1, 64), codec, enc, 1)  # 8 tokens at offset 1 span 2 groups
    v = make_codec("q4_0", "v")
    with pytest.raises(ValueError, match="q4_0 blocks"):
        gpu.v_weighted(torch.zeros(1, 3, 1, 8), v, encoded_view(v, 1, 3, 7, 0, gen, 64), 0)


def test_ragged_engine_step_on_the_triton_kernels(triton_backend, monkeypatch):
    """A ragged decode step (kvslim.generate.forward_rows: rows of different lengths, formats and evicted
    ranges, no padding to the longest) with the Triton kernels under the interpreter gives the logits of the
    same step on the CPU kernels, row by row."""
    import kvslim
    from conftest import tiny_model
    from kvslim import SlimCache
    from kvslim import generate as gen

    model = kvslim.enable(tiny_model("llama", num_hidden_layers=1))
    specs = ["int4,sink=2,window=40,group=8,residual=8", "q4_0,residual=0,group=1", "int8,group=8,residual=8", "q8_0,sink=2,window=20,residual=0,group=1"]
    lens = [70, 9, 33, 50]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (1, n), generator=g) for n in lens]
    out, used = {}, []
    real_select = kernels.select

    def spy(*a, **k):
        used.append(real_select(*a, **k)[0])
        return real_select(*a, **k)

    real_attend = kernels.cpu.attend

    def spy_attend(*a, **k):  # the CPU backend serves a decode step's attention as one fused C call
        used.append("cpu")
        return real_attend(*a, **k)

    real_rows = kernels.cpu.attend_rows

    def spy_rows(*a, **k):  # ... and a ragged step's rows as one C call per layer (kv_attend_rows)
        used.append("cpu")
        return real_rows(*a, **k)

    real_gpu_rows = kernels.gpu_rows.attend_rows

    def spy_gpu_rows(*a, **k):  # ... and on the Triton backend, as one rows launch per layer
        used.append("triton")
        return real_gpu_rows(*a, **k)

    monkeypatch.setattr(kernels, "select", spy)
    monkeypatch.setattr(kernels.cpu, "attend", spy_attend)
    monkeypatch.setattr(kernels.cpu, "attend_rows", spy_rows)
    monkeypatch.setattr(kernels.gpu_rows, "attend_rows", spy_gpu_rows)
    for backend in ("cpu", "triton"):
        kernels.set_backend(backend)
        caches = [SlimCache.from_config(kvslim.parse_spec(s), config=model.config) for s in specs]
        with torch.inference_mode():
            for p, c in zip(prompts, caches, strict=True):
                gen.prefill(model, p, c)
            used.clear()
            out[backend] = gen.forward_rows(model, [5, 6, 7, 8], caches)
        assert used and set(used) == {backend}
    assert torch.allclose(out["triton"], out["cpu"], atol=1e-4, rtol=1e-4)
