"""The compiled decode step over the spec matrix it claims (docs/compile.md; issue 33): a full-precision
residual of 0 (every group encoded on arrival), the lossless ring, fp8, q4_1, and ``positions=original`` —
each compiled under real ``torch.compile`` and checked against the same static cache stepped eagerly.

Cost: one graph per spec, compiled once for the module. Two identical tiny models (same seed): one stays eager,
the other is compiled for the whole module, so every test of a spec reuses that spec's graph (a second cache of
the same spec compiles nothing, which a test checks). The reference is eager on the same inputs (forced tokens,
so a flipped argmax cannot change what is fed): logits to 1e-4, greedy tokens equal, and layer 0's stores and
slot positions: the positions exactly, the integer codes with at most 2% flipped, the fp slots, scales and fp8
codes to 1e-3 (the compiled forward's K/V carry its own rounding: an ulp moves a per-token fp8 scale; measured).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from kvslim import StaticSlimCache
from kvslim.compiled import compile_decode, uncompile
from kvslim.generate import decode_one_token, prefill

MATRIX = {
    "residual=0": dict(kv_quantize="int4", group_size=4, residual=0, max_cache_len=96),  # unbounded, no fp ring
    "q4_1": dict(kv_quantize="q4_1", group_size=4, residual=0, window=24),  # a window, groups encoded on arrival
    "lossless-ring": dict(kv_quantize="none", sink=4, window=20),  # the model's dtype: a ring of window + 1
    "fp8": dict(kv_quantize="fp8", group_size=8, residual=8, sink=2, window=30),
    "positions=original": dict(kv_quantize="int4", group_size=8, residual=8, sink=4, window=20, positions="original"),
}
PROMPT, STEPS = 30, 40  # 70 tokens: every window above wraps, every ring turns over


@pytest.fixture(scope="module")
def models():
    eager = tiny_model(attn_implementation="kvslim")
    compiled = tiny_model(attn_implementation="kvslim")  # the same weights (same seed)
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), compiled.state_dict().values()))
    step = compile_decode(compiled)
    yield eager, compiled, step
    uncompile(compiled)


def _run(model, cache, ids, tokens):
    """Prefill ``ids``, then one decode step per forced token: (B, STEPS, V) logits."""
    out = []
    with torch.inference_mode():
        prefill(model, ids, cache)
        for i in range(tokens.shape[1]):
            out.append(decode_one_token(model, tokens[:, i : i + 1], cache))
    return torch.stack(out, dim=1)


def _codes(cache) -> dict[str, torch.Tensor]:
    """Layer 0's stored tensors: the full-precision slots (``fp.k``, ``fp.v``), their positions and the encoded
    bodies."""
    s = cache.stores()[0]
    out = {"fp_pos": s.fp_pos, "body_pos": s.body_pos, "fp.k": s.k_fp, "fp.v": s.v_fp}
    for role, body in (("k", s.k_body), ("v", s.v_body)):
        if body is None:  # lossless: no encoded body, the ring is k_fp / v_fp
            continue
        out.update({f"{role}.token.{n}": t for n, t in body.token.items()})
        out.update({f"{role}.group.{n}": t for n, t in body.group.items()})
    return {n: t.clone() for n, t in out.items() if t is not None}


_RUNS: dict[str, dict] = {}  # spec name -> what its eager and compiled runs produced (computed once)


def _spec_run(models, name):
    if name not in _RUNS:
        eager_model, compiled_model, step = models
        spec = MATRIX[name]
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(3, 128, (1, PROMPT), generator=g)
        tokens = torch.randint(3, 128, (1, STEPS), generator=g)
        before = (step.compiles, step.steps)
        eager_cache = StaticSlimCache(config=eager_model.config, **spec)
        compiled_cache = StaticSlimCache(config=compiled_model.config, **spec)
        eager = _run(eager_model, eager_cache, ids, tokens)
        compiled = _run(compiled_model, compiled_cache, ids, tokens)
        _RUNS[name] = dict(
            spec=spec, ids=ids, tokens=tokens, eager=eager, compiled=compiled,
            eager_codes=_codes(eager_cache), compiled_codes=_codes(compiled_cache),
            stored=(eager_cache.stored_tokens(), compiled_cache.stored_tokens()),
            compiles=step.compiles - before[0], steps=step.steps - before[1],
        )  # fmt: skip
    return _RUNS[name]


#: Found by this matrix (issue 33): with positions=original (sink=4, window=20) the compiled step's logits leave
#: the eager static step's (26% of the logits off by more than 1e-4, max |diff| 0.018 at decode step 30; greedy tokens
#: still equal), where every other spec agrees to 1e-4. strict: the test fails as soon as it is fixed.
ORIGINAL_DIVERGES = pytest.mark.xfail(
    strict=True, reason="compiled positions=original drifts from the eager static step after the window wraps"
)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=ORIGINAL_DIVERGES) if n == "positions=original" else n for n in MATRIX]
)
def test_compiled_step_scores_what_the_eager_step_scores(models, name):
    run = _spec_run(models, name)
    assert run["compiles"] == 1 and run["steps"] == STEPS  # one graph served every decode step
    assert torch.equal(run["compiled"].argmax(-1), run["eager"].argmax(-1))
    torch.testing.assert_close(run["compiled"], run["eager"], atol=1e-4, rtol=1e-4)
    assert run["stored"][0] == run["stored"][1]


@pytest.mark.parametrize("name", list(MATRIX))
def test_compiled_step_writes_the_eager_codes(models, name):
    run = _spec_run(models, name)
    eager, compiled = run["eager_codes"], run["compiled_codes"]
    assert eager.keys() == compiled.keys()
    for part in eager:
        a, b = eager[part], compiled[part]
        assert a.shape == b.shape and a.dtype == b.dtype, part
        if part.endswith("_pos"):  # which token sits in which slot: exactly
            assert torch.equal(b, a), part
        elif a.is_floating_point():  # fp slots, scales, fp8 codes: the compiled forward's K/V carry its own rounding
            torch.testing.assert_close(b.float(), a.float(), atol=1e-3, rtol=1e-2, msg=lambda m, part=part: f"{part}: {m}")
        else:  # integer codes: one flips only where a value sits on a rounding boundary
            assert (b != a).float().mean() <= 0.02, part


@pytest.mark.parametrize("name", list(MATRIX))
def test_a_second_cache_of_the_same_spec_reuses_the_graph(models, name):
    """The graph is the spec's, not the cache object's: a fresh cache (another prompt) compiles nothing."""
    run = _spec_run(models, name)
    _, compiled_model, step = models
    before = step.compiles
    cache = StaticSlimCache(config=compiled_model.config, **run["spec"])
    again = _run(compiled_model, cache, run["ids"][:, :11], run["tokens"][:, :8])
    assert step.compiles == before
    assert torch.isfinite(again).all()
