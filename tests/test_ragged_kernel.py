"""One attention call per layer for every row of a ragged step (kernels.cpu.attend_rows, C's kv_attend_rows,
attention._ragged_fused): each row's output is bit for bit what the row alone gets (kernels.cpu.attend, one C
kv_attend call, or the row's whole per-row path), whatever the other rows are, their order, the thread count
or how a body is cut into pieces; rows the call cannot read take the per-row path; a failing row stays alone;
greedy continuations through the engine equal each request run alone."""

from __future__ import annotations

import dataclasses
import random
import types

import pytest
import torch

import kvslim
from conftest import tiny_config, tiny_model
from kvslim import SlimCache, attention
from kvslim import generate as gen
from kvslim.cache.ragged import RaggedSegments
from kvslim.formats import Encoded
from kvslim.kernels import clib, cpu

H, M, D = 2, 2, 32  # the tiny llama's KV heads, GQA group (4 query heads / 2) and head dim
#: what the attention functions read off the model's attention module (sdpa repeats the KV heads M times)
_MODULE = types.SimpleNamespace(training=False, num_key_value_groups=M, is_causal=True)

#: (cache spec, tokens fed before the decode token): the formats the C kernels read (KIVI int8/int4/int2,
#: GGML q8_0/q4_0/q4_1/q5_0, fp8), mixed K/V formats, rotated and unrotated bases, sinks, windows, residual 0,
#: bfloat16 residuals, bodies of 1 token and of several chunks. Comments: body tokens, what the row tests.
FUSED = [
    ("int4", 700),  # 16 sinks (sink=auto), 544: 2 chunks a head alone at 2 threads, where longer rows split in 4
    ("q4_0,residual=0,group=1,sink=0", 0),  # 1: a 1-token body, no residual
    ("int8,residual=0,group=8,sink=0", 9),  # 8: one per-channel group, a 2-token residual
    ("int4,sink=4,window=60,group=8,residual=8", 300),  # 52: sinks, a window, the first group partly evicted
    ("q8_0,sink=4,window=60,residual=0,group=1", 300),  # 61: sinks, a window, residual 0
    ("int4,k=q8_0,sink=2,window=200,residual=32", 900),  # 166: K and V in different formats
    ("int4,sink=2,window=200,group=16,residual=16", 903),  # 179: first group 13 tokens into a group
    ("q5_0,rotate=none", 400),  # 256: no Hadamard basis
    ("int2,pre_rope=false,group=16,residual=16", 257),  # 240: int2
    ("q4_1,residual_dtype=bfloat16", 1500),  # 1344: 4 chunks a head, bfloat16 residual
    ("fp8,residual=32,sink=0", 64),  # 32: fp8
    ("int8,v=q4_0,rotate=k", 2000),  # 1856: K rotated, V not
    ("int4,varnorm=on,sink=4,window=60,group=8,residual=8", 300),  # variance-normalized, V factors entered mid-group
    ("int2,varnorm=on,pre_rope=false,group=16,residual=16", 257),  # normalized int2
]
#: rows the fused call does not read: they keep the per-row path (nothing encoded yet, lossless)
PER_ROW = [("int4", 5), ("none", 50)]
#: rows only the rows call reads (kv_attend does not): pre-RoPE keys, each K piece with its key transform
ROWS_ONLY = [("int2", 300)]


def _segments(spec: str, n: int, seed: int):
    """Layer 0 of a SlimCache with ``spec`` fed ``n`` random tokens, then one decode token: its Segments view."""
    cache = SlimCache.from_config(kvslim.parse_spec(spec), config=tiny_config())
    store = cache.layers[0].store
    g = torch.Generator().manual_seed(seed)
    kv = lambda t: torch.randn(1, H, t, D, generator=g) * 2 + torch.linspace(-3, 3, D)  # noqa: E731 - channel means
    if n:
        store.append(kv(n), kv(n))
    return store.append(kv(1), kv(1), segments=True)


def _alone(query_row: torch.Tensor, seg) -> torch.Tensor:
    """A row's attention alone: what _segments_attention computes for a batch of one (B=1, 1, Hq, D)."""
    return attention._segments_attention(_MODULE, query_row.clone(), seg, None, 0.0, None, {})[0]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    if not cpu.status()[0]:
        pytest.skip("no C compiler: the fused call needs the C kernels")
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _queries(b: int, seed: int) -> torch.Tensor:
    return torch.randn(b, H * M, 1, D, generator=torch.Generator().manual_seed(seed))


def _rows(specs, seed=0):
    return [_segments(spec, n, seed + i) for i, (spec, n) in enumerate(specs)]


def test_the_row_table_layout_matches_the_library():
    if not cpu.status()[0]:
        pytest.skip("no C compiler")
    assert clib.rows_layout(clib.library()) == clib.ROWS_LAYOUT


def test_attend_rows_equals_attend_per_row_bit_for_bit(threads):
    """Every FUSED row in one call, in a shuffled order, equals kernels.cpu.attend for that row alone (a fresh
    query tensor, as the per-row path has), at 1 and 2 threads."""
    segs = _rows(FUSED)
    qf = torch.randn(len(segs) + 3, H, M, D, generator=torch.Generator().manual_seed(1)) * D**-0.5
    order = list(range(len(segs)))
    random.Random(threads).shuffle(order)
    rows = [attention._fused_row(segs[i], qrow=i + 3) for i in order]  # query rows 0..2 are no row's
    out = torch.full_like(qf, 7.0)
    assert cpu.attend_rows(qf, rows, out) == []
    assert torch.equal(out[:3], torch.full_like(out[:3], 7.0))  # rows no row names are left as they were
    for i, seg in enumerate(segs):
        assert attention._fusable(qf, seg), FUSED[i]
        hk, hv = attention._hblocks(seg)
        alone = cpu.attend(
            qf[i + 3 : i + 4].clone(), seg.k_sink, seg.v_sink, seg.k_res, seg.v_res, seg.k_codec, seg.k_body,
            seg.k_offset, seg.v_codec, seg.v_body, k_hblock=hk, v_hblock=hv, v_offset=seg.v_offset,
        )  # fmt: skip
        assert torch.equal(out[i + 3 : i + 4], alone), FUSED[i]


def _cut(seg, cuts):
    """The K and V bodies of ``seg`` as pieces ``(codec, Encoded, offset)`` cut before each token index in
    ``cuts``: views, as a paged pool's blocks are (a per-channel K piece keeps the groups it touches)."""
    pieces = []
    for codec, body, offset in ((seg.k_codec, seg.k_body, seg.k_offset), (seg.v_codec, seg.v_body, seg.v_offset)):
        n = next(iter(body.token.values())).shape[2]
        bounds = [0, *sorted({c for c in cuts if 0 < c < n}), n]
        pieces.append(
            tuple(
                (codec, *body.narrow(lo, hi, offset, codec.token_group)) for lo, hi in zip(bounds, bounds[1:])
            )
        )
    return pieces[0], pieces[1]


def test_a_body_cut_into_pieces_gives_the_same_bits(threads):
    """A body as a list of blocks (what a paged pool hands the kernel): cut anywhere (1-token pieces, cuts inside
    a per-channel group, at chunk boundaries and off them), the output is the one-piece output, bit for bit."""
    segs = _rows([FUSED[0], FUSED[3], FUSED[6], FUSED[9], FUSED[11], FUSED[12]], seed=5)
    qf = torch.randn(len(segs), H, M, D, generator=torch.Generator().manual_seed(2)) * D**-0.5
    whole = torch.zeros_like(qf)
    assert cpu.attend_rows(qf, [attention._fused_row(s, i) for i, s in enumerate(segs)], whole) == []
    rng = random.Random(3)
    cut_rows = []
    for i, seg in enumerate(segs):
        n = seg.n_body("k")
        cuts = {1, 2, 3, n // 4, n // 2, n // 2 + 1, n - 1} | {
            rng.randrange(1, n) for _ in range(5)
        }  # n // 2, n // 4: chunk ends
        kp, vp = _cut(seg, cuts)
        assert len(kp) > 5 and len(vp) == len(kp)
        cut_rows.append(attention._fused_row(seg, i)._replace(k_body=kp, v_body=vp))
    pieces = torch.zeros_like(qf)
    assert cpu.attend_rows(qf, cut_rows, pieces) == []
    assert torch.equal(pieces, whole)


def test_ragged_attention_equals_each_row_alone_with_per_row_rows_and_fillers(threads, monkeypatch):
    """_ragged_attention on a step of FUSED rows, a pre-RoPE row (ROWS_ONLY), rows the fused call cannot read (a
    cache with nothing encoded, a lossless one) and filler rows: every row's output equals the row alone through
    its whole path (_segments_attention), fillers are 0; the fused rows went in one call, the others did not."""
    specs = FUSED[:6] + ROWS_ONLY + PER_ROW + FUSED[6:]
    segs = _rows(specs, seed=11)
    rows = segs[:4] + [None] + segs[4:9] + [None] + segs[9:]
    names = specs[:4] + [None] + specs[4:9] + [None] + specs[9:]
    query = _queries(len(rows), 4)
    calls = []
    real = cpu.attend_rows
    monkeypatch.setattr(
        cpu, "attend_rows", lambda q, rs, out: calls.append(sorted(r.qrow for r in rs)) or real(q, rs, out)
    )
    out, _ = attention.kvslim_attention(_MODULE, query, RaggedSegments(tuple(rows)), None, None, scaling=None)
    assert out.shape == (len(rows), 1, H * M, D)
    fused = [b for b, name in enumerate(names) if name in FUSED or name in ROWS_ONLY]
    assert calls == [fused]
    for b, seg in enumerate(rows):
        if seg is None:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
        else:
            assert torch.equal(out[b : b + 1], _alone(query[b : b + 1], seg)), names[b]


def test_a_step_without_fused_rows_runs_row_by_row(threads):
    """Only rows the fused call cannot read, and fillers: each row alone, fillers 0."""
    segs = _rows(PER_ROW, seed=13)
    rows = (None, *segs, None)
    query = _queries(len(rows), 8)
    out, _ = attention._ragged_attention(_MODULE, query, RaggedSegments(rows), 0.0, None, {})
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[-1], torch.zeros_like(out[-1]))
    for b in range(1, len(rows) - 1):
        assert torch.equal(out[b : b + 1], _alone(query[b : b + 1], rows[b]))


def _broken(seg):
    """seg with a K body one token short of its V body: arguments that do not fit (the per-row path raises)."""
    body = Encoded(token={k: v[:, :, :-1] for k, v in seg.k_body.token.items()}, group=dict(seg.k_body.group))
    return dataclasses.replace(seg, k_body=body)


def test_a_row_that_cannot_be_marshalled_fails_alone(threads):
    """A row whose body does not fit its residual is left by the fused call, fails on the per-row path and is
    dropped (key.drop); the other rows are exactly the rows alone. Without a drop hook it raises."""
    segs = _rows(FUSED[:4], seed=21)
    bad = _broken(segs[1])
    rows = (segs[0], bad, segs[2], segs[3])
    query = _queries(4, 5)
    dropped = {}
    out, _ = attention._ragged_attention(
        _MODULE, query, RaggedSegments(rows, lambda b, e: dropped.setdefault(b, e)), 0.0, None, {}
    )
    assert set(dropped) == {1} and isinstance(dropped[1], ValueError)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for b in (0, 2, 3):
        assert torch.equal(out[b : b + 1], _alone(query[b : b + 1], rows[b]))
    with pytest.raises(ValueError):
        attention._ragged_attention(_MODULE, query, RaggedSegments(rows), 0.0, None, {})


def _garbage(args):
    raise MemoryError("a failure inside the batched call")


@pytest.mark.parametrize(
    "entry", [lambda args: 1, lambda args: 2, _garbage], ids=["out-of-memory", "refused", "raises"]
)
def test_a_failed_call_falls_back_to_the_per_row_path(threads, monkeypatch, entry):
    """The C call out of memory (code 1), refusing without a word (code 2, no row's status set: every row stays
    refused) or raising: every row runs alone instead, with the same bits."""
    segs = _rows(FUSED[:5], seed=31)
    query = _queries(5, 6)
    real = cpu.library()
    fake = types.SimpleNamespace(kv_attend=real.kv_attend, kv_attend_rows=entry)
    monkeypatch.setattr(cpu, "library", lambda: fake)
    out, _ = attention._ragged_attention(_MODULE, query, RaggedSegments(tuple(segs)), 0.0, None, {})
    monkeypatch.undo()
    for b, seg in enumerate(segs):
        assert torch.equal(out[b : b + 1], _alone(query[b : b + 1], seg))


def test_rows_the_c_side_refuses_are_handed_back(threads):
    """What Python does not check, C does, row by row: a Hadamard block that does not tile the head; a duplicate
    or out-of-range query row and V pieces of two formats are caught before. The others are computed."""
    segs = _rows(FUSED[:3], seed=41)
    qf = torch.randn(3, H, M, D, generator=torch.Generator().manual_seed(7)) * D**-0.5
    good = [attention._fused_row(s, i) for i, s in enumerate(segs)]
    ref = torch.zeros_like(qf)
    assert cpu.attend_rows(qf, good, ref) == []
    out = torch.zeros_like(qf)
    rows = [good[0], good[1]._replace(k_hblock=3), good[2]]
    assert cpu.attend_rows(qf, rows, out) == [1]
    assert (
        torch.equal(out[0], ref[0])
        and torch.equal(out[2], ref[2])
        and torch.equal(out[1], torch.zeros_like(out[1]))
    )
    mixed_v = good[2]._replace(v_body=good[2].v_body + good[0].v_body[:1])  # another format after the first
    assert cpu.attend_rows(
        qf, [good[0], good[0], good[1]._replace(qrow=9), mixed_v], torch.zeros_like(qf)
    ) == [1, 2, 3]
    with pytest.raises(ValueError, match="out must be"):
        cpu.attend_rows(qf, good, torch.zeros(3, H, M, D + 1))


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


#: (prompt length, cache spec) of the engine test: fused rows of several formats and lengths, a window, a
#: pre-RoPE row (fused through a key transform) and a lossless one (per-row path), different lengths so rows join
#: and leave at different steps
MIX = [
    (300, "int4"),
    (37, "int4,sink=4,window=60,group=8,residual=8"),
    (200, "int8,residual=32"),
    (150, "int2,group=16,residual=16"),
    (90, "q8_0,sink=4,window=50,residual=0"),
    (9, "none"),
    (260, "q4_0,k=int8,group=16,residual=16"),
    (120, "int4,varnorm=on,group=16,residual=16"),  # variance-normalized rows in the one call too
]


def test_engine_greedy_equals_each_request_alone(model, monkeypatch):
    """Continuous batching with the fused call: each request's greedy tokens equal the request run alone through
    the engine and through kvslim's single-stream loop (kv_attend per layer), token for token; steps with
    several fused rows really happened."""
    from kvslim.engine import Engine, Request

    if not cpu.status()[0]:
        pytest.skip("no C compiler")
    sizes = []
    real = cpu.attend_rows
    monkeypatch.setattr(cpu, "attend_rows", lambda q, rs, out: sizes.append(len(rs)) or real(q, rs, out))
    g = torch.Generator().manual_seed(0)
    reqs = [
        Request(torch.randint(3, 128, (n,), generator=g).tolist(), max_new_tokens=12 + 2 * i, cache=spec)
        for i, (n, spec) in enumerate(MIX)
    ]
    together = Engine(model, max_batch=4, prefill_chunk=64).run(reqs)
    assert max(sizes) >= 3
    for req, got in zip(reqs, together, strict=True):
        alone = Engine(model, prefill_chunk=64).run([req])[0]
        assert got.tokens == alone.tokens, req.cache.to_spec()
        cache = SlimCache.from_config(req.cache, config=model.config)
        single = gen.greedy(model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=64)
        assert got.tokens == single, req.cache.to_spec()


def test_rows_bench_runs_and_checks_identity(capsys):
    """python -m kvslim.kernels.bench --rows: both modes per (format, rows, tokens), a table and JSON."""
    from kvslim.kernels import bench

    if not cpu.status()[0]:
        pytest.skip("no C compiler")
    rows = bench.bench_rows(
        formats=("int4",), rows=(2,), lengths=(40,), ragged=True, residual=8, layers=1, repeats=1
    )
    assert {(r["mode"], r["rows"], r["total_tokens"]) for r in rows} == {
        ("per-row", 2, 60),
        ("one-call", 2, 60),
    }
    assert (
        bench.main(["--rows", "1", "--lengths", "33", "--formats", "q4_0", "--layers", "1", "--repeats", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "one-call us" in out and '"mode": "one-call"' in out


#: (spec, tokens before the re-base, tokens after it): rows whose keys sit in two RoPE frames (a re-base of the
#: position ids by RUN_BASE between them; the residual already all in the new frame): per-channel K with a group
#: split by the run boundary, GGML rows, a Hadamard basis and none, sinks, a window
RUNS = [
    ("int4,sink=4,window=200,group=16,residual=16", 150, 40),
    ("q4_0,sink=2,window=100,residual=0,group=1", 300, 30),
    ("int8,rotate=none,group=8,residual=8", 77, 21),
    ("q8_0,k=int4,group=16,residual=16", 500, 60),
]
RUN_BASE = 37


def _segments_with_runs(spec: str, before: int, after: int, seed: int):
    """Layer 0 of a SlimCache with ``spec``: ``before`` tokens fed at base 0, ``after`` and a decode token at base
    RUN_BASE (what kvslim's loop does when it re-bases the position ids): its Segments view, with key runs."""
    cache = SlimCache.from_config(kvslim.parse_spec(spec), config=tiny_config())
    store = cache.layers[0].store
    g = torch.Generator().manual_seed(seed)
    kv = lambda t: torch.randn(1, H, t, D, generator=g) * 2 + torch.linspace(-3, 3, D)  # noqa: E731 - channel means
    store.append(kv(before), kv(before))
    store.append(kv(after), kv(after), base=RUN_BASE)
    return store.append(kv(1), kv(1), segments=True, base=RUN_BASE)


def test_rows_with_key_runs_are_fused_and_read_each_run_in_its_frame(threads, monkeypatch):
    """A row whose keys sit in two RoPE frames goes through the fused call (each run a K piece scored with the
    query moved into its frame) and gives the op-by-op path's output (which moves the query per run too) up to
    the order of fp32 sums; alone and in a ragged step beside rows without runs, bit for bit the same."""
    segs = [_segments_with_runs(spec, b, a, 21 + i) for i, (spec, b, a) in enumerate(RUNS)]
    query = _queries(len(segs) + 2, 9)
    qf = (query.float() * D**-0.5).reshape(len(segs) + 2, H, M, D)
    for spec_runs, seg in zip(RUNS, segs, strict=True):
        assert len(seg.k_runs) == 2 and seg.k_runs[0][1] != 0 and seg.k_runs[1][1] == 0, (spec_runs, seg.k_runs)
        assert attention._fusable(qf[:1], seg), spec_runs
    alone = [_alone(query[i : i + 1], seg) for i, seg in enumerate(segs)]
    monkeypatch.setattr(attention, "FUSED_DECODE", False)
    op_by_op = [_alone(query[i : i + 1], seg) for i, seg in enumerate(segs)]
    monkeypatch.setattr(attention, "FUSED_DECODE", True)
    for spec_runs, a, o in zip(RUNS, alone, op_by_op, strict=True):
        torch.testing.assert_close(a, o, atol=2e-5, rtol=1e-5, msg=str(spec_runs))
    # a ragged step: the rows with runs beside rows without, one fused call, each row = alone
    plain = _rows([FUSED[0], FUSED[4]], seed=31)
    rows = (segs[0], plain[0], segs[1], segs[2], plain[1], segs[3])
    calls = []
    real = cpu.attend_rows
    monkeypatch.setattr(
        cpu, "attend_rows", lambda q, rs, out: calls.append(sorted(r.qrow for r in rs)) or real(q, rs, out)
    )
    q6 = _queries(len(rows), 10)
    out, _ = attention.kvslim_attention(_MODULE, q6, RaggedSegments(rows), None, None, scaling=None)
    assert calls[0] == list(range(len(rows)))  # every row in the one call
    calls.clear()
    for b, seg in enumerate(rows):
        assert torch.equal(out[b : b + 1], _alone(q6[b : b + 1], seg)), b


@pytest.mark.parametrize("residual_dtype", ["float16", "bfloat16", "model"])
def test_a_run_that_reaches_into_the_residual_is_fused(residual_dtype, monkeypatch):
    """Right after a re-base the old frame's keys are still in the full-precision residual too: they become a
    piece of their own (the residual's dtype, read by the C row decoders) scored with the moved query, the
    residual's tail in the frame with the row's; the output is the op-by-op path's."""
    if not cpu.status()[0]:
        pytest.skip("no C compiler")
    seg = _segments_with_runs(f"int4,group=16,residual=64,residual_dtype={residual_dtype}", 100, 2, 41)
    n_body = seg.n_body("k")
    assert seg.k_runs[0][1] != 0 and seg.k_runs[0][0] > n_body  # the old frame's keys reach into the residual
    query = _queries(1, 12)
    qf = (query.float() * D**-0.5).reshape(1, H, M, D)
    assert attention._fusable(qf, seg)
    row = attention._fused_row(seg, 0, qf=qf)
    assert len(row.k_body) == 2 and row.k_res.shape[2] == seg.k_res.shape[2] - (seg.k_runs[0][0] - n_body)
    fused = _alone(query, seg)
    monkeypatch.setattr(attention, "FUSED_DECODE", False)
    torch.testing.assert_close(fused, _alone(query, seg), atol=2e-5, rtol=1e-5)


def test_a_piece_with_its_own_queries_is_scored_with_them(threads):
    """kv_attend_rows reads a K piece's own queries where it has them: a row cut into two pieces, the second
    given the row's query moved, equals the op-by-op scores of that split (checked against torch)."""
    seg = _segments(FUSED[7][0], FUSED[7][1], 51)  # q5_0, no Hadamard basis: the pieces' queries as given
    qf = torch.randn(1, H, M, D, generator=torch.Generator().manual_seed(5)) * D**-0.5
    n = seg.n_body("k")
    (k1, k2), vp = _cut(seg, {n // 3})[0], _cut(seg, {n // 3})[1]
    other = (torch.randn(1, H, M, D, generator=torch.Generator().manual_seed(6)) * D**-0.5).contiguous()
    row = attention._fused_row(seg, 0)._replace(k_body=(k1, (*k2, other)), v_body=vp)
    out = torch.zeros_like(qf)
    assert cpu.attend_rows(qf, [row], out) == []
    # torch: decoded keys and values, scores of the first piece with qf, the second with other
    k, v = seg.materialize()
    k, v = k.float(), v.float()  # (1, H, T, D): sinks, body, residual
    s = seg.k_sink.shape[2] if seg.k_sink is not None else 0
    n1 = n // 3
    scores = qf @ k.transpose(-1, -2)
    scores[..., s + n1 : s + n] = (other @ k.transpose(-1, -2))[..., s + n1 : s + n]
    ref = torch.softmax(scores, -1) @ v
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # and the same call without the second piece's queries differs (the queries are read, not ignored)
    plain = torch.zeros_like(qf)
    assert cpu.attend_rows(qf, [attention._fused_row(seg, 0)], plain) == []
    assert not torch.allclose(plain, out, atol=1e-3)


def test_a_step_moves_its_rows_sinks_and_run_queries_in_one_call_each_with_the_same_bits(monkeypatch):
    """A ragged step moves the sinks of all its windowed rows in one Rotary.move (and the queries of all its rows
    with key runs in one more): each row's sink keys and output are bit for bit those of the row alone, for rows
    of different lengths (different distances), two sink counts and a row whose sinks need no move."""
    from kvslim.cache.ragged import RaggedCache
    from kvslim.cache.rotary import Rotary

    specs = [("int4,sink=4,window=60,group=8,residual=8", n) for n in (200, 75, 131)]
    specs += [("q8_0,sink=2,window=50,residual=0,group=1", 90), ("int4,sink=4,window=600", 40)]  # last: no move
    g = torch.Generator().manual_seed(5)
    feeds = [(torch.randn(1, H, n, D, generator=g) * 2, torch.randn(1, H, n, D, generator=g)) for _, n in specs]
    new_k, new_v = torch.randn(1, H, len(specs), D, generator=g), torch.randn(1, H, len(specs), D, generator=g)

    def caches():
        out = []
        for (spec, _), (k, v) in zip(specs, feeds, strict=True):
            cache = SlimCache.from_config(kvslim.parse_spec(spec), config=tiny_config())
            cache.layers[0].store.append(k, v)
            out.append(cache)
        return out

    alone = [
        c.layers[0].store.append(new_k[:, :, b : b + 1], new_v[:, :, b : b + 1], segments=True)
        for b, c in enumerate(caches())
    ]
    moves = []
    real_move = Rotary.move
    monkeypatch.setattr(
        Rotary, "move", lambda self, x, d, **kw: moves.append(tuple(x.shape)) or real_move(self, x, d, **kw)
    )
    rows = caches()
    step = RaggedCache(rows, positions=[n for _, n in specs], bases=[0] * len(specs))
    view, _ = step.layers[0].update(new_k, new_v)
    assert sorted(moves) == sorted([(3, H, 4, D), (1, H, 2, D)])  # three int4 rows at once, the q8_0 row alone
    for b, (seg, ref) in enumerate(zip(view.rows, alone, strict=True)):
        assert torch.equal(seg.k_sink, ref.k_sink), b
    assert view.rows[-1].k_sink is rows[-1].layers[0].store.sink_k  # no move due: the stored keys themselves
    # the fused call over the step: each row's output is its output alone
    q = _queries(len(specs), 13)
    out, _ = attention.kvslim_attention(_MODULE, q, RaggedSegments(view.rows), None, None, scaling=None)
    for b, seg in enumerate(alone):
        assert torch.equal(out[b : b + 1], _alone(q[b : b + 1], seg)), b
    # rows with key runs: their queries moved in one call for the step
    segs = [_segments_with_runs(spec, b, a, 61 + i) for i, (spec, b, a) in enumerate(RUNS)]
    moves.clear()
    q4 = _queries(len(segs), 14)
    out, _ = attention.kvslim_attention(_MODULE, q4, RaggedSegments(tuple(segs)), None, None, scaling=None)
    assert moves == [(len(segs), H, M, D)]
    monkeypatch.setattr(Rotary, "move", real_move)
    for b, seg in enumerate(segs):
        assert torch.equal(out[b : b + 1], _alone(q4[b : b + 1], seg)), b
