"""Engine sessions (kvslim.engine.sessions): a continued conversation prefills only its new tokens and
gives exactly the tokens of one request carrying the whole history; idle sessions count against the
budget, are parked on disk least recently used first and come back bit for bit."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import kvslim
from conftest import tiny_model
from kvslim.engine import Engine, Request
from kvslim.engine.sessions import session_key

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
            tight.sessions.flush()  # a session parked while its write ran counts in session_bytes until written
            mem = tight.memory()
            assert mem["reserved_bytes"] + mem["session_bytes"] <= budget
            histories[s] = prompt + got.tokens
            if t:
                assert got.cached_tokens > 0
    mem = tight.memory()
    assert mem["sessions_evicted"] >= 4 and mem["sessions_restored"] >= 4 and mem["sessions_dropped"] == 0
    # written through: every session has its file; one distinct session each, in memory or not
    assert mem["sessions_on_disk"] == 3 and tight.sessions.count() == 3 and mem["sessions_kept"] <= 1
    assert free.memory()["sessions_evicted"] == 0


def test_a_restarted_engine_continues_a_parked_session(model, tmp_path):
    spec = "int4,sink=4,window=60"
    first = Engine(model, session_dir=tmp_path)
    history, _ = _turns(first, "kept", spec, turns=2)
    first.park_sessions()  # what a server does on shutdown
    first.sessions.flush()
    assert first.memory()["sessions_on_disk"] == 1 and first.memory()["sessions_kept"] == 0
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


# -- the store on its own: continuation rule, disk, bounds, the writer --------------------------------------

FP = "sha256:" + "f" * 64


def _filled(model, n: int = 12, seed: int = 0, spec: str = "int8"):
    """A cache of ``spec`` filled with ``n`` prompt ids, and the ids."""
    from kvslim import SlimCache
    from kvslim.config import parse_spec
    from kvslim.generate import prefill

    ids = _ids(n, seed)
    cache = SlimCache.from_config(parse_spec(spec), config=model.config)
    with torch.inference_mode():
        prefill(model, torch.tensor([ids]), cache)
    return cache, tuple(ids)


def _store(model, path, **kw):
    from kvslim.engine.sessions import SessionStore

    kw.setdefault("model_fingerprint", FP)
    kw.setdefault("dtype", torch.float32)
    return SessionStore(path, config=model.config, **kw)


def _files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


def _state_sha(cache, ids) -> str:
    """The checksum a session file of ``cache`` holding ``ids`` records."""
    from kvslim import promptcache as pc

    return pc.to_state(cache, token_ids=torch.tensor([ids]), model_fingerprint=FP)[1]["sha256"]


def test_session_dir_and_files_are_private(model, tmp_path, monkeypatch):
    """The directory is made 0700 (created, or an existing one of ours chmod'ed); every file is 0600 from its
    first byte (the temporary is created private, whatever the umask), not only after the rename."""
    import safetensors.torch

    cfg = kvslim.config.parse_spec("int8")
    new = tmp_path / "new"
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    seen_modes = []
    real = safetensors.torch.save_file

    def spy(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        seen_modes.append(stat.S_IMODE(os.stat(filename).st_mode))  # the temporary, before the rename

    monkeypatch.setattr(safetensors.torch, "save_file", spy)
    mask = os.umask(0)  # the loosest umask: a file made with the default 0o666 would be world-writable
    try:
        for d in (new, old):
            store = _store(model, d)
            assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
            cache, ids = _filled(model)
            store.keep("s", cache, ids, cfg)
            assert store.flush(10)
            store.make_room(0)  # parked: its file is current, no second write
            (name,) = _files(d)
            assert stat.S_IMODE(os.stat(d / name).st_mode) == 0o600
            store.close(10)
    finally:
        os.umask(mask)
    assert seen_modes == [0o600, 0o600]
    with pytest.raises(ValueError, match="is a file"):
        _store(model, tmp_path / "new" / name)


def test_a_file_of_another_dtype_model_or_settings_starts_over(model, tmp_path, caplog):
    """A file written by a float32 server read by a bfloat16 one (the same fingerprint: it is the same
    checkpoint), another model or other settings: the session starts over, counted in reset and logged with
    the continuation rule's reason; take() never raises, and the file is removed."""
    cfg = kvslim.config.parse_spec("int8")
    first = _store(model, tmp_path)
    cache, ids = _filled(model)
    prompt = ids + (5, 6)
    for other in (
        dict(dtype=torch.bfloat16),
        dict(model_fingerprint="sha256:" + "0" * 64),
        dict(),  # the same store settings, other cache settings below
    ):
        first.keep("s", cache, ids, cfg)
        assert first.flush(10) and first.on_disk() == 1
        store = _store(model, tmp_path, **other)
        want = kvslim.config.parse_spec("int4") if not other else cfg
        with caplog.at_level("INFO", logger="kvslim.engine"):
            assert store.take("s", prompt, want) is None
        assert store.stats.reset == 1 and store.stats.restored == 0 and store.on_disk() == 0
        assert _files(tmp_path) == []
        first.take("s", prompt, cfg)  # hand the cache back to `first` for the next round
    assert "saved from a float32 model, this one runs in bfloat16" in caplog.text
    assert "saved for another model" in caplog.text
    assert "saved with cache 'int8', expected 'int4'" in caplog.text


@pytest.mark.parametrize("damage", ["garbage", "truncated", "one bit", "token ids"])
def test_a_damaged_file_starts_over(model, tmp_path, caplog, damage):
    cfg = kvslim.config.parse_spec("int8")
    first = _store(model, tmp_path)
    cache, ids = _filled(model)
    first.keep("s", cache, ids, cfg)
    assert first.flush(10)
    path = first.path("s")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if damage == "garbage":
        data = b"not a safetensors file"
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "one bit":
        data[-20] ^= 0x10  # tensor bytes: the header reads, the checksum does not match
    with open(path, "wb") as f:
        f.write(data)
    if damage == "token ids":  # a consistent file whose token ids are not what its header says
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        tensors = load_file(path)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        tensors["token_ids"] = tensors["token_ids"][:, :3].clone()
        save_file(tensors, path, metadata=meta)
    store = _store(model, tmp_path)
    with caplog.at_level("WARNING", logger="kvslim.engine"):
        assert store.take("s", ids + (7,), cfg) is None
    assert store.stats.reset == 1 and store.on_disk() == 0 and not os.path.exists(path)
    assert "starts over" in caplog.text
    # and it is a new session from there on
    cache2, ids2 = _filled(model, seed=3)
    store.keep("s", cache2, ids2, cfg)
    assert store.take("s", ids2 + (7,), cfg)[1] == len(ids2)


def test_take_never_raises(model, tmp_path, monkeypatch):
    """Whatever fails while a session is restored (here the load itself), the request starts over."""
    from kvslim import promptcache as pc

    cfg = kvslim.config.parse_spec("int8")
    first = _store(model, tmp_path)
    cache, ids = _filled(model)
    first.keep("s", cache, ids, cfg)
    assert first.flush(10)

    def boom(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(pc, "load", boom)
    store = _store(model, tmp_path)
    assert store.take("s", ids + (1,), cfg) is None and store.stats.reset == 1
    monkeypatch.setattr(pc.SavedCache, "of", boom)  # the rule on a cache in memory
    store.keep("t", cache, ids, cfg)
    assert store.take("t", ids + (1,), cfg) is None and store.stats.reset == 2 and "t" not in store.kept


def test_write_through_survives_a_kill(model, tmp_path):
    """After a turn and flush() (the writer's bounded delay), the file is there: a new engine on the same
    directory — as after kill -9, nothing parked on the way out — continues the session with its tokens."""
    spec = "int4,sink=4,window=60"
    first = Engine(model, session_dir=tmp_path)
    history, _ = _turns(first, "k", spec, turns=2)
    assert first.sessions.flush(10)
    assert first.memory()["sessions_kept"] == 1 and first.memory()["sessions_on_disk"] == 1
    prompt = history[:-1] + _ids(8, 78)
    second = Engine(model, session_dir=tmp_path)
    assert second.memory()["sessions_on_disk"] == 1
    got = second.run([Request(prompt, max_new_tokens=6, cache=spec, session="k")])[0]
    assert got.cached_tokens == len(history) - 1
    assert got.tokens == Engine(model).run([Request(prompt, max_new_tokens=6, cache=spec)])[0].tokens


def test_the_writer_never_reads_a_cache_being_continued(model, tmp_path, monkeypatch):
    """A session that comes back while its write is pending: take() waits for the writer's snapshot (when
    the writer has begun) or takes it itself (when not), so the file holds the kept turn exactly, never
    the tokens the engine adds after take()."""
    import threading

    from kvslim import promptcache as pc
    from kvslim.generate import prefill

    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path)
    in_snapshot, go = threading.Event(), threading.Event()
    real_to_state = pc.to_state

    def slow_to_state(cache, **kw):  # the writer's snapshot, held until the test says go
        in_snapshot.set()
        assert go.wait(10)
        return real_to_state(cache, **kw)

    a, ids_a = _filled(model, seed=1)
    b, ids_b = _filled(model, seed=2)
    sha_a, sha_b = _state_sha(a, ids_a), _state_sha(b, ids_b)
    monkeypatch.setattr(pc, "to_state", slow_to_state)
    store.keep("a", a, ids_a, cfg)  # the writer begins a's snapshot and waits
    assert in_snapshot.wait(10)
    store.keep("b", b, ids_b, cfg)  # queued behind a: not begun
    monkeypatch.setattr(pc, "to_state", real_to_state)  # take()'s own snapshot of b runs at once
    got_b = store.take("b", ids_b + (9,), cfg)
    assert got_b is not None and got_b[0] is b
    with torch.inference_mode():
        prefill(model, torch.tensor([[9, 10, 11]]), b)  # the engine extends b right away
    taken = []
    thread = threading.Thread(target=lambda: taken.append(store.take("a", ids_a + (9,), cfg)))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # a's snapshot is running: take() waits for it
    go.set()
    thread.join(10)
    assert taken[0][0] is a
    with torch.inference_mode():
        prefill(model, torch.tensor([[9, 10, 11]]), a)
    assert store.flush(10)
    for name, sha, ids in (("a", sha_a, ids_a), ("b", sha_b, ids_b)):
        assert pc.read_header(store.path(name))["sha256"] == sha, name
        assert tuple(pc.SavedCache.read(store.path(name)).token_ids[0].tolist()) == ids


def test_max_sessions_bounds_memory_and_disk(model, tmp_path):
    """50 distinct sessions through a store of max_sessions=10: at most 10 remain, in memory and on disk
    together, the least recently used removed first (files too); a session used again is kept."""
    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path, max_sessions=10)
    cache, ids = _filled(model)
    for i in range(50):
        c, t = _filled(model, n=4, seed=i)
        store.keep(f"s{i}", c, t, cfg)
        if i == 20:
            store.keep("s0", cache, ids, cfg)  # s0 used again: the most recent at that point
        assert store.count() <= 10 and len(store.kept) <= 10
    assert store.flush(10)
    want = {f"s{i}" for i in range(40, 50)}
    assert set(store.kept) == want
    assert _files(tmp_path) == sorted(os.path.basename(store.path(s)) for s in want)
    assert store.on_disk() == 10 and store.stats.discarded == 41
    # after a restart only the files count, least recently used (oldest mtime) first
    for i, s in enumerate(sorted(want, key=lambda s: int(s[1:]))):
        os.utime(store.path(s), (1_000_000 + i, 1_000_000 + i))
    again = _store(model, tmp_path, max_sessions=5)
    assert again.on_disk() == 5 and len(_files(tmp_path)) == 5
    assert all(os.path.exists(again.path(f"s{i}")) for i in range(45, 50))


def test_max_sessions_without_session_dir(model):
    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, None, max_sessions=3)
    for i in range(8):
        c, t = _filled(model, n=4, seed=i)
        store.keep(f"s{i}", c, t, cfg)
    assert list(store.kept) == ["s5", "s6", "s7"] and store.held() == sum(k.nbytes for k in store.kept.values())


def test_ttl_expires_memory_and_files(model, tmp_path):
    import time

    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path, ttl=100)
    cache, ids = _filled(model)
    store.keep("old", cache, ids, cfg)
    c2, t2 = _filled(model, seed=5)
    assert store.flush(10)
    now = time.time()
    assert store.expire(now + 50) == 0 and store.count() == 1
    store.keep("new", c2, t2, cfg)
    store._ix.last[session_key("old")].used = now - 200  # idle for 200 s
    assert store.flush(10)
    assert store.expire() == 1 and list(store.kept) == ["new"] and store.stats.expired == 1
    assert store.on_disk() == 1 and not os.path.exists(store.path("old"))
    # a restarted store: a file's mtime is its last use
    os.utime(store.path("new"), (now - 500, now - 500))
    again = _store(model, tmp_path, ttl=100)
    assert again.on_disk() == 0 and _files(tmp_path) == []


def test_a_running_session_is_neither_expired_nor_discarded(model, tmp_path):
    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path, ttl=100, max_sessions=1)
    cache, ids = _filled(model)
    store.keep("run", cache, ids, cfg)
    assert store.take("run", ids + (1,), cfg) is not None
    store._ix.last[session_key("run")].used -= 1000
    assert store.expire() == 0
    c2, t2 = _filled(model, seed=5)
    store.keep("other", c2, t2, cfg)  # over max_sessions, but "run" is in use
    assert store.count() == 2 and store.stats.discarded == 0


def test_delete_removes_memory_and_file(model, tmp_path):
    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path)
    cache, ids = _filled(model)
    store.keep("d", cache, ids, cfg)
    assert store.flush(10) and os.path.exists(store.path("d"))
    assert store.delete("d") is True
    assert "d" not in store.kept and store.on_disk() == 0 and _files(tmp_path) == [] and store.count() == 0
    assert store.delete("d") is False and store.delete("never") is False
    assert store.take("d", ids + (1,), cfg) is None and store.stats.deleted == 1
    # a file left by an earlier server (known only by its name) is deleted too
    store.keep("d", cache, ids, cfg)
    assert store.flush(10)
    assert _store(model, tmp_path).delete("d") is True and _files(tmp_path) == []


def test_delete_while_its_write_runs(model, tmp_path, monkeypatch):
    """A write that lands after its session was deleted removes its own file."""
    import threading

    from kvslim import promptcache as pc

    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path)
    writing, go = threading.Event(), threading.Event()
    real = pc.write_state

    def slow(*a, **k):
        writing.set()
        assert go.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(pc, "write_state", slow)
    cache, ids = _filled(model)
    store.keep("d", cache, ids, cfg)
    assert writing.wait(10)
    assert store.delete("d") is True
    go.set()
    assert store.flush(10)
    assert _files(tmp_path) == [] and store.on_disk() == 0


def test_a_failed_request_falls_back_to_its_file(model, tmp_path, caplog):
    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path)
    cache, ids = _filled(model)
    store.keep("f", cache, ids, cfg)
    assert store.flush(10)
    assert store.take("f", ids + (1, 2), cfg) is not None
    store.forget("f")  # the request failed: its cache is gone, its file is the last finished turn
    assert store.stats.dropped == 0
    got = store.take("f", ids + (1, 2), cfg)
    assert got is not None and got[1] == len(ids) and store.stats.restored == 1
    memory_only = _store(model, None)
    memory_only.keep("f", cache, ids, cfg)
    memory_only.take("f", ids + (1,), cfg)
    memory_only.forget("f")
    assert memory_only.stats.dropped == 1 and memory_only.count() == 0


def test_surrogate_session_ids_do_not_crash(model, tmp_path):
    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path)
    cache, ids = _filled(model)
    bad = "\ud800x"
    assert store.path(bad).endswith(".safetensors") and store.path(bad) != store.path("\udc00x")
    store.keep(bad, cache, ids, cfg)
    assert store.flush(10) and store.on_disk() == 1
    assert store.take(bad, ids + (1,), cfg)[1] == len(ids)
    store.keep(bad, cache, ids, cfg)
    assert store.delete(bad) is True


def test_on_disk_is_a_count_not_a_listing(model, tmp_path, monkeypatch):
    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path)
    cache, ids = _filled(model)
    store.keep("x", cache, ids, cfg)
    assert store.flush(10)

    def no(*a, **k):
        raise AssertionError("listed the directory")

    monkeypatch.setattr(os, "listdir", no)
    monkeypatch.setattr(os, "scandir", no)
    assert store.on_disk() == 1


def test_parking_a_written_session_writes_nothing_more(model, tmp_path, monkeypatch):
    from kvslim import promptcache as pc

    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path)
    cache, ids = _filled(model)
    store.keep("p", cache, ids, cfg)
    assert store.flush(10) and store.stats.written == 1
    writes = []
    monkeypatch.setattr(pc, "write_state", lambda *a, **k: writes.append(a))
    monkeypatch.setattr(pc, "save", lambda *a, **k: writes.append(a))
    assert store.make_room(0) and store.held() == 0 and store.stats.evicted == 1
    assert writes == [] and store.on_disk() == 1


def test_write_through_off_parks_as_before(model, tmp_path):
    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path, write_through=False)
    cache, ids = _filled(model)
    store.keep("w", cache, ids, cfg)
    assert store.on_disk() == 0 and _files(tmp_path) == []
    assert store.make_room(0) and store.on_disk() == 1 and store.writer.thread is None
    assert store.take("w", ids + (3,), cfg)[1] == len(ids)


def test_bad_bounds_are_refused(model):
    with pytest.raises(ValueError, match="max_sessions must be an integer >= 1"):
        _store(model, None, max_sessions=0)
    with pytest.raises(ValueError, match="ttl must be a number of seconds > 0"):
        _store(model, None, ttl=float("nan"))


def test_a_parked_session_counts_until_written_and_can_be_taken_back(model, tmp_path, monkeypatch):
    """make_room on sessions whose writes are pending: their bytes count in held() until the writes land
    (make_room says False meanwhile); a session taken back before its write landed comes from memory."""
    import threading

    from kvslim import promptcache as pc

    cfg = kvslim.config.parse_spec("int8")
    store = _store(model, tmp_path)
    writing, go = threading.Event(), threading.Event()
    real = pc.write_state

    def slow(*a, **k):
        writing.set()
        assert go.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(pc, "write_state", slow)
    a, ids_a = _filled(model, seed=1)
    b, ids_b = _filled(model, seed=2)
    store.keep("a", a, ids_a, cfg)
    assert writing.wait(10)  # a's write is running (held up)
    store.keep("b", b, ids_b, cfg)  # b's is queued
    total = store.held()
    assert store.make_room(0) is False and store.held() == total and not store.kept
    got = store.take("b", ids_b + (4,), cfg)  # back from the pending write, not from disk
    assert got[0] is b and store.stats.restored == 0 and store.held() == total - got[0].nbytes()
    go.set()
    assert store.flush(10)
    assert store.held() == 0 and store.make_room(0) is True and store.on_disk() == 2
    assert store.take("a", ids_a + (4,), cfg)[1] == len(ids_a) and store.stats.restored == 1


def test_a_server_restarted_in_another_dtype_starts_sessions_over(model, tmp_path):
    """The issue's case end to end: sessions written by a float32 engine, the server restarted in bfloat16
    (the same checkpoint, the same fingerprint): the request is answered, prefilled from scratch, counted."""
    spec = "int8"
    first = Engine(model, session_dir=tmp_path)
    history, _ = _turns(first, "d", spec, turns=1)
    assert first.sessions.flush(10)
    prompt = history[:-1] + _ids(4, 11)
    bf16 = kvslim.enable(tiny_model("llama", dtype=torch.bfloat16))
    engine = Engine(bf16, session_dir=tmp_path)
    got = engine.run([Request(prompt, max_new_tokens=3, cache=spec, session="d")])[0]
    assert got.error is None and got.finish_reason == "length" and got.cached_tokens == 0
    mem = engine.memory()
    assert mem["sessions_reset"] == 1 and mem["sessions_restored"] == 0
