"""StreamingLLM positions: where kept keys sit (``original`` vs the paper's ``cache``), bounded position
ids for endless streams (re-basing), in both attention paths — against independent references."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvslim
from conftest import tiny_model
from kvslim import SlimCache
from kvslim.cache.rotary import Rotary
from kvslim.generate import decode_one_token, forward, generate, prefill

MODES = ["original", "cache"]


def _ids(length, seed=0, batch=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _layer0_keys(model, ids, positions):
    """Layer 0's keys of ``ids`` (1, T) rotated at ``positions`` (T,): in layer 0 a key depends on its
    token and position only, so this is the independent reference for what any cache should hold."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, position_ids=torch.as_tensor(positions)[None], use_cache=True)
    return cache.layers[0].keys  # (1, H, T, D)


def _stream(model, cache, ids, chunk):
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            forward(model, ids[:, s : s + chunk], cache, logits_to_keep=1)


# -- the keys attention sees -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("period", [None, 16])
def test_stored_keys_sit_at_the_expected_positions(mode, chunk, period):
    """After many evictions (and, with a period, many re-bases of the position ids) the keys the
    materializing path hands attention equal layer-0 keys computed directly at the positions the mode
    asks for, in the frame of the last forward's position ids."""
    model = tiny_model("llama")
    sink, window, n = 3, 9, 61
    ids = _ids(n, seed=1)
    cache = SlimCache(sink=sink, window=window, positions=mode, config=model.config)
    cache.rebase_period = period
    _stream(model, cache, ids, chunk)
    store = cache.layers[0].store
    keys, _ = store.read(torch.float32)  # what the next forward would see (before its own tokens)
    seen = store.seen
    kept = list(range(sink)) + list(range(seen - window, seen))  # true positions of the kept tokens
    base = store.base
    if mode == "original":
        want = [p - base for p in kept]
    else:  # contiguous: sinks right before the window
        want = [seen - window - sink + j - base for j in range(sink)] + [p - base for p in kept[sink:]]
    ref = _layer0_keys(model, ids[:, kept], want)
    torch.testing.assert_close(keys, ref, atol=2e-5, rtol=1e-5)
    if period:
        assert base > 0  # the ids really were re-based


# -- exactness where nothing is evicted -----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["none", "int8"])
def test_window_longer_than_text_is_the_identity(mode, fmt):
    model = tiny_model("llama")
    ids = _ids(30, seed=3)
    with torch.no_grad():
        ref = forward(model, ids, DynamicCache(config=model.config), logits_to_keep=0)
        slim = SlimCache(kv_quantize=fmt, sink=4, window=1000, positions=mode, config=model.config)
        got = torch.cat(
            [forward(model, ids[:, :20], slim, logits_to_keep=0)]
            + [forward(model, ids[:, t : t + 1], slim, logits_to_keep=0) for t in range(20, 30)],
            dim=1,
        )
    bound = 1e-5 if fmt == "none" else 0.05
    torch.testing.assert_close(got, ref, atol=bound, rtol=0)


# -- re-basing changes nothing ----------------------------------------------------------------------------


def _decode_logits(model, cache, ids, prefill_len):
    with torch.no_grad():
        out = [prefill(model, ids[:, :prefill_len], cache)]
        for t in range(prefill_len, ids.shape[1]):
            out.append(decode_one_token(model, ids[:, t : t + 1], cache))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
def test_rebased_position_ids_give_the_same_logits(mode, attn):
    """Re-basing every 16 tokens (runs of keys from two frames in the window, moved at read time: keys in
    the materializing path, queries in the compressed one) equals never re-basing."""
    model = tiny_model("llama", head_dim=32)
    if attn == "kvslim":
        kvslim.enable(model)
    ids = _ids(90, seed=4)
    kw = dict(sink=2, window=11, positions=mode, config=model.config)
    plain = SlimCache(**kw)
    plain.rebase_period = None
    rebased = SlimCache(**kw)
    rebased.rebase_period = 16
    a = _decode_logits(model, plain, ids, 7)
    b = _decode_logits(model, rebased, ids, 7)
    assert rebased.layers[0].store.base > 0
    torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "spec",
    [dict(kv_quantize="int4", group_size=4, residual=4), dict(kv_quantize="q8_0", residual=0, group_size=1)],
    ids=["int4", "q8_0"],
)
def test_rebased_lossy_compressed_path_equals_materializing_path(mode, spec):
    """Lossy stores hold other codes once keys are rotated from another base (so they are compared with
    the identity through the KL they cost); the two attention paths read the same codes identically."""
    model = tiny_model("llama", head_dim=32)
    ids = _ids(90, seed=4)
    kw = dict(sink=2, window=11, positions=mode, config=model.config, **spec)

    def run(attn):
        if attn:
            kvslim.enable(model)
        cache = SlimCache(**kw)
        cache.rebase_period = 16
        return _decode_logits(model, cache, ids, 7)

    ref_cache = SlimCache(**{**kw, "kv_quantize": "none"})
    ref = _decode_logits(model, ref_cache, ids, 7)
    mat = run(False)
    comp = run(True)
    torch.testing.assert_close(comp, mat, atol=5e-4, rtol=1e-4)
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(mat.double(), -1)
    assert (p.exp() * (p - q)).sum(-1).mean() < 0.05


@pytest.mark.parametrize("attn", ["sdpa", "kvslim"])
def test_rebasing_keeps_mean_centering_exact(attn):
    """A mean-centered K body (q8_0), re-based every 16 tokens, reads as the plain keys up to the format's
    error, in both attention paths (re-based runs of keys: moved keys when materialized, moved queries and
    their ``q . bias`` on the compressed codes). The keys get a large shared zero point: a k_proj bias on the
    slow RoPE channel pairs only (at cache positions, < 30, they turn by < 0.3 rad), so the bias handed to
    the stores is nearly every key's offset and every token is stored centered (a lossless format would drop
    the bias and test nothing). A path that forgets to add the bias back (scores or decoded keys) costs a
    KL far above the bound. Measured: KL 2.8e-5 against the uncentered identity cache (4.1e-5 without
    centering), 1.2e-6 re-based vs not."""
    model = tiny_model("llama", head_dim=32, attention_bias=True)
    heads = model.config.num_key_value_heads
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            bias = torch.randn(heads, 32, generator=torch.Generator().manual_seed(i)) * 4  # (H_kv, D)
            bias[:, :8] = bias[:, 16:24] = 0  # the fast pairs (i, i + 16), i < 8, would spread it by position
            layer.self_attn.k_proj.bias.copy_(bias.reshape(-1))  # (H_kv * D,)
    if attn == "kvslim":
        kvslim.enable(model)
    ids = _ids(70, seed=5)
    kw = dict(sink=2, window=9, positions="cache", config=model.config)
    ref = SlimCache(kv_quantize="none", **kw)
    ref.rebase_period = None

    def centered(period):
        cache = SlimCache(kv_quantize="q8_0", group_size=1, residual=0, rotate="none", pre_rope=False, **kw)
        cache.rebase_period = period
        for store, layer in zip(cache.stores(), model.model.layers, strict=True):
            store.k_bias = layer.self_attn.k_proj.bias.detach().reshape(heads, 32)
        return _decode_logits(model, cache, ids, 5)

    a = _decode_logits(model, ref, ids, 5)
    b = centered(16)
    assert _kl(a, b) < 1e-4
    assert _kl(centered(None), b) < 1e-5


def _kl(ref, got):
    """Mean KL(ref || got) of (B, T, V) logits."""
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


# -- the library loop and generate() agree --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_generate_and_library_loop_same_tokens(mode):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = _ids(12, seed=6)
    kw = dict(
        kv_quantize="int8", sink=2, window=10, group_size=4, residual=4, positions=mode, config=model.config
    )
    ref = model.generate(ids, cache=SlimCache(**kw), max_new_tokens=40, do_sample=False, pad_token_id=0)
    cache = SlimCache(**kw)
    cache.rebase_period = 16  # our loop re-bases; generate() feeds absolute ids
    ours = [e.tokens[0] for e in generate(model, ids, cache, max_new_tokens=40)]
    assert ours == ref[0, 12:].tolist()


# -- endless streams ----------------------------------------------------------------------------------------


def test_stream_past_2_to_the_24_matches_small_positions():
    """A stream that has already seen 2^24 + 1000 tokens (simulated: the counters start there) decodes with
    the same logits as a fresh one in 'cache' mode, because the ids handed to the model stay bounded."""
    model = tiny_model("llama")
    ids = _ids(60, seed=7)
    kw = dict(sink=2, window=12, positions="cache", config=model.config)
    fresh = SlimCache(**kw)
    a = _decode_logits(model, fresh, ids, 9)
    far = SlimCache(**kw)
    far.set_left_padding(None)
    offset = 2**24 + 1000
    for store in far.stores():
        store.seen = offset
    b = _decode_logits(model, far, ids, 9)
    assert far.get_seq_length() == offset + 60
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    # without bounded ids (what feeding absolute positions does) fp32 RoPE at 2^24 is far off
    unbounded = SlimCache(**kw)
    unbounded.rebase_period = None
    unbounded.set_left_padding(None)
    for store in unbounded.stores():
        store.seen = offset
    c = _decode_logits(model, unbounded, ids, 9)
    assert (c - a).abs().max() > 100 * (b - a).abs().max()


# -- the rotation itself ------------------------------------------------------------------------------------


def test_rotary_moves_compose_and_match_the_model():
    model = tiny_model("llama")
    rot = SlimCache(config=model.config).rotary
    assert isinstance(rot, Rotary) and rot.rotary_dim == 32
    ids = _ids(5, seed=8)
    at0 = _layer0_keys(model, ids, [0, 1, 2, 3, 4])
    at7 = _layer0_keys(model, ids, [7, 8, 9, 10, 11])
    torch.testing.assert_close(rot.move(at0, 7), at7, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rot.move(rot.move(at0, 2**24), -(2**24)), at0, atol=1e-5, rtol=1e-5)
    assert rot.move(at0, 0) is at0  # a zero move is exact


def test_cache_positions_need_a_movable_rope():
    import transformers as tf

    cfg = tf.CohereConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(ValueError, match="positions='cache' re-rotates"):
        SlimCache(sink=2, window=8, positions="cache", config=cfg)
    assert SlimCache(sink=2, window=8, positions="original", config=cfg).rebase_period is None


def test_positions_option_is_validated():
    with pytest.raises(ValueError, match="positions must be one of"):
        SlimCache(positions="absolute")
    assert kvslim.parse_spec("int4,sink=4,window=60,positions=cache").positions == "cache"


def test_cache_fed_outside_the_loop_is_not_rebased():
    """A cache whose first tokens came through cache.update directly (no padding handed) reads ids by
    transformers' convention; kvslim's loop must then not re-base them (it would look like padding)."""
    model = tiny_model("llama")
    cache = SlimCache(kv_quantize="int4", sink=2, window=10, group_size=4, residual=4, config=model.config)
    cache.rebase_period = 16
    g = torch.Generator().manual_seed(9)
    for i in range(model.config.num_hidden_layers):
        cache.update(torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g), i)
    with torch.no_grad():
        for t in range(5):
            decode_one_token(model, _ids(1, seed=t), cache)
    store = cache.layers[0].store
    assert store.base == 0 and int(store.pads.max()) == 0 and store.stored == 12
