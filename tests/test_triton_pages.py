"""The Triton pages program (kvslim.vllm.attend_triton, kernels/triton_pages.py), run on CPU by Triton's interpreter:
attention on kvslim pages over block tables, the contract of the C kernel kvp_attend for CUDA tensors.

Against the torch reference (attend_reference) and the C kernel on the same pages: every page format in both roles
(K and V of different formats in one layout, so a swapped K/V constant shows), decode rows of 1 to 300 keys over
shuffled page ids, GQA groups, prefill chunks over a cached prefix with and without a window, non-causal rows, every
key read from the pages (no raw K/V), staged pages, sinks beside a window, Hadamard bases; and attend()'s dispatch.
Same tolerance as the C kernel's tests (tests/test_paged_kernel.py, whose pages and rows these reuse)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install 'kvslim[gpu]')")

from kernel_helpers import interpreted  # noqa: E402
from kvslim.kernels import gpu  # noqa: E402
from kvslim.vllm import attend as paged  # noqa: E402
from kvslim.vllm import attend_triton  # noqa: E402
from kvslim.vllm.pages import PageLayout, write  # noqa: E402
from test_paged_kernel import FORMATS, T, _staged_last_pages, _step  # noqa: E402

TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    with interpreted(lambda: attend_triton.programs().pages_kernel):
        yield

def _run(layout, pages, query, rows, key, value, window=0, causal=True, staged=None, sink=0, rotate=(0, 0)):
    """(Triton's output, the reference's) on the same arguments."""
    assert attend_triton.why_not(layout, pages, staged) is None
    ref = torch.zeros(query.shape)
    out = torch.full(query.shape, float("nan"))
    args = (rows, 0.125, window, causal, key, value, staged, sink, rotate)
    paged.attend_reference(layout, pages, query, ref, *args)
    attend_triton.attend_triton(layout, pages, query, out, *args)
    return out, ref


@pytest.mark.parametrize("fmt_k,fmt_v", [*FORMATS, ("fp16", "bf16"), ("q5_0", "q8_0")])
def test_decode_steps_over_many_pages_equal_the_reference(fmt_k, fmt_v):
    """Decode rows (one query each) of 1 to 300 keys, page-boundary lengths, GQA 9 over 3."""
    case = _step(fmt_k, fmt_v, [300, 1, 32, 33, 64, 95], [1] * 6, 9, 3, seed=len(fmt_k + fmt_v))
    out, ref = _run(*case)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("h_q,h_kv", [(2, 2), (14, 2)])
def test_gqa_groups(h_q, h_kv):
    """One query head a KV head, and 7 (the program pads the group to a tile of 16)."""
    out, ref = _run(*_step("q4_0", "int4", [70, 5, 129], [1] * 3, h_q, h_kv, seed=h_q))
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("fmt,window", [("q4_0", 0), ("int4", 45)])
def test_prefill_chunks_over_a_cached_prefix(fmt, window):
    """Rows of 9 and 17 new queries continuing 68 and 13 cached keys beside a decode row, with and without a
    window (causal: the window's first page moves with the query), then the same rows non-causal."""
    case = _step(fmt, fmt, [77, 30, 120], [9, 17, 1], 9, 3, seed=1)
    out, ref = _run(*case, window=window)
    torch.testing.assert_close(out, ref, **TOL)
    if not window:
        out, ref = _run(*case, causal=False)
        torch.testing.assert_close(out, ref, **TOL)


def test_every_key_from_the_pages():
    """No raw K/V: the step's own tokens written to their pages first and read back from them, causally."""
    layout, pages, query, rows, key, value = _step("q8_0", "int4", [90, 40, 33], [5, 1, 33], 9, 3, seed=4)
    for r, (n, m) in enumerate(zip(rows.kv_lens, [5, 1, 33])):
        q0 = rows.starts[r]
        pos = torch.arange(n - m, n)
        write(
            layout,
            pages,
            key[q0 : q0 + m],
            value[q0 : q0 + m],
            rows.block_table[r, pos // T].long() * T + pos % T,
        )
    out, ref = _run(layout, pages, query, rows, None, None)
    torch.testing.assert_close(out, ref, **TOL)


def test_sinks_beside_a_window():
    """A window of 45 keys with 4 sinks: the sink page, then the window's pages, rows past and within the window."""
    case = _step("q4_0", "q4_0", [300, 40, 97], [1, 1, 9], 9, 3, seed=5)
    out, ref = _run(*case, window=45, sink=4)
    torch.testing.assert_close(out, ref, **TOL)
    plain, _ = _run(*case, window=45)
    assert (plain - out).abs().max() > 1e-3  # the sinks were read


def test_staged_pages_are_read_from_the_pool():
    """Each row's partly filled last page staged (fp32 copies): read from the pool, the rest from the codes."""
    kv_lens = [70, 129, 40]
    layout, pages, query, rows, key, value = _step("int4", "int4", kv_lens, [1, 1, 1], 9, 3, seed=2)
    staged = _staged_last_pages(pages, rows, kv_lens)
    out, ref = _run(layout, pages, query, rows, key, value, staged=staged)
    torch.testing.assert_close(out, ref, **TOL)
    plain, _ = _run(layout, pages, query, rows, key, value)
    assert (plain - out).abs().max() > 1e-3  # the pool was read


def test_rotated_pages_and_the_c_kernel():
    """Pages in a Hadamard basis (K blocks of 64, V of 16): the query rotated in, the output back; the same as the
    reference and as the C kernel on the same arguments."""
    layout, pages, query, rows, key, value = _step("q4_0", "int4", [120, 33], [1, 1], 9, 3, seed=6)
    out, ref = _run(layout, pages, query, rows, key, value, rotate=(64, 16))
    torch.testing.assert_close(out, ref, **TOL)
    if paged.library() is not None:
        c = torch.zeros(query.shape)
        paged.attend(layout, pages, query, c, rows, 0.125, 0, True, key, value, None, 0, (64, 16))
        torch.testing.assert_close(out, c, **TOL)


def test_attend_dispatches_to_triton_where_asked(monkeypatch):
    """$KVSLIM_VLLM_KERNEL=triton sends CPU tensors to the program (status says so); without the interpreter it is
    refused in one line, never run elsewhere in its place."""
    layout, pages, query, rows, key, value = _step("q8_0", "q8_0", [50], [1], 9, 3, seed=8)
    monkeypatch.setenv(paged.KERNEL_ENV, "triton")
    assert "Triton" in paged.status()
    calls = []
    real = attend_triton.attend_triton
    monkeypatch.setattr(attend_triton, "attend_triton", lambda *a: calls.append(1) or real(*a))
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    paged.attend(layout, pages, query, out, rows, 0.125, key=key, value=value)
    ref = torch.zeros(query.shape)
    paged.attend_reference(layout, pages, query, ref, rows, 0.125, 0, True, key, value)
    assert calls == [1]
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(gpu, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="KVSLIM_VLLM_KERNEL=triton, but CPU tensors run in Triton only"):
        paged.attend(layout, pages, query, out, rows, 0.125, key=key, value=value)


def test_the_pages_program_compiles_for_the_gpu(monkeypatch, tmp_path):
    """Without a GPU: the compiled (not interpreted) program builds to a cubin (sm_80) with Triton's own compiler, for
    q4_0 K with int3 V over staged bfloat16 pages with the step's raw K/V, and int8 K with fp32 V off a 4-byte
    boundary, all keys from the pages: the GPU path's front end, types and lowering, not only its arithmetic."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip(f"the ASTSource signature this test builds is Triton >= 3.4's, got {triton.__version__}")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.runtime.interpreter import InterpretedFunction

    kernel = attend_triton.programs().pages_kernel
    assert not gpu.interpreting() and not isinstance(kernel, InterpretedFunction)
    names = list(kernel.arg_names)
    cases = [("q4_0", "int3", torch.bfloat16, True, True), ("int8", "none", torch.float32, False, False)]
    for fk, fv, dtype, staged, has_new in cases:
        layout = PageLayout.of(fk, fv, 64, dtype)
        kc, vc = attend_triton._constants(layout.k), attend_triton._constants(layout.v)
        const = dict(zip(("KFAM", "KFMT", "KBITS", "KNB", "KCAST"), kc, strict=True))
        const.update(zip(("VFAM", "VFMT", "VBITS", "VNB", "VCAST"), vc, strict=True))
        const.update(
            KALIGN=layout.k.offset % 4 == 0, VALIGN=layout.v.offset % 4 == 0 and layout.row_bytes % 4 == 0
        )
        const.update(SCAST=attend_triton.CAST[dtype][0], STAGED=staged, HAS_NEW=has_new)
        const.update(BLOCK_M=16, BLOCK_T=attend_triton.PAGE, BLOCK_D=64)
        signature = {n: "i32" for n in names}  # sizes, strides, offsets
        signature.update(q_ptr="*fp32", out_ptr="*fp32", tok_ptr="*i64", bt_ptr="*i32", kv_ptr="*u8")
        signature.update(key_ptr="*fp32", val_ptr="*fp32", stage_ptr="*u8", smap_ptr="*i32", scale="fp32")
        signature.update({n: "constexpr" for n in const})
        src = ASTSource(
            fn=kernel, signature=signature, constexprs={(names.index(c),): x for c, x in const.items()}
        )
        compiled = triton.compile(src, target=GPUTarget("cuda", 80, 32), options=gpu.COMPILE_OPTIONS)
        assert compiled.asm["cubin"], (fk, fv)
        if fv == "none":  # after int8 K's 66 bytes: its fp32 V read byte by byte
            assert not const["VALIGN"]
