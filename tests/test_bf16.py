"""bfloat16 end to end (issue 30, item 4): a bfloat16 model's tokens keep the model's dtype where they stay at full
precision (sinks and residual), are encoded to the same bytes as their float32 values (the body "as today"), and
are read by the same C calls as float32 ones — the single-stream fused call (kernels.cpu.attend), the rows kernel
of a ragged step (kernels.cpu.attend_rows), never a materialized history — and continuous batching in bfloat16
gives each request the greedy tokens it gets alone.

References: attention outputs are checked against float64 softmax attention over the cache's own decoded tokens
(Segments.materialize); the route is checked by counting kernel calls against the same run in float32."""

from __future__ import annotations

import collections
import json
import types

import pytest
import torch

import kvslim
from conftest import tiny_config, tiny_model
from kvslim import SlimCache, attention
from kvslim import generate as gen
from kvslim.cache.ragged import RaggedSegments
from kvslim.cache.segments import Segments
from kvslim.kernels import cpu

BF16 = torch.bfloat16
H, M, D = 2, 2, 32  # the tiny llama's KV heads, GQA group (4 query heads / 2) and head dim
_MODULE = types.SimpleNamespace(training=False, num_key_value_groups=M, is_causal=True)

#: one spec per format family the C kernels read (float casts, fp8, KIVI affine, GGML blocks), with sinks and a
#: window, mixed K/V formats, no rotation; each fed enough tokens for a body
FAMILIES = [
    "bf16",
    "fp16",
    "fp8",
    "int8",
    "int4",
    "int2,pre_rope=false,group=16,residual=16",
    "q8_0",
    "q4_0",
    "q4_1",
    "q5_0,rotate=none",
    "int4,sink=4,window=60,group=8,residual=8",
    "q4_0,k=int8,group=16,residual=16",
]
#: rows the fused call does not read in float32 either (nothing encoded yet, lossless)
PER_ROW = [("int4", 5), ("none", 50)]
#: pre-RoPE keys: read by the rows call only (a key transform per K piece), not by kv_attend
ROWS_ONLY = [("int2", 300)]


@pytest.fixture(autouse=True)
def _c_kernels():
    if not cpu.status()[0]:
        pytest.skip("no C compiler: the fused calls need the C kernels")


def _kv(t: int, g: torch.Generator) -> torch.Tensor:
    """(1, H, t, D) random keys/values with channel means, rounded to bfloat16."""
    return (torch.randn(1, H, t, D, generator=g) * 2 + torch.linspace(-3, 3, D)).to(BF16)


def _segments(spec: str, n: int, seed: int, dtype=BF16) -> Segments:
    """Layer 0 of a SlimCache with ``spec`` fed ``n`` bfloat16-valued tokens (as ``dtype``), then one decode token."""
    cache = SlimCache.from_config(kvslim.parse_spec(spec), config=tiny_config())
    store = cache.layers[0].store
    g = torch.Generator().manual_seed(seed)
    if n:
        store.append(_kv(n, g).to(dtype), _kv(n, g).to(dtype))
    return store.append(_kv(1, g).to(dtype), _kv(1, g).to(dtype), segments=True)


def _reference(query: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Softmax attention in float64 over ``seg``'s decoded tokens: query (1, Hq, 1, D) -> (1, 1, Hq, D)."""
    k, v = (t.double() for t in seg.materialize(torch.float32))  # (1, H, T, D)
    q = query.double().reshape(1, H, M, D) * D**-0.5
    p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    return (p @ v).reshape(1, H * M, 1, D).transpose(1, 2)


@pytest.mark.parametrize("spec", FAMILIES)
def test_bf16_store_keeps_model_dtype_and_encodes_as_float32(spec):
    """Sinks and residual of a bfloat16 stream stay bfloat16 (2 bytes, as the float32 model's default float16);
    the encoded body holds the very bytes the same values give as float32."""
    bf = _segments(spec, 300, 1)
    f32 = _segments(spec + ",residual_dtype=model", 300, 1, dtype=torch.float32)
    for part in (bf.k_res, bf.v_res, bf.k_sink, bf.v_sink):
        assert part is None or part.dtype == BF16
    assert bf.k_body is not None and bf.v_body is not None
    for a, b in ((bf.k_body, f32.k_body), (bf.v_body, f32.v_body)):
        assert a.token.keys() == b.token.keys() and a.group.keys() == b.group.keys()
        for name in a.token:
            assert torch.equal(a.token[name], b.token[name]), (spec, name)
        for name in a.group:
            assert torch.equal(a.group[name], b.group[name]), (spec, name)
    assert torch.equal(bf.k_res.float(), f32.k_res) and torch.equal(bf.v_res.float(), f32.v_res)


@pytest.mark.parametrize("spec", FAMILIES)
def test_bf16_decode_attention_is_one_fused_call(spec, monkeypatch):
    """A bfloat16 decode query over a bfloat16 cache: one kernels.cpu.attend call, no materialized history, the
    output within bfloat16 rounding of float64 attention over the cache's decoded tokens."""
    seg = _segments(spec, 300, 2)
    query = torch.randn(1, H * M, 1, D, generator=torch.Generator().manual_seed(3)).to(BF16)
    calls = collections.Counter()
    real_attend, real_mat = cpu.attend, Segments.materialize
    monkeypatch.setattr(cpu, "attend", lambda *a, **k: calls.update(["attend"]) or real_attend(*a, **k))
    monkeypatch.setattr(
        Segments, "materialize", lambda s, *a: calls.update(["materialize"]) or real_mat(s, *a)
    )
    out, _ = attention._segments_attention(_MODULE, query, seg, None, 0.0, None, {})
    assert calls == {"attend": 1}
    assert out.dtype == BF16 and out.shape == (1, 1, H * M, D)
    monkeypatch.undo()
    ref = _reference(query, seg)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    assert (out.double() - ref).abs().max() > 0  # rounded to bfloat16: never bit-equal to float64 by accident


def test_bf16_ragged_step_takes_the_rows_kernel(monkeypatch):
    """A ragged step of bfloat16 rows of every family, rows the fused call does not read and fillers: the fusable
    rows go in one kernels.cpu.attend_rows call, only the others run row by row, each row's output is bit for bit
    the row alone, fillers are 0."""
    specs = (
        [(s, 300) for s in FAMILIES[:6]]
        + ROWS_ONLY
        + PER_ROW
        + [(s, 200 + 37 * i) for i, s in enumerate(FAMILIES[6:])]
    )
    segs = [_segments(s, n, 10 + i) for i, (s, n) in enumerate(specs)]
    rows = (*segs[:5], None, *segs[5:], None)
    names = [*specs[:5], None, *specs[5:], None]
    query = torch.randn(len(rows), H * M, 1, D, generator=torch.Generator().manual_seed(4)).to(BF16)
    fused_calls, per_row = [], []
    real_rows, real_alone = cpu.attend_rows, attention._segments_attention
    monkeypatch.setattr(
        cpu,
        "attend_rows",
        lambda q, rs, out: fused_calls.append(sorted(r.qrow for r in rs)) or real_rows(q, rs, out),
    )
    monkeypatch.setattr(attention, "_segments_attention", lambda *a: per_row.append(1) or real_alone(*a))
    out, _ = attention.kvslim_attention(_MODULE, query, RaggedSegments(rows), None, None, scaling=None)
    monkeypatch.undo()
    fused = [b for b, name in enumerate(names) if name is not None and name not in PER_ROW]
    assert fused_calls == [fused] and len(per_row) == len(PER_ROW)
    assert out.dtype == BF16 and out.shape == (len(rows), 1, H * M, D)
    for b, seg in enumerate(rows):
        if seg is None:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        alone = attention._segments_attention(_MODULE, query[b : b + 1].clone(), seg, None, 0.0, None, {})[0]
        assert torch.equal(out[b : b + 1], alone), names[b]


def _route(
    model, spec: str, prompt: torch.Tensor, n: int, monkeypatch
) -> tuple[collections.Counter, list[int]]:
    """Greedy tokens of ``model`` through a SlimCache of ``spec`` and the kernel calls made on the way."""
    calls = collections.Counter()
    names = ("attend", "attend_rows")
    real = {k: getattr(cpu, k) for k in names}
    for k in names:
        monkeypatch.setattr(cpu, k, lambda *a, _k=k, **kw: calls.update([_k]) or real[_k](*a, **kw))
    real_mat = Segments.materialize
    monkeypatch.setattr(
        Segments, "materialize", lambda s, *a: calls.update(["materialize"]) or real_mat(s, *a)
    )
    cache = SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
    tokens = gen.greedy(model, prompt, cache, n, prefill_chunk=64)
    monkeypatch.undo()
    return calls, tokens


@pytest.mark.parametrize(
    "spec", ["none", "bf16", "fp8", "int8", "int4", "q4_0", "int4,sink=4,window=60,group=8,residual=8"]
)
def test_bf16_model_decodes_on_the_codes_like_float32(spec, monkeypatch):
    """A bfloat16 model through SlimCache: the same route as the float32 model (kernel calls and materializations
    counted), one fused call per layer and decode step once a body exists, nothing materialized by a decode step."""
    prompt = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    n = 12
    got = {}
    for dtype in (torch.float32, BF16):
        model = kvslim.enable(tiny_model("llama", dtype=dtype))
        got[dtype] = _route(model, spec, prompt, n, monkeypatch)
    (c32, _), (c16, tokens) = got[torch.float32], got[BF16]
    assert c16 == c32
    assert len(tokens) == n
    layers = 2
    if spec != "none":  # a lossless cache has no codes: sdpa on its stored tokens, as the plain cache
        assert c16["attend"] == (n - 1) * layers
        assert c16["materialize"] <= 3 * layers  # the prompt's 64-token chunks only, never a decode step


@pytest.fixture(scope="module")
def bf16_model():
    return kvslim.enable(tiny_model("llama", dtype=BF16))


#: (prompt length, cache spec): fused rows of several families and lengths, a window, a lossless row
MIX = [
    (300, "int4"),
    (37, "int4,sink=4,window=60,group=8,residual=8"),
    (200, "int8,residual=32"),
    (90, "q8_0,sink=4,window=50,residual=0"),
    (9, "none"),
    (260, "q4_0,k=int8,group=16,residual=16"),
]


def test_bf16_engine_greedy_equals_each_request_alone(bf16_model, monkeypatch):
    """Continuous batching of a bfloat16 model: each request's greedy tokens equal the request alone through the
    engine and through the single-stream loop; steps with several rows in one attend_rows call happened."""
    from kvslim.engine import Engine, Request

    sizes = []
    real = cpu.attend_rows
    monkeypatch.setattr(cpu, "attend_rows", lambda q, rs, out: sizes.append(len(rs)) or real(q, rs, out))
    g = torch.Generator().manual_seed(0)
    reqs = [
        Request(torch.randint(3, 128, (n,), generator=g).tolist(), max_new_tokens=10 + 2 * i, cache=spec)
        for i, (n, spec) in enumerate(MIX)
    ]
    together = Engine(bf16_model, max_batch=4, prefill_chunk=64).run(reqs)
    monkeypatch.undo()
    assert max(sizes) >= 3
    for req, got in zip(reqs, together, strict=True):
        assert len(got.tokens) == req.max_new_tokens
        alone = Engine(bf16_model, prefill_chunk=64).run([req])[0]
        assert got.tokens == alone.tokens, req.cache.to_spec()
        cache = SlimCache.from_config(req.cache, config=bf16_model.config)
        single = gen.greedy(
            bf16_model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=64
        )
        assert got.tokens == single, req.cache.to_spec()


def test_bench_concurrency_runs_in_bf16_and_records_it(tmp_path, capsys):
    """``kvslim bench --concurrency --dtype bfloat16`` runs the engine's rows in bfloat16 and its JSON says which
    dtype ran and which bfloat16 instructions the CPU has (a speed number without them means little)."""
    from conftest import save_tiny_word_model
    from kvslim.cli import main
    from kvslim.kernels.clib import bf16_instructions

    model_dir = save_tiny_word_model(tmp_path / "tiny")
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", str(model_dir), "--dtype", "bfloat16", "--concurrency", "2", "--lengths", "40"]
    argv += ["--steps", "2", "--warmup", "1", "--config", "int4,group=8,residual=8", "q4_0,residual=0"]
    argv += ["--no-continuous-batching", "--json", str(out_json), "--quiet"]
    assert main(argv) == 0
    capsys.readouterr()
    data = json.loads(out_json.read_text())
    assert data["settings"]["dtype"] == "bfloat16"
    assert data["settings"]["cpu_bf16"] == bf16_instructions()
    assert set(data["settings"]["cpu_bf16"]) <= {"avx512_bf16", "amx_bf16"}
    rows = {r["mode"]: r for r in data["concurrency"]}
    assert set(rows) == {"dynamic", "int4,group=8,residual=8", "q4_0,residual=0"}
    assert all(r["aggregate_tok_s"] > 0 for r in rows.values())
