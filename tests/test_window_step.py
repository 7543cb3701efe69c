"""A windowed ragged step's per-row bookkeeping, done once a layer or on the host (issue 30's windowed step): the
sinks' distances worked out on the host equal the tensor arithmetic they replace, an unpadded layer's eviction
equals the padded path's, and a step of windowed rows moves each distinct set of sinks with angles computed once a
step — each row's logits bit for bit those of the row stepped alone."""

from __future__ import annotations

import copy

import pytest
import torch

import kvslim
from conftest import tiny_config, tiny_model
from kvslim import SlimCache
from kvslim import generate as gen
from kvslim.cache.rotary import Rotary
from kvslim.engine.linears import Linears

H, D = 2, 32  # the tiny llama's KV heads and head dim


def _layer(spec: str):
    cache = SlimCache.from_config(kvslim.parse_spec(spec), config=tiny_config())
    return cache.layers[0].store


@pytest.mark.parametrize("positions", ["cache", "original"])
@pytest.mark.parametrize("bases", [(0, 0, 0), (0, 64, 64), (0, 0, 128)])
def test_host_sink_deltas_equal_the_tensor_arithmetic(positions, bases):
    """Frames.sink_delta on the host (no padding: pads and sink starts None) gives the distances of its tensor
    path with explicit zero pads and starts, at every step of a stream that evicts and re-bases."""
    store = _layer(f"int4,sink=4,window=40,group=8,residual=8,positions={positions}")
    g = torch.Generator().manual_seed(1)
    kv = lambda t: torch.randn(1, H, t, D, generator=g)  # noqa: E731
    zeros = torch.zeros(1, dtype=torch.long)
    checked = 0
    for i, n in enumerate([3, 1, 30, 1, 1, 20] + [1] * 12):
        base = bases[min(i // 6, 2)]
        store.append(kv(n), kv(n), base=base)
        first = store.seen - len(store.k)
        host = store.frames.sink_delta(store.sink_k, first_stream_slot=first, pads=None, sink_start=None)
        ref = store.frames.sink_delta(store.sink_k, first_stream_slot=first, pads=zeros, sink_start=zeros)
        if ref is None:
            assert host is None, i
            continue
        assert torch.equal(host, ref), (i, host, ref)
        as_tuples = store.frames.sink_delta(
            store.sink_k, first_stream_slot=first, pads=None, sink_start=None, host=True
        )
        assert as_tuples == tuple(tuple(r) for r in ref.tolist())
        checked += 1
    if positions == "cache" or any(bases):  # the window slides (or the base moves): the sinks move
        assert checked >= 5


def test_an_unpadded_layer_evicts_as_the_padded_path_does():
    """A layer without padding takes the eviction's fast path (its sink starts stay 0 with no torch op); fed the
    same tokens, a layer handed explicit zero pads (the general path) holds the same tensors at every step."""
    spec = "int4,sink=4,window=24,group=8,residual=8"
    fast, slow = _layer(spec), _layer(spec)
    slow.set_pads(torch.zeros(1, dtype=torch.long))
    g = torch.Generator().manual_seed(2)
    for i, n in enumerate([2, 5, 40] + [1] * 30):
        k, v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
        a = fast.append(k, v, segments=True)
        b = slow.append(k, v, segments=True)
        assert fast._unpadded() and not slow._unpadded()
        for x, y in zip(a.materialize(), b.materialize(), strict=True):
            assert torch.equal(x, y), i
        assert torch.equal(fast.sink_k, slow.sink_k) and torch.equal(fast.sink_rot, slow.sink_rot), i
        assert torch.equal(fast.sink_start, slow.sink_start) and fast.stored == slow.stored, i


#: windowed rows of two sink counts (two groups of sink shapes), several lengths (different distances) and two rows
#: at the same length (one group sharing its distances), beside an unbounded row
ROWS = [
    ("int4,sink=4,window=48,group=8,residual=8", 70),
    ("int4,sink=4,window=48,group=8,residual=8", 93),
    ("int4,sink=4,window=48,group=8,residual=8", 93),
    ("q8_0,sink=2,window=40,residual=0,group=1", 61),
    ("int4,group=8,residual=8", 50),
]


def test_windowed_rows_in_a_step_equal_each_row_alone_with_angles_once_a_step(monkeypatch):
    """Ragged decode steps of windowed rows (every step moves their sinks, evicts, and now and then encodes a
    group) on a 4-layer model: each row's logits are bit for bit the row's alone, step after step, and the sinks'
    angles are computed once per step and group of distances, not once per layer."""
    model = tiny_model(num_hidden_layers=4)
    kvslim.enable(model)
    g = torch.Generator().manual_seed(3)
    caches = []
    for spec, n in ROWS:
        cache = SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
        with torch.inference_mode():
            gen.prefill(model, torch.randint(3, 120, (1, n), generator=g), cache)
        caches.append(cache)
    alone = [copy.deepcopy(c) for c in caches]
    calls = []
    real = Rotary.move_angles
    monkeypatch.setattr(
        Rotary, "move_angles", lambda self, d, dev: calls.append(tuple(d.shape)) or real(self, d, dev)
    )
    steps = 12
    tokens = torch.randint(3, 120, (steps, len(ROWS)), generator=g).tolist()
    with torch.inference_mode(), Linears(model, "auto").routed():  # the engine's default route: rows alike on any CPU
        for s in range(steps):
            calls.clear()
            together = gen.forward_rows(model, tokens[s], caches)
            # rows 0-2 (4 sinks; rows 1 and 2 at the same distances) and row 3 (2 sinks): two moves a step
            assert sorted(calls) == [(1, 2), (3, 4)], (s, calls)
            for b, cache in enumerate(alone):
                one = gen.forward_rows(model, [tokens[s][b]], [cache])
                assert torch.equal(together[b], one[0]), (s, b)


#: copies of one prompt fill their residuals at the same step (as kvslim bench's rows do): their flushed groups are
#: encoded in one call per stream and configuration. Formats: per-channel K with a Hadamard basis, per-token rows,
#: variance-normalized codes, pre-RoPE int2, a window; one configuration with a single row (encoded alone).
SYNCED = [
    ("int4,group=8,residual=8", 3),
    ("q8_0,k=int8,group=8,residual=8", 2),
    ("int4,varnorm=on,group=8,residual=8", 2),
    ("int2,group=8,residual=8", 2),
    ("int4,sink=4,window=40,group=8,residual=8", 2),
    ("int8,rotate=none,group=8,residual=16", 1),
]


def test_rows_that_flush_together_encode_in_one_call_with_each_rows_bits(monkeypatch):
    """Rows that flush a residual group in the same step (copies of one prompt) are encoded in one call per stream
    and configuration; each row's logits, step after step, are bit for bit the row's stepped alone, and its stored
    codes equal its own."""
    from kvslim.cache.stream import Stream

    model = tiny_model(num_hidden_layers=3)
    kvslim.enable(model)
    g = torch.Generator().manual_seed(4)
    caches, specs = [], []
    for spec, copies in SYNCED:
        base = SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
        with torch.inference_mode():
            gen.prefill(model, torch.randint(3, 120, (1, 45), generator=g), base)
        caches += [copy.deepcopy(base) for _ in range(copies)]
        specs += [spec] * copies
    alone = [copy.deepcopy(c) for c in caches]
    encodes = []
    real = Stream._encode
    monkeypatch.setattr(Stream, "_encode", lambda self, x: encodes.append(x.shape[0]) or real(self, x))
    tokens = torch.randint(3, 120, (20, len(caches)), generator=g).tolist()
    batched, seen = 0, []
    with torch.inference_mode(), Linears(model, "auto").routed():
        for s in range(20):
            encodes.clear()
            together = gen.forward_rows(model, tokens[s], caches)
            batched += sum(n > 1 for n in encodes)
            seen += encodes
            for b, cache in enumerate(alone):
                one = gen.forward_rows(model, [tokens[s][b]], [cache])
                assert torch.equal(together[b], one[0]), (s, b, specs[b])
    assert (
        3 in seen and batched >= 2 * 3 * 5
    )  # 20 steps: 2+ flushes of K and V in 3 layers for each of 5 configs
    for c, a in zip(caches, alone, strict=True):
        for lc, la in zip(c.layers, a.layers, strict=True):
            for role in ("k", "v"):
                x, y = getattr(lc.store, role).body(), getattr(la.store, role).body()
                for name in x.token:
                    assert torch.equal(x.token[name], y.token[name]), name


def test_re_based_rows_move_their_queries_with_angles_once_a_step(monkeypatch):
    """Windowed rows right after the re-base at 4,096 (keys in two RoPE frames: each row's queries moved for the
    old frame's run) on a 3-layer model: each row's logits bit for bit its own alone, and the queries' angles
    computed once a step for the rows' distances, not once a layer."""
    model = tiny_model(num_hidden_layers=3, max_position_embeddings=8192)
    kvslim.enable(model)
    g = torch.Generator().manual_seed(6)
    spec = "int4,sink=4,window=48,group=8,residual=8"
    caches = []
    for n in (4090, 4093, 4093):
        cache = SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
        with torch.inference_mode():
            gen.prefill(model, torch.randint(3, 120, (1, n), generator=g), cache, chunk_size=2048)
        caches.append(cache)
    alone = [copy.deepcopy(c) for c in caches]
    calls = []
    real = Rotary.move_angles
    monkeypatch.setattr(
        Rotary, "move_angles", lambda self, d, dev: calls.append(tuple(d.shape)) or real(self, d, dev)
    )
    tokens = torch.randint(3, 120, (12, len(caches)), generator=g).tolist()
    with torch.inference_mode():
        for s in range(12):
            calls.clear()
            together = gen.forward_rows(model, tokens[s], caches)
            queries = [c for c in calls if c[0] == 3 and c[1] == 2]  # 3 rows x (GQA group 2 x 1 token)
            if s >= 6:  # every row past 4,096: its old keys a run off the frame
                assert queries == [(3, 2)], (s, calls)
            for b, cache in enumerate(alone):
                one = gen.forward_rows(model, [tokens[s][b]], [cache])
                assert torch.equal(together[b], one[0]), (s, b)


def test_a_single_streams_sinks_move_with_angles_once_a_forward(monkeypatch):
    """One stream's decode (no ragged step): the sinks of every layer move by the same distances, so their angles
    are computed once a forward and shared (Rotary.rows_angles), not once a layer; the moved sinks are the bits of
    moving them by the distances' tensor, as before."""
    model = kvslim.enable(tiny_model("llama"))
    n_layers = model.config.num_hidden_layers
    cache = SlimCache.from_config(kvslim.parse_spec("int4,sink=4,window=28,group=8,residual=8"), config=model.config)
    calls = []
    real = Rotary.move_angles

    def spy(self, delta, device):
        calls.append(tuple(delta.shape))
        return real(self, delta, device)

    monkeypatch.setattr(Rotary, "move_angles", spy)
    with torch.inference_mode():
        gen.prefill(model, torch.arange(3, 43)[None], cache)
        for t in range(6):
            calls.clear()
            gen.decode_one_token(model, torch.tensor([[50 + t]]), cache)
            assert len(calls) == 1, calls  # the window slid: every layer's sinks moved, one set of angles
            assert "rows" not in cache.layers[0].store.rotary._memo  # dropped after the last layer: not the cache's bytes
        store = cache.layers[1].store
        delta = store.frames.sink_delta(store.sink_k, first_stream_slot=store.seen - len(store.k), pads=None, sink_start=None)
        assert delta is not None and n_layers > 1
        assert torch.equal(store.segments().k_sink, store.rotary.move(store.sink_k, delta))
        held = cache.nbytes()
        store.read(torch.float32)  # a read from outside a forward shares nothing and keeps nothing
        assert cache.nbytes() == held and "rows" not in store.rotary._memo
