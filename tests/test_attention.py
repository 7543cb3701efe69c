"""The compressed attention path ("kvslim") against the materializing path (sdpa) and against sdpa itself."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvslim
from conftest import tiny_model
from kvslim import SlimCache
from kvslim.cache.segments import Segments
from kvslim.generate import forward


def _ids(length, seed=0, batch=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _run(model, cache, ids, prefill, attention_mask=None):
    """Prefill, then one token at a time; returns all logits (B, T, V)."""
    am = None if attention_mask is None else attention_mask[:, :prefill]
    out = [forward(model, ids[:, :prefill], cache, attention_mask=am, logits_to_keep=0)]
    for t in range(prefill, ids.shape[1]):
        am = None if attention_mask is None else attention_mask[:, : t + 1]
        out.append(forward(model, ids[:, t : t + 1], cache, attention_mask=am, logits_to_keep=0))
    return torch.cat(out, dim=1)


def test_kvslim_attention_with_other_caches_is_sdpa():
    model = tiny_model("llama")
    ids = _ids(20)
    with torch.no_grad():
        ref = _run(model, DynamicCache(config=model.config), ids, 12)
        kvslim.enable(model)
        got = _run(model, DynamicCache(config=model.config), ids, 12)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


SPECS = [
    dict(kv_quantize="none"),
    dict(kv_quantize="int8", group_size=4, residual=8),
    dict(kv_quantize="int4", group_size=8, residual=0),
    dict(kv_quantize="int2", group_size=4, residual=4),
    dict(kv_quantize="q8_0", residual=0, group_size=1),
    dict(kv_quantize="q4_0", residual=4, group_size=4),
    dict(kv_quantize="q4_1", residual=0, group_size=1),
    dict(kv_quantize="q5_0", residual=0, group_size=1),
    dict(kv_quantize="q5_1", residual=0, group_size=1),
    dict(kv_quantize="fp8", residual=0, group_size=1),
    dict(kv_quantize="fp16", residual=0, group_size=1),
    dict(kv_quantize="bf16", residual=0, group_size=1),
    dict(kv_quantize="int4", k_quantize="q4_0", residual=0, group_size=1),
    dict(kv_quantize="int4", sink=2, window=9, group_size=4, residual=4),
    dict(kv_quantize="q4_0", sink=3, window=12, residual=0, group_size=1),
]


CASES = [("llama", s) for s in SPECS] + [("qwen3", SPECS[i]) for i in (0, 2, 5, 13)]


@pytest.mark.parametrize(
    "arch,spec", CASES, ids=[f"{a}-" + ",".join(f"{k}={v}" for k, v in s.items()) for a, s in CASES]
)
def test_compressed_path_equals_materializing_path(arch, spec):
    model = tiny_model(arch, head_dim=32)
    ids = _ids(40, seed=1)
    with torch.no_grad():
        ref = _run(model, SlimCache(config=model.config, **spec), ids, 17)
        kvslim.enable(model)
        got = _run(model, SlimCache(config=model.config, **spec), ids, 17)
    # fp32 summation order differs; in lossy formats a 1e-7 change in a deeper layer's K can flip a code
    # at a rounding tie (measured: qwen3 + q4_0 flips one on this CPU, a 1.3e-3 logit change, where the CI
    # machine of an earlier round did not), so the bound is above one flipped code and far below a wrong mask
    # or segment (O(0.1)).
    torch.testing.assert_close(got, ref, atol=5e-3, rtol=1e-4)


def test_compressed_path_is_taken():
    model = tiny_model("llama", attn_implementation="kvslim")
    cache = SlimCache(kv_quantize="int4", group_size=4, residual=0, config=model.config)
    seen = []
    from kvslim import attention

    orig = attention.compressed_attention

    def spy(query, kv, mask, scaling):
        seen.append(isinstance(kv, Segments))
        return orig(query, kv, mask, scaling)

    attention.compressed_attention = spy
    try:
        with torch.no_grad():
            _run(model, cache, _ids(24), 20)  # a 20-token prefill (> FAST_MAX_QUERY) then 4 decode steps
    finally:
        attention.compressed_attention = orig
    assert seen and all(seen)
    assert len(seen) == 4 * model.config.num_hidden_layers  # 4 decode steps; the prefill took sdpa


def test_compressed_generate_left_padded_batch_matches_sdpa():
    model = tiny_model("llama")
    ids = _ids(12, seed=2, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, attention_mask=mask)
    spec = dict(kv_quantize="q8_0", sink=2, window=10, residual=0, group_size=1)
    ref = model.generate(ids, cache=SlimCache(config=model.config, **spec), **kw)
    kvslim.enable(model)
    got = model.generate(ids, cache=SlimCache(config=model.config, **spec), **kw)
    assert torch.equal(got, ref)


def test_bf16_model_compressed_path():
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = _ids(24)
    spec = dict(kv_quantize="int8", group_size=4, residual=4)
    with torch.no_grad():
        ref = _run(model, SlimCache(config=model.config, **spec), ids, 16).float()
        kvslim.enable(model)
        got = _run(model, SlimCache(config=model.config, **spec), ids, 16).float()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


# pre_rope=False: the formats with keys after RoPE; the last spec keeps int2's default, keys stored before RoPE,
# which the fused call reads through a key transform (the rows call, one row; tests/test_fused_fitted.py).
FUSED_SPECS = [dict(s, pre_rope=False) for s in SPECS[1:]] + [
    dict(kv_quantize="int4", group_size=8, residual=8, rotate="kv", pre_rope=False),  # a Hadamard basis on K and V
    dict(kv_quantize="q4_0", residual=4, group_size=4, rotate="kv", sink=2, window=11, pre_rope=False),
    dict(kv_quantize="int8", k_quantize="q8_0", group_size=4, residual=4, sink=1, window=10, pre_rope=False),
    dict(kv_quantize="int2", group_size=4, residual=4),
]


@pytest.mark.parametrize("spec", FUSED_SPECS, ids=[",".join(f"{k}={v}" for k, v in s.items()) for s in FUSED_SPECS])
def test_fused_decode_attention_equals_the_op_by_op_path(spec, monkeypatch):
    """A decode step's attention as one C call (attention._fused_decode) against the same step computed op by
    op (FUSED_DECODE off): the same logits up to the order of fp32 sums, for every format the C kernels read,
    with sinks, a window (a partly evicted first group), a residual and a rotated basis."""
    from kvslim import attention

    model = tiny_model("llama", head_dim=32, attn_implementation="kvslim")
    ids = _ids(40, seed=2)
    calls = []
    orig = attention._fused_decode

    def spy(qf, kv):
        out = orig(qf, kv)
        calls.append(out is not None)
        return out

    with torch.no_grad():
        monkeypatch.setattr(attention, "FUSED_DECODE", False)
        ref = _run(model, SlimCache(config=model.config, **spec), ids, 17)
        monkeypatch.setattr(attention, "FUSED_DECODE", True)
        monkeypatch.setattr(attention, "_fused_decode", spy)
        got = _run(model, SlimCache(config=model.config, **spec), ids, 17)
    if not kvslim.kernels.cpu.status()[0]:
        pytest.skip("no C compiler: the fused call needs the C kernels")
    assert any(calls)  # the fused call served decode steps (pre-RoPE keys too)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hk", "n", "t"), [(9, 3, 32, 300), (4, 2, 17, 17), (8, 1, 64, 1000)])
def test_masked_gqa_sdpa_is_bit_for_bit_transformers_with_no_kv_copies(monkeypatch, dtype, hq, hk, n, t):
    """kvslim.attention.sdpa asks sdpa for GQA where transformers copies each KV head (a mask and several queries):
    the same bits as transformers' sdpa_attention_forward, bool and additive masks alike, and no repeat_kv."""
    import types

    import transformers.integrations.sdpa_attention as tsdpa

    from kvslim.attention import sdpa

    g = torch.Generator().manual_seed(n + t)
    q = torch.randn(1, hq, n, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, hk, t, 64, generator=g).to(dtype) for _ in range(2))
    bool_mask = torch.ones(n, t, dtype=torch.bool).tril(t - n)[None, None]
    module = types.SimpleNamespace(num_key_value_groups=hq // hk, training=False)
    real, copies = tsdpa.repeat_kv, []
    for mask in (bool_mask, torch.where(bool_mask, 0.0, float("-inf")).to(dtype)):
        want = tsdpa.sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)[0]
        monkeypatch.setattr(tsdpa, "repeat_kv", lambda x, r: copies.append(r) or real(x, r))
        got = sdpa(module, q, k, v, mask, 0.0, 0.125, {})[0]
        monkeypatch.setattr(tsdpa, "repeat_kv", real)
        assert torch.equal(got, want) and copies == []
