"""The Triton rows program (kvslim.kernels.gpu_rows, kernels/triton_rows.py), run on CPU by Triton's interpreter:
a decode step's attention for many rows in one launch, the contract of the C rows kernel (kernels.cpu.attend_rows).

Against an independent float64 reference (each row's pieces decoded by their codec, rotated back by the Hadamard
matrix, concatenated with its sinks and residual, softmax, weighted sum) and against the C kernel where it reads
the row: every format in both roles (K and V of different formats in one row, so a swapped K/V constant shows),
rows of different lengths with sinks, a partly evicted first group, residuals of different lengths and dtypes, GQA
(3 query rows a KV head, 2 KV heads), Hadamard bases, variance-normalized bodies, bodies cut into pieces; a row
reads its own segments only (rows of one shape and different data, in a shuffled order); a row's output is the
same bits alone and in a batch; rows that do not fit are handed back; the engine's ragged step dispatches here.

Tolerance: |out - ref| <= 1e-5 * (1 + max_t sum_d |q_d| |k_td|) * sum_t p_t |v_td|: a score's fp32 error is a few
ulps of sum_d |q_d||k_td| and moves the output by that much of its weighted magnitude, plus the sums' own rounding.
A row reading anything but its own data misses by orders of magnitude more.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install 'kvslim[gpu]')")

from kernel_helpers import data, encoded_view, interpreted  # noqa: E402
from kvslim import kernels  # noqa: E402
from kvslim.cache.hadamard import Hadamard  # noqa: E402
from kvslim.formats import format_names, make_codec  # noqa: E402
from kvslim.formats.varnorm import varnorm_codec  # noqa: E402
from kvslim.kernels import cpu, gpu, gpu_rows  # noqa: E402
from kvslim.kernels.cpu import AttendRow  # noqa: E402

H, M, D = 2, 3, 32  # KV heads, query rows a KV head (GQA), head dim (one GGML block)
REL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    with interpreted(lambda: gpu_rows.programs().rows_kernel, backend="triton"):
        yield

def _codec(name: str, role: str, vn: bool = False):
    codec = make_codec(name, role, group_size=8, v_group_size=16)
    return varnorm_codec(codec, 8) if vn else codec


#: every registered format the Triton programs read
NAMES = [n for n in format_names() if _codec(n, "k").family != "generic"]


def _fp(n: int, gen, dtype=torch.float32):
    """n full-precision tokens (1, H, n, D) as a view of a bigger buffer (strides of dims 1, 2 not contiguous)."""
    return data(1, H + 1, n + 2, D, gen).to(dtype)[:, 1:, 1 : 1 + n]


def _row(qrow, k, v, gen, *, sinks=0, nk=20, k_off=0, rk=3, nv=None, v_off=0, hb=(0, 0), dtype=torch.float32):
    """An AttendRow: ``sinks`` sink tokens, a K body of nk tokens starting k_off into its group and rk residual
    tokens, a V body of nv tokens (nk by default; a normalized V's factors k_off... v_off into their group) and as
    many residual tokens as make V as long as K. Bodies are views into bigger buffers, as the cache hands them."""
    nv = nk if nv is None else nv
    rv = nk + rk - nv
    assert rv >= 0
    k_off = k_off if k.token_group > 1 else 0
    v_off = v_off if getattr(v, "varnorm", False) else 0
    kb = encoded_view(k, 1, H, nk, k_off, gen, D)
    vb = encoded_view(v, 1, H, nv, v_off, gen, D)
    s = (_fp(sinks, gen, dtype), _fp(sinks, gen, dtype)) if sinks else (None, None)
    return AttendRow(
        qrow, *s, _fp(rk, gen, dtype), _fp(rv, gen, dtype), ((k, kb, k_off),), ((v, vb, v_off),), *hb
    )


def _reference(q: torch.Tensor, row) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, scale) float64 (H, M, D) of a row for its queries q (H, M, D): the decoded tokens attended in float64;
    scale: the error bound's magnitude (module docstring)."""

    def stream(sink, pieces, res, hb):
        body = torch.cat([c.decode(e, torch.float32, o) for c, e, o in pieces], 2)[0].double()  # (H, n, D)
        if hb:  # stored in the basis: the model's tokens are H x (H symmetric, its own inverse)
            body = body @ Hadamard(D, hb).matrix(dtype=torch.float64)
        parts = [t[0].double() for t in (sink,) if t is not None] + [body] + [res[0].double()]
        return torch.cat(parts, 1)  # (H, T, D)

    keys = stream(row.k_sink, row.k_body, row.k_res, row.k_hblock)
    values = stream(row.v_sink, row.v_body, row.v_res, row.v_hblock)
    qd = q.double()
    p = torch.softmax(qd @ keys.mT, -1)  # (H, M, T)
    sscale = (qd.abs() @ keys.abs().mT).amax(-1, keepdim=True)  # (H, M, 1)
    return p @ values, (1 + sscale) * (p @ values.abs())


def _check(out: torch.Tensor, q: torch.Tensor, row, what: str) -> None:
    """out[row.qrow] (H, M, D) equals the float64 reference of the row within the bound."""
    ref, scale = _reference(q[row.qrow], row)
    err = (out[row.qrow].double() - ref).abs()
    bad = err > REL * scale
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {err.numel()} off, max relative {(err / scale).max():.3g}"
    )


def _queries(n: int, gen) -> torch.Tensor:
    return torch.randn(n, H, M + 1, D, generator=gen)[:, :, :M] * D**-0.5  # a view, as the step's reshaped q


def _run(q, rows, fill=0.0):
    out = torch.full(q.shape, fill)
    assert gpu_rows.attend_rows(q, rows, out) == []
    return out


@pytest.mark.parametrize("i", range(len(NAMES)), ids=NAMES)
def test_every_format_against_the_reference_and_the_c_kernel(i):
    """K of one format, V of the next, two rows of different lengths (sinks, an evicted part of the first group, a
    body past one tile, residuals of 0 and 4 tokens): equal to the float64 reference, and to the C rows kernel on
    the rows it reads."""
    k, v = _codec(NAMES[i], "k"), _codec(NAMES[(i + 1) % len(NAMES)], "v")
    gen = torch.Generator().manual_seed(i)
    rows = [_row(0, k, v, gen, sinks=2, nk=13, k_off=3, rk=4, nv=17), _row(1, k, v, gen, nk=40, rk=0)]
    q = _queries(2, gen)
    out = _run(q, rows)
    for row in rows:
        _check(out, q, row, f"K {k.name} V {v.name} row {row.qrow}")
    if cpu.status()[0]:
        ref = torch.zeros_like(q)
        done = [r for j, r in enumerate(rows) if j not in cpu.attend_rows(q, rows, ref)]
        for row in done:
            torch.testing.assert_close(out[row.qrow], ref[row.qrow], atol=2e-5, rtol=1e-5)


def test_hadamard_bases_variance_normalized_bodies_and_pieces():
    """Rows with K and/or V in a Hadamard basis (blocks 32 and 16), variance-normalized K and V (a V factor group
    entered 5 tokens in), bfloat16 sinks and residuals, and the same rows with their bodies cut into pieces
    (1-token pieces, cuts inside a K group): every row equal to the reference; the cut rows equal the whole ones."""
    gen = torch.Generator().manual_seed(40)
    k4, v4 = _codec("int4", "k"), _codec("int4", "v")
    kn, vn = _codec("int2", "k", vn=True), _codec("int4", "v", vn=True)
    rows = [
        _row(0, k4, v4, gen, sinks=2, nk=13, k_off=2, rk=5, hb=(32, 32), dtype=torch.bfloat16),
        _row(1, k4, _codec("q8_0", "v"), gen, nk=9, rk=2, hb=(16, 0)),
        _row(2, kn, vn, gen, sinks=2, nk=11, k_off=3, rk=4, nv=13, v_off=5),
        _row(3, kn, vn, gen, nk=8, rk=0, v_off=0, hb=(0, 32)),
    ]
    q = _queries(4, gen)
    out = _run(q, rows)
    for row in rows:
        _check(out, q, row, f"row {row.qrow}")
    cut = [row._replace(k_body=_cut(row.k_body[0]), v_body=_cut(row.v_body[0])) for row in rows]
    assert all(len(r.k_body) == 4 and len(r.v_body) == 4 for r in cut)
    pieces = _run(q, cut)
    for row in cut:
        _check(pieces, q, row, f"cut row {row.qrow}")
    torch.testing.assert_close(pieces, out, atol=1e-5, rtol=1e-5)


def _cut(piece, cuts=(1, 2, 7)):
    """A body piece (codec, Encoded, offset) cut before each token index of ``cuts`` (views, as a paged pool's
    blocks; a group part keeps the groups its tokens touch; a plain V piece's offset stays 0)."""
    codec, enc, offset = piece
    n = next(iter(enc.token.values())).shape[2]
    bounds = [0, *sorted(c for c in cuts if 0 < c < n), n]
    group = codec.token_group if codec.role == "k" or getattr(codec, "varnorm", False) else 1
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        e, o = enc.narrow(lo, hi, offset, group)
        out.append((codec, e, o))
    return tuple(out)


def test_a_row_reads_its_own_segments_only_and_alone_gives_the_same_bits():
    """Three rows of one layout and one length, different data, in a shuffled order, their queries at scattered
    rows of a bigger q: each equals its own reference (a row reading another's table entry, pieces or head would
    not); rows no row names keep their values; each row alone (a 1-row launch) gives the batch's bits exactly."""
    gen = torch.Generator().manual_seed(50)
    k, v = _codec("int4", "k"), _codec("q4_0", "v")
    qrows = [4, 0, 2]
    rows = [_row(r, k, v, gen, sinks=2, nk=12, k_off=1, rk=3) for r in qrows]
    random.Random(1).shuffle(rows)
    q = _queries(5, gen)
    out = _run(q, rows, fill=7.0)
    for r in (1, 3):
        assert torch.equal(out[r], torch.full_like(out[r], 7.0))
    for row in rows:
        _check(out, q, row, f"row {row.qrow}")
        alone = _run(q, [row], fill=7.0)
        assert torch.equal(alone[row.qrow], out[row.qrow])


def test_rows_that_do_not_fit_are_handed_back():
    """A duplicate or out-of-range query row, K and V of different lengths, a Hadamard block that does not tile the
    head, V pieces of two formats: handed back (not written); the other rows are computed."""
    gen = torch.Generator().manual_seed(60)
    k, v = _codec("int8", "k"), _codec("int4", "v")
    good = [_row(i, k, v, gen, nk=10, rk=2) for i in range(3)]
    q = _queries(3, gen)
    ref = _run(q, good)
    bad = [
        good[0],
        good[0],  # query row 0 again
        good[1]._replace(qrow=7),
        good[1]._replace(k_res=None),  # K two tokens short
        good[1]._replace(k_hblock=3),
        good[2]._replace(v_body=good[2].v_body + (_row(2, k, _codec("q8_0", "v"), gen).v_body[0],)),
        good[2],
    ]
    out = torch.zeros_like(q)
    assert gpu_rows.attend_rows(q, bad, out) == [1, 2, 3, 4, 5]
    assert torch.equal(out[0], ref[0]) and torch.equal(out[2], ref[2]) and not out[1].any()
    with pytest.raises(ValueError, match="out must be"):
        gpu_rows.attend_rows(q, good, torch.zeros(3, H, M, D + 1))
    with pytest.raises(ValueError, match="query rows a head"):
        gpu_rows.attend_rows(
            torch.zeros(1, H, gpu.MAX_M + 1, D), good[:1], torch.zeros(1, H, gpu.MAX_M + 1, D)
        )


def test_the_engine_step_runs_one_launch_a_layer_with_each_row_as_alone():
    """A ragged decode step (generate.forward_rows) on the Triton backend: one rows launch per layer for the rows it
    reads (the pre-RoPE row goes its own way), each row's logits bit for bit the row's own step alone, and close to
    the same step on the CPU backend."""
    import kvslim
    from conftest import tiny_model
    from kvslim import SlimCache
    from kvslim import generate as gen

    model = kvslim.enable(tiny_model("llama", num_hidden_layers=1))
    specs = [
        "int4,sink=2,window=40,group=8,residual=8",
        "q4_0,residual=0,group=1,sink=0",
        "int4,k=q8_0,varnorm=on,group=8,residual=8",
        "int2,group=8,residual=8",  # pre-RoPE keys: the per-row path
    ]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (1, n), generator=g) for n in (70, 9, 33, 50)]
    tokens = [5, 6, 7, 8]
    launches = []
    real = gpu_rows.attend_rows

    def spy(q, rows, out):
        launches.append(sorted(r.qrow for r in rows))
        return real(q, rows, out)

    def caches(which=None):
        which = range(len(specs)) if which is None else which
        made = [SlimCache.from_config(kvslim.parse_spec(specs[b]), config=model.config) for b in which]
        for b, c in zip(which, made, strict=True):
            gen.prefill(model, prompts[b], c)
        return made

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_rows, "attend_rows", spy)
        made = caches()
        launches.clear()
        together = gen.forward_rows(model, tokens, made)
        assert launches == [[0, 1, 2]]  # one call for the layer, the three fusable rows
        for b in range(len(specs)):
            alone = gen.forward_rows(model, tokens[b : b + 1], caches([b]))
            assert torch.equal(alone[0], together[b]), specs[b]
        kernels.set_backend("cpu")
        try:
            on_cpu = gen.forward_rows(model, tokens, caches())
        finally:
            kernels.set_backend("triton")
    torch.testing.assert_close(together, on_cpu, atol=1e-4, rtol=1e-4)


_PTR = {torch.uint8: "*u8", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def test_the_rows_program_compiles_for_the_gpu(monkeypatch, tmp_path):
    """Without a GPU: the compiled (not interpreted) rows program builds to a cubin (sm_80) with Triton's own
    compiler, for normalized affine K and int3 V with Hadamard bases and bfloat16 sinks and residuals, so the GPU
    path's front end, types and lowering are checked too, not only its arithmetic (tests/test_triton.py builds the
    tile decoder of every layout the same way)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip(f"the ASTSource signature this test builds is Triton >= 3.4's, got {triton.__version__}")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.runtime.interpreter import InterpretedFunction

    kernel = gpu_rows.programs().rows_kernel
    assert not gpu.interpreting() and not isinstance(kernel, InterpretedFunction)
    gen = torch.Generator().manual_seed(70)
    cases = [(_codec("int4", "k", vn=True), _codec("int3", "v"), True, torch.bfloat16, 80)]
    names = list(kernel.arg_names)
    for k, v, had, fp, arch in cases:
        lk, _ = gpu._layout(k, encoded_view(k, 1, H, 8, 0, gen, D), 1, H, 8, D, 0)
        lv, _ = gpu._layout(v, encoded_view(v, 1, H, 8, 0, gen, D), 1, H, 8, None, 0)
        const = dict(KFMT=lk.fmt, KBITS=lk.bits, KNB=lk.nb, KVN=lk.vn, VFMT=lv.fmt, VBITS=lv.bits, VNB=lv.nb)
        const.update(VVN=lv.vn, KHAD=had, VHAD=had, BLOCK_M=16, BLOCK_T=gpu_rows.BLOCK_T, BLOCK_D=D)
        signature = {n: "i32" for n in names}  # sizes and strides
        signature.update(q_ptr="*fp32", out_ptr="*fp32", rt_ptr="*i64", pt_ptr="*i64", scr_ptr="*fp32")
        signature.update(had_ptr="*fp32", **{f"{p}_ptr": _PTR[fp] for p in ("ksk", "vsk", "kre", "vre")})
        for role, lay in (("k", lk), ("v", lv)):
            for part, t in zip("xszf", (lay.x, lay.s, lay.z, lay.factors), strict=True):
                signature[f"{role}{part}_ptr"] = _PTR[t.dtype]
        signature.update({n: "constexpr" for n in const})
        src = ASTSource(
            fn=kernel, signature=signature, constexprs={(names.index(c),): x for c, x in const.items()}
        )
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=gpu.COMPILE_OPTIONS)
        assert compiled.asm["cubin"], (k.name, v.name, arch)
