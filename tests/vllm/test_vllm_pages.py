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
from kvslim.vllm.staging import Stager, pool_bytes, slots_from_env

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


@pytest.mark.parametrize("fmt", ["int4", "int3", "int2"])
def test_affine_v_rows_are_kvslims_v_codec(fmt):
    k, v = _kv(33)
    layout = PageLayout.of("int4", fmt, D, torch.float32)
    rows = layout.encode(k, v)[..., layout.v.offset :]  # (N, H, Vbytes)
    enc = make_codec(fmt, "v").encode(v.transpose(0, 1)[None]).token  # whole-head groups, fp16 scale/zero
    n = layout.v.nbytes - 4
    assert torch.equal(rows[..., :n], enc["codes"][0].transpose(0, 1))
    assert torch.equal(rows[..., n : n + 2].contiguous().view(torch.float16), enc["scale"][0].transpose(0, 1))
    assert torch.equal(rows[..., n + 2 :].contiguous().view(torch.float16), enc["zero"][0].transpose(0, 1))


def test_int8_rows_are_symmetric_per_token_with_one_fp16_scale():
    """int8 pages: an fp16 scale (max |x| / 127), then D int8 codes; checked against a float64 reference."""
    k, v = _kv(33)
    k[3, 1] = 0  # an all-zero head-token: scale 0, codes 0
    layout = PageLayout.of("int8", "int8", D, torch.float32)
    assert layout.k.family == layout.v.family == "sym" and layout.row_bytes == 2 * (D + 2)
    rows = layout.encode(k, v)
    for x, part in ((k, layout.k), (v, layout.v)):
        b = rows[..., part.offset : part.offset + part.nbytes]
        scale = b[..., :2].contiguous().view(torch.float16).double()  # (N, H, 1)
        want = (x.double().abs().amax(-1, keepdim=True) / 127).half().double()
        assert torch.equal(scale, want)
        codes = b[..., 2:].contiguous().view(torch.int8).double()
        ref = torch.where(want > 0, x.double() / want.clamp_min(1e-30), 0).round().clamp(-127, 127)
        assert (codes - ref).abs().max() <= 1  # round-half ties in fp32 may differ by one
        assert (codes - ref).abs().sum() <= 4
    dk, dv = layout.decode(rows)
    assert ((dk - k).abs() <= _scale_of(k) / 2 + 1e-6).all() and (dk[3, 1] == 0).all()
    assert ((dv - v).abs() <= _scale_of(v) / 2 + 1e-6).all()


def _scale_of(x):
    """The int8 page scale of x (N, H, D), fp32 (N, H, 1), with a margin of one fp16 rounding."""
    return (x.abs().amax(-1, keepdim=True) / 127).half().float() * 1.001


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
    assert PageLayout.of("int8", "int8", D, torch.bfloat16).row_bytes == 2 * (64 + 2)  # symmetric: 1.94x bf16
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


#: _case's rows: a decode row, a whole prefill, a prefill continuing a cached prefix of 50 (chunked prefill / prefix
#: caching: its first new key sits inside a page), an idle row, a 1-token prompt.
KV_LENS, Q_LENS = [75, 40, 70, 9, 1], [1, 40, 20, 0, 1]


def _case(fmt_k, fmt_v, dtype=torch.float32, h_q=6, h_kv=2, seed=0, write_new=True):
    """A mixed batch over shuffled pages (:data:`KV_LENS`, :data:`Q_LENS`): layout, pages, query, rows, and the
    step's raw key and value (the rows' new tokens, packed like the queries). write_new False: only the cached
    tokens are written (the new tokens' slots stay zero), so a kernel that read them from pages would be wrong."""
    g = torch.Generator().manual_seed(seed)
    layout = PageLayout.of(fmt_k, fmt_v, D, dtype)
    kv_lens, q_lens = KV_LENS, Q_LENS
    n_pages = sum(-(-n // PAGE_TOKENS) for n in kv_lens) + 3
    pages = torch.zeros(n_pages, h_kv, PAGE_TOKENS, layout.row_bytes, dtype=torch.uint8)
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)
    table = torch.full((len(kv_lens), 4), -1, dtype=torch.int32)
    used = 0
    new_k, new_v = [], []
    for r, n in enumerate(kv_lens):
        m = -(-n // PAGE_TOKENS)
        table[r, :m] = perm[used : used + m]
        used += m
        k, v = _kv(n, h_kv, seed=seed + r + 1, dtype=dtype)
        pos = torch.arange(n if write_new else n - q_lens[r])
        write(layout, pages, k, v, table[r, pos // PAGE_TOKENS].long() * PAGE_TOKENS + pos % PAGE_TOKENS)
        new_k.append(k[n - q_lens[r] :])
        new_v.append(v[n - q_lens[r] :])
    starts = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), h_q, D, generator=g).to(dtype)
    rows = paged.Rows.of(starts, torch.tensor(kv_lens, dtype=torch.int32), table)
    return layout, pages, query, rows, torch.cat(new_k), torch.cat(new_v)


def _plain(query, k, v, n, h_q, window=0):
    """sdpa in fp32 of ``query`` (m, H_q, D), the last m of n positions, on k, v (n, H_kv, D): GQA expanded,
    causal, keys older than ``window`` masked (0: none)."""
    g = h_q // k.shape[1]
    k, v = (x.float().transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))  # (H_q, n, D)
    m = query.shape[0]
    qpos, kpos = torch.arange(n - m, n)[:, None], torch.arange(n)[None, :]
    mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    q = query.float().transpose(0, 1)  # (H_q, m, D)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)


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
@pytest.mark.parametrize("raw", [True, False], ids=["raw-new", "pages-only"])
def test_kernel_equals_the_reference(fmt_k, fmt_v, dtype, window, causal, raw):
    if paged.library() is None:
        pytest.skip(f"C kernels unavailable: {paged.status()}")
    layout, pages, query, rows, key, value = _case(fmt_k, fmt_v, dtype, write_new=not raw)
    kv = (key, value) if raw else (None, None)
    ref = torch.zeros(query.shape, dtype=torch.float32)
    out = torch.zeros(query.shape, dtype=torch.float32)
    paged.attend_reference(layout, pages, query, ref, rows, 0.125, window, causal, *kv)
    paged.attend(layout, pages, query, out, rows, 0.125, window, causal, *kv)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("raw", [True, False], ids=["raw-new", "pages-only"])
def test_reference_is_plain_attention(raw):
    """The oracle itself: ``none`` pages give exactly the attention of the raw K/V (fp32 sdpa, GQA expanded),
    whether the new keys come from the step's K/V or from the pages."""
    layout, pages, query, rows, key, value = _case("none", "none", h_q=4, h_kv=2, seed=3)
    out = torch.zeros(query.shape)
    paged.attend_reference(layout, pages, query, out, rows, D**-0.5, 0, True, *((key, value) if raw else ()))
    for r, n in enumerate(rows.kv_lens):
        q0, q1 = rows.starts[r], rows.starts[r + 1]
        if q0 == q1:
            continue
        k, v = _kv(n, 2, seed=3 + r + 1)
        torch.testing.assert_close(out[q0:q1], _plain(query[q0:q1], k, v, n, 4), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["q4_0", "int4"])
@pytest.mark.parametrize("window", [0, 17])
def test_new_tokens_are_attended_exactly_and_the_cached_prefix_on_its_codes(fmt, window):
    """A lossy format: each row's new tokens are attended on their raw K/V (a prefill over no cached prefix is
    plain attention, exactly), its cached prefix on the pages' codes (decoded, not the raw values); the new
    tokens' slots in the pages are left empty, so reading them from pages would show."""
    layout, pages, query, rows, key, value = _case(fmt, fmt, h_q=6, h_kv=2, seed=5, write_new=False)
    fns = [paged.attend_reference] + ([paged.attend] if paged.library() is not None else [])
    for fn in fns:
        out = torch.zeros(query.shape)
        fn(layout, pages, query, out, rows, D**-0.5, window, True, key, value)
        for r, n in enumerate(rows.kv_lens):
            q0, q1 = rows.starts[r], rows.starts[r + 1]
            if q0 == q1:
                continue
            k, v = _kv(n, 2, seed=5 + r + 1)
            exact = _plain(query[q0:q1], k, v, n, 6, window)
            c = n - (q1 - q0)  # cached keys
            if c == 0:  # a prefill over no cached prefix: plain attention on the raw K/V
                torch.testing.assert_close(out[q0:q1], exact, atol=1e-5, rtol=1e-5)
                continue
            dk, dv = layout.decode(layout.encode(k[:c], v[:c]))  # the prefix's codes, decoded
            on_codes = _plain(query[q0:q1], torch.cat([dk, k[c:]]), torch.cat([dv, v[c:]]), n, 6, window)
            torch.testing.assert_close(out[q0:q1], on_codes, atol=1e-5, rtol=1e-5)
            assert (out[q0:q1] - exact).abs().max() > 1e-3, (fn.__name__, r)  # the codes did matter


def test_the_steps_raw_kv_must_match_the_queries():
    layout, pages, query, rows, key, value = _case("q4_0", "q4_0")
    with pytest.raises(ValueError, match="key has shape"):
        paged.attend(layout, pages, query, torch.zeros(query.shape), rows, 0.125, key=key[:-1], value=value)
    with pytest.raises(ValueError, match="both"):
        paged.attend(layout, pages, query, torch.zeros(query.shape), rows, 0.125, key=key)


def test_kernel_refuses_a_page_outside_the_pool():
    if paged.library() is None:
        pytest.skip(f"C kernels unavailable: {paged.status()}")
    layout, pages, query, rows, _, _ = _case("q4_0", "q4_0")
    rows.block_table[0, 0] = pages.shape[0] + 5
    with pytest.raises(RuntimeError, match="bad arguments"):
        paged.attend(layout, pages, query, torch.zeros(query.shape), rows, 0.125)


# ------------------------------------------------------------------------------------- staged partial pages


def test_the_stager_stages_a_page_from_its_first_write_until_its_32nd():
    t = PAGE_TOKENS
    st = Stager(4)
    # a 40-token prefill: page 5 filled in this one step (never staged), page 7 started (8 tokens); padding -1
    dest = st.plan(torch.cat([5 * t + torch.arange(32), 7 * t + torch.arange(8), torch.tensor([-1])]))
    s7 = int(st.map[7])
    assert int(st.map[5]) == -1 and (dest[:32] == -1).all() and dest[-1] == -1
    assert s7 >= 0 and dest[32:40].tolist() == [s7 * t + i for i in range(8)]
    for off in range(8, 32):  # decode steps: each token into the page's slot, until (and including) the 32nd
        assert st.plan(torch.tensor([7 * t + off])).tolist() == [s7 * t + off]
        assert int(st.map[7]) == s7  # the step that fills the page still reads it staged
    st.plan(torch.tensor([9 * t]))  # the next step: page 7, full, is read from its codes; page 9 starts
    assert int(st.map[7]) == -1 and int(st.map[9]) >= 0
    # a page written at an offset > 0 without a slot (its slot evicted, or begun before staging) stays on codes
    assert st.plan(torch.tensor([11 * t + 3])).tolist() == [-1] and int(st.map[11]) == -1


def test_a_reused_page_id_never_reads_a_stale_staged_copy():
    t = PAGE_TOKENS
    st = Stager(4)
    st.plan(3 * t + torch.arange(20))  # request A: page 3 partly filled, then A finishes (vLLM frees page 3)
    slot = int(st.map[3])
    assert slot >= 0
    # request B gets page 3 again and starts it at offset 0 with 5 tokens: the same slot, written from 0 anew
    assert st.plan(3 * t + torch.arange(5)).tolist() == [slot * t + i for i in range(5)]
    st.plan(4 * t + torch.arange(20))
    # request C gets page 4 again and fills it in one step (a prefill): the stale slot is dropped at once
    st.plan(torch.cat([4 * t + torch.arange(32), 6 * t + torch.arange(3)]))
    assert int(st.map[4]) == -1 and int(st.map[6]) >= 0


def test_the_stager_evicts_the_least_recently_written_slot():
    t = PAGE_TOKENS
    st = Stager(2)
    st.plan(torch.tensor([1 * t, 2 * t]))  # pages 1 and 2 start
    st.plan(torch.tensor([2 * t + 1]))  # page 2 written again; page 1 not
    st.plan(torch.tensor([8 * t]))  # page 8 starts: page 1's slot (least recently written) is taken
    assert int(st.map[1]) == -1 and int(st.map[2]) >= 0 and int(st.map[8]) >= 0
    assert st.plan(torch.tensor([1 * t + 1])).tolist() == [-1]  # page 1 now reads its codes
    # more pages started in one step than slots: the rest are not staged
    dest = st.plan(torch.tensor([12 * t, 13 * t, 14 * t]))
    assert (dest >= 0).sum() == 2 and int(st.map[14]) == -1


def _staged_steps(fmt, h_q=6, h_kv=2, slots=8, seed=7, stage_dtype=torch.float32):
    """Requests written step by step as the backend writes them (codes through the slot mapping; the raw K/V
    into their staging slots as planned by a :class:`Stager`), then one mixed step to attend.

    Rows (kv_len, q_len, history written as): 0: (75, 1) a 50-token prefill then 24 decode steps (its last page
    staged from a decode step); 1: (40, 40) a prefill; 2: (70, 20) a 50-token prefill (page 1 staged from the
    prefill), 20 new tokens that fill page 1 in this step; 3: (9, 0) idle; 4: (41, 1) a 40-token prefill whose
    first page id is reused from a finished request that left it partly filled and staged (row 4 fills it in
    one step: the stale copy must not be read). Returns layout, pages, query, rows, key, value, Staged, the raw
    K/V of every row."""
    t = PAGE_TOKENS
    g = torch.Generator().manual_seed(seed)
    layout = PageLayout.of(fmt, fmt, D, torch.float32)
    stage_layout = PageLayout.of("none", "none", D, stage_dtype)  # the model's dtype
    kv_lens, q_lens = [75, 40, 70, 9, 41], [1, 40, 20, 0, 1]
    pages = torch.zeros(20, h_kv, t, layout.row_bytes, dtype=torch.uint8)
    junk = torch.Generator().manual_seed(
        seed + 1000
    )  # its own stream: the query does not depend on the pool's size
    pool = torch.randint(0, 256, (slots, h_kv, t, stage_layout.row_bytes), dtype=torch.uint8, generator=junk)
    table = torch.tensor(
        [[11, 2, 7, -1], [5, 9, -1, -1], [0, 14, 3, -1], [8, -1, -1, -1], [12, 6, -1, -1]], dtype=torch.int32
    )
    st = Stager(slots)
    raw = [_kv(n, h_kv, seed=seed + r + 1) for r, n in enumerate(kv_lens)]

    def step(items):
        """items: (row, first position, count) written in one step (the K/V of the row, or given (k, v))."""
        slot_list, ks, vs = [], [], []
        for r, p0, n, *given in items:
            pos = torch.arange(p0, p0 + n)
            slot_list.append(table[r, pos // t].long() * t + pos % t)
            k, v = given[0] if given else raw[r]
            ks.append(k[p0 : p0 + n])
            vs.append(v[p0 : p0 + n])
        slots_ = torch.cat(slot_list)
        k, v = torch.cat(ks), torch.cat(vs)
        dest = st.plan(slots_)
        write(layout, pages, k, v, slots_)
        write(stage_layout, pool, k, v, dest)

    # a finished request A on row 4's first page id: 20 tokens, staged; row 4's prefill then fills that page id in
    # one step (so its stale copy must be dropped, not read)
    step([(4, 0, 20, _kv(20, h_kv, seed=seed + 99))])
    step([(0, 0, 50), (2, 0, 50), (3, 0, 9), (4, 0, 40)])
    for p in range(50, 74):
        step([(0, p, 1)])
    # this step: every row's new tokens written first (as do_kv_cache_update and forward do), then attended
    step([(r, kv_lens[r] - q_lens[r], q_lens[r]) for r in range(5) if q_lens[r]])
    starts = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), h_q, D, generator=g)
    rows = paged.Rows.of(starts, torch.tensor(kv_lens, dtype=torch.int32), table)
    key = torch.cat([k[n - q :] for (k, _), n, q in zip(raw, kv_lens, q_lens)])
    value = torch.cat([v[n - q :] for (_, v), n, q in zip(raw, kv_lens, q_lens)])
    return layout, pages, query, rows, key, value, paged.Staged(pool, stage_layout, st.map), raw


@pytest.mark.parametrize("fmt", ["q4_0", "int4", "q8_0"])
@pytest.mark.parametrize("window", [0, 17])
def test_staged_pages_are_attended_at_full_precision_and_full_pages_on_their_codes(fmt, window):
    """Against plain attention: a row's keys in pages that were full before this step on their codes (decoded),
    the rest (the partly filled page, staged, and the step's own tokens) on their raw K/V — kvslim's own cache
    with group 32 (its partly filled group unencoded). The kernel equals the reference."""
    layout, pages, query, rows, key, value, staged, raw = _staged_steps(fmt)
    fns = [paged.attend_reference] + ([paged.attend] if paged.library() is not None else [])
    outs = []
    for fn in fns:
        out = torch.zeros(query.shape)
        fn(layout, pages, query, out, rows, D**-0.5, window, True, key, value, staged)
        outs.append(out)
        for r, n in enumerate(rows.kv_lens):
            q0, q1 = rows.starts[r], rows.starts[r + 1]
            if q0 == q1:
                continue
            k, v = raw[r]
            full = (n - (q1 - q0)) // PAGE_TOKENS * PAGE_TOKENS  # keys in pages full before this step
            dk, dv = layout.decode(layout.encode(k[:full], v[:full]))
            want = _plain(query[q0:q1], torch.cat([dk, k[full:]]), torch.cat([dv, v[full:]]), n, 6, window)
            torch.testing.assert_close(out[q0:q1], want, atol=1e-5, rtol=1e-5, msg=f"{fn.__name__} row {r}")
    if len(outs) == 2:
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("stage_dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_a_staging_pool_in_the_models_half_dtype_as_the_reference(stage_dtype):
    if paged.library() is None:
        pytest.skip(f"C kernels unavailable: {paged.status()}")
    layout, pages, query, rows, key, value, staged, _ = _staged_steps("q4_0", stage_dtype=stage_dtype)
    ref, out = torch.zeros(query.shape), torch.zeros(query.shape)
    paged.attend_reference(layout, pages, query, ref, rows, D**-0.5, 0, True, key, value, staged)
    paged.attend(layout, pages, query, out, rows, D**-0.5, 0, True, key, value, staged)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    f_layout, f_pages, f_query, f_rows, f_key, f_value, f_staged, _ = _staged_steps("q4_0")  # fp32 staging
    full = torch.zeros(query.shape)
    paged.attend(f_layout, f_pages, f_query, full, f_rows, D**-0.5, 0, True, f_key, f_value, f_staged)
    assert (out - full).abs().max() > 1e-4  # the half-precision staged rows were read (not the fp32 ones)
    torch.testing.assert_close(out, full, atol=2e-2, rtol=0)  # ... and are those rows, rounded


def test_without_staging_the_same_steps_read_every_cached_key_from_its_codes():
    """The staging matters (the test above would catch a kernel that ignores it): without the pool, row 0's
    partly filled page is read from its codes and the result moves away from the staged one."""
    layout, pages, query, rows, key, value, staged, raw = _staged_steps("q4_0")
    with_stage, without = torch.zeros(query.shape), torch.zeros(query.shape)
    for fn in [paged.attend_reference] + ([paged.attend] if paged.library() is not None else []):
        fn(layout, pages, query, with_stage, rows, D**-0.5, 0, True, key, value, staged)
        fn(layout, pages, query, without, rows, D**-0.5, 0, True, key, value)
        assert (with_stage[0] - without[0]).abs().max() > 1e-3, fn.__name__
        torch.testing.assert_close(with_stage[1:41], without[1:41])  # row 1: a prefill, no cached key


def test_kernel_refuses_a_staging_slot_outside_the_pool():
    if paged.library() is None:
        pytest.skip(f"C kernels unavailable: {paged.status()}")
    layout, pages, query, rows, key, value, staged, _ = _staged_steps("q4_0")
    staged.map[7] = staged.pool.shape[0]  # row 0's last page
    with pytest.raises(RuntimeError, match="bad arguments"):
        paged.attend(layout, pages, query, torch.zeros(query.shape), rows, 0.125, 0, True, key, value, staged)


def test_the_staging_pool_is_sized_by_max_num_seqs_or_the_environment():
    assert slots_from_env(64, {}) == 64
    assert slots_from_env(64, {"KVSLIM_VLLM_STAGED_SLOTS": "16"}) == 16
    assert slots_from_env(64, {"KVSLIM_VLLM_STAGED_SLOTS": "0"}) == 0  # no staging
    with pytest.raises(ValueError, match="must be a whole number of slots"):
        slots_from_env(64, {"KVSLIM_VLLM_STAGED_SLOTS": "-3"})
    # bf16, SmolLM2-135M (30 layers, 3 KV heads, D 64), 64 slots: 45 MiB (docs/vllm.md)
    assert pool_bytes(64, 30, 3, 64, 2) == 45 * 2**20


# ------------------------------------------------------------------------------------------------- sink pages


def test_a_sink_page_stays_staged_while_a_running_sequence_starts_with_it():
    t = PAGE_TOKENS
    st = Stager(3, sink_pages=1)
    # a 40-token prefill: its first page (5) filled in one step is staged all the same, as a sink; page 7 starts
    dest = st.plan(torch.cat([5 * t + torch.arange(32), 7 * t + torch.arange(8)]), sinks=[5])
    s5 = int(st.map[5])
    assert s5 >= 0 and dest[:32].tolist() == [s5 * t + i for i in range(32)]
    for off in range(8, 32):  # page 7 fills; page 5 stays
        st.plan(torch.tensor([7 * t + off]), sinks=[5])
    st.plan(torch.tensor([9 * t]), sinks=[5])  # page 7 released (full, not a sink); page 5 held
    assert int(st.map[7]) == -1 and int(st.map[5]) == s5 and int(st.map[9]) >= 0
    # two pages start: one takes the free slot, the other evicts page 9 (least recently written), never page 5
    st.plan(torch.tensor([11 * t, 12 * t]), sinks=[5])
    assert int(st.map[5]) == s5 and int(st.map[11]) >= 0 and int(st.map[12]) >= 0 and int(st.map[9]) == -1
    # three pages start with two slots not a sink's: one is not staged
    dest = st.plan(torch.tensor([15 * t, 16 * t, 17 * t]), sinks=[5])
    assert int(st.map[5]) == s5 and (dest >= 0).sum() == 2
    for _ in range(3):  # idle steps: the least recently written slot would be page 5's, were it not a sink
        st.plan(torch.tensor([13 * t + 0]), sinks=[5])
    assert int(st.map[5]) == s5
    # a step that does not name page 5 (its sequence finished, or was not scheduled): it stays staged, but its slot
    # is evictable again, least recently written first
    st.plan(torch.tensor([13 * t + 1]), sinks=[])
    assert int(st.map[5]) == s5
    dest = st.plan(torch.tensor([18 * t, 19 * t, 20 * t]), sinks=[])
    assert int(st.map[5]) == -1 and (dest >= 0).sum() == 3


def test_a_reused_sink_page_id_is_staged_anew():
    t = PAGE_TOKENS
    st = Stager(4, sink_pages=1)
    st.plan(3 * t + torch.arange(32), sinks=[3])  # request A's sink page, full, staged
    st.plan(torch.tensor([4 * t]), sinks=[3])
    slot = int(st.map[3])
    # A finished; request B gets page 3 as its first page again and prefills 10 tokens: staged from offset 0 anew
    dest = st.plan(3 * t + torch.arange(10), sinks=[3])
    assert int(st.map[3]) == slot and dest.tolist() == [slot * t + i for i in range(10)]


def test_sink_pages_are_the_first_pages_each_sequence_has():
    from kvslim.vllm.staging import sink_pages_of

    table = torch.tensor([[4, 9, 2], [7, 1, 0], [3, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([70, 33, 5])  # 3, 2 and 1 pages
    assert sink_pages_of(table, lens, 1) == [4, 7, 3]
    assert sink_pages_of(table, lens, 2) == [4, 9, 7, 1, 3]  # the third row has one page so far
    assert sink_pages_of(table, lens[:2], 1) == [4, 7]  # rows beyond the running ones are not read
    assert sink_pages_of(table, lens, 0) == []


def test_sink_is_taken_and_a_window_refused():
    from kvslim.vllm.spec import from_sources, sink_pages

    assert sink_pages(from_sources({"kvslim": "q4_0,sink=4"}, {})) == 1
    assert sink_pages(from_sources({"kvslim": "q4_0,sink=64"}, {})) == 2
    assert sink_pages(from_sources({"kvslim": "q4_0"}, {})) == 0
    with pytest.raises(ValueError, match="window=60 is not supported in vLLM"):
        from_sources({"kvslim": "q4_0,sink=4,window=60"}, {})


def test_fp8_rows_are_kvslims_fp8_codec():
    """fp8 pages: D e4m3 codes, then the token's fp32 scale: the bytes of kvslim's own fp8 codec, K and V."""
    k, v = _kv(33)
    k[3, 1] = 0  # an all-zero head-token: the floored scale
    layout = PageLayout.of("fp8", "fp8", D, torch.float32)
    assert layout.k.family == layout.v.family == "fp8" and layout.row_bytes == 2 * (D + 4)
    rows = layout.encode(k, v)
    for x, part in ((k, layout.k), (v, layout.v)):
        enc = make_codec("fp8", "k").encode(x.transpose(0, 1)[None]).token  # (1, H, N, D) codes, (1, H, N, 1) scale
        b = rows[..., part.offset : part.offset + part.nbytes]
        assert torch.equal(b[..., :D].contiguous().view(torch.float8_e4m3fn).view(torch.uint8),
                           enc["codes"][0].transpose(0, 1).contiguous().view(torch.uint8))  # fmt: skip
        assert torch.equal(b[..., D:].contiguous().view(torch.float32), enc["scale"][0].transpose(0, 1))
    dk, dv = layout.decode(rows)
    assert torch.allclose(dk, k, rtol=0.07, atol=1e-6) and torch.allclose(dv, v, rtol=0.07, atol=1e-6)
