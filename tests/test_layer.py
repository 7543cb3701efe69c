"""Unit tests of the storage pieces below the cache: KeepPolicy, TimeBuffer, Stream and SlimLayer's
Segments view — each against a plain-list or plain-tensor model of what it must hold."""

from __future__ import annotations

import pytest
import torch

from kvslim.cache.layer import SlimLayer
from kvslim.cache.policy import KeepPolicy
from kvslim.cache.stream import Stream
from kvslim.cache.timebuffer import TimeBuffer
from kvslim.formats import make_codec


def _x(n, start=0, b=1, h=2, d=4):
    """(b, h, n, d) whose every entry along dim 2 carries its token index: token t is all t."""
    t = torch.arange(start, start + n, dtype=torch.float32)
    return t[None, None, :, None].expand(b, h, n, d).clone()


# -- KeepPolicy -----------------------------------------------------------------------------------


def test_unbounded_policy_keeps_everything():
    p = KeepPolicy()
    assert not p.bounded and p.capacity is None
    assert p.n_to_sinks(0, 100) == 0 and p.n_to_evict(10**6) == 0


@pytest.mark.parametrize("sink, window", [(0, 5), (3, 5), (4, 1)])
def test_policy_counts_match_a_list_model(sink, window):
    p = KeepPolicy(sink=sink, window=window)
    kept: list[int] = []
    sinks = 0
    t = 0
    for chunk in [1, 3, 7, 1, 1, 12, 2]:
        n = p.n_to_sinks(sinks, chunk)
        assert n == max(0, min(sink - sinks, chunk))
        sinks += n
        kept += list(range(t, t + chunk))
        t += chunk
        k = p.n_to_evict(len(kept))
        # the list model: drop the oldest non-sink tokens down to sink + window
        del kept[sinks : sinks + k]
        assert len(kept) == min(t, sink + window)
        assert kept[:sinks] == list(range(sinks))
        assert kept[sinks:] == list(range(t - (len(kept) - sinks), t))


def test_sink_starts_freeze_after_pads_leave():
    p = KeepPolicy(sink=2, window=4)
    pads = torch.tensor([0, 3, 10])
    assert p.sink_starts(6, pads).tolist() == [0, 0, 0]  # nothing evicted yet
    assert p.sink_starts(8, pads).tolist() == [0, 2, 2]  # pads inside the span: sinks slide
    assert p.sink_starts(30, pads).tolist() == [0, 3, 10]  # frozen on each row's first real token


# -- TimeBuffer -----------------------------------------------------------------------------------


def test_time_buffer_matches_a_tensor_model():
    buf = TimeBuffer(min_slack=2)
    ref = torch.empty(1, 2, 0, 4)
    t = 0
    for op, n in [("a", 3), ("a", 5), ("f", 2), ("a", 1), ("b", 2), ("f", 4), ("a", 9), ("f", 0), ("a", 1)]:
        if op == "a":
            buf.append(_x(n, t))
            ref = torch.cat([ref, _x(n, t)], dim=2)
            t += n
        elif op == "f":
            buf.drop_front(n)
            ref = ref[:, :, n:]
        else:
            buf.drop_back(n)
            ref = ref[:, :, : ref.shape[2] - n]
        assert len(buf) == ref.shape[2]
        assert torch.equal(buf.view(), ref)
        assert buf.live_nbytes() == ref.numel() * 4
        assert buf.nbytes() >= buf.live_nbytes()


def test_time_buffer_never_overwrites_handed_out_views():
    buf = TimeBuffer(min_slack=1)
    buf.append(_x(2))
    view = buf.view()
    before = view.clone()
    for i in range(20):
        buf.append(_x(1, 2 + i))
    assert torch.equal(view, before)


def test_time_buffer_gives_memory_back_after_a_big_drop():
    buf = TimeBuffer(min_slack=4)
    buf.append(_x(1000))
    buf.drop_front(995)
    assert buf.nbytes() <= (5 + 2 * 4) * buf.view()[:, :, :1].numel() * 4 * 2
    assert torch.equal(buf.view(), _x(5, 995))


@pytest.mark.parametrize("capacity, chunk, drop", [(10, 1, 1), (10, 3, 1), (33, 32, 1), (40, 1, 32), (9, 4, 4), (8, 2, 5)])
def test_capped_time_buffer_compacts_in_place_as_a_tensor_model(capacity, chunk, drop):
    """A ring at its capacity moves its live entries to the front in place whatever the gap against the live
    entries (shorter: overlapping chunks copied front to back; as long or longer: one copy), never reallocating."""
    buf = TimeBuffer(min_slack=1, capacity=capacity)
    ref = torch.empty(2, 3, 0, 4)
    t, block = 0, None
    for step in range(60):
        n = min(chunk, capacity - len(buf))
        x = _x(n, t, b=2, h=3) * torch.arange(1, 7.0).view(2, 3, 1, 1)  # every (row, head) block its own values
        buf.append(x)
        ref = torch.cat([ref, x], dim=2)
        t += n
        if len(buf) + chunk > capacity:
            k = min(drop, len(buf))
            buf.drop_front(k)
            ref = ref[:, :, k:]
        assert torch.equal(buf.view(), ref), step
        if buf.data is not None and buf.data.shape[2] == capacity:
            block = buf.data if block is None else block
            assert buf.data is block  # full: never reallocated again
    assert block is not None


def test_time_buffer_rejects_bad_drops():
    buf = TimeBuffer()
    buf.append(_x(3))
    with pytest.raises(ValueError, match="cannot drop 4 of 3"):
        buf.drop_front(4)
    with pytest.raises(ValueError, match="cannot drop -1 of 3"):
        buf.drop_back(-1)


# -- Stream ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, residual, unit", [("none", 0, 1), ("fp16", 4, 2), ("int8", 8, 4), ("int4", 0, 4)])
def test_stream_keeps_order_and_residual_bound(fmt, residual, unit):
    codec = make_codec(fmt, "k", group_size=unit)
    s = Stream(codec, residual, unit, min_slack=2)
    ref = torch.empty(1, 2, 0, 32)
    t = 0
    g = torch.Generator().manual_seed(0)
    for n in [1, 2, 13, 1, 1, 1, 6, 1]:
        x = torch.randn(1, 2, n, 32, generator=g) + t
        s.append(x)
        ref = torch.cat([ref, x], dim=2)
        t += n
        assert len(s) == ref.shape[2]
        if codec.lossy:
            assert residual <= len(s.fp) + (ref.shape[2] < residual) * residual
            assert len(s.fp) <= max(residual, 0) + unit - 1 or len(s.fp) == ref.shape[2]
            assert s.n_body % unit == 0
        got = s.materialize(torch.float32)
        # the residual is exact; the body decodes within the format's error
        assert torch.equal(got[:, :, s.n_body :], ref[:, :, s.n_body :])
        tol = {"none": 0, "fp16": 1e-2, "int8": 0.1, "int4": 1.0}[fmt]
        assert (got - ref).abs().max() <= tol
    s.drop_front(5)
    assert len(s) == ref.shape[2] - 5
    assert torch.equal(s.materialize(torch.float32)[:, :, -len(s.fp) :], ref[:, :, -len(s.fp) :])


def test_stream_eviction_inside_a_group_keeps_surviving_tokens_exact():
    codec = make_codec("int4", "k", group_size=4)
    s = Stream(codec, residual=0, unit=4)
    x = torch.randn(1, 2, 12, 32, generator=torch.Generator().manual_seed(1))
    s.append(x)
    before = s.materialize(torch.float32)
    for k in range(1, 10):
        s.drop_front(1)
        assert s.offset == k % 4
        assert torch.equal(s.materialize(torch.float32), before[:, :, k:])


def test_stream_crop_back_only_from_the_residual():
    s = Stream(make_codec("q8_0", "v"), residual=0, unit=1)
    s.append(torch.randn(1, 1, 3, 32))
    with pytest.raises(ValueError, match="full precision"):
        s.crop_back(1)


# -- SlimLayer ------------------------------------------------------------------------------------


def _layer(fmt="int4", sink=2, window=6, residual=4, group=2):
    k, v = make_codec(fmt, "k", group_size=group), make_codec(fmt, "v", group_size=group)
    return SlimLayer(KeepPolicy(sink=sink, window=window), k, v, residual, group)


def test_segments_materialize_equals_read():
    layer = _layer()
    g = torch.Generator().manual_seed(2)
    for n in [5, 1, 1, 3, 1]:
        k, v = torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g)
        seg = layer.append(k, v, segments=True)
        # taken before eviction: stored + the new tokens
        assert seg.shape[2] == seg.length
        mk, mv = seg.materialize()
        layer2_k, layer2_v = layer.read(torch.float32)
        # after eviction the layer holds the last `stored` of what the view showed
        assert torch.equal(mk[:, :, : layer.sink_len], layer2_k[:, :, : layer.sink_len])
        assert torch.equal(mv[:, :, -layer.stored + layer.sink_len :], layer2_v[:, :, layer.sink_len :])
    with pytest.raises(AttributeError):
        seg.length = 0  # frozen


def test_layer_pads_are_set_explicitly():
    layer = _layer(fmt="none", sink=1, window=3)
    layer.set_pads(torch.tensor([0, 2]))
    layer.append(_x(6, b=2), _x(6, b=2))
    # row 1 has 2 pads: its sink is its first real token (position 2), row 0's is position 0
    assert layer.sink_k[:, 0, 0, 0].tolist() == [0.0, 2.0]


@pytest.mark.parametrize(
    "sink, window, residual, group, v_fmt, first, routed",
    [
        (0, None, 6, 4, "int4", 7, True),
        (2, 9, 4, 2, "int4", 7, True),
        (0, 12, 5, 4, "int4", 7, True),
        (4, 10, 4, 2, "int4", 1, True),  # decode tokens while the sinks still fill: the full path until they are full
        (0, None, 4, 2, "int8", 3, True),  # K and V in two formats
        (0, None, 4, 2, "none", 3, False),  # a lossless V stores its token as given: the full path
        (3, None, 0, 1, "int4", 7, False),  # no residual: every token is encoded on arrival
    ],
)
def test_a_decode_token_committed_without_planning_leaves_what_planning_leaves(
    monkeypatch, sink, window, residual, group, v_fmt, first, routed
):
    """SlimLayer.append's one-token route (a ragged step's decode token, cast to float16 and checked by the caller:
    kvslim.cache.layercheck.one_token) against the full path on a twin layer fed the same tokens: the same stored
    state, the same Segments, the same sink deltas after every append, flushes, sinks and evictions included
    (those take the full path), and the route really taken by append where it applies."""
    from kvslim.cache import layercheck, layerstate

    asked = []
    real = layercheck.one_token
    monkeypatch.setattr(layercheck, "one_token", lambda *a: asked.append(real(*a)) or asked[-1])

    def make():
        k = make_codec("int4", "k", group_size=group)
        v = make_codec(v_fmt, "v", group_size=group)
        return SlimLayer(KeepPolicy(sink=sink, window=window), k, v, residual, group, fp_dtype="auto")

    fast, slow = make(), make()
    g = torch.Generator().manual_seed(4)
    for n in [first, *[1] * 16, 3, *[1] * 6]:
        k, v = torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g)
        halves = (k.half(), v.half()) if n == 1 else None
        a, da = fast.append(k, v, segments=True, defer_sinks=True, base=0, finite_checked=True, halves=halves)
        b, db = slow.append(k, v, segments=True, defer_sinks=True, base=0)
        assert da == db
        for name in ("k_sink", "v_sink", "k_res", "v_res", "length", "kv_shape", "dtype", "k_runs", "k_offset"):
            x, y = getattr(a, name), getattr(b, name)
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), name
        for x, y in zip(a.materialize(), b.materialize(), strict=True):
            assert torch.equal(x, y)
        sa, sb = layerstate.layer_state(fast), layerstate.layer_state(slow)
        assert sa.keys() == sb.keys()
        for key in sa:
            assert _same(sa[key], sb[key]), key
    taken = sum(asked)
    assert (taken >= 8) == routed and (taken == 0) == (not routed)  # append took the route where it applies
    if sink and first < sink:
        assert not asked[0]  # the first decode token still fills a sink
    k = torch.randn(1, 2, 1, 32)
    assert not real(fast, k.double(), k.double())  # another dtype: the full path says why
    assert not real(fast, torch.randn(1, 3, 1, 32), torch.randn(1, 3, 1, 32))


def _same(x, y) -> bool:
    """Equal bit for bit, through tensors, Encoded bodies, tuples, lists and dicts."""
    from kvslim.formats import Encoded

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, Encoded):
        return isinstance(y, Encoded) and _same(x.token, y.token) and _same(x.group, y.group)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return x == y


def test_segments_of_is_the_constructor():
    """Segments.of (a layer's view, built without the frozen dataclass' per-field setattr) makes what the
    constructor makes, still frozen; a field left out or unknown is an error, never a view missing a field."""
    from dataclasses import fields as dc_fields

    from kvslim.cache.segments import Segments

    layer = _layer()
    layer.append(torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 32))
    seg = layer.segments()
    values = {f.name: getattr(seg, f.name) for f in dc_fields(Segments)}
    assert Segments.of(**values) == Segments(**values) == seg
    with pytest.raises(AttributeError):
        Segments.of(**values).length = 0
    with pytest.raises(TypeError, match=r"missing \['v_stream'\], unknown \[\]"):
        Segments.of(**{k: v for k, v in values.items() if k != "v_stream"})
    with pytest.raises(TypeError, match=r"unknown \['extra'\]"):
        Segments.of(**values, extra=1)
