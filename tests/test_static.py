"""StaticSlimCache (kvslim.cache.static) and the compiled decode step (kvslim.compiled, kvslim.kernels.ops).

The reference for a static cache is a SlimCache of the same options: the same tokens kept, the same groups
encoded at the same steps, so the same stored codes (compared exactly) and the same logits (up to the order
of floating-point sums). The reference for a compiled step is the same static cache stepped eagerly.
"""

from __future__ import annotations

import pytest
import torch

from conftest import blas_row_identity, save_tiny_word_model, tiny_model
from kvslim import SlimCache, StaticSlimCache
from kvslim.compiled import check_compileable, compile_decode, compiled_decode, uncompile
from kvslim.formats import make_codec
from kvslim.generate import decode_one_token, prefill
from kvslim.kernels import ops

SPECS = [
    dict(kv_quantize="int4", group_size=8, residual=16),  # unbounded (max_cache_len), rotated by default
    dict(kv_quantize="int4", group_size=8, residual=8, sink=4, window=20),  # the fp ring wraps, groups evicted
    dict(kv_quantize="q4_0", group_size=8, residual=8, sink=4, window=40),
    dict(kv_quantize="q4_1", group_size=4, residual=0, window=24),  # every group encoded on arrival
    dict(kv_quantize="int8", sink=4, group_size=16, residual=16),  # fp sinks without a window
    dict(kv_quantize="fp8", group_size=8, residual=8, sink=2, window=30),
    dict(kv_quantize="int2", group_size=8, residual=8, window=32),
    dict(kv_quantize="none", sink=4, window=20),  # lossless: a ring of window + 1 slots
    dict(kv_quantize="int4", group_size=8, residual=8, sink=4, window=20, positions="original"),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model(attn_implementation="kvslim")


def _static(model, spec, **kw):
    if spec.get("window") is None:
        kw.setdefault("max_cache_len", 256)
    return StaticSlimCache(config=model.config, **spec, **kw)


def _reference(model, spec):
    # what a StaticSlimCache's "auto" pre-RoPE resolves to: the K stream as fed
    return SlimCache(config=model.config, pre_rope=False, **spec)


def _run(model, cache, ids, steps=45, tokens=None):
    """Prefill ids, then `steps` greedy decode steps (or the given tokens); logits of every step."""
    out = []
    with torch.inference_mode():
        logits = prefill(model, ids, cache)
        tok = logits.argmax(-1, keepdim=True)
        for i in range(steps):
            if tokens is not None:
                tok = tokens[:, i : i + 1]
            logits = decode_one_token(model, tok, cache)
            out.append(logits)
            tok = logits.argmax(-1, keepdim=True)
    return torch.stack(out, dim=1)


@blas_row_identity
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_static_cache_stores_and_reads_what_a_slimcache_does(model, spec):
    uncompile(model)
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    ref, static = _reference(model, spec), _static(model, spec)
    with torch.inference_mode():
        a, b = prefill(model, ids, ref), prefill(model, ids, static)
    # the prefill attends to the same stored values (SlimCache through its own attention path: rounding apart)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    tokens = torch.randint(3, 128, (2, 45), generator=torch.Generator().manual_seed(2))
    la, lb = _run(model, ref, ids[:, -1:], tokens=tokens), _run(model, static, ids[:, -1:], tokens=tokens)
    # int2's four levels carry the two attention paths' rounding into the next layers furthest: 1.5e-4 at most over
    # the 45 steps on an AVX-512 EPYC (median 9e-5; the other formats 7e-5 at most). fp8's three mantissa bits flip a
    # code that sits on a rounding boundary with that rounding: over 8 seeds of this test 1e-5 to 2.4e-4, once 2.4e-3,
    # whichever product rotates the Hadamard basis (torch's mm or kvslim's kernel); this seed 2.6e-4 with kvslim's
    tol = 3e-4 if spec["kv_quantize"] == "int2" else 5e-4 if spec["kv_quantize"] == "fp8" else 1e-4
    torch.testing.assert_close(lb, la, atol=tol, rtol=tol)
    assert static.get_seq_length() == ref.get_seq_length() == 37 + 1 + 45
    assert static.stored_tokens() == ref.stored_tokens()
    # Layer 0's K/V depend on the tokens alone: the same codes, decoded the same way, bit for bit (deeper layers'
    # inputs carry the rounding of the attention path above, which may flip a code).
    assert torch.equal(static.layers[0].keys, ref.layers[0].keys)
    assert torch.equal(static.layers[0].values, ref.layers[0].values)
    for layer_ref, layer_static in zip(ref.layers[1:], static.layers[1:], strict=True):
        assert layer_static.keys.shape == layer_ref.keys.shape


def test_static_nbytes_is_its_capacity_from_the_first_write(model):
    spec = dict(kv_quantize="int4", group_size=8, residual=8, sink=4, window=32)
    cache = _static(model, spec)
    ids = torch.randint(3, 128, (1, 10))
    with torch.inference_mode():
        prefill(model, ids, cache)
        first = cache.nbytes()
        for _ in range(100):
            decode_one_token(model, ids[:, :1], cache)
    assert cache.nbytes() == first > 0
    held = sum(
        t.numel() * t.element_size()
        for s in cache.stores()
        for t in (
            s.k_fp,
            s.v_fp,
            s.fp_pos,
            s.body_pos,
            s.seen,
            *s.k_body.token.values(),
            *s.k_body.group.values(),
            *s.v_body.token.values(),
            *s.v_body.group.values(),
        )
    )
    assert first == held + cache.components()["rotary"]  # + the RoPE frequencies, held once
    assert cache.report()["tokens_stored"] == 4 + 32


def test_compiled_step_equals_the_eager_step(model):
    spec = dict(kv_quantize="int4", group_size=8, residual=8, sink=4, window=20)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    uncompile(model)
    eager_cache = _static(model, spec)
    eager = _run(model, eager_cache, ids, steps=40)
    compiled = compile_decode(model)
    try:
        compiled_cache = _static(model, spec)
        out = _run(model, compiled_cache, ids, steps=40)
    finally:
        uncompile(model)
    assert compiled.compiles == 1 and compiled.steps == 40 and compiled.compile_s > 0
    assert torch.equal(out.argmax(-1), eager.argmax(-1))  # greedy tokens equal
    torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
    # The same groups encoded into the same codes: bit for bit in layer 0, whose K/V depend on the tokens alone
    # (deeper layers' K/V carry the compiled forward's rounding, which may move a scale by an ulp). Layer 0's groups
    # are rotated by torch's mm in the graph and by kvslim's kernel in the eager step (kvslim.cache.hadamard): the
    # two may differ by an ulp, which moves a code only where a value sits on a rounding boundary (none here).
    a, b = eager_cache.stores()[0], compiled_cache.stores()[0]
    for body_a, body_b in ((a.k_body, b.k_body), (a.v_body, b.v_body)):
        for name in body_a.token:
            assert torch.equal(body_a.token[name], body_b.token[name])
        for name in body_a.group:
            assert torch.equal(body_a.group[name], body_b.group[name])
    assert torch.equal(a.body_pos, b.body_pos) and torch.equal(a.fp_pos, b.fp_pos)


def test_compiled_identity_format_greedy_matches_dynamic_cache(model):
    from transformers import DynamicCache

    ids = torch.randint(3, 128, (1, 25), generator=torch.Generator().manual_seed(4))
    uncompile(model)
    dynamic = _run(model, DynamicCache(config=model.config), ids, steps=30)
    compile_decode(model)
    try:
        out = _run(model, _static(model, dict(kv_quantize="none"), max_cache_len=64), ids, steps=30)
    finally:
        uncompile(model)
    assert torch.equal(out.argmax(-1), dynamic.argmax(-1))
    torch.testing.assert_close(out, dynamic, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_compiled_one_row_matmuls_are_fused_reductions(bias):
    """compile_decode's backend turns a one-row linear layer (mm, or addmm with a bias) into a fused
    multiply-and-sum (no extern matmul left in the generated code) with the matmul's result; more rows keep
    Inductor's matmul."""
    from torch._inductor.utils import run_and_get_code

    from kvslim.compiled import _backend

    torch._dynamo.reset()
    lin = torch.nn.Linear(48, 40, bias=bias)
    fn = torch.compile(lambda x: lin(x), fullgraph=True, dynamic=False, backend=_backend)
    with torch.no_grad():
        for rows, fused in ((1, True), (5, False)):
            x = torch.randn(1, rows, 48)
            out, code = run_and_get_code(fn, x)
            torch.testing.assert_close(out, lin(x), atol=1e-5, rtol=1e-5)
            assert ("extern_kernels.mm" in code[0] or "extern_kernels.addmm" in code[0]) is not fused


def test_a_growing_cache_is_never_compiled(model):
    compile_decode(model)
    try:
        cache = SlimCache(config=model.config, kv_quantize="int4")
        with pytest.warns(UserWarning, match="SlimCache grows or re-slices its storage, so its decode steps run eagerly"):
            _run(model, cache, torch.randint(3, 128, (1, 8)), steps=3)
        assert compiled_decode(model).steps == 0  # eager: SlimCache is not compileable, and it said so once
    finally:
        uncompile(model)
    with pytest.raises(ValueError, match="needs a cache of fixed shape; SlimCache grows"):
        check_compileable(cache)


@pytest.mark.parametrize("name", ["int4", "q4_0", "int8"])
def test_custom_ops_pass_opcheck(name):
    torch.manual_seed(0)
    for role in ("k", "v"):
        codec = make_codec(name, role, group_size=8)
        enc = codec.encode(torch.randn(1, 2, 16, 32))
        key = ops.codec_key(codec, enc)
        token, group = ops.split(enc)
        if role == "k":
            args = (torch.randn(1, 2, 3, 32), key, token, group)
            torch.library.opcheck(torch.ops.kvslim.k_scores.default, args)
            ref = torch.randn(1, 2, 3, 32) @ codec.decode(enc, torch.float32).transpose(-1, -2)
            assert ops.k_scores(*args).shape == ref.shape
        else:
            p = torch.softmax(torch.randn(1, 2, 3, 16), -1)
            args = (p, key, token, group, 32)
            torch.library.opcheck(torch.ops.kvslim.v_weighted.default, args)
            torch.testing.assert_close(ops.v_weighted(*args), p @ codec.decode(enc, torch.float32), atol=1e-5, rtol=1e-5)


def test_unknown_codec_key_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown codec key"):
        ops.k_scores(torch.randn(1, 1, 1, 32), "nope", [torch.zeros(1, 1, 4, 32)], [])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_quantize="int4"), "without a window it needs max_cache_len"),
        (dict(kv_quantize="int2", window=32, pre_rope=True), "pass pre_rope=False"),
        (dict(kv_quantize="int4", k_quantize="none", window=32), "both quantized or both 'none'"),
        (dict(kv_quantize="int4", max_cache_len=0), "max_cache_len"),
    ],
)
def test_what_a_static_cache_refuses(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        StaticSlimCache(config=model.config, **kwargs)


def test_static_cache_needs_the_kvslim_attention():
    plain = tiny_model(attn_implementation="sdpa")
    with pytest.raises(ValueError, match="attn_implementation='kvslim'"):
        StaticSlimCache(config=plain.config, kv_quantize="int4", window=32)


def test_feeding_past_max_cache_len_is_refused_and_leaves_the_cache_as_it_was(model):
    cache = _static(model, dict(kv_quantize="int4", group_size=8, residual=8, sink=0), max_cache_len=16)
    with torch.inference_mode():
        prefill(model, torch.randint(3, 128, (1, 12)), cache)
        with pytest.raises(ValueError, match="at most max_cache_len=16"):
            prefill(model, torch.randint(3, 128, (1, 5)), cache)
    assert cache.get_seq_length() == 12


def test_bench_compile_rows_side_by_side():
    from kvslim.bench import run_bench

    model = tiny_model(attn_implementation="sdpa")
    fast = dict(warmup=1, progress=False, bandwidth_bytes=1 << 20, append_lengths=None, seen=None)
    with pytest.raises(ValueError, match="--attn kvslim"):
        run_bench(model, ["int4"], [16], 2, attn="sdpa", compile=True, **fast)
    r = run_bench(model, ["int4", "q4_0,sink=2,window=8"], [16], 2, attn="kvslim", compile=True, **fast)
    rows = {row.mode: row for row in r.decode}
    assert set(rows) == {
        "dynamic",
        "int4",
        "q4_0,sink=2,window=8",
        "tf-static",
        "int4+compiled",
        "q4_0,sink=2,window=8+compiled",
    }
    assert [m for m, row in rows.items() if row.compiled] == ["tf-static", "int4+compiled", "q4_0,sink=2,window=8+compiled"]
    assert r.settings["compiles"] == 3 and r.settings["compile_s"] > 0
    assert rows["q4_0,sink=2,window=8+compiled"].tokens_stored == rows["q4_0,sink=2,window=8"].tokens_stored == 10
    assert r.to_dict()["decode"][3]["compiled"] is True
    assert compiled_decode(model) is None  # back to eager after the run


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny_word_model(tmp_path)


def test_cli_sample_compile_reports_the_compile_and_matches_eager(model_dir, tmp_path, capsys):
    import json

    from kvslim.cli import main

    def run(*flags):
        report = tmp_path / "r.json"
        argv = ["sample", "--model", str(model_dir), "--prompt", "t5 t9 t17 t33 t65", "--tokens", "20"]
        argv += ["--temperature", "0", "--ignore-eos", "--kv-quantize", "int4", "--streaming-llm-sink", "2"]
        argv += ["--streaming-llm-window", "12", "--report-json", str(report), *flags]
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0, err
        return out, err, json.loads(report.read_text())

    eager_out, _, eager = run()
    out, err, report = run("--compile")
    assert out == eager_out  # the same greedy text
    assert report["compile"]["graphs"] == 1 and report["compile"]["steps"] == 19 and report["compile"]["compile_s"] > 0
    assert "compiled decode step: 1 graph(s) compiled in" in err
    assert report["tokens_stored"] == eager["tokens_stored"] == 14


def test_cli_compile_refusals(model_dir, capsys):
    from kvslim.cli import main

    code = main(["sample", "--model", str(model_dir), "--prompt", "t5", "--compile", "--prompt-cache", "x.kvc"])
    assert code == 2 and "--compile and --prompt-cache" in capsys.readouterr().err
    code = main(["bench", "--model", str(model_dir), "--compile", "--concurrency", "1,2"])
    assert code == 2 and "--compile with --concurrency needs --pages" in capsys.readouterr().err


def test_a_fresh_cache_is_allocated_eagerly_even_for_a_one_token_prompt(model):
    compile_decode(model)
    try:
        cache = _static(model, dict(kv_quantize="int4", group_size=8, residual=8, sink=2, window=16))
        out = _run(model, cache, torch.tensor([[7]]), steps=20)  # the first forward: 1 token, eager
        assert compiled_decode(model).steps == 20
    finally:
        uncompile(model)
    eager = _run(model, _static(model, dict(kv_quantize="int4", group_size=8, residual=8, sink=2, window=16)), torch.tensor([[7]]), steps=20)
    assert torch.equal(out.argmax(-1), eager.argmax(-1))


def test_cli_eval_greedy_compile_scores_what_eager_scores(model_dir, tmp_path, capsys, monkeypatch):
    """``eval greedy --compile`` against ``eval greedy``: every decode step's logits, not only the summaries
    (a compiled step that kept each argmax but moved the logits would score the same prefix match). The prompts
    are the word model's own tokens: the built-in English prompts are all ``t0`` to it, the padding token, whose
    zero embedding makes every logit exactly 0 in any cache, compiled or not (a comparison that cannot fail)."""
    import json

    import kvslim.generate
    from kvslim.cli import main

    steps: list[tuple[str, torch.Tensor]] = []  # (cache class, logits (1, V)) of every decode step, in order
    eager_step = kvslim.generate.decode_one_token

    def recorded(model, token, cache):
        logits = eager_step(model, token, cache)
        steps.append((type(cache).__name__, logits.detach().clone()))
        return logits

    monkeypatch.setattr(kvslim.generate, "decode_one_token", recorded)  # what greedy() calls

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("t5 t9 t17 t33 t65\nt40 t41 t7 t3 t99 t12 t64 t8\nt100 t22\n", encoding="utf-8")

    def run(*flags):
        steps.clear()
        out_json = tmp_path / "g.json"
        argv = ["eval", "greedy", "--model", str(model_dir), "--tokens", "12", "--no-progress", "--json", str(out_json)]
        argv += ["--prompts", str(prompts)]
        argv += ["--config", "int4,group=4,residual=0,sink=0", "--config", "q4_0,sink=2,window=8,group=4,residual=0", *flags]
        code = main(argv)
        _, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out_json.read_text()), err, list(steps)

    eager, _, eager_steps = run()
    compiled, err, compiled_steps = run("--compile")
    assert compiled["results"] == eager["results"]
    assert compiled["compile"]["graphs"] == 3 and "compiled decode step: 3 graph(s)" in err  # none, int4, q4_0
    # every decode step ran the compiled graph on a static cache, and scored what the eager step scored
    assert len(compiled_steps) == len(eager_steps) == compiled["compile"]["steps"] > 30
    assert {name for name, _ in eager_steps} == {"SlimCache"}
    assert {name for name, _ in compiled_steps} == {"StaticSlimCache"}
    eager_logits = torch.cat([logits for _, logits in eager_steps])  # (steps, V)
    assert eager_logits.std(dim=-1).min() > 0.5 and len(set(eager_logits.argmax(-1).tolist())) > 5  # not degenerate
    for i, ((_, a), (_, b)) in enumerate(zip(eager_steps, compiled_steps, strict=True)):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"decode step {i}: {m}")


def test_a_compiled_step_past_max_cache_len_is_refused(model):
    cache = _static(model, dict(kv_quantize="int4", group_size=8, residual=8, sink=0), max_cache_len=12)
    compile_decode(model)
    try:
        with torch.inference_mode():
            prefill(model, torch.randint(3, 128, (1, 11)), cache)
            decode_one_token(model, torch.tensor([[5]]), cache)  # the 12th token: fits
            with pytest.raises(ValueError, match="at most max_cache_len=12 tokens and is full"):
                decode_one_token(model, torch.tensor([[5]]), cache)
    finally:
        uncompile(model)
    assert cache.get_seq_length() == 12


SCHEDULES = [[5, 1, 1, 3, 1, 9, 1, 30, 1, 17], [1, 1, 1, 40, 2, 1, 1]]  # chunks, some longer than the window


@pytest.mark.parametrize(
    "spec",
    [
        dict(kv_quantize="int4", group_size=4, residual=8, sink=3, window=13),
        dict(kv_quantize="q4_1", group_size=4, residual=0, sink=2, window=24),
        dict(kv_quantize="int4", group_size=4, residual=4),
        dict(kv_quantize="none", sink=3, window=13),
    ],
    ids=["int4-window", "q4_1-residual0", "int4-unbounded", "none-window"],
)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=["mixed", "ones-then-40"])
def test_chunks_into_a_cache_that_holds_tokens_match_slimcache(model, spec, schedule):
    """write() after decode steps and after other chunks (old ring tokens encoded, tokens evicted meanwhile)."""
    from kvslim.generate import forward

    uncompile(model)
    ids = torch.randint(3, 128, (2, sum(schedule)), generator=torch.Generator().manual_seed(5))
    ref, static = _reference(model, spec), _static(model, spec)
    start = 0
    with torch.inference_mode():
        for n in schedule:
            chunk = ids[:, start : start + n]
            a, b = forward(model, chunk, ref, logits_to_keep=0), forward(model, chunk, static, logits_to_keep=0)
            torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
            start += n
            assert static.stored_tokens() == ref.stored_tokens()
            assert torch.equal(static.layers[0].keys, ref.layers[0].keys)
            assert torch.equal(static.layers[0].values, ref.layers[0].values)


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "fp8", "fp16"])
def test_encoders_inside_a_trace_write_the_eager_bytes(name, monkeypatch):
    """The branch-free paths the encoders take inside torch.compile (no host sync) give the eager bytes, on the
    data their branches exist for: ties of max and -min, blocks of +-0, zero minima, values near fp16's limits."""
    import kvslim.formats.affine as affine
    import kvslim.formats.floats as floats
    import kvslim.formats.ggml as ggml

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 32, 64, generator=g)
    x[0, 0, :4] = 0.0  # all-zero blocks
    x[0, 1, 4:8] = -0.0
    x[1, 0, 8, :32] = torch.linspace(-1, 1, 32)  # max == -min: a tie
    x[1, 1, 9] = x[1, 1, 9].abs()  # a non-negative block: zero minimum after rounding where it holds a 0
    x[1, 1, 9, 5] = 0.0
    x[1, 1, 10] *= 1e-6  # tiny: float16 subnormals
    for role in ("k", "v"):
        codec = make_codec(name, role, group_size=8)
        eager = codec.encode(x)
        for mod in (affine, floats, ggml):
            monkeypatch.setattr(mod, "tracing", lambda: True)
        traced = codec.encode(x)
        monkeypatch.undo()
        for part in ("token", "group"):
            a, b = getattr(eager, part), getattr(traced, part)
            assert set(a) == set(b)
            for key in a:
                assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), (role, part, key)


def test_eager_decode_past_max_cache_len_is_refused(model):
    uncompile(model)
    cache = _static(model, dict(kv_quantize="int4", group_size=8, residual=8, sink=0), max_cache_len=12)
    with torch.inference_mode():
        prefill(model, torch.randint(3, 128, (1, 12)), cache)
        with pytest.raises(ValueError, match="at most max_cache_len=12 tokens and is full"):
            decode_one_token(model, torch.tensor([[5]]), cache)
    assert cache.get_seq_length() == 12 and cache.stored_tokens() == 12
