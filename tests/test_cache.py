"""SlimCache against transformers' DynamicCache and against an independent eviction reference."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import ARCHS, tiny_config, tiny_model
from kvslim import SlimCache
from kvslim.formats import format_names
from kvslim.generate import forward

LOSSY = [f for f in format_names() if f != "none"]


def _prompt(batch=1, length=12, seed=1, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def _left_pad(ids: torch.Tensor, pads: list[int], pad_id: int = 0):
    """Left-pad each row of ids (B, T) by pads[b] tokens (truncating from the left to keep T)."""
    rows, masks = [], []
    for b, p in enumerate(pads):
        row = torch.cat([torch.full((p,), pad_id), ids[b, : ids.shape[1] - p]])
        rows.append(row)
        masks.append(
            torch.cat([torch.zeros(p, dtype=torch.long), torch.ones(ids.shape[1] - p, dtype=torch.long)])
        )
    return torch.stack(rows), torch.stack(masks)


def _prefill_then_decode(model, cache, ids, prefill):
    """Logits (B, T, V) of a prefill of ``prefill`` tokens, then one token per forward, through ``cache``."""
    out = [forward(model, ids[:, :prefill], cache, logits_to_keep=0)]
    out += [forward(model, ids[:, t : t + 1], cache, logits_to_keep=0) for t in range(prefill, ids.shape[1])]
    return torch.cat(out, dim=1)  # float32 (generate.forward upcasts the logits)


# -- identity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_logits_match_dynamic_cache(arch):
    model = tiny_model(arch)
    ids = _prompt(length=20)
    with torch.no_grad():
        ref_cache, slim = DynamicCache(config=model.config), SlimCache(config=model.config)
        for chunk in (ids[:, :13], ids[:, 13:17], ids[:, 17:18], ids[:, 18:]):
            a = model(chunk, cache=ref_cache, use_cache=True).logits
            b = model(chunk, cache=slim, use_cache=True).logits
            torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    assert slim.get_seq_length() == 20 == slim.stored_tokens()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_identity_generate_matches(arch, mode):
    model = tiny_model(arch)
    ids = _prompt(length=10)
    kw = dict(max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    if mode == "greedy":
        kw.update(do_sample=False)
    else:
        kw.update(do_sample=True, temperature=0.9, top_p=0.95)
    torch.manual_seed(5)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    torch.manual_seed(5)
    out = model.generate(ids, cache=SlimCache(config=model.config), **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_identity_batch_left_padding(arch):
    model = tiny_model(arch)
    ids, mask = _left_pad(_prompt(batch=3, length=11), [0, 3, 6])
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0, attention_mask=mask)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    out = model.generate(ids, cache=SlimCache(config=model.config), **kw)
    assert torch.equal(out, ref)


def test_identity_beam_search():
    model = tiny_model("llama")
    ids = _prompt(batch=2, length=8)
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0, early_stopping=True)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    out = model.generate(ids, cache=SlimCache(config=model.config), **kw)
    assert torch.equal(out, ref)


def test_cache_kwarg_and_past_key_values_kwarg_both_work():
    model = tiny_model("llama")
    ids = _prompt(length=9)
    with torch.no_grad():
        a = model(ids, cache=SlimCache(config=model.config)).logits
        b = model(ids, past_key_values=SlimCache(config=model.config)).logits
        c = model(ids, use_cache=False).logits
    torch.testing.assert_close(a, c, atol=1e-6, rtol=0)
    torch.testing.assert_close(b, c, atol=1e-6, rtol=0)


def test_without_config_layers_are_created_lazily():
    model = tiny_model("llama")
    ids = _prompt(length=9)
    with torch.no_grad():
        cache = SlimCache(kv_quantize="int8", residual=0, group_size=1)
        model(ids, cache=cache)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert cache.stored_tokens() == 9


# -- StreamingLLM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_window_longer_than_text_changes_nothing(arch):
    model = tiny_model(arch)
    ids = _prompt(length=30)
    with torch.no_grad():
        full = model(ids).logits
        slim = SlimCache(sink=4, window=1000, config=model.config)
        step = torch.cat(
            [model(ids[:, :20], cache=slim).logits]
            + [model(ids[:, t : t + 1], cache=slim).logits for t in range(20, 30)],
            dim=1,
        )
    torch.testing.assert_close(step, full, atol=1e-5, rtol=0)


def _reference_streaming_logits(model, ids, sink, window, chunk, positions="original"):
    """An independent StreamingLLM: a plain DynamicCache whose layers are cut to sinks + window by hand after
    every forward, fed with explicit absolute position ids. ``original``: every key keeps its rotation
    (vanilla). ``cache`` (the paper): before each forward the sink keys are re-rotated, with the model's
    own rotary module and rotate_half, to sit right before the window's first key."""
    from transformers.models.llama.modeling_llama import rotate_half

    cache = DynamicCache(config=model.config)
    rotary = model.model.rotary_emb
    outs = []
    seen = 0
    original_sinks: list[torch.Tensor | None] = []
    for s in range(0, ids.shape[1], chunk):
        piece = ids[:, s : s + chunk]
        if positions == "cache" and original_sinks:
            for layer, k0 in zip(cache.layers, original_sinks, strict=True):
                n_window = layer.keys.shape[2] - sink
                shift = seen - n_window - sink  # sink j moves from position j to (first window pos) - sink + j
                cos, sin = rotary(k0, torch.full((1, sink), shift))  # (1, sink, D) at position `shift`
                cos, sin = cos[:, None], sin[:, None]
                layer.keys = torch.cat([k0 * cos + rotate_half(k0) * sin, layer.keys[:, :, sink:]], dim=2)
        pos = torch.arange(seen, seen + piece.shape[1])[None]
        outs.append(model(piece, cache=cache, position_ids=pos).logits)
        seen += piece.shape[1]
        if not original_sinks and seen >= sink:
            original_sinks = [layer.keys[:, :, :sink].clone() for layer in cache.layers]
        for layer in cache.layers:
            if layer.keys.shape[2] > sink + window:
                layer.keys = torch.cat([layer.keys[:, :, :sink], layer.keys[:, :, -window:]], dim=2)
                layer.values = torch.cat([layer.values[:, :, :sink], layer.values[:, :, -window:]], dim=2)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_streaming_matches_independent_reference(arch, chunk, positions):
    """Chunked prefill far past the window (5x), not only 1-token decode, in both position semantics."""
    model = tiny_model(arch)
    sink, window = 3, 10
    ids = _prompt(length=50)
    with torch.no_grad():
        ref = _reference_streaming_logits(model, ids, sink, window, chunk, positions)
        slim = SlimCache(sink=sink, window=window, positions=positions, config=model.config)
        got = torch.cat(
            [model(ids[:, s : s + chunk], cache=slim).logits for s in range(0, ids.shape[1], chunk)], dim=1
        )
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert slim.stored_tokens() == sink + window
    assert slim.get_seq_length() == 50


def test_streaming_generate_bounded_and_flat():
    model = tiny_model("llama")
    sink, window = 4, 16
    cache = SlimCache(
        kv_quantize="int4", sink=sink, window=window, group_size=4, residual=8, config=model.config
    )
    ids = _prompt(length=6)
    sizes = []
    with torch.no_grad():
        logits = model(ids, cache=cache).logits
        tok = logits[:, -1:].argmax(-1)
        for _ in range(3 * window):
            logits = model(tok, cache=cache).logits
            tok = logits[:, -1:].argmax(-1)
            sizes.append((cache.stored_tokens(), cache.live_nbytes(), cache.nbytes()))
    assert all(layer.store.stored == sink + window for layer in cache.layers)
    full = [s for s in sizes if s[0] == sink + window]
    assert len(full) > 2 * window  # it reached the cap early and stayed there
    # live bytes cycle with the K group boundary (group_size=4 distinct splits of fp residual vs codes) ...
    assert len({s[1] for s in full}) <= 4
    # ... and the memory held stops moving once the buffers reached their steady size
    assert len({s[2] for s in sizes[-window:]}) == 1


@pytest.mark.parametrize("fmt", ["none", "int8", "q8_0"])
def test_streaming_left_padded_batch_rows_match_unpadded(fmt):
    """Pads are not sinks: each row of a left-padded batch behaves as the same row alone."""
    model = tiny_model("llama")
    sink, window, pads = 2, 12, [0, 3, 7]
    ids, mask = _left_pad(_prompt(batch=3, length=14, seed=3), pads)
    # residual 16: a padded row's sinks slide onto its first real tokens while they are still at full
    # precision (once encoded, sinks taken from the stream carry the format's rounding, which a row
    # alone never sees — a lossy difference that can flip a near-tie greedy token)
    kw = dict(kv_quantize=fmt, sink=sink, window=window, group_size=4, residual=16)
    new = 30
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            cache=SlimCache(config=model.config, **kw),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        for b, p in enumerate(pads):
            alone = model.generate(
                ids[b : b + 1, p:],
                cache=SlimCache(config=model.config, **kw),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            assert torch.equal(out[b, ids.shape[1] :], alone[0, ids.shape[1] - p :]), f"row {b} (pads {p})"


def test_streaming_sinks_are_first_tokens_and_window_is_last():
    """With an identity codec the stored keys are exactly the keys of positions [0, sink) + [seen-window, seen)."""
    model = tiny_model("llama")
    ids = _prompt(length=41)
    sink, window = 3, 7
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        model(ids, cache=ref)
        slim = SlimCache(sink=sink, window=window, positions="original", config=model.config)
        for s in range(0, 41, 6):
            model(ids[:, s : s + 6], cache=slim)
    # Layer 0's keys depend on the token and position only (deeper layers see evicted context differently).
    ref_layer, layer = ref.layers[0], slim.layers[0]
    k, v = layer.store.read(torch.float32)
    for got, full in ((k, ref_layer.keys), (v, ref_layer.values)):
        want = torch.cat([full[:, :, :sink], full[:, :, -window:]], dim=2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# -- lossy formats -----------------------------------------------------------------------------------------


def _kl(ref_logits, logits):
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.mark.parametrize("fmt", LOSSY)
def test_lossy_formats_stay_close(fmt):
    model = tiny_model("llama", head_dim=32)
    ids = _prompt(length=48)
    with torch.no_grad():
        full = model(ids).logits
        cache = SlimCache(kv_quantize=fmt, group_size=8, residual=8, config=model.config)
        got = _prefill_then_decode(model, cache, ids, 16)
    kl = _kl(full, got)
    assert torch.isfinite(kl).all()
    bound = {"int2": 0.5, "int3": 0.1, "q4_0": 0.05, "q4_1": 0.05, "int4": 0.05, "fp8": 0.02}.get(fmt, 0.005)
    assert kl.mean().item() < bound, (fmt, kl.mean().item())


def test_per_tensor_formats():
    model = tiny_model("llama")
    cache = SlimCache(
        kv_quantize="int8", k_quantize="q4_0", v_quantize="fp8", residual=0, group_size=1, sink=0, config=model.config
    )
    with torch.no_grad():
        model(_prompt(length=8), cache=cache)
    store = cache.layers[0].store
    assert store.k.codec.name == "q4_0" and store.v.codec.name == "fp8"
    assert store.k.n_body == 8 and store.v.n_body == 8


def test_residual_and_group_bound():
    """Between residual and residual + group - 1 tokens of each stream stay in fp; bodies are whole groups."""
    model = tiny_model("llama")
    g, r = 8, 16
    cache = SlimCache(kv_quantize="int4", group_size=g, residual=r, sink=0, config=model.config)
    with torch.no_grad():
        model(_prompt(length=5), cache=cache)
        for n in range(5, 60):
            store = cache.layers[0].store
            assert len(store.k.fp) <= r + g - 1 and len(store.k.fp) >= min(n, r)
            assert len(store.v.fp) == len(store.k.fp)
            assert store.k.n_body % g == 0
            model(_prompt(length=1, seed=n), cache=cache)


def test_append_never_requantizes():
    """Encoded tokens are never touched again: their codes are bit-identical after more appends."""
    model = tiny_model("llama")
    cache = SlimCache(kv_quantize="q4_0", residual=0, group_size=1, sink=0, config=model.config)
    with torch.no_grad():
        model(_prompt(length=10), cache=cache)
        before = cache.layers[1].store.k.tokens["blocks"].view().clone()
        for t in range(20):
            model(_prompt(length=1, seed=t), cache=cache)
        after = cache.layers[1].store.k.tokens["blocks"].view()[:, :, :10]
    assert torch.equal(before, after)


# -- accounting -------------------------------------------------------------------------------------------


def _real_tensor_bytes(cache):
    """Bytes of every tensor storage reachable from the cache object, found by walking its object graph
    (attributes, dicts, lists, tuples, slots) — independent of the fields ``components()`` lists."""
    seen_objs, storages = set(), {}
    stack = [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objs or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype)):
            continue
        seen_objs.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
            continue
        if isinstance(obj, (torch.nn.Module, type)) or type(obj).__module__.startswith("transformers.configuration"):
            continue  # the model / its config are not the cache's
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, slot, None))
            if hasattr(obj, "func"):  # functools.partial
                stack.extend([obj.func, *obj.args, *obj.keywords.values()])
            if hasattr(obj, "__self__"):  # bound methods
                stack.append(obj.__self__)
    return sum(storages.values())


@pytest.mark.parametrize("fmt", ["none", "int4", "int2", "q4_0", "fp8", "bf16"])
def test_nbytes_equals_real_tensors(fmt):
    model = tiny_model("llama")
    bias = [torch.randn(2, 32) for _ in range(2)] if fmt == "q4_0" else None
    cache = SlimCache(
        kv_quantize=fmt, sink=2, window=30, group_size=8, residual=8, mean_center=bias, config=model.config
    )
    with torch.no_grad():
        model(_prompt(length=25), cache=cache)
        for t in range(20):
            model(_prompt(length=1, seed=t), cache=cache)
    assert cache.nbytes() == _real_tensor_bytes(cache)
    rep = cache.report()
    assert rep["cache_bytes"] == sum(rep["components"].values())
    assert rep["tokens_stored"] == 32 and rep["tokens_seen"] == 45
    assert rep["fp16_full_cache_bytes"] == 2 * 2 * 1 * 2 * 45 * 32 * 2


# -- crop, reset ------------------------------------------------------------------------------------------


def test_crop_identity_matches_dynamic():
    model = tiny_model("llama")
    ids = _prompt(length=20)
    with torch.no_grad():
        slim = SlimCache(config=model.config)
        model(ids, cache=slim)
        slim.crop(-5)
        a = model(ids[:, 15:], cache=slim).logits
        b = model(ids).logits[:, 15:]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # chunked vs one-shot matmul shapes


def test_crop_refuses_what_it_cannot_undo():
    model = tiny_model("llama")
    with torch.no_grad():
        cache = SlimCache(kv_quantize="q8_0", residual=0, group_size=1, sink=0, config=model.config)
        model(_prompt(length=10), cache=cache)
    with pytest.raises(ValueError, match="full precision"):
        cache.crop(-2)
    with torch.no_grad():
        cache = SlimCache(sink=2, window=4, config=model.config)
        model(_prompt(length=10), cache=cache)
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(-1)


def test_reset_empties():
    model = tiny_model("llama")
    cache = SlimCache(kv_quantize="int8", config=model.config)
    with torch.no_grad():
        model(_prompt(length=10), cache=cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.live_nbytes() == 0
    assert cache.nbytes() == cache.components()["rotary"] > 0  # only the model's RoPE frequencies stay


# -- validation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=0), "window must be >= 1"),
        (dict(sink=-1, window=4), "sink must be >= 0"),
        (dict(kv_quantize="int5"), "unknown KV format 'int5'"),
        (
            dict(kv_quantize="int4", keep_layers=(0, 2)),
            r"^keep_layers names layer 2, out of range: this model has 2 layers",
        ),
        (dict(kv_quantize="int4", keep_layers=(-3,)), "names layer -3, out of range"),
        (
            dict(
                kv_quantize="int4",
                keep_layers=(0,),
                keep_format="q4_0",
                config=tiny_config("llama", head_dim=16),
            ),
            "keep_format='q4_0' cannot store this model's KV",
        ),
        (dict(k_quantize="q9"), "unknown KV format"),
        (dict(group_size=32, residual=48), "not a multiple of group_size"),
        (dict(group_size=0), "group_size must be >= 1"),
        (dict(kv_quantize="int4", mean_center=[torch.zeros(2, 32)] * 2), "does not apply to K format 'int4'"),
        (dict(kv_quantize="q4_1", mean_center="bias.gguf"), "does not apply to K format 'q4_1'"),
    ],
)
def test_invalid_options(kwargs, match):
    kwargs.setdefault("config", tiny_config("llama"))
    with pytest.raises(ValueError, match=match):
        SlimCache(**kwargs)


def test_block_format_needs_head_dim_multiple_of_32():
    with pytest.raises(ValueError, match="q4_0"):
        SlimCache(kv_quantize="q4_0", config=tiny_config("llama", hidden_size=64, num_attention_heads=4))


def test_sliding_window_models_keep_the_models_window():
    """Mistral with a sliding window: every layer is a sliding layer holding at most window - 1 tokens
    (transformers' own convention), whatever StreamingLLM policy is asked for the full layers."""
    model = tiny_model("mistral", sliding_window=6)
    ids = _prompt(length=20)
    with torch.no_grad():
        ref = _prefill_then_decode(model, DynamicCache(config=model.config), ids, 8)
        cache = SlimCache(config=model.config)
        got = _prefill_then_decode(model, cache, ids, 8)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert all(layer.is_sliding and layer.store.stored == 5 for layer in cache.layers)


# -- dtypes -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    model = tiny_model("llama", dtype=dtype)
    ids = _prompt(length=24)
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        same = SlimCache(config=model.config)
        lossy = SlimCache(
            kv_quantize="int4", sink=2, window=12, group_size=4, residual=4, config=model.config
        )
        a, b, c = (_prefill_then_decode(model, cache, ids, 16) for cache in (ref, same, lossy))
    assert torch.equal(a, b)
    assert torch.isfinite(c).all()
    assert lossy.layers[0].store.k.fp.data.dtype == dtype  # the residual keeps the model's dtype


@pytest.mark.parametrize(
    "spec",
    [
        dict(kv_quantize="int4"),
        dict(kv_quantize="none", sink=4, window=40),
        dict(kv_quantize="q4_0", sink=4, window=60, residual=32),
    ],
)
def test_memory_held_stays_close_to_what_is_stored(spec):
    """After a long prefill the buffers hold little more than the stored tokens (no prefill-sized slack)."""
    model = tiny_model("llama")
    cache = SlimCache(config=model.config, **spec)
    with torch.no_grad():
        model(_prompt(length=600), cache=cache)
        for t in range(10):
            model(_prompt(length=1, seed=t), cache=cache)
    assert (
        cache.nbytes() <= 1.5 * cache.live_nbytes() + 2 * 2 * 2 * 64 * 32 * 4 * 4
    )  # + slack of 64 tokens/buffer


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_residual_dtype_stores_fp_tokens_in_16_bits(dtype_name):
    """A lossy format's residual and sinks in 16 bits: half the bytes of an fp32 model's, close logits;
    a lossless 'none' stream is its storage and keeps the model's dtype."""
    model = tiny_model("llama")
    ids = _prompt(length=40)
    kw = dict(kv_quantize="int4", sink=2, window=30, group_size=4, residual=8, config=model.config)
    with torch.no_grad():
        ref_cache = SlimCache(residual_dtype="model", **kw)
        ref = _prefill_then_decode(model, ref_cache, ids, 12)
        cache = SlimCache(residual_dtype=dtype_name, **kw)
        got = _prefill_then_decode(model, cache, ids, 12)
    store = cache.layers[0].store
    want = getattr(torch, dtype_name)
    assert store.k.fp.data.dtype == want and store.sink_k.dtype == want and store.sink_v.dtype == want
    ref_store = ref_cache.layers[0].store
    assert 2 * store.k.fp.live_nbytes() == ref_store.k.fp.live_nbytes() > 0
    assert 2 * store.sink_v.numel() * store.sink_v.element_size() == ref_store.sink_v.numel() * 4
    assert _kl(ref, got).mean() < 1e-3
    mixed = SlimCache(
        kv_quantize="none", k_quantize="int4", residual_dtype=dtype_name, group_size=4, residual=4, config=model.config
    )
    with torch.no_grad():
        forward(model, ids, mixed)
    assert mixed.layers[0].store.v.fp.data.dtype == torch.float32  # V is lossless: the model's dtype
    with pytest.raises(ValueError, match="residual_dtype must be one of"):
        SlimCache(residual_dtype="fp8")


def test_residual_dtype_auto_is_float16_for_fp32_models_and_the_model_dtype_otherwise():
    """The default: an fp32 model's full-precision tokens in float16 (docs/quality.md measured it free), a
    16-bit model's in its own dtype; a value float16 cannot hold is a clear error, never an inf."""
    kw = dict(kv_quantize="int4", sink=2, window=30, group_size=4, residual=8)
    ids = _prompt(length=20)
    for dtype, want in ((torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)):
        model = tiny_model("llama", dtype=dtype)
        cache = SlimCache(config=model.config, **kw)
        assert cache.cache_config.residual_dtype == "auto"
        with torch.no_grad():
            forward(model, ids, cache)
        store = cache.layers[0].store
        assert store.k.fp.data.dtype == want and store.sink_k.dtype == want and store.sink_v.dtype == want, dtype
    cache = SlimCache(**kw)
    big = torch.full((1, 2, 3, 32), 1e6)
    with pytest.raises(ValueError, match="beyond float16's range.*residual_dtype='model'"):
        cache.update(big, big.clone(), 0)
    assert cache.get_seq_length() == 0  # nothing half-stored
    SlimCache(residual_dtype="model", **kw).update(big, big.clone(), 0)  # the model's dtype holds it


def test_a_decode_token_checked_once_still_raises_each_error_and_stores_nothing():
    """A one-token append into float16 residuals checks its cast values once (SlimLayer.append): a NaN or inf
    input still raises the non-finite error naming keys or values, a finite value beyond float16's range the
    residual-dtype error; either way nothing is stored. A token that goes straight to the encoder (residual
    0, a group completing) is never cast, so a large finite value there is stored."""
    kw = dict(kv_quantize="int4", group_size=4, residual=8, sink=0)
    cache = SlimCache(**kw)
    cache.update(torch.randn(1, 2, 10, 32), torch.randn(1, 2, 10, 32), 0)
    ok = torch.randn(1, 2, 1, 32)
    held = len(cache.layers[0].store.k.fp)
    for k, v, match in (
        (ok.clone(), torch.full_like(ok, float("nan")), "values have non-finite values"),
        (torch.full_like(ok, float("inf")), ok.clone(), "keys have non-finite values"),
        (torch.full_like(ok, 1e6), ok.clone(), "beyond float16's range"),
        (ok.clone(), torch.full_like(ok, -1e6), "beyond float16's range"),
    ):
        with pytest.raises(ValueError, match=match):
            cache.update(k, v, 0)
        assert cache.get_seq_length() == 10 and len(cache.layers[0].store.k.fp) == held  # nothing half-stored
    cache.update(ok, ok.clone(), 0)
    assert cache.get_seq_length() == 11
    direct = SlimCache(kv_quantize="int4", group_size=4, residual=0, sink=0)
    direct.update(torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32), 0)
    direct.update(torch.full_like(ok, 7e4), torch.full_like(ok, 7e4), 0)  # the 4th token completes a group
    assert direct.get_seq_length() == 4 and len(direct.layers[0].store.k.fp) == 0
