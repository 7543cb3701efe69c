"""Engine sessions (kvslim.engine.sessions): a continued conversation prefills only its new tokens and
gives exactly the tokens of one request carrying the whole history; idle sessions count against the
budget, are parked on disk least recently used first and come back bit for bit."""

from __future__ import annotations

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim.engine import Engine, Request

SPECS = ["none", "int4,sink=4,window=60", "q8_0,residual=32"]


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _turns(engine: Engine, session: str, spec: str, turns: int = 3, seed: int = 0) -> tuple[list[int], list]:
    """Run a ``turns``-turn conversation: each turn's prompt is the history (prompts + replies but the last
    token of the last reply, never fed) plus new user tokens. Returns the final history and the results."""
    history: list[int] = []
    results = []
    for t in range(turns):
        prompt = history + _ids(7 + 5 * t, seed + t)
        res = engine.run([Request(prompt, max_new_tokens=6, cache=spec, session=session)])[0]
        results.append((prompt, res))
        history = prompt + res.tokens
    return history, results


@pytest.mark.parametrize("spec", SPECS)
def test_continued_session_equals_one_request_with_the_whole_history(model, spec):
    engine = Engine(model, prefill_chunk=16)
    _, results = _turns(engine, "chat", spec)
    fed = 0
    for t, (prompt, res) in enumerate(results):
        # one request, no session, carrying the whole history: the same greedy tokens
        alone = Engine(model, prefill_chunk=16).run([Request(prompt, max_new_tokens=6, cache=spec)])[0]
        assert res.tokens == alone.tokens, (spec, t)
        if t:
            kept = len(results[t - 1][0]) + len(results[t - 1][1].tokens) - 1
            assert res.cached_tokens == kept  # only the new tokens were prefilled
            fed += len(prompt) - kept
        else:
            assert res.cached_tokens == 0
            fed += len(prompt)
    assert engine.prefilled_tokens == fed
    mem = engine.memory()
    assert mem["sessions_continued"] == 2 and mem["sessions_reset"] == 0 and mem["sessions_kept"] == 1


def test_an_edited_history_starts_over_and_is_counted(model):
    engine = Engine(model)
    history, _ = _turns(engine, "s", "int4", turns=1)
    edited = [history[0] + 1 if history[0] < 120 else 3] + history[1:] + _ids(5, 9)
    res = engine.run([Request(edited, max_new_tokens=4, cache="int4", session="s")])[0]
    assert res.cached_tokens == 0 and engine.memory()["sessions_reset"] == 1
    assert res.tokens == Engine(model).run([Request(edited, max_new_tokens=4, cache="int4")])[0].tokens
    # other settings than the kept cache's: starts over too
    res = engine.run([Request(edited + res.tokens + [5], max_new_tokens=4, cache="int8", session="s")])[0]
    assert res.cached_tokens == 0 and engine.memory()["sessions_reset"] == 2


def _reserved(model, spec: str, total: int) -> int:
    from kvslim import SlimCache

    cache = SlimCache.from_config(kvslim.config.parse_spec(spec), config=model.config)
    return cache.projected_nbytes(total, dtype=torch.float32)


@pytest.mark.parametrize("spec", ["int4,sink=4,window=60", "none"])
def test_lru_sessions_parked_on_disk_come_back_identical(model, spec, tmp_path):
    """Three sessions interleaved under a budget that holds about one: the least recently used are parked in
    session_dir and read back; every turn equals the same conversation run with no budget at all."""
    budget = int(1.5 * _reserved(model, spec, 60))  # the last turns reach ~50 tokens: about one at a time
    tight = Engine(model, memory_budget=budget, session_dir=tmp_path, prefill_chunk=16)
    free = Engine(model, prefill_chunk=16)
    histories = {s: [] for s in "abc"}
    for t in range(4):
        for s in "abc":
            prompt = histories[s] + _ids(6 + t, ord(s) + 10 * t)
            got = tight.run([Request(prompt, max_new_tokens=5, cache=spec, session=s)])[0]
            want = free.run([Request(prompt, max_new_tokens=5, cache=spec, session=s)])[0]
            assert got.tokens == want.tokens and got.cached_tokens == want.cached_tokens, (s, t)
            mem = tight.memory()
            assert mem["reserved_bytes"] + mem["session_bytes"] <= budget
            histories[s] = prompt + got.tokens
            if t:
                assert got.cached_tokens > 0
    mem = tight.memory()
    assert mem["sessions_evicted"] >= 4 and mem["sessions_restored"] >= 4 and mem["sessions_dropped"] == 0
    assert mem["sessions_kept"] + mem["sessions_on_disk"] == 3
    assert free.memory()["sessions_evicted"] == 0


def test_a_restarted_engine_continues_a_parked_session(model, tmp_path):
    spec = "int4,sink=4,window=60"
    first = Engine(model, session_dir=tmp_path)
    history, _ = _turns(first, "kept", spec, turns=2)
    first.park_sessions()  # what a server does on shutdown
    assert first.memory()["sessions_on_disk"] == 1
    prompt = history[:-1] + _ids(8, 77)
    second = Engine(model, session_dir=tmp_path)  # a new process on the same directory
    got = second.run([Request(prompt, max_new_tokens=6, cache=spec, session="kept")])[0]
    assert got.cached_tokens == len(history) - 1
    assert got.tokens == Engine(model).run([Request(prompt, max_new_tokens=6, cache=spec)])[0].tokens


def test_without_session_dir_idle_sessions_are_dropped_and_counted(model, caplog):
    spec = "none"
    budget = int(1.2 * _reserved(model, spec, 40))
    engine = Engine(model, memory_budget=budget)
    engine.run([Request(_ids(20, 1), max_new_tokens=5, cache=spec, session="x")])
    with caplog.at_level("WARNING", logger="kvslim.engine"):
        engine.run([Request(_ids(30, 2), max_new_tokens=5, cache=spec, session="y")])
    mem = engine.memory()
    assert mem["sessions_dropped"] == 1 and mem["sessions_kept"] == 1
    assert "'x' dropped" in caplog.text and "no session_dir" in caplog.text


def test_a_cancelled_session_keeps_what_was_fed(model):
    engine = Engine(model)
    prompt = _ids(12, 3)
    rid = engine.submit(Request(prompt, max_new_tokens=50, cache="int8", session="c"))
    for _ in range(4):
        engine.step()
    engine.cancel(rid)
    engine.step()
    res = engine.results.pop(rid)
    assert res.finish_reason == "cancelled"
    history = prompt + res.tokens[:-1]
    nxt = history + _ids(4, 5)
    got = engine.run([Request(nxt, max_new_tokens=4, cache="int8", session="c")])[0]
    assert got.cached_tokens == len(history)
    assert got.tokens == Engine(model).run([Request(nxt, max_new_tokens=4, cache="int8")])[0].tokens


def test_session_must_be_a_string():
    with pytest.raises(ValueError, match="session must be a non-empty string"):
        Request([1, 2], max_new_tokens=2, session=3)
