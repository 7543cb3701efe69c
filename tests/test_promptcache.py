"""Prompt cache files (kvslim.promptcache): a restored cache continues with exactly the logits of the
cache that was saved (torch.equal), for every registered format and the levers; files for another model,
format or bias, damaged, truncated or newer files are refused with one clear error; writes are atomic."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import family_config, family_model, tiny_config, tiny_model
from kvslim import SlimCache
from kvslim import promptcache as pc
from kvslim.atomic import TMP_TAG, WriteError
from kvslim.cache.layer_adapter import SlimCacheLayer
from kvslim.calibration.meancenter import BiasSet
from kvslim.config import parse_spec
from kvslim.formats import format_names
from kvslim.generate import decode_one_token, forward, left_padding, prefill

FP_A = "sha256:" + "a" * 64
FP_B = "sha256:" + "b" * 64


pytestmark = pytest.mark.filterwarnings("ignore:SlimCache.*decodes every stored token:UserWarning")


@pytest.fixture(scope="module")
def models():
    """The tiny Llama with the kvslim attention (decode steps read the codes) and with sdpa (every step
    reads the materialized K/V)."""
    return {attn: tiny_model("llama", attn_implementation=attn) for attn in ("kvslim", "sdpa")}


def _ids(batch=1, length=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def _continue(model, cache, steps, *, pads=None, mask=None, seed=1) -> list[torch.Tensor]:
    """Logits of ``steps`` fixed next inputs: a 5-token chunk (the prefill path), then single tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        for step in range(steps):
            n = 5 if step == 0 else 1
            tok = torch.randint(3, 128, (cache.layers[0].store.kv_shape[0], n), generator=g)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            if n == 1:
                out.append(decode_one_token(model, tok, cache, pads=pads, attention_mask=mask))
            else:
                out.append(forward(model, tok, cache, pads=pads, attention_mask=mask, logits_to_keep=0))
    return out


def _round_trip(model, spec_or_cache, tmp_path, *, length=90, chunk=23, steps=8, batch_pads=None, **load):
    """Fill a cache, save it, load it; both continue with the same inputs: the logits must be equal."""
    cache = (
        SlimCache.from_config(parse_spec(spec_or_cache), config=model.config)
        if isinstance(spec_or_cache, str)
        else spec_or_cache
    )
    ids = _ids(batch=1 if batch_pads is None else len(batch_pads), length=length)
    mask = pads = None
    if batch_pads is not None:
        mask = torch.ones_like(ids)
        for row, p in enumerate(batch_pads):
            mask[row, :p] = 0
        pads = left_padding(mask)
    with torch.inference_mode():
        prefill(model, ids, cache, attention_mask=mask, chunk_size=chunk)
    path = tmp_path / "prompt.safetensors"
    cache.save(path, token_ids=ids, model_fingerprint=FP_A)
    restored = pc.load(path, new_cache=SlimCache.from_config, config=model.config, model_fingerprint=FP_A, **load)
    assert torch.equal(restored.token_ids, ids)
    assert restored.cache.get_seq_length() == cache.get_seq_length() == length
    assert restored.cache.live_nbytes() == cache.live_nbytes()
    assert (restored.cache.rotate, restored.cache.pre_rope) == (cache.rotate, cache.pre_rope)
    # the same stored tensors, byte for byte (codes, scales, residual, sinks, positions bookkeeping)
    assert pc.to_state(restored.cache)[1]["sha256"] == pc.to_state(cache)[1]["sha256"]
    a = _continue(model, cache, steps, pads=pads, mask=mask)
    b = _continue(model, restored.cache, steps, pads=pads, mask=mask)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"step {step}: max diff {(x - y).abs().max()}"
    return cache, restored


@pytest.mark.parametrize("fmt", format_names())
def test_every_format_continues_exactly(models, tmp_path, fmt):
    """Prefill 90 tokens in chunks (sink=auto's 16 first tokens at full precision, groups encoded, 42 tokens in
    the residual), save, load, continue."""
    cache, restored = _round_trip(models["kvslim"], f"{fmt},residual=32", tmp_path)
    store = restored.cache.layers[0].store
    if fmt != "none":  # something really was encoded, and restored as codes, beside the sinks
        assert store.k.n_body >= 32 and store.v.n_body >= 32
        assert store.sink_k.shape[2] == store.sink_v.shape[2] == 16


@pytest.mark.parametrize("residual", [32, 0])
@pytest.mark.parametrize("attn", ["kvslim", "sdpa"])
def test_bounded_cache_past_eviction(models, tmp_path, attn, residual):
    """StreamingLLM: a 150-token prompt through sink 4 + window 40 (evicted while reading), then 60 steps
    past the window again: sinks, partly evicted groups, runs and positions all come back."""
    spec = f"int4,sink=4,window=40,residual={residual}"
    cache, restored = _round_trip(models[attn], spec, tmp_path, length=150, chunk=16, steps=60)
    if residual == 0:  # the oldest per-channel K group was partly evicted when saved
        assert restored.header["layers"][0]["k_offset"] > 0
    store = restored.cache.layers[0].store
    assert store.stored == 44 and store.seen == 150 + 5 + 59


def test_rebased_positions_continue_exactly(models, tmp_path):
    """Past the re-base period (4096) kvslim's loop feeds position ids minus a base: a cache saved holding
    runs of keys at two bases (and sinks rotated for the old one) continues exactly."""
    model = models["kvslim"]
    cache = SlimCache.from_config(parse_spec("int4,sink=4,window=40,residual=32"), config=model.config)
    assert cache.rebase_period == 4096
    _, restored = _round_trip(model, cache, tmp_path, length=4110, chunk=1024, steps=12)
    saved = restored.header["layers"][0]
    assert saved["base"] == 4096 and [b for _, b in saved["runs"]] == [0, 4096]


@pytest.mark.parametrize(
    "spec, rotate, pre_rope",
    [
        ("int2,residual=32", "kv", True),  # auto: rotated K and V, K before RoPE
        ("int4,residual=0,group=1,rotate=k,pre_rope=1,sink=4,window=30", "k", True),
        ("q4_0,residual=0,group=1,rotate=none", "none", False),
    ],
)
def test_levers_continue_exactly(models, tmp_path, spec, rotate, pre_rope):
    model = models["kvslim"]
    cache = SlimCache.from_config(parse_spec(spec), config=model.config)
    assert (cache.rotate, cache.pre_rope) == (rotate, pre_rope)
    _round_trip(model, cache, tmp_path, length=70, steps=40)


def _bias(k_rot=False, pre_rope=False, seed=4):
    g = torch.Generator().manual_seed(seed)
    return BiasSet([torch.randn(2, 32, generator=g) for _ in range(2)], k_rot=k_rot, pre_rope=pre_rope)


def test_centered_rotated_pre_rope_cache(models, tmp_path):
    """K mean-centered (per token) in the rotated, pre-RoPE basis: the bias is recorded by identity and
    must be handed back on load; another bias is refused."""
    model = models["kvslim"]
    bias = _bias(k_rot=True, pre_rope=True)
    cfg = parse_spec("q4_0,residual=0,group=1,rotate=kv,pre_rope=1,sink=2,window=40")
    cache = SlimCache.from_config(cfg, config=model.config, mean_center=bias)
    assert cache.layers[0].store.k.basis.bias is not None
    _round_trip(model, cache, tmp_path, steps=30, mean_center=bias)
    path = tmp_path / "prompt.safetensors"
    with pytest.raises(ValueError, match="another K mean-centering bias"):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config, mean_center=_bias(k_rot=True, pre_rope=True, seed=5))
    with pytest.raises(ValueError, match="mean-centering from tensors given directly; pass the same bias"):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config)


def test_bias_file_is_found_by_its_recorded_path(models, tmp_path):
    from kvslim.calibration.biasfile import write_bias_file

    model = models["kvslim"]
    bias_path = tmp_path / "bias.gguf"
    write_bias_file(bias_path, _bias())
    cache = SlimCache.from_config(
        parse_spec(f"q8_0,residual=0,group=1,mean_center={bias_path}"), config=model.config
    )
    _round_trip(model, cache, tmp_path, steps=4)  # load(mean_center=None): the header's path
    header = pc.read_header(tmp_path / "prompt.safetensors")
    assert header["mean_center"]["path"] == str(bias_path)
    assert header["mean_center"]["file_sha256"].startswith("sha256:")
    write_bias_file(bias_path, _bias(seed=9))  # the file changed since
    with pytest.raises(ValueError, match="another K mean-centering bias"):
        pc.load(tmp_path / "prompt.safetensors", new_cache=SlimCache.from_config, config=model.config)


@pytest.mark.parametrize("attn", ["kvslim", "sdpa"])
def test_left_padded_batch(models, tmp_path, attn):
    """Two rows, the second left-padded by 7: the explicit padding, per-row sinks and positions come back."""
    cache, restored = _round_trip(
        models[attn],
        "int4,sink=4,window=30,residual=0,group=1",
        tmp_path,
        length=60,
        steps=20,
        batch_pads=[0, 7],
    )
    assert restored.cache.padding_explicit and torch.equal(restored.cache.pads, cache.pads)


def test_in_memory_state_is_json_and_tensors(models):
    """to_state/from_state (what a server parks idle sessions with): a JSON-able header, CPU tensors that
    are copies (the cache's next update does not change them), and the same continuation."""
    model = models["kvslim"]
    cache = SlimCache.from_config(parse_spec("int4,sink=4,window=40"), config=model.config)  # residual auto
    with torch.inference_mode():
        prefill(model, _ids(length=80), cache, chunk_size=30)
    tensors, header = pc.to_state(cache, model_fingerprint=FP_A)
    assert json.loads(json.dumps(header)) == header and header["levers"]["residual"] == 0
    snapshot = {n: t.clone() for n, t in tensors.items()}
    a = _continue(model, cache, 30)  # the original moves on (evicts, re-encodes its residual)
    assert all(torch.equal(tensors[n], snapshot[n]) for n in tensors)
    restored = pc.from_state(tensors, header, new_cache=SlimCache.from_config, config=model.config, model_fingerprint=FP_A)
    assert restored.token_ids is None
    b = _continue(model, restored.cache, 30)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- refusals ---------------------------------------------------------------------------------------------


@pytest.fixture
def saved(models, tmp_path):
    model = models["kvslim"]
    cache = SlimCache.from_config(parse_spec("int4,residual=32"), config=model.config)
    with torch.inference_mode():
        prefill(model, _ids(length=100), cache)  # 16 sinks, a group encoded, 52 in the residual
    path = tmp_path / "prompt.safetensors"
    cache.save(path, model_fingerprint=FP_A)
    return model, path


def _rewrite(path, edit_header, *, checksum=True):
    """Write the file again with its header edited: with ``checksum``, a consistent file (as if written with
    those settings), else the checksum left as recorded (a damaged file)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()[pc.META_KEY])  # as written, unchecked
    edit_header(header)
    if checksum:
        header["sha256"] = pc.content_sha256(tensors, header)
    save_file(tensors, path, metadata={pc.META_KEY: json.dumps(header)})


def test_another_model_is_refused(saved):
    model, path = saved
    with pytest.raises(
        ValueError, match=r"saved for another model: the file records model fingerprint sha256:aaa"
    ):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config, model_fingerprint=FP_B)
    with pytest.raises(
        ValueError, match="saved for another model: n_kv_heads 2 in the file, 4 for this model"
    ):
        pc.load(path, new_cache=SlimCache.from_config, config=tiny_config("llama", num_key_value_heads=4))
    with pytest.raises(ValueError, match="saved for another model: model_type 'llama' in the file, 'qwen2'"):
        pc.load(path, new_cache=SlimCache.from_config, config=tiny_config("qwen2"))


def test_another_format_is_refused(saved):
    model, path = saved
    with pytest.raises(ValueError, match=r"saved with cache 'int4,residual=32', expected 'q4_0'"):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config, cache_config="q4_0")
    # a header that claims another format than its codes hold
    _rewrite(path, lambda h: h.update(cache_config="int8,residual=32"))
    with pytest.raises(
        ValueError,
        match=r"layer 0: k token part 'codes' is uint8 \(16,\) per entry, but int8 writes uint8 \(32,\)",
    ):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config)


def test_a_file_from_before_sink_auto_loads_as_it_was_saved(models, tmp_path):
    """A file written before ``sink=auto`` (its spec names no sink, its levers no ``sink``) meant no sinks: it
    loads with none and continues exactly as the cache it was saved from; a caller that asks for the spec as
    written (now 16 sinks) is refused in one line naming sink=0."""
    model = models["kvslim"]
    cache = SlimCache.from_config(parse_spec("int4,residual=32,sink=0"), config=model.config)
    with torch.inference_mode():
        prefill(model, _ids(length=100), cache)
    path = tmp_path / "old.safetensors"
    cache.save(path, model_fingerprint=FP_A)

    def old(h):
        h.update(cache_config="int4,residual=32")
        del h["levers"]["sink"]

    _rewrite(path, old)
    restored = pc.load(path, new_cache=SlimCache.from_config, config=model.config, model_fingerprint=FP_A).cache
    assert restored.cache_config.sink_tokens == 0 and restored.layers[0].store.k.n_body == 64
    for step, (x, y) in enumerate(zip(_continue(model, cache, 3), _continue(model, restored, 3), strict=True)):
        assert torch.equal(x, y), f"step {step}"
    with pytest.raises(ValueError, match=r"saved with cache 'int4,sink=0,residual=32', expected 'int4,residual=32'") as e:
        pc.load(path, new_cache=SlimCache.from_config, config=model.config, cache_config="int4,residual=32")
    assert "it holds 0 sinks, the settings ask 16" in str(e.value) and "ask sink=0)" in str(e.value)
    # a file of today records the sinks it resolved, and a caller's auto that resolves to the same is the same
    cache.save(path, model_fingerprint=FP_A)
    assert pc.read_header(path)["levers"]["sink"] == 0
    fresh = SlimCache.from_config(parse_spec("int4,residual=32"), config=model.config)
    with torch.inference_mode():
        prefill(model, _ids(length=100), fresh)
    fresh.save(path, model_fingerprint=FP_A)
    assert pc.read_header(path)["levers"]["sink"] == 16
    pc.load(path, new_cache=SlimCache.from_config, config=model.config, cache_config="int4,residual=32,sink=16")


def test_other_levers_are_refused(saved):
    model, path = saved
    _rewrite(path, lambda h: h["levers"].update(rotate="none"))
    with pytest.raises(ValueError, match="saved with rotate='none', but its settings resolve to rotate='kv'"):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config)


def test_damaged_truncated_and_newer_files_are_refused(saved, tmp_path):
    model, path = saved
    data = path.read_bytes()
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="damaged or truncated"):
        pc.load(broken, new_cache=SlimCache.from_config, config=model.config)
    flipped = bytearray(data)
    flipped[-100] ^= 0x40  # one bit of the tensor data
    broken.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=r"content does not match its checksum \(a damaged or edited file\)"):
        pc.load(broken, new_cache=SlimCache.from_config, config=model.config)
    broken.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        pc.load(broken, new_cache=SlimCache.from_config, config=model.config)
    with pytest.raises(ValueError, match="no such file"):
        pc.load(tmp_path / "missing.safetensors", new_cache=SlimCache.from_config, config=model.config)
    _rewrite(path, lambda h: h["layers"][0].update(seen=71), checksum=False)  # an edit the shapes allow
    with pytest.raises(ValueError, match=r"content does not match its checksum \(a damaged or edited file\)"):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config)
    _rewrite(path, lambda h: h.update(version=pc.FORMAT_VERSION + 1))
    with pytest.raises(
        ValueError, match=r"written by a newer kvslim \(layout version 2; this kvslim reads 1\)"
    ):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config)
    _rewrite(path, lambda h: h.update(version=pc.FORMAT_VERSION) or h["layers"][1].pop("runs"))
    with pytest.raises(ValueError, match=r"the header lacks or mistypes layers\[1\].runs \(a damaged file\)"):
        pc.load(path, new_cache=SlimCache.from_config, config=model.config)


def test_recurrent_layers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="layer 0 is a linear_attention layer with a recurrent"):
        SlimCache(config=family_config("qwen3_next")).save(tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_sliding_and_kv_shared_layers(tmp_path):
    """Gemma-3n: sliding-window layers (the model's own window) and KV-shared layers (DummyLayer, nothing
    stored) next to full-attention layers under sink + window."""
    model = family_model("gemma3n")
    cache, restored = _round_trip(
        model, "int4,residual=0,group=1,sink=2,window=20", tmp_path, length=40, chunk=7
    )
    kinds = [type(x).__name__ for x in restored.cache.layers]
    assert kinds == [type(x).__name__ for x in cache.layers] and "DummyLayer" in kinds
    assert any(x.is_sliding for x in restored.cache.layers if isinstance(x, SlimCacheLayer))


def test_a_failing_write_leaves_the_old_file(saved, monkeypatch):
    """The write goes to a temporary beside the target: a full disk mid-write leaves the old file as it
    was and no temporary behind."""
    import errno

    import safetensors.torch

    model, path = saved
    before = path.read_bytes()
    cache = SlimCache.from_config(parse_spec("int4,residual=32"), config=model.config)
    with torch.inference_mode():
        prefill(model, _ids(length=40, seed=3), cache)

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(WriteError, match=r"cannot write prompt cache .*No space left on device.*unchanged"):
        cache.save(path)
    assert path.read_bytes() == before
    assert not [p for p in os.listdir(path.parent) if TMP_TAG in p]
    monkeypatch.undo()
    cache.save(path)  # and a good write replaces it
    assert pc.load(path, new_cache=SlimCache.from_config, config=model.config).cache.get_seq_length() == 40


def test_the_same_cache_gives_the_same_bytes(models, tmp_path):
    model = models["kvslim"]
    paths = []
    for name in ("a", "b"):
        cache = SlimCache.from_config(parse_spec("q4_0,residual=32"), config=model.config)
        with torch.inference_mode():
            prefill(model, _ids(length=50), cache)
        paths.append(tmp_path / f"{name}.safetensors")
        cache.save(paths[-1])
    assert paths[0].read_bytes() == paths[1].read_bytes()


# -- kvslim sample --prompt-cache -----------------------------------------------------------------------


@pytest.mark.slow
def test_sample_prompt_cache_reuses_the_file(real_model, monkeypatch, capsys, tmp_path):
    """The first run saves the prompt's cache, the second loads it and prefills one token: both print the
    greedy text of a run without a prompt cache. A longer prompt starting with the cached one reuses the
    file; other cache flags or another prompt are one error line."""
    from kvslim import models
    from kvslim.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: real_model)
    model = real_model[0]
    before = model.config._attn_implementation
    prompt = "The night sky over the quiet village was full of stars, and the old astronomer"
    flags = ["--tokens", "12", "--temperature", "0", "--ignore-eos", "--kv-quantize", "int4"]
    flags += ["--kv-residual", "0", "--kv-group-size", "1"]  # every token encoded: the file holds codes
    path = tmp_path / "prompt.safetensors"
    report = tmp_path / "report.json"

    def run(*extra, text=prompt):
        code = main(["sample", "--prompt", text, "--report-json", str(report), *flags, *extra])
        out, err = capsys.readouterr()
        return code, out, err, (json.loads(report.read_text()) if code == 0 else None)

    try:
        code, plain, err, _ = run()
        assert code == 0, err
        code, first, err, r1 = run("--prompt-cache", str(path))
        assert code == 0 and path.exists(), err
        n = r1["prompt_cache"]["saved_tokens"]
        assert n == r1["tokens_seen"] - 12 and f"saved the prompt's first {n} of {n + 1} tokens" in err
        code, second, err, r2 = run("--prompt-cache", str(path))
        assert code == 0, err
        assert f"reused {n} of the prompt's {n + 1} tokens; prefilling 1" in err
        assert r2["prompt_cache"]["reused_tokens"] == n and r2["prompt_tokens"] == 1
        assert first == second == plain  # the same greedy text with and without the file
        code, _, err, r3 = run("--prompt-cache", str(path), text=prompt + " looked up at the moon")
        assert code == 0 and r3["prompt_cache"]["reused_tokens"] == n, err
        code, _, err, _ = run("--prompt-cache", str(path), "--kv-quantize", "int8")
        assert (
            code == 2
            and "saved with cache 'int4,group=1,residual=0', expected 'int8,group=1,residual=0'" in err
        )
        code, _, err, _ = run("--prompt-cache", str(path), text="Another prompt")
        assert (
            code == 2 and "the prompt does not start with the" in err and len(err.strip().splitlines()) == 1
        )
    finally:
        model.set_attn_implementation(before)


def test_continued_prefix():
    cached = torch.tensor([[5, 6, 7]])
    assert pc.continued_prefix(cached, torch.tensor([[5, 6, 7, 8, 9]])) == 3
    assert pc.continued_prefix(None, torch.tensor([[5]])) == 0
    with pytest.raises(
        ValueError, match="does not start with the 3 tokens the file holds .* from token 1 on"
    ):
        pc.continued_prefix(cached, torch.tensor([[5, 9, 7, 8]]))
    with pytest.raises(ValueError, match="differ from token 2 on"):
        pc.continued_prefix(cached, torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match="exactly the 3 tokens the file holds, with nothing left to feed"):
        pc.continued_prefix(cached, cached)


# -- the continuation rule -------------------------------------------------------------------------------


def test_the_continuation_rule(saved):
    """check_continuation: model, dtype, settings, tokens, in that order, each when its argument is given;
    can_continue says the same without raising."""
    model, path = saved
    cache = SlimCache.from_config(parse_spec("int4,residual=32"), config=model.config)
    ids = _ids(length=20)
    with torch.inference_mode():
        prefill(model, ids, cache)
    cache.save(path, token_ids=ids, model_fingerprint=FP_A)
    s = pc.SavedCache.read(path)
    assert s.dtypes == ("float32",) and s.model_fingerprint == FP_A and not s.centered
    assert torch.equal(s.token_ids, ids)
    longer = torch.cat([ids, ids[:, :3]], dim=1)
    ok = dict(cache_config="int4,residual=32", model_fingerprint=FP_A, dtype=torch.float32)
    assert pc.check_continuation(s, longer, **ok) == 20
    assert pc.check_continuation(s, longer[0].tolist(), **ok) == 20  # one row of ints
    assert pc.check_continuation(s) is None  # nothing asked: nothing refused
    cases = [
        (dict(ok, model_fingerprint=FP_B), longer, "model", "saved for another model"),
        (dict(ok, dtype=torch.bfloat16), longer, "dtype", "saved from a float32 model, this one runs in bfloat16"),
        (dict(ok, cache_config="q4_0"), longer, "settings", "saved with cache 'int4,residual=32', expected 'q4_0'"),
        (ok, ids, "tokens", "exactly the 20 tokens the file holds"),
        (ok, longer.flip(1), "tokens", "does not start with the 20 tokens"),
        # several reasons: the first check in the rule's order names it
        (dict(ok, model_fingerprint=FP_B, dtype="bfloat16"), ids, "model", "another model"),
    ]
    for kwargs, prompt, kind, message in cases:
        with pytest.raises(pc.CannotContinue, match=message) as e:
            pc.check_continuation(s, prompt, where="here", **kwargs)
        assert e.value.kind == kind and str(e.value).startswith("here: ")
        n, why = pc.can_continue(s, prompt, **kwargs)
        assert n is None and why.kind == kind and message.split(" (")[0].replace("\\", "") in str(why)
    assert pc.can_continue(s, longer, **ok) == (20, None)
    # a cache in memory goes through the same rule
    mem = pc.SavedCache.of(cache, ids[0].tolist(), cache_config=parse_spec("int4,residual=32"), model_fingerprint=FP_A)
    assert mem.dtypes == ("float32",) and pc.check_continuation(mem, longer, **ok) == 20
    with pytest.raises(pc.CannotContinue, match="this one runs in float16"):
        pc.check_continuation(mem, longer, **dict(ok, dtype=torch.float16))


def test_a_damaged_file_is_a_damaged_continuation(saved, tmp_path):
    model, path = saved
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(pc.CannotContinue, match="damaged or truncated") as e:
        pc.SavedCache.read(broken)
    assert e.value.kind == "damaged"
    _rewrite(path, lambda h: h.update(tokens=[1, 5]))  # a header that promises token ids the file lacks
    with pytest.raises(pc.CannotContinue, match="token ids do not match its header") as e:
        pc.SavedCache.read(path)


def test_save_with_a_mode_is_private(saved, tmp_path):
    """mode=0o600: the temporary is created with it (whatever the umask), so the bytes are never readable by
    others, and the file keeps it after the rename (even if the writer replaced the temporary)."""
    from kvslim.atomic import atomic_path

    model, _ = saved
    cache = SlimCache.from_config(parse_spec("int8"), config=model.config)
    with torch.inference_mode():
        prefill(model, _ids(length=10), cache)
    mask = os.umask(0)
    try:
        pc.save(cache, tmp_path / "private.safetensors", mode=0o600)
        with atomic_path(tmp_path / "raw.bin", mode=0o600) as tmp:
            assert os.stat(tmp).st_mode & 0o777 == 0o600  # before a byte is written
            tmp.write_bytes(b"secret")
        with atomic_path(tmp_path / "plain.bin") as tmp:
            tmp.write_bytes(b"public")
    finally:
        os.umask(mask)
    assert os.stat(tmp_path / "private.safetensors").st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "raw.bin").st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "plain.bin").st_mode & 0o777 == 0o666  # no mode: as open() makes it


def _sample_args(path):
    import argparse

    return argparse.Namespace(prompt_cache=str(path), kv_mean_center=None, kv_mean_center_any_model=False)


def test_sample_and_sessions_refuse_another_dtype_alike(tmp_path, caplog):
    """A prompt cache saved from the float32 model, continued by the same checkpoint in bfloat16 (the same
    fingerprint): `kvslim sample --prompt-cache` refuses it (one line, how to fix it) and a server's session
    starts over — with the same reason, from the same rule."""
    from kvslim.calibration.fingerprint import model_fingerprint
    from kvslim.cli import UserError
    from kvslim.cli import prompt_cache as cli_prompt_cache
    from kvslim.engine.sessions import SessionStore

    f32 = tiny_model("llama")
    bf16 = tiny_model("llama", dtype=torch.bfloat16)
    fp = model_fingerprint(f32)
    assert model_fingerprint(bf16) == fp
    cfg = parse_spec("int8")
    cache = SlimCache.from_config(cfg, config=f32.config)
    ids = _ids(length=16)
    with torch.inference_mode():
        prefill(f32, ids, cache)
    path = tmp_path / "prompt.safetensors"
    cache.save(path, token_ids=ids, model_fingerprint=fp)
    prompt = torch.cat([ids, ids[:, :2]], dim=1)

    args = _sample_args(path)
    saved = cli_prompt_cache.check_prompt_cache(args, cfg)  # before the model: the settings match
    with pytest.raises(UserError) as e:
        cli_prompt_cache.prompt_cache(args, bf16, prompt, cfg, saved)
    sample_msg = str(e.value)
    assert sample_msg == (
        f"--prompt-cache {path}: saved from a float32 model, this one runs in bfloat16: pass the --dtype it was "
        f"saved with, or another --prompt-cache file"
    )
    reused = cli_prompt_cache.prompt_cache(args, f32, prompt, cfg, saved)[2]  # the float32 model continues it
    assert reused["reused_tokens"] == 16

    from kvslim.engine.sessions import session_key

    (tmp_path / "s").mkdir()
    os.replace(path, tmp_path / "s" / (session_key("chat") + ".safetensors"))  # the session "chat"'s file
    store = SessionStore(tmp_path / "s", config=bf16.config, model_fingerprint=fp, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="kvslim.engine"):
        assert store.take("chat", prompt[0].tolist(), cfg) is None
    assert store.stats.reset == 1
    assert "saved from a float32 model, this one runs in bfloat16" in caplog.text


def test_sample_and_sessions_share_one_rule(saved, monkeypatch, caplog):
    """Both ask kvslim.promptcache.check_continuation: a veto there reaches `kvslim sample --prompt-cache`
    and a session alike (no second copy of the rule anywhere)."""
    from kvslim.cli import UserError
    from kvslim.cli import prompt_cache as cli_prompt_cache
    from kvslim.engine.sessions import SessionStore

    model, path = saved

    def veto(saved, prompt=None, *, where="prompt cache", **kw):
        raise pc.CannotContinue(f"{where}: vetoed by the rule", "settings")

    monkeypatch.setattr(pc, "check_continuation", veto)
    with pytest.raises(UserError, match="vetoed by the rule: pass the cache flags it was saved with"):
        cli_prompt_cache.check_prompt_cache(_sample_args(path), parse_spec("int4,residual=32"))
    cfg = parse_spec("int8")
    store = SessionStore(None, config=model.config)
    cache = SlimCache.from_config(cfg, config=model.config)
    with torch.inference_mode():
        prefill(model, _ids(length=8), cache)
    store.keep("s", cache, _ids(length=8)[0].tolist(), cfg)
    with caplog.at_level("WARNING", logger="kvslim.engine"):
        assert store.take("s", _ids(length=8)[0].tolist() + [3], cfg) is None
    assert "vetoed by the rule" in caplog.text and store.stats.reset == 1
