"""The C kernels' register path for KIVI bodies (csrc/kvslim_kernels.c, "KIVI, codes in registers": int8/int4/int2
codes widened and converted in registers, up to 3 queries a pass, no fp32 tile): bit for bit the tile path it stands
in for (kv_run's test switch, param 7), and within the kernels' tolerance of a float64 decode + matmul written from
the layout (tests/test_kernels.py's decode64), for K and V, M = 1..8 (1, 2 and 3 queries a pass, and several passes),
D = 64 and 128 (and 32, 96: a 32-channel V block spanning planes), token counts off the 4- and 8-token steps, K groups
cut by the body's ends, V channel groups of the whole head, 16 and 32; int3 (which keeps the tiles) alongside; GGML
q8_0 / q4_0 rows (read in registers too) against their tiles and gguf-py's decode. The fused call (kv_attend)
against a float64 attention; and a build without AVX (``CC="cc -mno-avx"``: the portable loops, no F16C) against
the same references."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import assert_scaled_close, encoded_view, probs, queries
from kvslim import kernels
from kvslim.formats import make_codec
from kvslim.formats.layout import body_layout
from kvslim.kernels import clib, cpu
from test_kernels import decode64

BITS = {"int8": 8, "int4": 4, "int2": 2, "int3": 3}


@pytest.fixture(autouse=True)
def _c_one_thread():
    ok, why = cpu.status()
    if not ok:
        pytest.skip(f"C kernels unavailable: {why}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    kernels.set_backend(None)


def _k_scores(q, codec, enc, offset, tiles):
    """kv_run's OP_K_AFFINE as cpu.k_affine calls it, param 7 = tiles."""
    b, h, m, d = q.shape
    t = enc.token["codes"].shape[2]
    codes, scale, zero = cpu._affine_k_parts(codec, enc, b, h, t, d, offset)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    params = (codec.bits, codec.token_group, offset, 0, 0, 0, 0, int(tiles))
    cpu._run(cpu._OP_K_AFFINE, "k_affine", (b, h, m, t, d), params, (q, codes, scale, zero, out, None))
    return out


def _v_sums(p, codec, enc, tiles):
    """kv_run's OP_V_AFFINE as cpu.v_affine calls it, param 7 = tiles."""
    b, h, m, t = p.shape
    lay = body_layout(codec, enc, b, h, t)
    out = torch.empty((b, h, m, lay.d), dtype=torch.float32)
    params = (codec.bits, lay.group, codec.token_group, 0, 0, 0, 0, int(tiles))
    cpu._run(cpu._OP_V_AFFINE, "v_affine", (b, h, m, t, lay.d), params, (p, lay.x, lay.scale, lay.zero, out, None))
    return out


def _rows_call(op, x, codec, enc, tiles):
    """kv_run's OP_K_ROWS (x: q) or OP_V_ROWS (x: p) as cpu.k_rows / cpu.v_rows call it, param 7 = tiles."""
    b, h, m = x.shape[:3]
    t = enc.token["blocks"].shape[2]
    fmt, rows, xs, d = cpu._row_parts(codec, enc, b, h, t, None)
    out = torch.empty((b, h, m, t if op == cpu._OP_K_ROWS else d), dtype=torch.float32)
    cpu._run(op, "rows", (b, h, m, t, d), (fmt, 0, 0, 0, 0, 0, 0, int(tiles)), (x, rows, xs, out))
    return out


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_ggml_register_path_is_the_tile_path_and_the_reference(name, d):
    gen = torch.Generator().manual_seed(d + len(name))
    for m in (1, 2, 3, 5, 8):
        for t in (1, 6, 37):
            codec = make_codec(name, "k")
            enc = encoded_view(codec, 2, 3, t, 0, gen, d=d)
            full = decode64(codec, enc, 0)
            q, p = queries(2, 3, m, gen, d), probs(2, 3, m, t, gen)
            what = f"{name} D={d} M={m} T={t}"
            reg, tiles = _rows_call(cpu._OP_K_ROWS, q, codec, enc, False), _rows_call(cpu._OP_K_ROWS, q, codec, enc, True)
            assert torch.equal(reg, tiles), what
            assert_scaled_close(reg, (q.double() @ full.mT).float(), q.abs() @ full.abs().mT.float(), what)
            reg, tiles = _rows_call(cpu._OP_V_ROWS, p, codec, enc, False), _rows_call(cpu._OP_V_ROWS, p, codec, enc, True)
            assert torch.equal(reg, tiles), what
            assert_scaled_close(reg, (p.double() @ full).float(), p.abs() @ full.abs().float(), what)


def _cases():
    out = []
    for name in BITS:
        for d in (32, 64, 96, 128):
            out.append(pytest.param(name, d, id=f"{name}-D{d}"))
    return out


@pytest.mark.parametrize("name,d", _cases())
def test_register_path_is_the_tile_path_and_the_reference(name, d):
    gen = torch.Generator().manual_seed(BITS[name] * 1000 + d)
    for m in (1, 2, 3, 5, 8):
        for t in (1, 6, 37):
            # K: per-channel groups of 8 and 32, the body starting inside its first group
            for group, offset in ((8, 3), (32, 0), (32, 29)):
                codec = make_codec(name, "k", group_size=group)
                enc = encoded_view(codec, 2, 3, t, offset, gen, d=d)
                q = queries(2, 3, m, gen, d)
                what = f"{name}-k D={d} M={m} T={t} G={group} offset={offset}"
                reg, tiles = _k_scores(q, codec, enc, offset, False), _k_scores(q, codec, enc, offset, True)
                assert torch.equal(reg, tiles), what
                full = decode64(codec, enc, offset)  # (B, H, T, D) float64
                assert_scaled_close(reg, (q.double() @ full.mT).float(), q.abs() @ full.abs().mT.float(), what)
            # V: per-token scales over the whole head, or channel groups of 16 / 32
            for vgroup in (None, 16, 32):
                if vgroup is not None and (d % vgroup or vgroup % (8 if name == "int3" else 1)):
                    continue
                codec = make_codec(name, "v", v_group_size=vgroup)
                enc = encoded_view(codec, 2, 3, t, 0, gen, d=d)
                p = probs(2, 3, m, t, gen)
                what = f"{name}-v D={d} M={m} T={t} g={vgroup}"
                reg, tiles = _v_sums(p, codec, enc, False), _v_sums(p, codec, enc, True)
                assert torch.equal(reg, tiles), what
                full = decode64(codec, enc, 0)
                assert_scaled_close(reg, (p.double() @ full).float(), p.abs() @ full.abs().float(), what)


def _attend64(q, kfull, vfull, k_res, v_res):
    """Decode attention in float64: softmax over the body's keys then the residual's, values summed."""
    k = torch.cat([kfull, k_res.double()], dim=2)
    v = torch.cat([vfull, v_res.double()], dim=2)
    return torch.softmax(q.double() @ k.mT, dim=-1) @ v


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("d", [64, 128])
def test_fused_attend_against_float64(name, d):
    """kv_attend over a register-path body and a float16 residual: the float64 attention of the decoded body, to
    fp32 rounding of the scores (scaled by the softmax) and of the sums."""
    gen = torch.Generator().manual_seed(d + BITS[name])
    for m, t, offset in ((1, 45, 5), (3, 200, 0), (7, 131, 7), (8, 9, 2)):
        kc, vc = make_codec(name, "k", group_size=8), make_codec(name, "v")
        kenc, venc = encoded_view(kc, 1, 3, t, offset, gen, d=d), encoded_view(vc, 1, 3, t, 0, gen, d=d)
        res = [torch.randn(1, 3, 5, d, generator=gen).half() for _ in range(2)]
        q = queries(1, 3, m, gen, d).contiguous()
        out = cpu.attend(q, None, None, res[0], res[1], kc, kenc, offset, vc, venc)
        kfull, vfull = decode64(kc, kenc, offset), decode64(vc, venc, 0)
        ref = _attend64(q, kfull, vfull, *res)
        vmax = torch.cat([vfull, res[1].double()], dim=2).abs().amax()
        torch.testing.assert_close(out, ref.float(), rtol=0, atol=float(2e-5 * vmax), msg=f"{name} D={d} M={m} T={t}")


def test_portable_build_against_the_references(monkeypatch, tmp_path):
    """The kernels built without AVX (so without AVX2, FMA, F16C: the portable loops and libm's expf) read every
    KIVI width within the same tolerances."""
    compiler = clib.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("CC", " ".join([*compiler, "-mno-avx"]))
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path))
    clib._reset_for_tests()
    try:
        assert cpu.status()[0], cpu.status()[1]
        assert cpu.to_half_finite(torch.zeros(3)) is None  # built without F16C: the flag took
        gen = torch.Generator().manual_seed(11)
        for name in BITS:
            codec = make_codec(name, "k", group_size=8)
            enc = encoded_view(codec, 1, 3, 21, 3, gen)
            q = queries(1, 3, 3, gen)
            full = decode64(codec, enc, 3)
            out = _k_scores(q, codec, enc, 3, False)
            assert_scaled_close(out, (q.double() @ full.mT).float(), q.abs() @ full.abs().mT.float(), name)
            codec = make_codec(name, "v")
            enc = encoded_view(codec, 1, 3, 21, 0, gen)
            p = probs(1, 3, 3, 21, gen)
            full = decode64(codec, enc, 0)
            assert_scaled_close(_v_sums(p, codec, enc, False), (p.double() @ full).float(), p.abs() @ full.abs().float(), name)
        kc, vc = make_codec("int4", "k", group_size=8), make_codec("int4", "v")
        kenc, venc = encoded_view(kc, 1, 3, 40, 2, gen), encoded_view(vc, 1, 3, 40, 0, gen)
        res = [torch.randn(1, 3, 4, 64, generator=gen).half() for _ in range(2)]
        q = queries(1, 3, 3, gen).contiguous()
        out = cpu.attend(q, None, None, res[0], res[1], kc, kenc, 2, vc, venc)
        vfull = decode64(vc, venc, 0)
        ref = _attend64(q, decode64(kc, kenc, 2), vfull, *res)
        vmax = torch.cat([vfull, res[1].double()], dim=2).abs().amax()
        torch.testing.assert_close(out, ref.float(), rtol=0, atol=float(2e-5 * vmax))
    finally:
        clib._reset_for_tests()  # the next use loads the real build again


def test_rows_bench_against_a_baseline_revision(capsys):
    """python -m kvslim.kernels.bench --rows --baseline REV: the rows call against the same call into REV's kernels
    (built from git, here HEAD's), in one process: both modes, the body bytes, the largest output difference."""
    import json

    from kvslim.kernels import bench

    try:
        code = bench.main(["--rows", "2", "--lengths", "70", "--formats", "int4", "--residual", "8", "--layers", "1",
                           "--repeats", "1", "--baseline", "HEAD"])
    except SystemExit as e:  # not a git checkout (an installed package), or no git: argparse's one-line error
        pytest.skip(f"no git revision to build ({e})")
    assert code == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])
    assert [r["mode"] for r in rows] == ["one-call", "one-call@HEAD"] and "GB/s" in out
    assert all(r["body_bytes"] > 2 * 62 * 3 * 32 for r in rows)  # 2 rows x 62 body tokens x 3 heads x 32 K code bytes
    assert rows[1]["max_diff"] < 1e-5  # HEAD's kernels: the same arithmetic up to what this tree changed since
