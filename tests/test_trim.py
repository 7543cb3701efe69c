"""kvslim.engine.trim: the heap freed by ended requests is handed back, once per batch of frees."""

from __future__ import annotations

import kvslim
from conftest import tiny_model
from kvslim.engine import Engine, Request
from kvslim.engine.trim import Trimmer


def test_trims_only_after_something_was_freed():
    t = Trimmer()
    assert t.available  # glibc here; elsewhere maybe() is a no-op
    assert not t.maybe()
    t.freed()
    t.freed()
    assert t.maybe() and t.trims == 1
    assert not t.maybe() and t.trims == 1


def test_the_engine_trims_after_requests_end():
    engine = Engine(kvslim.enable(tiny_model("llama")), cache="int8")
    engine.run([Request([5, 6, 7], max_new_tokens=3), Request([8, 9], max_new_tokens=2)])
    assert engine.trimmer.trims == 0  # housekeeping ran at the first step, before anything ended
    engine._expired_at = float("-inf")  # the next step is a second later
    engine.step()
    assert engine.trimmer.trims == 1
