"""``torch.ops.kvslim.paged_attention`` / ``paged_write`` (kvslim.vllm.ops): the same bytes and outputs as the
Python calls they wrap, a schema torch's opcheck accepts, and a torch.compile'd function (fullgraph) calling them
that gives the eager results. No vLLM: kvslim.vllm.ops imports nothing of it."""

from __future__ import annotations

import pytest
import torch

from kvslim.vllm import attend as paged
from kvslim.vllm import ops
from kvslim.vllm.pages import PAGE_TOKENS as T
from kvslim.vllm.pages import PageLayout, write

H_Q, H_KV, D = 9, 3, 64


def _case(fmt_k="q4_0", fmt_v="int4", seed=0):
    """Pages holding two rows' cached tokens (row 0: a decode step over 70 keys; row 1: a 5-token chunk over 40),
    vLLM's metadata tensors, the queries and the step's raw K/V."""
    g = torch.Generator().manual_seed(seed)
    layout = PageLayout.of(fmt_k, fmt_v, D, torch.float32)
    kv_lens, q_lens = [70, 40], [1, 5]
    table = torch.tensor([[4, 1, 6], [0, 3, 2]], dtype=torch.int32)
    pages = torch.zeros(8, H_KV, T, layout.row_bytes, dtype=torch.uint8)
    for r, (n, m) in enumerate(zip(kv_lens, q_lens)):
        pos = torch.arange(n - m)
        k, v = torch.randn(n - m, H_KV, D, generator=g), torch.randn(n - m, H_KV, D, generator=g)
        write(layout, pages, k, v, table[r, pos // T].long() * T + pos % T)
    starts = torch.tensor([0, 1, 6], dtype=torch.int32)
    query = torch.randn(6, H_Q, D, generator=g)
    key, value = torch.randn(6, H_KV, D, generator=g), torch.randn(6, H_KV, D, generator=g)
    return layout, pages, starts, torch.tensor(kv_lens, dtype=torch.int32), table, query, key, value


@pytest.mark.parametrize("fmt_k,fmt_v", [("q4_0", "int4"), ("fp8", "q8_0"), ("none", "none")])
def test_the_attention_op_is_the_python_call(fmt_k, fmt_v):
    layout, pages, starts, lens, table, query, key, value = _case(fmt_k, fmt_v)
    want, got = torch.zeros(query.shape), torch.zeros(query.shape)
    paged.attend(layout, pages, query, want, paged.Rows.of(starts, lens, table), 0.125, 0, True, key, value)
    ops.paged_attention(query, got, pages, starts, lens, table, fmt_k, fmt_v, torch.float32, 0.125, 0, True, key, value)
    assert torch.equal(got, want) and want.abs().sum() > 0


def test_the_attention_op_reads_a_staging_pool():
    """A staged page (its tokens at full precision in the pool) read through the op as through the Python call."""
    layout, pages, starts, lens, table, query, key, value = _case()
    stage_layout = PageLayout.of("none", "none", D, torch.float32)
    pool = torch.zeros(2, H_KV, T, stage_layout.row_bytes, dtype=torch.uint8)
    k, v = torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    write(stage_layout, pool, k, v, torch.tensor([0, 1]))  # slot 0 holds page 6's first 2 tokens (row 0's 64, 65)
    smap = torch.full((8,), -1, dtype=torch.int32)
    smap[6] = 0
    want, got = torch.zeros(query.shape), torch.zeros(query.shape)
    staged = paged.Staged(pool, stage_layout, smap)
    paged.attend(layout, pages, query, want, paged.Rows.of(starts, lens, table), 0.125, 0, True, key, value, staged)
    ops.paged_attention(
        query, got, pages, starts, lens, table, "q4_0", "int4", torch.float32, 0.125, 0, True, key, value, pool, smap
    )
    assert torch.equal(got, want)
    plain = torch.zeros(query.shape)
    ops.paged_attention(query, plain, pages, starts, lens, table, "q4_0", "int4", torch.float32, 0.125, 0, True, key, value)
    assert not torch.equal(plain[0], got[0])  # the pool was read


def test_the_write_op_is_the_python_call():
    layout = PageLayout.of("int4", "int2", D, torch.float32)
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(20, H_KV, D, generator=g), torch.randn(20, H_KV, D, generator=g)
    slots = torch.randperm(4 * T, generator=g)[:20]
    want = torch.zeros(4, H_KV, T, layout.row_bytes, dtype=torch.uint8)
    got = want.clone()
    write(layout, want, key, value, slots)
    ops.paged_write(got, key, value, slots, "int4", "int2", torch.float32)
    assert torch.equal(got, want)


def test_bad_calls_say_what_is_wrong_in_one_line():
    layout, pages, starts, lens, table, query, key, value = _case()
    out = torch.zeros(query.shape)
    with pytest.raises(ValueError, match="row bytes|bytes a token"):
        ops.paged_attention(query, out, pages, starts, lens, table, "q8_0", "q8_0", torch.float32, 0.125)
    with pytest.raises(ValueError, match="together"):
        ops.paged_attention(
            query, out, pages, starts, lens, table, "q4_0", "int4", torch.float32, 0.125, 0, True, key, value, pages
        )
    with pytest.raises(ValueError, match="KV heads"):  # one head of K/V for pages of three
        ops.paged_attention(
            query, out, pages, starts, lens, table, "q4_0", "int4", torch.float32, 0.125, 0, True, key[:, :1], value
        )
    with pytest.raises(ValueError, match="not a multiple"):
        ops.paged_attention(query[:, :8], out[:, :8], pages, starts, lens, table, "q4_0", "int4", torch.float32, 0.125)
    before = pages.clone()
    with pytest.raises(ValueError, match="KV heads"):  # a write of one head would fill every head with it
        ops.paged_write(pages, key[:, :1], value[:, :1], torch.arange(6), "q4_0", "int4", torch.float32)
    with pytest.raises(ValueError, match="expected"):  # the same through the Python write
        write(layout, pages, key[:, :1], value[:, :1], torch.arange(6))
    assert torch.equal(pages, before)


def test_opcheck_accepts_both_schemas():
    layout, pages, starts, lens, table, query, key, value = _case()
    out = torch.zeros(query.shape)
    torch.library.opcheck(
        torch.ops.kvslim.paged_attention.default,
        (query, out, pages, starts, lens, table, "q4_0", "int4", torch.float32, 0.125, 0, True, key, value),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.kvslim.paged_write.default,
        (pages.clone(), key, value, torch.tensor([70, 71, 72, 73, 74, 75]), "q4_0", "int4", torch.float32),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_a_compiled_function_calling_the_ops_gives_the_eager_results():
    layout, pages, starts, lens, table, query, key, value = _case()
    # the step's tokens' slots (row 0: position 69, page 6; row 1: positions 35-39, page 3), written and then read
    # back from the pages (no raw K/V): a compiled graph that ran the attention before the write reads zeros there
    slots = torch.tensor([6 * T + 5, 3 * T + 3, 3 * T + 4, 3 * T + 5, 3 * T + 6, 3 * T + 7])

    def step(q, k, v, cache):
        out = torch.empty_like(q)
        ops.paged_write(cache, k * 1.0, v, slots, "q4_0", "int4", torch.float32)
        ops.paged_attention(q * 1.0, out, cache, starts, lens, table, "q4_0", "int4", torch.float32, 0.125)
        return out + 1.0

    torch._dynamo.reset()
    eager_cache, compiled_cache = pages.clone(), pages.clone()
    want = step(query, key, value, eager_cache)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(query, key, value, compiled_cache)
    assert torch.equal(got, want)
    assert torch.equal(compiled_cache, eager_cache) and not torch.equal(compiled_cache, pages)  # the write happened
