"""kvslim.vllm's pages and paged attention, without vLLM: byte layouts against kvslim's own codecs and gguf-py,
writes through a slot mapping, the C kernel against the torch reference, the reference against plain attention.

Fast (no model); runs in the project venv too (kvslim.vllm.pages / .attend import nothing of vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvslim.formats import make_codec
from kvslim.vllm import attend as paged
from kvslim.vllm.pages import PAGE_TOKENS, PageLayout, gather, write

D = 64


def _kv(n, h=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, h, D, generator=g) * 2 + torch.randn(
        1, h, D, generator=g
    )  # per-channel offsets, as K has
    v = torch.randn(n, h, D, generator=g)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_ggml_rows_are_kvslims_and_gguf_blocks(fmt):
    k, v = _kv(40)
    layout = PageLayout.of(fmt, fmt, D, torch.float32)
    rows = layout.encode(k, v)  # (N, H, C)
    assert rows.dtype == torch.uint8 and rows.shape == (40, 2, layout.row_bytes)
    for role, x, part in (("k", k, layout.k), ("v", v, layout.v)):
        ours = (
            make_codec(fmt, role).encode(x.transpose(0, 1)[None]).token["blocks"][0].transpose(0, 1)
        )  # (N, H, b)
        assert torch.equal(rows[..., part.offset : part.offset + part.nbytes], ours)
    import gguf.quants

    ref = gguf.quants.quantize(k.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    assert np.array_equal(rows[..., : layout.k.nbytes].numpy(), ref)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
def test_affine_v_rows_are_kvslims_v_codec(fmt):
    k, v = _kv(33)
    layout = PageLayout.of("int8", fmt, D, torch.float32)
    rows = layout.encode(k, v)[..., layout.v.offset :]  # (N, H, Vbytes)
    enc = make_codec(fmt, "v").encode(v.transpose(0, 1)[None]).token  # whole-head groups, fp16 scale/zero
    n = layout.v.nbytes - 4
    assert torch.equal(rows[..., :n], enc["codes"][0].transpose(0, 1))
    assert torch.equal(rows[..., n : n + 2].contiguous().view(torch.float16), enc["scale"][0].transpose(0, 1))
    assert torch.equal(rows[..., n + 2 :].contiguous().view(torch.float16), enc["zero"][0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_none_is_lossless_in_the_models_dtype(dtype):
    k, v = _kv(5, dtype=dtype)
    layout = PageLayout.of("none", "none", D, dtype)
    assert layout.row_bytes == 2 * D * dtype.itemsize
    dk, dv = layout.decode(layout.encode(k, v))
    assert torch.equal(dk, k.float()) and torch.equal(dv, v.float())


def test_layout_sizes():
    # bytes per token and KV head (K + V), D = 64: what vLLM's capacity is counted in
    assert PageLayout.of("q4_0", "q4_0", D, torch.bfloat16).row_bytes == 2 * 2 * 18
    assert PageLayout.of("q8_0", "q8_0", D, torch.bfloat16).row_bytes == 2 * 2 * 34
    assert PageLayout.of("int8", "int8", D, torch.bfloat16).row_bytes == 2 * (64 + 4)
    assert PageLayout.of("int4", "int2", D, torch.bfloat16).row_bytes == (32 + 4) + (16 + 4)
    assert PageLayout.of("none", "none", D, torch.bfloat16).row_bytes == 2 * 64 * 2


def test_writes_go_through_the_slot_mapping_and_never_touch_written_tokens():
    layout = PageLayout.of("q4_0", "q8_0", D, torch.float32)
    pages = torch.zeros(6, 2, PAGE_TOKENS, layout.row_bytes, dtype=torch.uint8)
    table = torch.tensor([4, 1, 3], dtype=torch.int32)  # a request's pages, out of order
    k, v = _kv(70, seed=1)
    slots = lambda pos: table[pos // PAGE_TOKENS].long() * PAGE_TOKENS + pos % PAGE_TOKENS  # noqa: E731
    # step 1: 50 prompt tokens, with two padding slots (-1) vLLM may append
    write(layout, pages, k[:52], v[:52], torch.cat([slots(torch.arange(50)), torch.tensor([-1, -1])]))
    before = pages.clone()
    # step 2 and 3: one token each
    for p in (50, 51):
        write(layout, pages, k[p : p + 1], v[p : p + 1], slots(torch.tensor([p])))
    changed = (pages != before).any(-1)  # (pages, H, T): which token rows changed
    assert changed.sum() == 2 * 2  # two tokens x two heads, nothing else
    gk, gv = gather(layout, pages, table, 52)  # (H, 52, D)
    ek, ev = layout.decode(layout.encode(k[:52], v[:52]))
    assert torch.equal(gk, ek.transpose(0, 1)) and torch.equal(gv, ev.transpose(0, 1))
    assert (pages[[0, 2, 5]] == 0).all()  # pages no request owns stay untouched


def _case(fmt_k, fmt_v, dtype=torch.float32, h_q=6, h_kv=2, seed=0):
    """A mixed batch over shuffled pages: a decode row, a whole prefill, a prefill continuing a cached prefix
    (chunked prefill / prefix caching), an idle row, a 1-token prompt."""
    g = torch.Generator().manual_seed(seed)
    layout = PageLayout.of(fmt_k, fmt_v, D, dtype)
    kv_lens, q_lens = [75, 40, 70, 9, 1], [1, 40, 20, 0, 1]
    n_pages = sum(-(-n // PAGE_TOKENS) for n in kv_lens) + 3
    pages = torch.zeros(n_pages, h_kv, PAGE_TOKENS, layout.row_bytes, dtype=torch.uint8)
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)
    table = torch.full((len(kv_lens), 4), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(kv_lens):
        m = -(-n // PAGE_TOKENS)
        table[r, :m] = perm[used : used + m]
        used += m
        k, v = _kv(n, h_kv, seed=seed + r + 1, dtype=dtype)
        pos = torch.arange(n)
        write(layout, pages, k, v, table[r, pos // PAGE_TOKENS].long() * PAGE_TOKENS + pos % PAGE_TOKENS)
    starts = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), h_q, D, generator=g).to(dtype)
    rows = paged.Rows.of(starts, torch.tensor(kv_lens, dtype=torch.int32), table)
    return layout, pages, query, rows


@pytest.mark.parametrize(
    "fmt_k,fmt_v,dtype",
    [
        ("none", "none", torch.float32),
        ("none", "none", torch.bfloat16),
        ("fp16", "fp16", torch.float32),
        ("q8_0", "q8_0", torch.float32),
        ("q4_0", "q4_0", torch.bfloat16),
        ("q4_1", "q5_0", torch.float32),
        ("q5_1", "q8_0", torch.float32),
        ("int8", "int8", torch.float32),
        ("int4", "int2", torch.float32),
        ("q4_0", "int3", torch.float32),
    ],
)
@pytest.mark.parametrize("window,causal", [(0, True), (17, True), (0, False)])
def test_kernel_equals_the_reference(fmt_k, fmt_v, dtype, window, causal):
    if paged.library() is None:
        pytest.skip(f"C kernels unavailable: {paged.status()}")
    layout, pages, query, rows = _case(fmt_k, fmt_v, dtype)
    ref = torch.zeros(query.shape, dtype=torch.float32)
    out = torch.zeros(query.shape, dtype=torch.float32)
    paged.attend_reference(layout, pages, query, ref, rows, 0.125, window, causal)
    paged.attend(layout, pages, query, out, rows, 0.125, window, causal)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_reference_is_plain_attention():
    """The oracle itself: ``none`` pages give exactly the attention of the raw K/V (fp32 sdpa, GQA expanded)."""
    layout, pages, query, rows = _case("none", "none", h_q=4, h_kv=2, seed=3)
    out = torch.zeros(query.shape)
    paged.attend_reference(layout, pages, query, out, rows, D**-0.5)
    for r, n in enumerate(rows.kv_lens):
        q0, q1 = rows.starts[r], rows.starts[r + 1]
        if q0 == q1:
            continue
        k, v = _kv(n, 2, seed=3 + r + 1)
        k, v = (
            k.transpose(0, 1).repeat_interleave(2, 0),
            v.transpose(0, 1).repeat_interleave(2, 0),
        )  # (4, n, D)
        q = query[q0:q1].transpose(0, 1)  # (4, m, D)
        mask = torch.arange(n)[None, :] <= torch.arange(n - (q1 - q0), n)[:, None]
        expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out[q0:q1], expect.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_kernel_refuses_a_page_outside_the_pool():
    if paged.library() is None:
        pytest.skip(f"C kernels unavailable: {paged.status()}")
    layout, pages, query, rows = _case("q4_0", "q4_0")
    rows.block_table[0, 0] = pages.shape[0] + 5
    with pytest.raises(RuntimeError, match="bad arguments"):
        paged.attend(layout, pages, query, torch.zeros(query.shape), rows, 0.125)
