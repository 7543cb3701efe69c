"""A long prompt's kept decoded bodies (issue 30, the join's cost): between a prompt's chunks a cache can keep each
layer's encoded body decoded (``SlimCache.keep_decoded``), so that a chunk decodes only what the last one encoded.
The values must be the same bits as decoding the whole body again; the engine keeps them only while a prompt of more
than one chunk is read, with the copy's bytes reserved and given back after its last chunk."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim import SlimCache
from kvslim import generate as gen
from kvslim.engine import Engine, Request

#: lossy formats over each decoder and basis: per-channel K groups, per-token V, GGML blocks, a Hadamard basis,
#: pre-RoPE keys, variance-normalized groups, fp8, a window longer than the prompt
SPECS = [
    "int4",
    "int4,rotate=none,group=16,residual=16",
    "int2",
    "q4_0,residual=0,group=1",
    "q8_0",
    "int8,varnorm=on",
    "fp8",
    "k4v2,sink=4,window=400",
]


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(model, spec: str) -> SlimCache:
    return SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)


def _chunks(model, cache, ids: list[int], sizes: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    with torch.inference_mode():
        for n in sizes:
            out.append(gen.forward_step(model, [(ids[start : start + n], cache)]))
            start += n
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_a_kept_stream_reads_the_same_bits_as_decoding_it_whole(model, spec):
    """Chunks of several sizes (some add fewer body tokens than KEPT_MIN_TOKENS, some none) through a cache that keeps
    its bodies decoded and one that does not: every chunk's logits equal (torch.equal), and after each chunk every
    layer's kept copy equals its body decoded whole."""
    sizes = [40, 24, 33, 17, 64, 2, 48]
    ids = _ids(sum(sizes), 1)
    plain, kept = _cache(model, spec), _cache(model, spec)
    kept.keep_decoded(True)
    want = _chunks(model, plain, ids, sizes)
    start = 0
    with torch.inference_mode():
        for n, w in zip(sizes, want, strict=True):
            got = gen.forward_step(model, [(ids[start : start + n], kept)])
            start += n
            assert torch.equal(got, w), spec
            for s in kept.stores():
                for stream in (s.k, s.v):
                    if stream.n_body:
                        assert torch.equal(stream.kept_stream(torch.float32), _whole(stream))
    assert kept.kept_nbytes() > 0
    kept.keep_decoded(False)
    assert kept.kept_nbytes() == 0


def test_the_kept_copy_is_reused_not_decoded_again(model, monkeypatch):
    """The second read of an unchanged body decodes nothing; one after a flush decodes only the new tokens."""
    cache = _cache(model, "int4,rotate=none,group=16,residual=16")
    cache.keep_decoded(True)
    _chunks(model, cache, _ids(96), [96])
    stream = cache.stores()[0].v
    decoded: list[int] = []
    real = type(stream.codec).decode

    def counting(self, enc, dtype, offset=0):
        decoded.append(next(iter(enc.token.values())).shape[2])
        return real(self, enc, dtype, offset)

    monkeypatch.setattr(type(stream.codec), "decode", counting)
    n = stream.n_body
    with torch.inference_mode():
        stream.kept_stream(torch.float32)
    assert decoded == []  # nothing new: nothing decoded
    _chunks(model, cache, _ids(32, 2), [32])  # its read decodes each layer's new group, never a whole body
    assert decoded and max(decoded) <= 32 < n


def test_an_eviction_starts_the_kept_copy_over(model):
    """A window the prompt overflows evicts from the body: the copy is dropped, and the next read is still exact."""
    spec = "int4,sink=4,window=60,group=16,residual=16"
    plain, kept = _cache(model, spec), _cache(model, spec)
    kept.keep_decoded(True)
    ids = _ids(200, 3)
    for a, b in zip(_chunks(model, plain, ids, [50, 50, 50, 50]), _chunks(model, kept, ids, [50, 50, 50, 50]),
                    strict=True):
        assert torch.equal(a, b)


def test_keep_decoded_takes_a_bool(model):
    with pytest.raises(ValueError, match="True or False"):
        _cache(model, "int4").keep_decoded("yes")


def test_the_engine_reserves_the_kept_bytes_while_a_prompt_is_read_and_gives_them_back(model):
    """A 96-token prompt read in 32-token chunks: while it is read its row reserves the cache's projection plus the
    kept copy's and its cache holds a copy no larger; after its last chunk both are back to the cache's alone. Its
    greedy tokens equal an engine's that keeps nothing."""
    prompt = _ids(96, 4)
    outs = []
    for keep in (True, False):
        eng = Engine(model, cache="int4,residual=16,group=16,sink=0", prefill_chunk=32, keep_decoded=keep)
        rid = eng.submit(Request(prompt=prompt, max_new_tokens=6))
        row = eng.scheduler.find(rid)
        projected = row.empty.projected_nbytes(96 + 6)
        kept = row.empty.projected_kept_nbytes(96)
        assert row.reserved == projected + (kept if keep else 0) and row.kept == (kept if keep else 0)
        eng.step()
        if keep:
            assert 0 < row.cache.kept_nbytes() <= kept
            assert eng.memory()["kept_decoded_bytes"] == row.cache.kept_nbytes()
            assert eng.scheduler.reserved == projected + kept
        while row.state == "prefill":
            eng.step()
        assert row.cache.kept_nbytes() == 0 and row.kept == 0
        assert eng.scheduler.reserved == projected
        while not eng.idle:
            eng.step()
        outs.append(eng.results[rid].tokens)
    assert len(outs[0]) == 6 and outs[0] == outs[1]


def test_the_engine_goes_without_when_the_copy_would_not_fit_or_is_not_needed(model):
    prompt = _ids(96, 5)
    cache = _cache(model, "int4")
    projected = cache.projected_nbytes(96 + 4)
    eng = Engine(model, cache="int4", prefill_chunk=32, memory_budget=projected + 10)
    row = eng.scheduler.find(eng.submit(Request(prompt=prompt, max_new_tokens=4)))
    assert row.kept == 0 and row.reserved == projected
    eng = Engine(model, cache="int4", prefill_chunk=128)  # one chunk: nothing to keep between chunks
    assert eng.scheduler.find(eng.submit(Request(prompt=prompt, max_new_tokens=4))).kept == 0
    eng = Engine(model, cache="int4,sink=4,window=60", prefill_chunk=32)  # every chunk evicts
    assert eng.scheduler.find(eng.submit(Request(prompt=prompt, max_new_tokens=4))).kept == 0
    with pytest.raises(ValueError, match="keep_decoded must be True or False"):
        Engine(model, cache="int4", keep_decoded=1)


def _whole(stream):
    """The stream decoded whole, body then residual, in float32."""
    body = stream.body()
    whole = stream.codec.decode(body, torch.float32, stream.offset)
    whole = whole if stream.basis is None else stream.basis.decode(whole, body.token.get("centered"))
    res = stream.fp.view()
    return whole if res is None or not res.shape[2] else torch.cat([whole, res.float()], dim=2)


def test_a_stream_fed_a_token_at_a_time_keeps_the_bits_of_a_whole_decode():
    """A fitted rotation's basis, one token a flush: too few rows for the basis' matmul to give the bits it gives
    inside a long run, so such increments decode the body whole (KEPT_MIN_TOKENS); every read is exact."""
    from kvslim.cache.basis import BodyBasis
    from kvslim.cache.stream import Stream
    from kvslim.calibration.rotation import FittedRotation
    from kvslim.formats import make_codec

    g = torch.Generator().manual_seed(6)
    rotation = FittedRotation(torch.linalg.qr(torch.randn(3, 64, 64, generator=g))[0])
    s = Stream(make_codec("q8_0", "k"), residual=0, unit=1, basis=BodyBasis(rotation))
    s.keep_decoded(True)
    s.append(torch.randn(2, 3, 200, 64, generator=g))
    assert torch.equal(s.kept_stream(torch.float32), _whole(s))
    for _ in range(12):
        s.append(torch.randn(2, 3, 1, 64, generator=g))
        assert torch.equal(s.kept_stream(torch.float32), _whole(s))


def test_a_stream_drops_its_kept_copy_on_an_eviction_restore_or_rebatch():
    """After tokens leave the front, even once more have come in than left, the kept copy is the body's."""
    from kvslim.cache.stream import Stream
    from kvslim.formats import make_codec

    s = Stream(make_codec("int4", "k"), residual=0, unit=32)
    s.keep_decoded(True)
    g = torch.Generator().manual_seed(7)
    s.append(torch.randn(2, 2, 64, 32, generator=g))
    s.kept_stream(torch.float32)
    s.drop_front(32)
    s.append(torch.randn(2, 2, 64, 32, generator=g))
    assert torch.equal(s.kept_stream(torch.float32), _whole(s))
    s.map_batch(lambda t: t[:1])
    assert torch.equal(s.kept_stream(torch.float32), _whole(s))


def test_a_prompt_whose_first_chunk_is_its_last_gives_the_reservation_back(model):
    """A row whose remaining prompt fits one chunk when it starts (a continued session's few new tokens, here a
    row whose cache already holds most of its prompt) keeps nothing and gives the kept bytes back."""
    prompt = _ids(96, 8)
    eng = Engine(model, cache="int4,residual=16,group=16", prefill_chunk=32)
    rid = eng.submit(Request(prompt=prompt, max_new_tokens=2))
    row = eng.scheduler.find(rid)
    projected = row.empty.projected_nbytes(96 + 2)
    assert row.kept > 0
    eng.scheduler.admit()
    eng._attach(row)
    row.fed = row.started = 80  # as if a session held the first 80 tokens
    eng.scheduler.start_prefill(row, 32)
    assert row.kept == 0 and row.cache.kept_nbytes() == 0
    assert eng.scheduler.reserved == row.reserved == projected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ["int4", "int8,rotate=none"])
def test_a_half_precision_model_reads_the_same_bits_kept_or_not(dtype, spec):
    """In a bf16/fp16 model the kept copy is float32 where the body has a basis (as the whole decode is) and the
    model's dtype where it has none: each chunk's logits equal a cache's that keeps nothing."""
    model = kvslim.enable(tiny_model("llama", dtype=dtype))
    plain, kept = _cache(model, spec), _cache(model, spec)
    kept.keep_decoded(True)
    ids = _ids(250, 9)
    for a, b in zip(_chunks(model, plain, ids, [50] * 5), _chunks(model, kept, ids, [50] * 5), strict=True):
        assert torch.equal(a, b)
    assert 0 < kept.kept_nbytes() <= kept.projected_kept_nbytes(250, dtype=dtype)


def test_the_public_keys_are_new_tensors_and_later_layers_keep_too(model):
    """``cache.layers[i].keys`` stays a new tensor on each read (a later chunk never writes into one handed out), and
    layers a cache makes after ``keep_decoded(True)`` (built without ``config``: lazily, on the first forward) keep."""
    cache = SlimCache(kv_quantize="int4", rotate="none", group_size=16, residual=16)
    cache.keep_decoded(True)
    ids = torch.tensor([_ids(164, 10)])
    with torch.inference_mode():
        gen.forward(model, ids[:, :100], cache)
        k1 = cache.layers[0].keys
        held = k1.clone()
        gen.forward(model, ids[:, 100:132], cache)
        gen.forward(model, ids[:, 132:], cache)
    assert torch.equal(k1, held)
    assert cache.kept_nbytes() > 0
