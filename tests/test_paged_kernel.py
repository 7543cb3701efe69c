"""kvp_attend (csrc/kvslim_paged.c) against its torch reference on the shapes its fast paths take: decode steps of
many rows over many pages (codes read in registers for q8_0 / q4_0 / sym8 / affine at up to 6 query-heads a task),
GQA groups on both sides of that bound, prefill chunks over a cached prefix (tiles), staged pages, windows.

No vLLM, no model: kvslim.vllm.pages / .attend import nothing of vLLM. tests/vllm/test_vllm_pages.py holds the
layout and planner tests; these are the kernel's shapes."""

from __future__ import annotations

import pytest
import torch

from kvslim.vllm import attend as paged
from kvslim.vllm.pages import PAGE_TOKENS, PageLayout, write

pytestmark = pytest.mark.skipif(paged.library() is None, reason=f"C kernels unavailable: {paged.status()}")

T = PAGE_TOKENS


@pytest.fixture(params=["avx512", "avx2"])
def loops(request):
    """Each attention test on both decode paths of the kernel: its AVX-512 loops (where built) and the AVX2 loops a
    build without them takes."""
    paged.use_avx512_loops(request.param == "avx512")
    yield request.param
    paged.use_avx512_loops(True)


def _step(fmt_k, fmt_v, kv_lens, q_lens, h_q, h_kv, d=64, seed=0, dtype=torch.float32):
    """Pages of shuffled ids holding every row's cached keys (not its new ones: those are raw, as the backend
    attends), the queries, the rows and the step's raw K/V."""
    g = torch.Generator().manual_seed(seed)
    layout = PageLayout.of(fmt_k, fmt_v, d, dtype)
    per_row = max(-(-n // T) for n in kv_lens)
    n_pages = len(kv_lens) * per_row + 2
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)
    table = perm[: len(kv_lens) * per_row].view(len(kv_lens), per_row).clone()
    pages = torch.zeros(n_pages, h_kv, T, layout.row_bytes, dtype=torch.uint8)
    new_k, new_v = [], []
    for r, (n, m) in enumerate(zip(kv_lens, q_lens)):
        k = (torch.randn(n, h_kv, d, generator=g) * 2 + torch.randn(1, h_kv, d, generator=g)).to(dtype)
        v = torch.randn(n, h_kv, d, generator=g).to(dtype)
        pos = torch.arange(n - m)
        write(layout, pages, k[: n - m], v[: n - m], table[r, pos // T].long() * T + pos % T)
        new_k.append(k[n - m :])
        new_v.append(v[n - m :])
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), h_q, d, generator=g).to(dtype)
    rows = paged.Rows.of(starts, torch.tensor(kv_lens, dtype=torch.int32), table)
    return layout, pages, query, rows, torch.cat(new_k), torch.cat(new_v)


def _both(layout, pages, query, rows, key, value, window=0, causal=True, staged=None):
    ref = torch.zeros(query.shape)
    out = torch.zeros(query.shape)
    paged.attend_reference(layout, pages, query, ref, rows, 0.125, window, causal, key, value, staged)
    paged.attend(layout, pages, query, out, rows, 0.125, window, causal, key, value, staged)
    return out, ref


FORMATS = [
    ("q4_0", "q4_0"),
    ("q8_0", "q8_0"),
    ("int8", "int8"),
    ("int4", "int4"),
    ("int4", "int2"),
    ("q4_0", "int3"),
    ("none", "none"),
    ("q5_1", "q4_1"),
    ("fp8", "fp8"),
    ("int8", "fp8"),
]


@pytest.mark.parametrize("fmt_k,fmt_v", FORMATS)
@pytest.mark.parametrize("h_q,h_kv", [(9, 3), (2, 2), (8, 2), (14, 2)])
def test_decode_steps_over_many_pages_equal_the_reference(fmt_k, fmt_v, h_q, h_kv, loops):
    """Decode rows (one query each) of 1 to 300 keys: the GQA group (1, 3, 4, 7 query-heads a task) on both sides
    of the in-register bound (6), page-boundary lengths, a one-key row."""
    kv_lens = [300, 1, 32, 33, 64, 257, 95]
    case = _step(fmt_k, fmt_v, kv_lens, [1] * len(kv_lens), h_q, h_kv, seed=h_q)
    out, ref = _both(*case)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fmt_k,fmt_v", FORMATS[:5])
@pytest.mark.parametrize("window", [0, 45])
def test_prefill_chunks_over_a_cached_prefix_equal_the_reference(fmt_k, fmt_v, window, loops):
    """Rows of 37 and 70 new queries continuing 100 and 13 cached keys (chunks of 16 queries, tiles), beside a
    decode row, with and without a window; and the same rows non-causal."""
    case = _step(fmt_k, fmt_v, [137, 83, 200], [37, 70, 1], 9, 3, seed=1)
    out, ref = _both(*case, window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    out, ref = _both(*case, causal=False)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def _staged_last_pages(pages, rows, kv_lens) -> paged.Staged:
    """A staging pool (fp32) holding other values for each decode row's partly filled last page, and its map."""
    stage_layout = PageLayout.of("none", "none", 64, torch.float32)
    pool = torch.zeros(4, 3, T, stage_layout.row_bytes, dtype=torch.uint8)
    smap = torch.full((pages.shape[0],), -1, dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    for r, n in enumerate(kv_lens):
        cached = n - 1
        smap[int(rows.block_table[r, cached // T])] = r + 1
        filled = cached % T  # tokens of the last page before this step
        k = torch.randn(filled, 3, 64, generator=g)
        v = torch.randn(filled, 3, 64, generator=g)
        write(stage_layout, pool, k, v, (r + 1) * T + torch.arange(filled))
    return paged.Staged(pool, stage_layout, smap)


@pytest.mark.parametrize("fmt", ["q4_0", "int8", "int4"])
def test_staged_last_pages_are_read_from_the_pool(fmt, loops):
    """Each decode row's partly filled last page staged (fp32 copies of its tokens): the kernel reads those pages
    from the pool and the rest from their codes, as the reference does; in-register rows and staged tile rows mix
    in one task (affine V sums in plane order on both)."""
    kv_lens = [70, 129, 40]
    layout, pages, query, rows, key, value = _step(fmt, fmt, kv_lens, [1, 1, 1], 9, 3, seed=2)
    staged = _staged_last_pages(pages, rows, kv_lens)
    out, ref = _both(layout, pages, query, rows, key, value, staged=staged)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    plain, _ = _both(layout, pages, query, rows, key, value)
    assert (plain - out).abs().max() > 1e-3  # the pool was read


def test_a_long_decode_batch_equals_the_reference():
    """The benchmark's shape, shortened: 16 rows x 1,000 keys, 9 query heads over 3 KV heads, q4_0."""
    case = _step("q4_0", "q4_0", [1000 - 7 * i for i in range(16)], [1] * 16, 9, 3, seed=3)
    out, ref = _both(*case)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def _awkward(n, h, d, seed):
    """K/V values that exercise the encoders' quirks: ties of +-max in a block, all-zero and signed-zero blocks,
    halves (x * id + 8.5 landing on integers), tiny and large magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g) * torch.logspace(-3, 3, n)[:, None, None]
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = -0.0
    x[1, 0, :32] = torch.tensor([1.0, -1.0] * 16)  # every element ties
    x[1, 1, :32] = torch.arange(32) / 4 - 4  # exact quarters: codes on half-way points
    x[2, 0, 5], x[2, 0, 9] = 3.0, -3.0  # max and -min tie
    x[2, 1] = torch.randint(-127, 128, (d,), generator=g).float() * 0.5  # sym8 halves: round half to even
    x[3, 0, :32] = torch.cat([torch.tensor([127.0]), torch.arange(31) - 15.5])  # q8_0 d = 1: halves away from zero
    # q8_0 d = 1: just under a half either way (floor(a + 0.5) would round 0.49999997 up)
    x[3, 1, :32] = torch.tensor([127.0, 0.49999997, -0.49999997, 1.4999999, -2.4999998] + [0.0] * 27)
    return x


@pytest.mark.parametrize(
    "fmt_k,fmt_v",
    [
        ("q4_0", "q4_0"),
        ("q8_0", "q8_0"),
        ("int8", "int8"),
        ("none", "none"),
        ("q4_0", "int8"),
        ("int4", "int2"),
        ("q8_0", "fp16"),
        ("int4", "int3"),
        ("fp8", "fp8"),
        ("bf16", "fp8"),
        ("q5_0", "int4"),
        ("q4_1", "q5_1"),
        ("q5_1", "q5_0"),
        ("q5_0", "q4_1"),
    ],
)
def test_c_writes_are_the_torch_encoders_bytes(fmt_k, fmt_v, monkeypatch):
    """kvp_write (paged.store) against pages.write: the same bytes in the same slots, padding (-1) skipped, the
    other rows untouched; every format is C's (a fallback to torch would fail)."""
    h, d, n = 3, 64, 40
    layout = PageLayout.of(fmt_k, fmt_v, d, torch.float32)
    monkeypatch.setattr(paged, "write", None)  # C must write these: a fallback would fail
    key, value = _awkward(n, h, d, 1), _awkward(n, h, d, 2).flip(0)
    slots = torch.randperm(8 * T, generator=torch.Generator().manual_seed(3))[:n]
    slots[[4, 17]] = -1
    want = torch.randint(0, 256, (8, h, T, layout.row_bytes), dtype=torch.uint8)
    got = want.clone()
    write(layout, want, key, value, slots)
    paged.store(layout, got, key, value, slots)
    assert torch.equal(got, want)
    # a strided view of the step's K/V (vLLM hands slices of its qkv tensor)
    qkv = torch.cat([torch.zeros(n, 2, d), key, value], 1)
    got2 = torch.zeros_like(want)
    want2 = torch.zeros_like(want)
    write(layout, want2, key, value, slots)
    paged.store(layout, got2, qkv[:, 2 : 2 + h], qkv[:, 2 + h :], slots)
    assert torch.equal(got2, want2)


def test_c_writes_leave_non_finite_values_to_the_torch_encoders():
    """A NaN: nothing is written by C, the torch encoder raises its own error (q4_0), as before."""
    layout = PageLayout.of("q4_0", "q4_0", 64, torch.float32)
    key, value = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    key[1, 0, 3] = float("nan")
    pages = torch.zeros(1, 1, T, layout.row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError):
        paged.store(layout, pages, key, value, torch.tensor([0, 1]))
    assert (pages == 0).all()


def test_queries_and_raw_kv_read_in_place_from_a_wider_tensor():
    """vLLM hands the layer views of its qkv projection (a token stride wider than the heads): the kernel reads them
    where they are, with the same result as contiguous copies."""
    layout, pages, query, rows, key, value = _step("q4_0", "q4_0", [70, 40], [1, 40], 9, 3, seed=4)
    n, d = query.shape[0], 64
    qkv = torch.cat(
        [query.reshape(n, -1), key.reshape(n, -1), value.reshape(n, -1)], 1
    )  # (n, (9 + 3 + 3) * D)
    q, k, v = (
        qkv[:, : 9 * d].view(n, 9, d),
        qkv[:, 9 * d : 12 * d].view(n, 3, d),
        qkv[:, 12 * d :].view(n, 3, d),
    )
    assert not q.is_contiguous()
    want, got = torch.zeros(query.shape), torch.zeros(query.shape)
    paged.attend(layout, pages, query, want, rows, 0.125, 0, True, key, value)
    paged.attend(layout, pages, q, got, rows, 0.125, 0, True, k, v)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt_k,fmt_v", [("q4_0", "q4_0"), ("int4", "int2"), ("none", "none")])
@pytest.mark.parametrize("window", [0, 300])
def test_few_long_rows_split_over_threads_equal_the_reference(fmt_k, fmt_v, window, loops):
    """A decode row of 4,500 tokens (141 pages, two parts of 64 or more) and a prompt chunk: the decode row's pages
    are split into parts and merged (split-K); the same results as the reference, and the same bits on every call."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        case = _step(fmt_k, fmt_v, [4500, 700], [1, 3], 9, 3, seed=5)
        out, ref = _both(*case, window=window)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        again, _ = _both(*case, window=window)
        assert torch.equal(again, out)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt_k,fmt_v", [("int4", "int4"), ("q4_0", "q4_0"), ("none", "none"), ("q8_0", "int2")])
@pytest.mark.parametrize(("window", "sink"), [(45, 4), (100, 40), (64, 32), (300, 1), (45, 0), (4200, 4)])
def test_sinks_beside_a_window_equal_the_reference(fmt_k, fmt_v, window, sink, loops):
    """StreamingLLM in the kernel: with a window, keys ``0 .. sink - 1`` stay visible to every query (a sink inside
    the first page, across two, a whole page; rows shorter than sink + window, where the two meet, and longer ones);
    decode rows and prompt chunks (several queries: each its own window); split over threads too. The pages between
    the sink pages and the window are never read: the C kernel gets them as -1 in the block table (a pool gave them
    back), and the results equal the reference's on the whole table."""
    # many short rows; and a long one, whose pages are split in parts (split-K) where its window spans 128 pages or
    # more (4,200: the first part reads the sinks)
    for kv_lens, q_lens in (([300, 137, 50, 1000, 20], [1, 37, 1, 3, 20]), ([4500, 700], [1, 3])):
        case = _step(fmt_k, fmt_v, kv_lens, q_lens, 9, 3, seed=window + sink)
        layout, pages, query, rows, key, value = case
        ref = torch.zeros(query.shape)
        paged.attend_reference(layout, pages, query, ref, rows, 0.125, window, True, key, value, None, sink)
        holed = rows.block_table.clone()
        for r, (n, m) in enumerate(zip(rows.kv_lens, q_lens, strict=True)):
            first = n - m - window + 1  # the row's first query's window
            for p in range(-(-sink // T), max(0, first) // T):
                holed[r, p] = -1
        holey = paged.Rows.of(torch.tensor(rows.starts, dtype=torch.int32), torch.tensor(rows.kv_lens), holed)
        before = torch.get_num_threads()
        for threads in (before, 4):
            torch.set_num_threads(threads)
            try:
                out = torch.zeros(query.shape)
                paged.attend(layout, pages, query, out, holey, 0.125, window, True, key, value, None, sink)
            finally:
                torch.set_num_threads(before)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        plain = torch.zeros(query.shape)
        paged.attend_reference(layout, pages, query, plain, rows, 0.125, window, True, key, value, None, 0)
        if sink and max(kv_lens) > window + sink:  # some query's window leaves the sinks: they were read
            assert (plain - ref).abs().max() > 1e-3


def test_c_writes_refuse_shapes_they_cannot_trust():
    """K/V whose heads or head size do not match the pages never reach C (it cannot check a pointer's extent):
    the torch path raises, nothing is written."""
    layout = PageLayout.of("q4_0", "q4_0", 64, torch.float32)
    pages = torch.zeros(2, 3, T, layout.row_bytes, dtype=torch.uint8)
    for key in (torch.randn(2, 4, 64), torch.randn(2, 3, 32)):
        with pytest.raises((RuntimeError, ValueError)):
            paged.store(layout, pages, key, key, torch.tensor([0, 1]))
    assert (pages == 0).all()


def _c_only(monkeypatch, layout, key, value):
    """``key``/``value`` (N, H, D) written by C alone (a fallback to torch fails) and by torch: both pages."""
    n = key.shape[0]
    slots = torch.arange(n)
    want = torch.zeros(-(-n // T), key.shape[1], T, layout.row_bytes, dtype=torch.uint8)
    got = want.clone()
    write(layout, want, key, value, slots)
    monkeypatch.setattr(paged, "write", None)
    paged.store(layout, got, key, value, slots)
    return got, want


def _e4m3_edges() -> torch.Tensor:
    """Every finite e4m3 magnitude, the midpoints between neighbours (ties: round to even), one fp32 step either
    side of each midpoint, and values below the smallest subnormal, both signs."""
    mags = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
    mid = (mags[1:] + mags[:-1]) / 2
    up, down = torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9))
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30, 0.0])
    x = torch.cat([mags, mid, up, down, tiny])
    return torch.cat([x, -x])


def test_c_fp8_writes_round_as_torch_on_every_edge(monkeypatch):
    """kvp_write's float8 e4m3fn rounding against torch's cast at every tie, its neighbours and the subnormals: each
    token starts with 448, so its scale is exactly 1 and the codes are the values' own e4m3 roundings."""
    x = _e4m3_edges()
    per = 63
    x = torch.cat([x, torch.zeros(-len(x) % per)]).view(-1, per)
    tokens = torch.cat([torch.full((x.shape[0], 1), 448.0), x], 1)[:, None, :]  # (N, 1, 64)
    layout = PageLayout.of("fp8", "fp8", 64, torch.float32)
    k, _ = layout.decode(_c_only(monkeypatch, layout, tokens, -tokens)[0].transpose(0, 1).reshape(1, -1, 136))
    assert torch.equal(k[0, : len(tokens)], tokens[:, 0].to(torch.float8_e4m3fn).float())  # the scale really was 1
    # and tokens whose scale is floored (all zeros; max |x| / 448 below 1e-12), beside ordinary ones
    floored = torch.cat([torch.zeros(1, 1, 64), torch.full((1, 1, 64), 1e-13), tokens[:2] * 1e-3])
    for key in (tokens, floored):
        got, want = _c_only(monkeypatch, layout, key, -key.flip(0))
        assert torch.equal(got, want)


def test_c_half_and_bfloat16_writes_round_as_torch_on_every_edge(monkeypatch):
    """fp16 and bf16 value pages written by C against torch's casts: ties either way (the low bits exactly half an
    ulp of the target), one fp32 step off them, fp32 subnormals, fp16 subnormals and overflow to inf."""
    g = torch.Generator().manual_seed(7)
    hi = torch.randint(0, 1 << 15, (512,), generator=g, dtype=torch.int32) << 16
    bf16_ties = (hi | 0x8000).view(torch.float32)  # exactly half a bf16 ulp: even or odd mantissa
    half_ties = (torch.randn(256, generator=g).to(torch.float16).float() * (1 + 2.0**-11)).float()
    x = torch.cat(
        [
            bf16_ties, torch.nextafter(bf16_ties, torch.tensor(1e30)), torch.nextafter(bf16_ties, torch.tensor(-1e30)),
            half_ties, torch.tensor([1e-40, -1e-40, 2.0**-149, 3e-6, 6e-8, 2.0**-25, 65504.0, 65519.0, 65520.0, 70000.0]),
        ]
    )  # fmt: skip
    x = x[torch.isfinite(x) & (x.abs() <= 65504.0 * 8)]
    x = torch.cat([x, torch.zeros(-len(x) % 64)]).view(-1, 1, 64)
    for fmt_k, fmt_v in (("fp16", "bf16"), ("bf16", "fp16")):
        got, want = _c_only(monkeypatch, PageLayout.of(fmt_k, fmt_v, 64, torch.float32), x, x.flip(0))
        assert torch.equal(got, want), (fmt_k, fmt_v)


def _ggml_min_edges() -> torch.Tensor:
    """Blocks of 32 for q4_1 / q5_1 / q5_0's quirks: zero minima whose last zero is -0 or +0 (the stored min's sign),
    blocks of zeros of mixed signs, codes on half-way points ((x - min) / d + 0.5 an integer, d = 1 for both tops),
    ties of +-max, a constant block, tiny and large magnitudes, random blocks."""
    g = torch.Generator().manual_seed(11)
    blocks = [
        torch.tensor([0.0, -0.0] * 16),
        torch.tensor([-0.0, 0.0] * 16),
        torch.cat([torch.tensor([0.0, -0.0, 0.0]), torch.rand(29, generator=g) + 0.1]),
        torch.cat([torch.tensor([-0.0, 0.0, -0.0]), torch.rand(29, generator=g) + 0.1]),
        torch.cat([torch.tensor([0.0, 15.0]), torch.arange(30) % 15 + 0.5]),  # q4_1 d = 1: every code a tie
        torch.cat([torch.tensor([0.0, 31.0]), torch.arange(30) + 0.5]),  # q5_1 d = 1
        torch.cat([torch.tensor([-16.0, 15.0]), torch.arange(30) - 14.5]),  # q5_0 d = 1: x + 16.5 on integers
        torch.tensor([3.0, -3.0] * 16),
        torch.full((32,), 2.5),
        torch.full((32,), -1e-30),
        torch.randn(32, generator=g) * 1e4,
    ]
    rand = torch.randn(22, 32, generator=g) * torch.logspace(-4, 4, 22)[:, None]
    x = torch.cat([torch.stack(blocks), rand, -torch.stack(blocks)])  # (44, 32): 22 tokens of 64
    return x.reshape(-1, 1, 64)


@pytest.mark.parametrize("fmt", ["q4_1", "q5_1", "q5_0"])
def test_c_ggml_writes_are_gguf_bytes_on_every_edge(fmt, monkeypatch):
    """kvp_write's q4_1 / q5_1 / q5_0 blocks against quantize_ggml's (gguf-py's bytes) on the quirks' edges: the
    stored min's sign, d's zero, half-way codes, the fifth bits' order."""
    x = _ggml_min_edges()
    got, want = _c_only(monkeypatch, PageLayout.of(fmt, fmt, 64, torch.float32), x, x.flip(0))
    assert torch.equal(got, want)


def _spy_writes(monkeypatch) -> list:
    """The library behind paged.store, with kvp_write's return codes recorded in the list returned."""
    lib, codes = paged.library(), []

    class Spy:
        def __getattr__(self, name):
            return getattr(lib, name)

        def kvp_write(self, args):
            codes.append(lib.kvp_write(args))
            return codes[-1]

    monkeypatch.setattr(paged, "library", Spy)
    return codes


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_c_ggml_writes_leave_tiny_values_to_the_torch_encoders(fmt, monkeypatch):
    """A GGML block of values so small that 1 / d overflows (a zero's code is then NaN, which torch packs its own
    way): kvp_write returns 4 for any non-zero value below 1e-30 in a GGML part, before writing, and the torch encoder
    writes the row; a value at 1e-30 stays C's."""
    codes = _spy_writes(monkeypatch)
    layout = PageLayout.of(fmt, fmt, 64, torch.float32)
    key = torch.zeros(2, 1, 64)
    key[0, 0, 16], key[1, 0, 16] = 3e-38, 1e-30
    for rows, want_code in ((slice(0, 1), 4), (slice(1, 2), 0)):
        want = torch.zeros(1, 1, T, layout.row_bytes, dtype=torch.uint8)
        got = want.clone()
        write(layout, want, key[rows], key[rows], torch.tensor([0]))
        paged.store(layout, got, key[rows], key[rows], torch.tensor([0]))
        assert codes[-1] == want_code and torch.equal(got, want), (fmt, rows)


@pytest.mark.parametrize("fmt_v", ["int4", "q4_1", "q5_1"])
def test_c_writes_leave_a_value_beyond_fp16_to_the_torch_encoder(fmt_v, monkeypatch):
    """A row whose min is below fp16's range (finite, within kvp_write's first check: an affine zero, a q4_1 / q5_1
    block's stored min): C refuses it (code 4) after encoding the row before it, writes nothing, and the torch
    encoder raises its own error, the pages untouched."""
    codes = _spy_writes(monkeypatch)
    layout = PageLayout.of("q8_0", fmt_v, 64, torch.float32)
    key, value = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    value[1, 0, 3] = -70000.0
    pages = torch.zeros(1, 1, T, layout.row_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError):
        paged.store(layout, pages, key, value, torch.tensor([0, 1]))
    assert codes == [4] and (pages == 0).all()
    paged.store(layout, pages, key[:1], value[:1], torch.tensor([0]))  # the good row alone: C writes it
    assert codes == [4, 0] and pages[0, 0, 0].any()


@pytest.mark.parametrize("fmt_k,fmt_v", [("int4", "int4"), ("q4_0", "int2"), ("none", "none")])
@pytest.mark.parametrize("rotate", [(64, 64), (64, 0), (0, 32), (16, 8)])
def test_rotation_inside_the_call_equals_the_reference(fmt_k, fmt_v, rotate, loops):
    """``rotate``: each query head rotated into K's Hadamard basis first and each output head back from V's last, in
    the kernel (a transform of the head's row) and in the reference (torch's matmul), decode rows and a prompt
    chunk; the rotation really moves the answer; a block that is not a power of two dividing the head size is
    refused in one line."""
    case = _step(fmt_k, fmt_v, [300, 1, 95, 120], [1, 1, 1, 37], 9, 3, seed=7)
    layout, pages, query, rows, key, value = case
    ref, out, plain = (torch.zeros(query.shape) for _ in range(3))
    paged.attend_reference(layout, pages, query, ref, rows, 0.125, 0, True, key, value, None, 0, rotate)
    paged.attend(layout, pages, query, out, rows, 0.125, 0, True, key, value, None, 0, rotate)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    paged.attend(layout, pages, query, plain, rows, 0.125, 0, True, key, value)
    assert (plain - out).abs().max() > 1e-2
    for bad in ((48, 0), (0, 128), (-2, 0)):
        with pytest.raises(ValueError, match="power of two dividing the head size 64"):
            paged.attend(layout, pages, query, out, rows, 0.125, 0, True, key, value, None, 0, bad)
