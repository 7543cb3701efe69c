"""Chaos on a real ``kvslim serve`` process (issue 29, items 5 and 7): ``kill -9`` under load and a restart on
the same ``--session-dir`` lose no finished turn; SIGTERM mid-stream ends every stream with an error event
or a clean end, exits 0 in a bounded time and parks the idle sessions; a second signal still parks.

The server is the tiny word-level llama of tests/test_serve_attack.py (``ServeProcess``), run as a
subprocess so it can be killed. Conversations are streamed chat completions at temperature 0 with the
``session`` field. A turn's session "continues" when the next turn reports
``usage.prompt_tokens_details.cached_tokens`` equal to everything the finished turn left in the cache (its
prompt and every generated token but the last, which was never fed), and its reply equals the reply to
the same history sent without a session. Every wait is bounded.
"""

from __future__ import annotations

import json
import signal
import stat
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_serve_attack import NAME, ServeProcess, tiny_chat_model_dir  # noqa: E402

#: seconds a client waits for a stream to end once the server was signalled
STREAM_END = 40.0
#: seconds the server may take to exit after SIGTERM (--shutdown-grace 1, then the cancel events, the parking
#: and the interpreter's exit)
EXIT_BOUND = 30.0
#: seconds a finished turn may take to reach --session-dir (write-through)
WRITE_THROUGH = 15.0
#: tokens of a stream that must not finish on its own during the test (~20 s at 8 rows on 2 cores)
LONG = 4000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model_dir(tmp_path_factory.mktemp("chaos-model"))


FLAGS = ["--served-model-name", NAME, "--prefill-chunk", "64", "--max-concurrency", "16", "--shutdown-grace", "1"]


def start(model_dir, session_dir, log) -> ServeProcess:
    s = ServeProcess(model_dir, session_dir, log, flags=FLAGS)
    s.start()
    return s


class Stream:
    """One streamed chat completion read on a thread: text, usage, finish reason, error event, how it ended."""

    def __init__(self, server: ServeProcess, messages, *, session=None, max_tokens=6, prompt=None):
        self.body = {"model": NAME, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}}
        path = "/v1/completions" if prompt is not None else "/v1/chat/completions"
        self.body.update({"prompt": prompt} if prompt is not None else {"messages": messages})
        if session is not None:
            self.body["session"] = session
        self.server, self.path = server, path
        self.text, self.usage, self.finish, self.error = "", None, None, None
        self.status: int | None = None
        self.done = False  # saw data: [DONE]
        self.broken: str | None = None  # the connection failed
        self.chunks = 0
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> Stream:
        self.thread.start()
        return self

    def run(self, timeout: float = 120.0) -> Stream:
        self.start()
        self.join(timeout)
        assert self.ended, f"no end in {timeout} s"
        assert self.status == 200 and self.done and not self.error, vars(self)
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    @property
    def ended(self) -> bool:
        return not self.thread.is_alive()

    @property
    def cached(self) -> int:
        return self.usage["prompt_tokens_details"]["cached_tokens"]

    @property
    def kept(self) -> int:
        """What this finished turn left in its session's cache: the prompt and all but the last new token."""
        return self.usage["prompt_tokens"] + self.usage["completion_tokens"] - 1

    def _read(self) -> None:
        try:
            with self.server.client(timeout=httpx.Timeout(STREAM_END, connect=10.0)) as c, \
                    c.stream("POST", self.path, json=self.body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        break
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        self.error = obj["error"]
                        continue
                    if obj.get("usage"):
                        self.usage = obj["usage"]
                    for choice in obj.get("choices", []):
                        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        if piece:
                            self.text += piece
                            self.chunks += 1
                            self.first.set()
                        self.finish = choice.get("finish_reason") or self.finish
        except (httpx.HTTPError, ValueError) as e:
            self.broken = f"{type(e).__name__}: {e}"
        finally:
            self.first.set()


def converse(server, sid: str, turns: int, history=None) -> tuple[list[dict], Stream]:
    """``turns`` turns of conversation ``sid`` (one user message each, the reply appended); the history and
    the last turn's stream."""
    history = list(history or [])
    last = None
    for turn in range(turns):
        history.append({"role": "user", "content": f"t{5 + len(history) % 40} t{40 + turn} t{70 + len(sid)}"})
        last = Stream(server, history, session=sid).run()
        history.append({"role": "assistant", "content": last.text})
    return history, last


def next_turn(history) -> list[dict]:
    return [*history, {"role": "user", "content": "t9 t10 t11"}]


def wait_for_files(server: ServeProcess, n: int, timeout: float) -> list:
    """Poll --session-dir until it holds ``n`` files whose sizes have not changed for 1 s (bounded)."""
    deadline = time.monotonic() + timeout
    seen, since = None, time.monotonic()
    while time.monotonic() < deadline:
        files = server.session_files()
        now = [(p.name, p.stat().st_size) for p in files]
        if now != seen:
            seen, since = now, time.monotonic()
        elif len(files) >= n and time.monotonic() - since >= 1.0:
            return files
        time.sleep(0.2)
    raise AssertionError(f"--session-dir holds {len(server.session_files())} file(s) after {timeout:.0f} s; "
                         f"expected {n} (a finished turn's session is written through)")


def check_continues(server, history, last: Stream, sid: str) -> None:
    """The next turn of ``sid`` continues the whole of ``last``'s cache, and answers as the same history sent
    without a session does."""
    turn = Stream(server, next_turn(history), session=sid).run()
    assert turn.cached == last.kept, (
        f"session {sid}: cached_tokens {turn.cached}, expected {last.kept} (the finished turn's prompt and reply)")
    plain = Stream(server, next_turn(history)).run()
    assert turn.text == plain.text, f"session {sid} continued to another reply than its history gives"


def test_kill_9_under_load_loses_no_finished_turn(model_dir, tmp_path):
    sessions = tmp_path / "sessions"
    a = start(model_dir, sessions, tmp_path / "a.log")
    try:
        done: dict[str, tuple] = {}
        errors: list[BaseException] = []

        def talk(sid: str) -> None:
            try:
                done[sid] = converse(a, sid, 2)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=talk, args=(f"chaos-{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors and len(done) == 4, errors
        # a fifth conversation: turn 1 finished and written through, turn 2 in flight when the server dies
        mid_history, mid_last = converse(a, "chaos-mid", 1)
        files = wait_for_files(a, 5, WRITE_THROUGH)
        assert stat.S_IMODE(sessions.stat().st_mode) == 0o700, oct(sessions.stat().st_mode)
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), [oct(p.stat().st_mode) for p in files]
        load = [Stream(a, None, prompt=f"t5 t{6 + i}", max_tokens=LONG).start() for i in range(3)]
        in_flight = Stream(a, next_turn(mid_history), session="chaos-mid", max_tokens=LONG).start()
        for s in (*load, in_flight):
            assert s.first.wait(60) and s.chunks, f"a load stream did not start: {vars(s)}"
        a.kill()
        for s in (*load, in_flight):
            s.join(STREAM_END)
            assert s.ended, "a client hung after the server was killed"
    finally:
        a.kill()
    b = start(model_dir, sessions, tmp_path / "b.log")
    try:
        for sid, (history, last) in sorted(done.items()):
            check_continues(b, history, last, sid)
        # the turn in flight is lost, the one before it is not: the client sends turn 2 again
        try:
            check_continues(b, mid_history, mid_last, "chaos-mid")
        except AssertionError as e:
            raise AssertionError(f"a session whose next turn was in flight at the kill lost its finished turn: {e}") from None
    finally:
        assert b.stop(EXIT_BOUND) == 0, b.tail()


def _sigterm_with_streams(model_dir, tmp_path, *, second: signal.Signals | None):
    """Two idle sessions, eight long streams; SIGTERM (and ``second`` 0.5 s later). Returns what each saw."""
    sessions = tmp_path / "sessions"
    s = start(model_dir, sessions, tmp_path / "a.log")
    try:
        idle = {sid: converse(s, sid, 1) for sid in ("idle-0", "idle-1")}
        streams = [Stream(s, [{"role": "user", "content": f"t5 t{6 + i}"}], max_tokens=LONG).start()
                   for i in range(8)]
        for st in streams:
            assert st.first.wait(60) and st.chunks, f"a stream did not start: {vars(st)}"
        t0 = time.monotonic()
        s.signal(signal.SIGTERM)
        if second is not None:
            time.sleep(0.5)
            s.signal(second)
        code = s.wait(EXIT_BOUND)
        s.kill()  # one that did not exit is failed below; its streams end now
        for st in streams:
            st.join(max(0.0, t0 + STREAM_END - time.monotonic()))
    finally:
        s.kill()
    assert code is not None, f"the server did not exit in {EXIT_BOUND:.0f} s after SIGTERM:\n{s.tail()}"
    assert code == 0, f"exit status {code} after SIGTERM:\n{s.tail()}"
    for st in streams:
        assert st.ended, "a streaming client hung after SIGTERM"
        clean = st.done and st.finish is not None
        assert st.error is not None or clean, (
            f"a stream ended with neither an error event nor a finish and [DONE]: broken={st.broken!r} "
            f"done={st.done} finish={st.finish} after {st.chunks} chunks")
    return s, idle


def test_sigterm_mid_stream_ends_streams_exits_0_and_parks(model_dir, tmp_path):
    s, idle = _sigterm_with_streams(model_dir, tmp_path, second=None)
    assert len(s.session_files()) >= len(idle), f"idle sessions not parked: {s.session_files()}"
    b = start(model_dir, tmp_path / "sessions", tmp_path / "b.log")
    try:
        for sid, (history, last) in sorted(idle.items()):
            check_continues(b, history, last, sid)
    finally:
        assert b.stop(EXIT_BOUND) == 0, b.tail()


def test_a_second_signal_still_parks(model_dir, tmp_path):
    s, idle = _sigterm_with_streams(model_dir, tmp_path, second=signal.SIGINT)
    assert len(s.session_files()) >= len(idle), f"idle sessions not parked after a second signal: {s.tail()}"
