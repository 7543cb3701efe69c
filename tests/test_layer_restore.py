"""SlimLayer.state() / restore() (kvslim.cache.layer, kvslim.cache.layerstate): a state restored into a fresh
layer reads back exactly what the saved layer held, and a state whose parts disagree — above all a stored-token
count the tokens seen cannot hold — is refused with one ValueError that names the part, leaving the layer
fresh (issue 33: dropping the stored-tokens check must fail a test)."""

from __future__ import annotations

import pytest
import torch

from kvslim.cache.layer import SlimLayer
from kvslim.cache.policy import KeepPolicy
from kvslim.formats import make_codec


def _layer(fmt="int4", sink=2, window=12, residual=4, group=2):
    k, v = make_codec(fmt, "k", group_size=group), make_codec(fmt, "v", group_size=group)
    return SlimLayer(KeepPolicy(sink=sink, window=window), k, v, residual, group)


def _filled(**kw) -> SlimLayer:
    """A layer fed 9 tokens in chunks (2 sinks, a body of encoded groups and a residual)."""
    layer = _layer(**kw)
    g = torch.Generator().manual_seed(0)
    for n in (5, 1, 3):
        layer.append(torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g))
    return layer


def test_a_restored_layer_reads_what_the_saved_one_held():
    saved = _filled()
    assert (saved.seen, saved.stored, saved.sink_len) == (9, 9, 2)
    fresh = _layer()
    fresh.restore(saved.state())
    assert (fresh.seen, fresh.stored) == (9, 9)
    for a, b in zip(saved.read(torch.float32), fresh.read(torch.float32), strict=True):
        assert torch.equal(a, b)


def test_a_state_storing_more_tokens_than_it_has_seen_is_refused():
    """9 tokens stored (2 sinks + 7 in the streams) for 8 seen: no layer can hold that; restoring it would
    leave positions and eviction counting from a wrong length."""
    state = _filled().state()
    state["seen"] = 8
    fresh = _layer()
    with pytest.raises(ValueError, match=r"^layer state: 2 sinks \(this layer keeps 2\) \+ 7 stream tokens for 8 seen$"):
        fresh.restore(state)
    assert (fresh.seen, fresh.stored) == (0, 0)  # nothing committed
    state["seen"] = 9  # the true count: restores
    fresh.restore(state)
    assert fresh.stored == 9


def test_a_state_with_more_sinks_than_the_layer_keeps_is_refused():
    state = _filled(sink=4).state()
    fresh = _layer(sink=2)
    with pytest.raises(ValueError, match=r"^layer state: 4 sinks \(this layer keeps 2\) \+ 5 stream tokens for 9 seen$"):
        fresh.restore(state)
    assert (fresh.seen, fresh.stored) == (0, 0)


def test_a_state_whose_runs_disagree_with_its_streams_is_refused():
    state = _filled().state()
    state["runs"] = [[n + 1, base] for n, base in state["runs"]]
    with pytest.raises(ValueError, match=r"^layer state: K stream holds 7 tokens, V 7, runs \d+$"):
        _layer().restore(state)
