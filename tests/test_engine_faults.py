"""The batch engine and its runner survive their requests (issue 29): whatever fails for one row ends that
row alone with an error, the others finish exactly as they would alone; refusals are typed; prefill is
shared in turns; the runner's thread outlives a failing step and never leaves a client waiting."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim import SlimCache
from kvslim import generate as gen
from kvslim.engine import (
    BudgetRefusal,
    ContextRefusal,
    Engine,
    InputRefusal,
    QueueFull,
    Refusal,
    Request,
    RequestLimits,
    SettingsRefusal,
    ShuttingDown,
)
from kvslim.serve.runner import Done, Runner


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _three() -> list[Request]:
    return [
        Request(_ids(20, 1), max_new_tokens=12, cache="int4,sink=4,window=60"),
        Request(_ids(33, 2), max_new_tokens=12, cache="q8_0"),
        Request(_ids(9, 3), max_new_tokens=12, cache="none"),
    ]


def _alone(model, req: Request, chunk: int = 256) -> list[int]:
    return Engine(model, prefill_chunk=chunk).run([req])[0].tokens


def _row(engine: Engine, rid: str):
    return next(r for r in engine.scheduler.active if r.request_id == rid)


# -- per-row fault isolation in step() -------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_end_that_row_alone(model, monkeypatch, temperature):
    """Row 1's logits turn NaN at its 4th decode step: it ends with an error naming the cause (greedy argmax
    would pick a token from NaN, sampling would raise); rows 0 and 2 finish exactly as they do alone."""
    reqs = _three()
    reqs[1] = Request(reqs[1].prompt, max_new_tokens=12, cache="q8_0", temperature=temperature, seed=5)
    engine = Engine(model, max_batch=3)
    ids = [engine.submit(r) for r in reqs]
    real, calls = gen.forward_rows, []

    def poisoned(model_, tokens, caches, **kw):
        logits = real(model_, tokens, caches, **kw)
        target = engine.scheduler.find(ids[1])
        if target is not None and target.cache in caches:
            calls.append(1)
            if len(calls) >= 4:
                logits[caches.index(target.cache)] = float("nan")
        return logits

    monkeypatch.setattr(gen, "forward_rows", poisoned)
    events = list(engine.events())
    bad = engine.results[ids[1]]
    assert bad.finish_reason == "error" and "sampling failed" in bad.error and "not finite" in bad.error
    assert len(bad.tokens) == 4  # the first (from prefill) and three decode steps
    final = [e for e in events if e.request_id == ids[1] and e.finished]
    assert len(final) == 1 and final[0].token is None and final[0].finish_reason == "error"
    monkeypatch.setattr(gen, "forward_rows", real)
    for i in (0, 2):
        assert engine.results[ids[i]].finish_reason == "length"
        assert engine.results[ids[i]].tokens == _alone(model, reqs[i])
    assert engine.memory()["row_errors"] == 1 and engine.memory()["reserved_bytes"] == 0


def test_a_prefill_chunk_that_raises_ends_only_that_row(model, monkeypatch):
    """Request 1's 2nd prompt chunk fails inside the step's one forward, which it shares with the decoding rows
    (its store raises in layer 1, as out of memory would): that row alone ends."""
    reqs = _three()
    engine = Engine(model, max_batch=3, prefill_chunk=16)
    ids = [engine.submit(r) for r in reqs]
    layer = type(SlimCache.from_config(kvslim.parse_spec("q8_0"), config=model.config).layers[1].store)
    real = layer.append

    def failing(store, keys, values, **kw):
        row = engine.scheduler.find(ids[1])
        if row is not None and store is row.cache.layers[1].store and store.seen == 16:  # its 2nd chunk
            raise RuntimeError("simulated out of memory")
        return real(store, keys, values, **kw)

    monkeypatch.setattr(layer, "append", failing)
    list(engine.events())
    monkeypatch.setattr(layer, "append", real)
    bad = engine.results[ids[1]]
    assert bad.finish_reason == "error" and bad.tokens == []
    assert bad.error == "prefill failed: RuntimeError: simulated out of memory"
    for i in (0, 2):
        assert engine.results[ids[i]].tokens == _alone(model, reqs[i], chunk=16)


def test_a_decode_step_whose_kv_one_row_refuses_ends_only_that_row(model):
    """Row 1's store refuses its K/V mid-decode (as non-finite K/V are): forward_rows drops it from the step
    (errors=), it ends with the error, and rows 0 and 2 keep every greedy token they have alone."""
    reqs = _three()
    engine = Engine(model, max_batch=3)
    ids = [engine.submit(r) for r in reqs]
    while len(engine.results[ids[1]].tokens) < 3:
        engine.step()
    store = _row(engine, ids[1]).cache.layers[1].store

    def refuse(*args, **kwargs):
        raise ValueError("keys hold non-finite values (nan) in layer 1")

    store.append = refuse
    list(engine.events())
    bad = engine.results[ids[1]]
    assert bad.finish_reason == "error" and len(bad.tokens) == 3
    assert bad.error == "the decode step failed: keys hold non-finite values (nan) in layer 1"
    for i in (0, 2):
        assert engine.results[ids[i]].finish_reason == "length"
        assert engine.results[ids[i]].tokens == _alone(model, reqs[i])


def test_a_session_restore_or_park_that_raises_ends_only_that_row(model, monkeypatch):
    engine = Engine(model, max_batch=4)
    first = engine.run([Request(_ids(10, 7), max_new_tokens=4, cache="int4", session="keep")])[0]
    store = engine.sessions
    real_take, real_keep = store.take, store.keep

    def take(session, prompt, config):
        if session == "restore":
            raise OSError(5, "Input/output error", "/srv/kvslim/sessions/abc.safetensors")
        return real_take(session, prompt, config)

    def keep(session, cache, tokens, config):
        if session == "park":
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        return real_keep(session, cache, tokens, config)

    monkeypatch.setattr(store, "take", take)
    monkeypatch.setattr(store, "keep", keep)
    history = _ids(10, 7) + first.tokens[:-1]
    reqs = [
        Request(_ids(12, 8), max_new_tokens=5, cache="int4", session="restore"),
        Request(_ids(14, 9), max_new_tokens=5, cache="int4", session="park"),
        Request(history + _ids(3, 10), max_new_tokens=5, cache="int4", session="keep"),
        Request(_ids(11, 11), max_new_tokens=5, cache="int4"),
    ]
    ids = [engine.submit(r) for r in reqs]
    events = list(engine.events())
    restore, park, kept, plain = (engine.results[i] for i in ids)
    assert restore.finish_reason == "error" and restore.tokens == []
    assert restore.error == "restoring its session failed: OSError: Input/output error"  # no server path
    # park: every token was produced; the failure to keep its session is its final event's error
    assert park.finish_reason == "error" and len(park.tokens) == 5
    assert park.error.startswith("keeping its session failed: 'utf-8' codec can't encode")
    last = [e for e in events if e.request_id == ids[1]][-1]
    assert last.finished and last.token == park.tokens[-1] and last.finish_reason == "error"
    assert kept.finish_reason == "length" and kept.cached_tokens == len(history)
    assert kept.tokens == _alone(model, Request(reqs[2].prompt, max_new_tokens=5, cache="int4"))
    assert plain.tokens == _alone(model, reqs[3])
    assert engine.memory()["reserved_bytes"] == 0 and engine.idle


def test_making_room_that_raises_ends_that_row_and_admission_goes_on(model, monkeypatch):
    engine = Engine(model, memory_budget=10**9)
    reqs = [Request(_ids(8, s), max_new_tokens=3, cache="int4") for s in (1, 2)]
    calls = []

    def make_room(need, *, exclude=None):
        calls.append(need)
        if len(calls) == 1:
            raise RuntimeError("parking another session failed")
        return True

    monkeypatch.setattr(engine.sessions, "make_room", make_room)
    a, b = (engine.submit(r) for r in reqs)
    list(engine.events())
    assert engine.results[a].error == "making room for it failed: RuntimeError: parking another session failed"
    assert engine.results[b].tokens == _alone(model, reqs[1])


def test_each_admitted_row_takes_its_session_before_the_next_is_admitted(model):
    """Session a's cache is idle; its next turn and a new request join in the same step under a budget that
    holds both rows but not the idle cache beside them. Making room for the second row must not park or drop
    the session the first is continuing (it attaches first): it continues, nothing is dropped."""
    spec = "none"
    engine = Engine(model)
    turn = engine.run([Request(_ids(30, 1), max_new_tokens=5, cache=spec, session="a")])[0]
    history = _ids(30, 1) + turn.tokens[:-1]
    cont = Request(history + _ids(4, 2), max_new_tokens=5, cache=spec, session="a")
    other = Request(_ids(30, 3), max_new_tokens=5, cache=spec)
    probe = Engine(model)
    need = sum(probe.results[probe.submit(r)].reserved_bytes for r in (cont, other))
    tight = Engine(model, memory_budget=need + 64)  # no session_dir: a session made room for is dropped
    tight.run([Request(_ids(30, 1), max_new_tokens=5, cache=spec, session="a")])
    a, b = tight.submit(cont), tight.submit(other)
    tight.step()
    assert tight.memory()["active"] == 2  # both joined in the same step
    list(tight.events())
    assert tight.results[a].cached_tokens == len(history)
    assert tight.memory()["sessions_dropped"] == 0
    assert tight.results[a].tokens == _alone(model, Request(cont.prompt, max_new_tokens=5, cache=spec))
    assert tight.results[b].tokens == _alone(model, other)


def test_a_session_id_that_is_not_utf8_never_stops_the_engine(model, tmp_path):
    engine = Engine(model, session_dir=tmp_path, max_batch=2)
    odd = engine.submit(Request(_ids(6, 1), max_new_tokens=3, session="\ud800"))
    ok = engine.submit(Request(_ids(6, 2), max_new_tokens=3))
    list(engine.events())
    assert engine.results[odd].finish_reason in ("length", "error")
    assert engine.results[ok].finish_reason == "length"
    assert engine.run([Request(_ids(6, 3), max_new_tokens=2)])[0].finish_reason == "length"


# -- prefill turns ---------------------------------------------------------------------------------


def test_prefill_takes_turns_so_a_long_prompt_never_holds_back_a_short_one(model):
    """A 20-chunk prompt is admitted first, two one-chunk prompts with it: each short request's first token
    comes within (prompts ahead of it + 1) steps — round robin — not after the 20 chunks (first in, first
    out); every request still equals itself run alone."""
    chunk = 16
    reqs = [
        Request(_ids(20 * chunk, 1), max_new_tokens=3, cache="int4,sink=4,window=60"),
        Request(_ids(chunk, 2), max_new_tokens=3),
        Request(_ids(chunk - 5, 3), max_new_tokens=3, cache="q8_0"),
    ]
    engine = Engine(model, prefill_chunk=chunk)
    ids = [engine.submit(r) for r in reqs]
    first: dict[str, int] = {}
    step = 0
    while not engine.idle:
        step += 1
        for ev in engine.step():
            first.setdefault(ev.request_id, step)
    assert first[ids[1]] <= 2 and first[ids[2]] <= 3
    assert first[ids[0]] >= 20
    for rid, req in zip(ids, reqs, strict=True):
        assert engine.results[rid].tokens == _alone(model, req, chunk=chunk)


def test_prefill_is_shortest_first_and_a_long_prompt_still_advances():
    """Scheduler.next_prefill: the prompt with the fewest tokens left goes first (a conversation's new turn
    is read at once while a long prompt prefills), and the long prompt, passed over MAX_SKIPS steps, gets its
    chunk: at least one in every MAX_SKIPS + 1 steps however many short prompts keep coming."""
    from kvslim.engine.scheduler import MAX_SKIPS, Row, Scheduler

    sched = Scheduler(None, max_batch=64)
    long = Row("long", Request([3] * 5000, max_new_tokens=1), reserved=0)
    sched.submit(long)
    sched.admit()
    picks = []
    for i in range(40):  # a new short prompt (one chunk) joins every other step: as many as the steps can read
        if i % 2 == 0:
            sched.submit(Row(f"s{i}", Request([3] * 20, max_new_tokens=1), reserved=0))
            sched.admit()
        row = sched.next_prefill()
        picks.append(row.request_id)
        row.fed = min(len(row.request.prompt), row.fed + 256)
        if row.fed == len(row.request.prompt):
            row.state = "decode"
    assert picks[0] == "s0"  # the new turn first, not the long prompt admitted before it
    longs = [i for i, p in enumerate(picks) if p == "long"]
    assert all(b - a <= MAX_SKIPS + 1 for a, b in zip([-1, *longs], [*longs, 40])), longs
    # every short prompt was read at the step it joined, or the next (after one chunk of the long one)
    for i in range(0, 40, 2):
        assert picks.index(f"s{i}") - i <= 1, picks
    # ten short prompts at once beside a long one: the long one's turn still comes after MAX_SKIPS steps
    sched = Scheduler(None, max_batch=64)
    for row in [Row("long", Request([3] * 5000, max_new_tokens=1), reserved=0)] + [
        Row(f"b{i}", Request([3] * 20, max_new_tokens=1), reserved=0) for i in range(10)
    ]:
        sched.submit(row)
    sched.admit()
    order = []
    for _ in range(11):
        row = sched.next_prefill()
        order.append(row.request_id)
        row.fed = min(len(row.request.prompt), row.fed + 256)
        row.state = "decode" if row.fed == len(row.request.prompt) else "prefill"
    assert order.index("long") == MAX_SKIPS, order
    # with a step's budget of 256 tokens, the ten short prompts (20 tokens each) are read in one step, and the
    # long one (a whole chunk of 256 no longer fits) in the next
    sched = Scheduler(None, max_batch=64)
    rows = [Row("long", Request([3] * 5000, max_new_tokens=1), reserved=0)] + [
        Row(f"b{i}", Request([3] * 20, max_new_tokens=1), reserved=0) for i in range(10)
    ]
    for row in rows:
        sched.submit(row)
    sched.admit()
    first = sched.prefill_plan(256)
    assert [r.request_id for r in first] == [f"b{i}" for i in range(10)]
    for r in first:
        r.fed, r.state = 20, "decode"
    assert [r.request_id for r in sched.prefill_plan(256)] == ["long"]


# -- refusals ----------------------------------------------------------------------------------------


def test_refusals_are_typed(model):
    engine = Engine(model, memory_budget=200_000, max_prompt_tokens=1000)
    engine.submit(Request([3], max_new_tokens=2, request_id="dup"))
    small = Engine(kvslim.enable(tiny_model("llama", hidden_size=64)))  # head_dim 16
    cases = [
        (engine, Request([3] * 900, max_new_tokens=3500, cache="none"), ContextRefusal, "context"),
        (engine, Request([3] * 100, max_new_tokens=3000, cache="none"), BudgetRefusal, "budget"),
        (engine, Request([3, 500], max_new_tokens=5), InputRefusal, "input"),
        (engine, Request([3] * 1001, max_new_tokens=5), InputRefusal, "input"),
        (engine, Request([3], max_new_tokens=5, request_id="dup"), InputRefusal, "input"),
        (small, Request([3, 4], max_new_tokens=2, cache="q4_0"), SettingsRefusal, "settings"),
    ]
    for eng, req, kind, name in cases:
        with pytest.raises(kind) as got:
            eng.submit(req)
        assert got.value.kind == name and isinstance(got.value, (Refusal, ValueError))
    assert len(engine.scheduler.waiting) == 1  # only "dup"'s first submission was queued


def test_max_queue_refuses_with_retry_after(model):
    engine = Engine(model, max_batch=1, max_queue=2)
    ids = [engine.submit(Request(_ids(8, s), max_new_tokens=40)) for s in range(2)]
    with pytest.raises(QueueFull) as full:
        engine.submit(Request(_ids(8, 9), max_new_tokens=4))
    assert full.value.kind == "queue" and isinstance(full.value.retry_after, int) and full.value.retry_after >= 1
    assert len(engine.scheduler.waiting) == 2
    for _ in range(3):
        engine.step()  # the first is admitted: one waits, there is room again
    engine.submit(Request(_ids(8, 9), max_new_tokens=4))
    with pytest.raises(QueueFull):
        engine.submit(Request(_ids(8, 10), max_new_tokens=4))
    list(engine.events())
    assert all(engine.results[i].finish_reason == "length" for i in ids)


def test_request_limits_bound_a_requests_own_cache_settings(model):
    engine = Engine(model, request_limits=RequestLimits(max_window=512, max_sink=8))
    for spec, words in [
        ("none,group=2048", ["group=2048", "1024"]),
        ("int4,residual=8192", ["residual=8192", "4096"]),
        ("int4,sink=16,window=100", ["sink=16", "8"]),
        ("int4", ["sink=16 (sink=auto's default; ask sink=8 or less)", "maximum of 8"]),
        ("int4,sink=4,window=1000", ["window=1000", "512"]),
        ("int4,group=128,window=64", ["group=128", "window=64"]),
    ]:
        with pytest.raises(SettingsRefusal) as got:
            engine.submit(Request([3, 4], max_new_tokens=2, cache=spec))
        assert all(w in str(got.value) for w in words), (spec, str(got.value))
    # the window's default maximum is the model's context (4096)
    with pytest.raises(SettingsRefusal, match="window=5000"):
        Engine(model).submit(Request([3], max_new_tokens=2, cache="int4,sink=4,window=5000"))
    # never the operator's own default, even past the limits
    big = Engine(model, cache="none,group=2048", request_limits=RequestLimits(max_group=64))
    assert big.run([Request([3, 4], max_new_tokens=2)])[0].finish_reason == "length"
    assert engine.run([Request([3, 4], max_new_tokens=2, cache="int4,sink=4,window=32")])[0].finish_reason == "length"


def test_the_default_bias_file_is_read_once_and_checked_against_the_model(model, tmp_path, monkeypatch):
    from kvslim.calibration import biasfile
    from kvslim.calibration.biasset import BiasSet
    from kvslim.calibration.fingerprint import model_fingerprint

    g = torch.Generator().manual_seed(0)
    tensors = [0.1 * torch.randn(2, 32, generator=g) for _ in range(2)]
    ours, other = tmp_path / "ours.gguf", tmp_path / "other.gguf"
    biasfile.write_bias_file(ours, BiasSet(tensors, model_fingerprint=model_fingerprint(model), cache_type="q8_0"))
    biasfile.write_bias_file(other, BiasSet(tensors, model_fingerprint="sha256:" + "ab" * 32, cache_type="q8_0"))
    with pytest.raises(ValueError, match="calibrated for another model"):
        Engine(model, cache=f"q8_0,rotate=none,mean_center={other}")
    reads = []
    real = biasfile._read  # every reader of the file (read_layers, read_file, read_bias_file) goes through it
    monkeypatch.setattr(biasfile, "_read", lambda *a, **k: reads.append(1) or real(*a, **k))
    spec = f"q8_0,rotate=none,mean_center={ours}"
    engine = Engine(model, cache=spec)
    got = engine.run([Request(_ids(9, s), max_new_tokens=3) for s in range(3)])
    assert len(reads) == 1 and all(r.finish_reason == "length" for r in got)
    want = SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
    single = gen.greedy(model, torch.tensor([_ids(9, 0)]), want, 3)
    assert got[0].tokens == single
    with pytest.raises(SettingsRefusal, match="mean_center"):  # a request cannot name another file
        engine.submit(Request([3], max_new_tokens=2, cache=f"q8_0,rotate=none,mean_center={other}"))
    # a parked session of the default cache records its bias file: a restarted engine continues it
    first = Engine(model, cache=spec, session_dir=tmp_path / "s")
    turn = first.run([Request(_ids(9, 0), max_new_tokens=3, session="s")])[0]
    first.close()
    prompt = _ids(9, 0) + turn.tokens[:-1] + [5, 6]
    again = Engine(model, cache=spec, session_dir=tmp_path / "s").run([Request(prompt, max_new_tokens=3, session="s")])
    assert again[0].cached_tokens == 11 and again[0].tokens == engine.run([Request(prompt, max_new_tokens=3)])[0].tokens


# -- budget, cancel, sessions -------------------------------------------------------------------------


def test_budget_holds_at_every_step_with_idle_sessions(model, tmp_path):
    """reserved + idle sessions' bytes stay within the budget after every step, not only once a request has
    ended: admission parks idle sessions (Engine._room) before a row joins."""
    spec = "none"
    probe = Engine(model)
    one = probe.results[probe.submit(Request(_ids(50, 0), max_new_tokens=5, cache=spec))].reserved_bytes
    budget = int(1.5 * one)
    engine = Engine(model, memory_budget=budget, session_dir=tmp_path, prefill_chunk=16)
    histories = {s: [] for s in "abc"}
    for t in range(3):
        for s in "abc":
            prompt = histories[s] + _ids(6 + t, ord(s) + 10 * t)
            rid = engine.submit(Request(prompt, max_new_tokens=5, cache=spec, session=s))
            while not engine.idle:
                engine.step()
                mem = engine.memory()
                assert mem["reserved_bytes"] + mem["session_bytes"] <= budget, (s, t, mem)
            histories[s] = prompt + engine.results.pop(rid).tokens
    assert engine.memory()["sessions_evicted"] >= 2


def test_cancelling_a_waiting_row_removes_it_from_the_queue(model):
    engine = Engine(model, max_batch=1)
    a = engine.submit(Request(_ids(8, 1), max_new_tokens=6))
    b = engine.submit(Request(_ids(8, 2), max_new_tokens=6))
    engine.step()
    assert engine.cancel(b)
    assert engine.memory()["waiting"] == 0 and engine.pending_ids() == {a}
    events = list(engine.events())
    assert [e.finish_reason for e in events if e.request_id == b] == ["cancelled"]
    assert engine.results[b].tokens == [] and engine.results[a].finish_reason == "length"


def test_cancel_all_ends_waiting_and_running_rows(model):
    engine = Engine(model, max_batch=1)
    ids = [engine.submit(Request(_ids(8, s), max_new_tokens=20)) for s in range(3)]
    engine.step()
    assert engine.cancel_all("error", "the server is shutting down") == 3
    events = engine.take_events()
    assert {e.request_id for e in events} == set(ids)
    assert all(e.finish_reason == "error" and e.error == "the server is shutting down" for e in events)
    assert engine.idle and engine.memory()["reserved_bytes"] == 0


def test_delete_session(model):
    engine = Engine(model)
    engine.run([Request(_ids(8, 1), max_new_tokens=3, session="x")])
    assert engine.memory()["sessions_kept"] == 1
    assert engine.delete_session("x") and not engine.delete_session("x")
    assert engine.memory()["sessions_kept"] == 0
    rid = engine.submit(Request(_ids(8, 2), max_new_tokens=3, session="y"))
    engine.step()
    assert engine.delete_session("y")  # running: its cache is not kept when it ends
    list(engine.events())
    assert engine.results[rid].finish_reason == "length" and engine.memory()["sessions_kept"] == 0


# -- logprobs -----------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits(model):
    prompt = _ids(12, 4)
    engine = Engine(model)
    rid = engine.submit(Request(prompt, max_new_tokens=3, logprobs=5, temperature=0.7, seed=1))
    plain = engine.submit(Request(prompt, max_new_tokens=3))
    events = [e for e in engine.events() if e.request_id == rid]
    assert [e.token for e in events] == engine.results[rid].tokens
    cache = SlimCache(config=model.config)
    with torch.inference_mode():
        want = torch.log_softmax(gen.prefill(model, torch.tensor([prompt]), cache)[0], dim=-1)
    first = events[0]
    assert first.logprob == pytest.approx(float(want[first.token]), abs=1e-5)
    top = first.top_logprobs
    assert len(top) == 5 and [t for t, _ in top] == want.topk(5).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert all(e.top_logprobs is not None and len(e.top_logprobs) == 5 for e in events)
    assert all(e.logprob is None and e.top_logprobs is None for e in engine.step())
    zero = engine.run([Request(prompt, max_new_tokens=1, logprobs=0)])
    assert zero[0].tokens == engine.results[plain].tokens[:1]
    for bad in (21, -1, True, 2.0):
        with pytest.raises(ValueError, match="logprobs"):
            Request(prompt, max_new_tokens=1, logprobs=bad)


# -- positions past the re-base period ------------------------------------------------------------------


def test_ragged_steps_past_the_rebase_period_equal_the_single_stream_loop():
    """A windowed cache re-bases its position ids every 4096 tokens: a request whose decode steps (ragged,
    through forward_rows) cross that period gives the greedy tokens of kvslim's single-stream loop."""
    m = kvslim.enable(tiny_model("llama", max_position_embeddings=8192, num_hidden_layers=1))
    spec = "int4,sink=4,window=60"
    prompt = _ids(4080, 5)
    cache = SlimCache.from_config(kvslim.parse_spec(spec), config=m.config)
    assert cache.rebase_period == 4096
    req = Request(prompt, max_new_tokens=40, cache=spec)
    got = Engine(m, prefill_chunk=512).run([req, Request(_ids(7, 6), max_new_tokens=40, cache=spec)])[0]
    single = gen.greedy(m, torch.tensor([prompt]), cache, 40, prefill_chunk=512)
    assert got.tokens == single


# -- the runner ------------------------------------------------------------------------------------------


def _collect(runner: Runner, requests, timeout: float = 20.0) -> list[list]:
    """Submit ``requests`` to ``runner`` from an event loop; every item each queue got, Done last (bounded)."""

    async def one(req):
        rid, queue = runner.submit(req, asyncio.get_running_loop())
        items = []
        while not items or not isinstance(items[-1], Done):
            items.append(await asyncio.wait_for(queue.get(), timeout))
        return items

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


@pytest.fixture
def runner(model):
    r = Runner(Engine(model, max_batch=4))
    r.start()
    yield r
    r.stop(timeout=5)


def test_a_step_that_raises_ends_its_rows_and_the_runner_goes_on(runner, monkeypatch):
    real, calls = runner.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("a bug in a step")
        return real()

    monkeypatch.setattr(runner.engine, "step", step)
    got = _collect(runner, [Request(_ids(8, s), max_new_tokens=30) for s in range(2)])
    for items in got:
        done = items[-1]
        assert done.event.finish_reason == "error" and done.event.error == "the engine step failed: RuntimeError: a bug in a step"
    assert runner.alive and runner.metrics()["engine_errors"] == 1
    again = _collect(runner, [Request(_ids(8, 5), max_new_tokens=3)])[0][-1]
    assert again.event.finish_reason == "length" and len(again.result.tokens) == 3
    assert runner.metrics()["outcomes"]["error"] == 2


class _Die(BaseException):
    """What no ``except Exception`` catches: the engine thread cannot go on."""


def test_a_dead_engine_thread_answers_every_client_and_refuses_new_ones(runner, monkeypatch):
    def step():
        raise _Die("gone")

    monkeypatch.setattr(runner.engine, "step", step)
    done = _collect(runner, [Request(_ids(8, 1), max_new_tokens=5)], timeout=10)[0][-1]
    assert done.event.finish_reason == "error" and "engine stopped" in done.event.error
    runner._thread.join(5)
    assert not runner.alive
    with pytest.raises(ShuttingDown, match="engine stopped"):
        _collect(runner, [Request(_ids(8, 2), max_new_tokens=5)], timeout=5)


def test_a_submit_racing_the_threads_death_is_answered(runner, monkeypatch):
    """The thread dies while a submit is registering its request: the queue still gets a Done (never hangs)."""
    engine = runner.engine
    real_submit = engine.submit

    def step():
        raise _Die("gone")

    def submit(request):
        rid = real_submit(request)
        monkeypatch.setattr(engine, "step", step)
        with runner._wake:
            runner._wake.notify_all()
        runner._thread.join(0.5)  # it dies now; it cannot finish before this submit has registered
        return rid

    monkeypatch.setattr(engine, "submit", submit)
    done = _collect(runner, [Request(_ids(8, 1), max_new_tokens=50)], timeout=10)[0][-1]
    assert done.event.finish_reason == "error"


def test_a_submit_whose_check_passed_before_the_thread_died_is_answered(runner, monkeypatch):
    """The thread dies after a submit found it alive but before the submit registered its queue: the queue is
    still answered (the gate orders registration with the dead thread's last sweep), never left hanging."""
    import types

    import kvslim.serve.runner as runner_module

    engine = runner.engine

    def step():
        raise _Die("gone")

    def queue():
        monkeypatch.setattr(engine, "step", step)  # the running request's next step kills the thread
        runner._thread.join(2)  # with the gate it cannot finish dying until this submit has registered
        return asyncio.Queue()

    async def main():
        loop = asyncio.get_running_loop()
        _, first = runner.submit(Request(_ids(8, 1), max_new_tokens=3000), loop)
        await asyncio.wait_for(first.get(), 10)
        monkeypatch.setattr(runner_module, "asyncio", types.SimpleNamespace(Queue=queue))
        try:
            _, second = runner.submit(Request(_ids(8, 2), max_new_tokens=5), loop)
        finally:
            monkeypatch.setattr(runner_module, "asyncio", asyncio)
        item = None
        while not isinstance(item, Done):
            item = await asyncio.wait_for(second.get(), 10)
        return item

    done = asyncio.run(main())
    assert done.event.finish_reason == "error" and "engine stopped" in done.event.error


def test_drain_lets_short_requests_finish_cancels_the_rest_and_parks_sessions(model, tmp_path):
    runner = Runner(Engine(model, session_dir=tmp_path))
    runner.start()
    _collect(runner, [Request(_ids(8, 1), max_new_tokens=3, session="idle")])
    assert runner.engine.memory()["sessions_kept"] == 1

    async def main():
        loop = asyncio.get_running_loop()
        _, long_q = runner.submit(Request(_ids(8, 2), max_new_tokens=3500, cache="int4"), loop)
        _, short_q = runner.submit(Request(_ids(8, 3), max_new_tokens=3), loop)
        await asyncio.wait_for(long_q.get(), 10)  # it is running
        started = time.monotonic()
        drained = loop.run_in_executor(None, runner.drain, 1.0)
        items = []
        for q in (long_q, short_q):
            item = None
            while not isinstance(item, Done):
                item = await asyncio.wait_for(q.get(), 10)
            items.append(item)
        await asyncio.wait_for(drained, 10)
        return items, time.monotonic() - started

    (long_done, short_done), took = asyncio.run(main())
    assert short_done.event.finish_reason == "length"
    assert long_done.event.finish_reason == "error" and long_done.event.error == "the server is shutting down"
    assert long_done.result is not None and long_done.result.tokens  # ended by the engine: what it produced
    assert took < 5
    assert runner.engine.idle and runner.engine.memory()["reserved_bytes"] == 0
    assert not runner.alive
    with pytest.raises(ShuttingDown):
        _collect(runner, [Request([3], max_new_tokens=1)], timeout=5)
    assert runner.engine.memory()["sessions_on_disk"] == 1
    runner.drain(0)  # idempotent
    runner.stop()


def test_a_second_drain_cuts_the_first_ones_grace_short(model):
    runner = Runner(Engine(model))
    runner.start()

    async def main():
        loop = asyncio.get_running_loop()
        _, q = runner.submit(Request(_ids(8, 2), max_new_tokens=3900, cache="int4,sink=4,window=60"), loop)
        await asyncio.wait_for(q.get(), 10)
        started = time.monotonic()
        first = loop.run_in_executor(None, runner.drain, 60.0)
        await asyncio.sleep(0.2)
        threading.Thread(target=runner.drain, args=(60.0,), daemon=True).start()
        await asyncio.wait_for(first, 15)
        return time.monotonic() - started

    assert asyncio.run(main()) < 5  # without the second call: the whole grace, or the ~8 s the request runs
    assert not runner.alive
