"""The fused decode of a fitted rotation and of a mean-centered K body (issue 32; :mod:`kvslim.fused`).

A post-RoPE body stored in a fitted basis (``y = R x`` per KV head) is read by C's rows call with the row's queries
taken to the basis once (``R_k q``) and the V body's weighted sum taken back once (``R_v^T``); a K body stored
centered scores ``qb . bias`` more on each centered token. Checked here: the logits of the tiny GQA llama through
the fused call against the op-by-op path (with and without a sink/window, a centering bias, post- and pre-RoPE);
the rows call against an independent float64 softmax over the decoded cache; each row bit for bit the same alone
and in a many-row step (and through the batch engine); and that leaving out a rotation or the bias is caught.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import kvslim
from conftest import BLAS_ROWS_INVARIANT, tiny_config, tiny_model
from kvslim import SlimCache, attention, parse_spec
from kvslim.cache.ragged import RaggedSegments
from kvslim.calibration.biasfile import write_bias_file
from kvslim.calibration.calibrate import collect_k_means_from_ids
from kvslim.generate import forward
from kvslim.kernels import cpu
from kvslim.models import model_fingerprint

H, M, D = 2, 2, 32  # the tiny llama's KV heads, GQA group (4 query heads / 2) and head dim
_MODULE = types.SimpleNamespace(training=False, num_key_value_groups=M, is_causal=True)

pytestmark = pytest.mark.skipif(not cpu.status()[0], reason="no C compiler: the fused call needs the C kernels")


def _ids(length, seed):
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def _fit(tmp_path, *, pre_rope=False, rotate=False, fit=True, name="fit.gguf"):
    """A calibration file of the tiny llama (600 random tokens): K means, and a fitted rotation when ``fit``."""
    model = tiny_model("llama")  # seeded: the model every test here builds, so its fingerprint is theirs
    bias = collect_k_means_from_ids(
        model, _ids(600, 3)[0], ctx=200, progress=False, fingerprint=model_fingerprint(model),
        fit_rotation=fit, pre_rope=pre_rope, rotate=rotate,
    )  # fmt: skip
    path = tmp_path / name
    write_bias_file(path, bias)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fits")
    return {
        "post": _fit(tmp, name="post.gguf"),
        "pre": _fit(tmp, pre_rope=True, name="pre.gguf"),
        "hadamard": _fit(tmp, rotate=True, fit=False, name="hadamard.gguf"),  # a plain K-mean file, rotated basis
    }


def _logits(model, cache, ids, prefill=20):
    with torch.no_grad():
        out = [forward(model, ids[:, :prefill], cache, logits_to_keep=0)]
        for t in range(prefill, ids.shape[1]):
            out.append(forward(model, ids[:, t : t + 1], cache, logits_to_keep=0))
    return torch.cat(out, dim=1)


def _counting(monkeypatch):
    """Count the rows the C rows call receives, by kind (fitted K/V, a K bias)."""
    seen = {"rows": 0, "k_rot": 0, "v_rot": 0, "k_bias": 0}
    real = cpu.attend_rows

    def counted(q, rows, out):
        for r in rows:
            seen["rows"] += 1
            for name in ("k_rot", "v_rot", "k_bias"):
                seen[name] += getattr(r, name) is not None
        return real(q, rows, out)

    monkeypatch.setattr(cpu, "attend_rows", counted)
    return seen


#: (spec, the file, whether the K body is centered): fitted post-RoPE with and without a window, with and without
#: the file's K means (q4_0 centers, int4 does not), int2; a Hadamard basis with a K bias. ``sink=0`` where there is
#: no window: every decode step after the 20-token prefill reads a body (the default 16 sinks would leave the first
#: steps without one, attended by sdpa on the stored tokens)
LOGIT_CASES = [
    ("int4,sink=0,residual=4,group=4,rotate=fitted", "post", False),
    ("int4,sink=2,window=24,residual=4,group=4,rotate=fitted", "post", False),
    ("q4_0,sink=0,residual=4,group=4,rotate=fitted", "post", True),
    ("q4_0,sink=2,window=24,residual=0,group=1,rotate=fitted", "post", True),
    ("int2,sink=0,residual=4,group=4,rotate=fitted,pre_rope=0", "post", False),
    ("q4_0,sink=2,window=24,residual=0,group=1", "hadamard", True),
]


@pytest.mark.xfail(
    not BLAS_ROWS_INVARIANT,
    reason="on a CPU whose MKL rounds rows by the product's row count (AVX-512-FP16), the two paths' fp32 differences "
    "flip a code of a later layer in one case (q4_0, fitted, post-RoPE, centered: 0.0068 in the logits)",
    strict=False,
)
@pytest.mark.parametrize("spec, file, centered", LOGIT_CASES)
def test_fused_decode_gives_the_op_by_op_logits(files, monkeypatch, spec, file, centered):
    """The tiny GQA llama decoding 50 tokens: the fused call's logits equal the op-by-op path's (1e-4; fp32
    summation order apart), and every decode step's every layer went through the rows call with the cache's
    rotations and bias."""
    model = tiny_model("llama", attn_implementation="kvslim")
    ids = _ids(70, 6)
    cfg = parse_spec(f"{spec},mean_center={files[file]}")
    logits = {}
    for fused in (True, False):
        monkeypatch.setattr(attention, "FUSED_DECODE", fused)
        seen = _counting(monkeypatch)
        cache = SlimCache.from_config(cfg, config=model.config)
        logits[fused] = _logits(model, cache, ids)
        monkeypatch.undo()
        store = cache.stores()[0]
        assert store.k.n_body > 0 and not cache.pre_rope
        assert (store.k.basis.bias is not None) == centered
        steps = (ids.shape[1] - 20) * model.config.num_hidden_layers
        if fused:
            fitted = 0 if file == "hadamard" else steps
            assert seen == {"rows": steps, "k_rot": fitted, "v_rot": fitted, "k_bias": steps if centered else 0}
        else:
            assert seen["rows"] == 0
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)


#: pre-RoPE keys (the K body taken back per key: the bias added where flagged, R^T or the Hadamard, then RoPE at
#: the key's position, in the C transform kernels): fitted with and without a window and the file's K means, and
#: the Hadamard basis (int2's default)
PRE_ROPE_CASES = [
    ("int4,residual=4,group=4,sink=0,rotate=fitted", "pre", False),
    ("q4_0,sink=2,window=24,residual=0,group=1,rotate=fitted", "pre", True),
    ("int2,residual=4,group=4,sink=0", None, False),
    ("int4,sink=2,window=24,residual=4,group=4,pre_rope=1", None, False),
]


@pytest.mark.parametrize("spec, file, centered", PRE_ROPE_CASES)
def test_pre_rope_keys_fused_give_the_op_by_op_logits(files, monkeypatch, spec, file, centered):
    """Keys stored before RoPE go through the rows call too, each K piece with its key transform (cos/sin of its
    tokens' positions, the basis, the bias) and the residual's keys rotated to their positions: the fused logits
    equal the op-by-op path's (1e-4), every decode step of every layer in the rows call, with the V rotation
    where fitted and never a row-level K basis or bias (the transform holds them)."""
    model = tiny_model("llama", attn_implementation="kvslim")
    ids = _ids(60, 8)
    cfg = parse_spec(spec if file is None else f"{spec},mean_center={files[file]}")
    logits = {}
    for fused in (True, False):
        monkeypatch.setattr(attention, "FUSED_DECODE", fused)
        seen = _counting(monkeypatch)
        cache = SlimCache.from_config(cfg, config=model.config)
        logits[fused] = _logits(model, cache, ids)
        monkeypatch.undo()
        assert cache.pre_rope and cache.stores()[0].k.n_body > 0
        assert (cache.stores()[0].k.basis.bias is not None) == centered
        steps = (ids.shape[1] - 20) * model.config.num_hidden_layers
        if fused:
            v_rot = steps if file else 0
            assert seen == {"rows": steps, "k_rot": 0, "v_rot": v_rot, "k_bias": 0}
        else:
            assert seen["rows"] == 0
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)


# -- rows -----------------------------------------------------------------------------------------------


def _segments(spec: str, n: int, seed: int, bias_scale: float = 0.0):
    """Layer 0 of a SlimCache with ``spec`` fed ``n`` random tokens with channel means, then one decode token: its
    Segments view. ``bias_scale``: a K centering bias of that size set on the layer (in its stored basis) before
    anything is encoded, so that leaving it out shows."""
    cache = SlimCache.from_config(kvslim.parse_spec(spec), config=tiny_config())
    store = cache.layers[0].store
    if bias_scale:
        g = torch.Generator().manual_seed(seed + 100)
        store.k_bias = torch.randn(H, D, generator=g) * bias_scale
    g = torch.Generator().manual_seed(seed)
    kv = lambda t: torch.randn(1, H, t, D, generator=g) * 2 + torch.linspace(-3, 3, D)  # noqa: E731 - channel means
    if n:
        store.append(kv(n), kv(n))
    return store.append(kv(1), kv(1), segments=True)


def _alone(query_row, seg):
    return attention._segments_attention(_MODULE, query_row.clone(), seg, None, 0.0, None, {})[0]


def _rows_specs(files):
    post, pre = files["post"], files["pre"]
    return [
        (f"int4,rotate=fitted,mean_center={post}", 700, 0.0),  # 2 chunks a head at 2 threads
        (f"int4,sink=4,window=60,group=8,residual=8,rotate=fitted,mean_center={post}", 300, 0.0),
        (f"q4_0,residual=0,group=1,rotate=fitted,mean_center={post}", 200, 3.0),  # fitted, K centered
        (f"q8_0,sink=4,window=60,residual=0,group=1,rotate=fitted,mean_center={post}", 300, 0.0),
        ("q4_0,residual=0,group=1", 150, 3.0),  # Hadamard, K centered
        ("int4,k=q8_0,sink=2,window=200,residual=32", 900, 0.0),  # Hadamard, no bias
        (f"q4_0,residual=0,group=1,rotate=fitted,mean_center={pre}", 200, 3.0),  # pre-RoPE, fitted, K centered
        (f"int4,sink=4,window=60,group=8,residual=8,rotate=fitted,mean_center={pre}", 300, 0.0),  # pre-RoPE window
        ("int2,group=16,residual=16", 257, 0.0),  # pre-RoPE, Hadamard
        ("int4", 5, 0.0),  # nothing encoded yet: the per-row path
    ]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_each_row_alone_equals_the_row_in_a_many_row_step(files, threads, monkeypatch):
    """A ragged step of fitted rows, centered rows, Hadamard rows, a row the call does not read and a filler: each
    row's output is bit for bit that row alone (its own whole path: one rows call of one row); the fused rows went
    in one call."""
    specs = _rows_specs(files)
    segs = [_segments(s, n, 11 + i, b) for i, (s, n, b) in enumerate(specs)]
    rows = segs[:3] + [None] + segs[3:]
    query = torch.randn(len(rows), H * M, 1, D, generator=torch.Generator().manual_seed(4))
    calls = []
    real = cpu.attend_rows
    monkeypatch.setattr(
        cpu, "attend_rows", lambda q, rs, out: calls.append(sorted(r.qrow for r in rs)) or real(q, rs, out)
    )
    out, _ = attention.kvslim_attention(_MODULE, query, RaggedSegments(tuple(rows)), None, None, scaling=None)
    assert calls[0] == [b for b in range(len(rows) - 1) if b != 3]  # not the filler (3) nor the unencoded row
    for b, seg in enumerate(rows):
        if seg is None:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
        else:
            assert torch.equal(out[b : b + 1], _alone(query[b : b + 1], seg)), b


def _reference(qf, seg):
    """float64 attention of qf (1, H, M, D) over the cache's decoded tokens (Segments.materialize: the bodies
    decoded and taken back to the model's basis by the torch code, the bias added back): (1, H, M, D)."""
    k, v = seg.materialize()
    p = torch.softmax(qf.double() @ k.double().transpose(-1, -2), dim=-1)
    return p @ v.double()


def test_dropping_a_rotation_or_the_bias_is_caught(files):
    """The rows call on a fitted, centered row equals an independent float64 reference (1e-5); the same row with
    its V rotation, its K rotation or its K bias left out does not (off by more than 0.05): what a kernel that
    forgot to take V back, to rotate the queries or to add the zero point would give. The same for a pre-RoPE
    row: its key transform's matrix, bias or RoPE left out, or the residual's keys left unrotated."""
    seg = _segments(f"q4_0,residual=0,group=1,rotate=fitted,mean_center={files['post']}", 200, 5, 3.0)
    qf = torch.randn(1, H, M, D, generator=torch.Generator().manual_seed(9)) * D**-0.5
    row = attention._fused_row(seg, 0)
    assert row.k_rot is not None and row.v_rot is not None and row.k_bias is not None
    ref = _reference(qf, seg)

    def run(r):
        out = torch.zeros_like(qf)
        assert cpu.attend_rows(qf, [r], out) == []
        return out.double()

    torch.testing.assert_close(run(row), ref, atol=1e-5, rtol=1e-5)
    for name in ("k_rot", "v_rot", "k_bias"):
        assert float((run(row._replace(**{name: None})) - ref).abs().max()) > 0.05, name

    seg = _segments(f"q4_0,residual=4,group=1,rotate=fitted,mean_center={files['pre']}", 200, 6, 3.0)
    row = attention._fused_row(seg, 0)
    codec, enc, offset, _, tr = row.k_body[0]
    assert seg.k_pos is not None and row.k_rot is None and row.k_bias is None and row.k_res.shape[2] == 4
    ref = _reference(qf, seg)
    torch.testing.assert_close(run(row), ref, atol=1e-5, rtol=1e-5)
    wrong = {
        "matrix": dataclasses.replace(tr, hadamard=None),
        "bias": dataclasses.replace(tr, bias=None),
        "rope": dataclasses.replace(tr, cos=None, sin=None),
    }
    for name, bad in wrong.items():
        out = run(row._replace(k_body=((codec, enc, offset, None, bad),)))
        assert float((out - ref).abs().max()) > 0.05, name
    assert float((run(row._replace(k_res=seg.k_res)) - ref).abs().max()) > 0.05, "residual unrotated"


def test_a_row_with_two_k_bases_is_left(files):
    """One basis per stream: a row claiming a Hadamard block and a fitted matrix for K, or a K piece with a key
    transform and a row-level K basis or bias, is not computed (the caller's own path says what is wrong); the
    others are."""
    seg = _segments(f"int4,rotate=fitted,mean_center={files['post']}", 300, 7)
    pre = attention._fused_row(_segments(f"int4,rotate=fitted,mean_center={files['pre']}", 300, 8), 2)
    qf = torch.randn(6, H, M, D, generator=torch.Generator().manual_seed(3))
    good = attention._fused_row(seg, 0)
    bad = [
        good._replace(qrow=1, k_hblock=32),
        pre._replace(qrow=3, k_hblock=32),
        pre._replace(qrow=4, k_rot=good.k_rot),
        pre._replace(qrow=5, k_bias=torch.ones(H, D)),
    ]
    out = torch.zeros_like(qf)
    assert cpu.attend_rows(qf, [good, pre, *bad], out) == [2, 3, 4, 5]
    for r in (0, 2):
        assert not torch.equal(out[r], torch.zeros_like(out[r]))
    for r in (1, 3, 4, 5):
        assert torch.equal(out[r], torch.zeros_like(out[r]))


def test_engine_greedy_with_fitted_rows_equals_each_request_alone(files, monkeypatch):
    """Continuous batching with fitted and centered rows among Hadamard ones: each request's greedy tokens equal
    the request alone through the engine and through the single-stream loop; the rows call took fitted rows in
    steps of several rows."""
    from kvslim import generate as gen
    from kvslim.engine import Engine, Request

    model = kvslim.enable(tiny_model("llama"))
    sizes = []
    real = cpu.attend_rows
    monkeypatch.setattr(
        cpu,
        "attend_rows",
        lambda q, rs, out: sizes.append(sum(r.k_rot is not None for r in rs)) or real(q, rs, out),
    )
    post = files["post"]
    mix = [
        (200, f"int4,rotate=fitted,mean_center={post}"),
        (90, f"q4_0,sink=4,window=50,residual=0,group=1,rotate=fitted,mean_center={post}"),
        (150, "int4,group=16,residual=16,pre_rope=0"),
        (120, f"int4,group=16,residual=16,rotate=fitted,mean_center={post}"),
        (170, "int2,group=16,residual=16"),  # pre-RoPE keys: a key transform in the rows call
    ]
    g = torch.Generator().manual_seed(0)
    reqs = [
        Request(torch.randint(3, 128, (n,), generator=g).tolist(), max_new_tokens=10 + 2 * i, cache=spec)
        for i, (n, spec) in enumerate(mix)
    ]
    default = mix[0][1]  # the engine's own file: what every request's mean_center must name
    together = Engine(model, max_batch=4, prefill_chunk=64, cache=default).run(reqs)
    assert max(sizes) >= 2
    for req, got in zip(reqs, together, strict=True):
        alone = Engine(model, prefill_chunk=64, cache=default).run([req])[0]
        assert got.tokens == alone.tokens, req.cache.to_spec()
        cache = SlimCache.from_config(req.cache, config=model.config)
        single = gen.greedy(model, torch.tensor([req.prompt]), cache, req.max_new_tokens, prefill_chunk=64)
        assert got.tokens == single, req.cache.to_spec()


def test_the_kernels_name_the_centering_flags_as_the_cache_does():
    """The rows call reads a K piece's flags under the name the cache writes them (named twice: the kernels do not
    import the cache)."""
    from kvslim.cache.basis import CENTERED
    from kvslim.kernels.cpu_parts import CENTERED as KERNEL_NAME

    assert KERNEL_NAME == CENTERED
