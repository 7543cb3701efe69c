"""``kvslim serve`` (kvslim.serve) with a real server on 127.0.0.1 and the real ``openai`` client: streaming and
not, chat and completions, concurrent clients, a client that leaves mid-stream, sessions, and every refusal a
4xx JSON body in OpenAI's shape. A tiny random model with an offline character-level tokenizer; one ``slow``
test runs the embedded model end to end."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from conftest import tiny_model

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import kvslim  # noqa: E402
from kvslim.serve import build_app  # noqa: E402

NAME = "tiny"
#: 128 characters, one token each (the tiny model's vocabulary): decode and encode round-trip exactly
CHARS = [chr(c) for c in range(32, 127)] + ["\n"] + [chr(c) for c in range(192, 224)]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer():
    """An offline transformers tokenizer: one token per character, no special tokens, a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="?"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    tok.chat_template = TEMPLATE
    return tok


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving ``app`` on 127.0.0.1 in a background thread; ``stop()`` ends it (bounded waits).
    graceful: run it as ``kvslim serve`` does (:class:`kvslim.serve.shutdown.GracefulServer`, whose
    ``handle_exit`` a test calls as a signal would). key: the API key its clients send."""

    def __init__(self, app, *, graceful: float | None = None, key: str = "none"):
        import uvicorn

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        if graceful is None:
            self.server = uvicorn.Server(config)
            run = self.server.run
        else:
            from kvslim.serve.shutdown import GracefulServer

            self.server = GracefulServer(config, app.state.runner, graceful)
            run = self.server.run_and_park
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kw):
        kw.setdefault("api_key", self.key)
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {self.key}"}).text
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }


@pytest.fixture(scope="module")
def model():
    return kvslim.enable(tiny_model("llama"))


def _budget(model) -> int:
    from kvslim import SlimCache

    cache = SlimCache.from_config(kvslim.config.parse_spec("int4"), config=model.config)
    return 4 * cache.projected_nbytes(3300)


@pytest.fixture(scope="module")
def server(model):
    tok = char_tokenizer()
    app = build_app(model, tok, model_name=NAME, cache="int4", memory_budget=_budget(model), prefill_chunk=64)
    srv = Server(app)
    srv.runner, srv.tok = app.state.runner, tok
    yield srv
    srv.stop()


KEY = "sk-test-0123456789"
#: the guarded server's body limit (bytes): small, so a test can pass it cheaply
SMALL_BODY = 64 << 10


@pytest.fixture(scope="module")
def guarded(model):
    """A server with an API key, one request at a time, one waiting at most, and a 64 KiB body limit."""
    app = build_app(model, char_tokenizer(), model_name=NAME, cache="int4", memory_budget=_budget(model),
                    api_key=KEY, max_concurrency=1, max_queue=1, max_body=SMALL_BODY, prefill_chunk=64)
    srv = Server(app, key=KEY)
    srv.runner = app.state.runner
    yield srv
    srv.stop()


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def test_chat_non_stream_and_stream_agree(server):
    client = server.client()
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 10
    text = whole.choices[0].message.content
    assert len(text) == 12  # one character per token
    chunks = list(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_completions_non_stream_and_stream(server):
    client = server.client()
    whole = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=9, temperature=0)
    assert whole.object == "text_completion" and len(whole.choices[0].text) == 9
    assert whole.usage.prompt_tokens == len("Once upon a time")
    parts = list(client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=9, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    seeded = [client.completions.create(model=NAME, prompt="abc", max_tokens=8, temperature=0.9, seed=7)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_concurrent_clients_get_what_each_gets_alone(server):
    client = server.client()
    prompts = [f"prompt number {i}: " + "xy" * i for i in range(6)]
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=15, temperature=0).choices[0].text
             for p in prompts]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            c = server.client()
            if i % 2:
                got[i] = "".join(p.choices[0].text for p in c.completions.create(
                    model=NAME, prompt=prompts[i], max_tokens=15, temperature=0, stream=True))
            else:
                got[i] = c.completions.create(model=NAME, prompt=prompts[i], max_tokens=15, temperature=0).choices[0].text
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and [got[i] for i in range(len(prompts))] == alone


def test_a_client_that_leaves_mid_stream_is_cancelled_and_the_others_go_on(server):
    before = server.metrics()
    body = {"model": NAME, "prompt": "a long story", "max_tokens": 3000, "temperature": 0, "stream": True}
    other = threading.Thread(target=lambda: server.client().completions.create(
        model=NAME, prompt="the other one", max_tokens=40, temperature=0))
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert seen[0].startswith("data: ")
        other.start()
    # the connection is closed: the engine cancels the request and frees its cache
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if m['kvslim_requests_total{outcome="cancelled"}'] > before['kvslim_requests_total{outcome="cancelled"}']:
            break
        assert time.monotonic() < deadline, "the abandoned stream was not cancelled"
        time.sleep(0.1)
    other.join(60)
    m = server.metrics()
    assert m['kvslim_requests_total{outcome="length"}'] >= before['kvslim_requests_total{outcome="length"}'] + 1
    assert m["kvslim_active_streams"] == 0 and m['kvslim_cache_bytes{where="running"}'] == 0
    assert m["kvslim_generated_tokens_total"] - before["kvslim_generated_tokens_total"] < 3000
    assert server.runner.engine.memory()["reserved_bytes"] == 0


def test_a_non_stream_client_that_gives_up_is_cancelled(server):
    before = server.metrics()['kvslim_requests_total{outcome="cancelled"}']
    body = {"model": NAME, "prompt": "wait for me", "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 30
    while server.metrics()['kvslim_requests_total{outcome="cancelled"}'] == before:
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.1)
    assert server.metrics()["kvslim_active_streams"] == 0


def test_a_session_continues_on_its_kept_cache(server):
    client = server.client()
    first_prompt = "User: hello there\nBot:"
    a = client.completions.create(model=NAME, prompt=first_prompt, max_tokens=8, temperature=0,
                                  extra_body={"session": "conv-1"})
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    second_prompt = first_prompt + a.choices[0].text + "\nUser: and then?\nBot:"
    before = server.metrics()["kvslim_prefilled_tokens_total"]
    b = client.completions.create(model=NAME, prompt=second_prompt, max_tokens=8, temperature=0,
                                  extra_headers={"X-Session-Id": "conv-1"})
    kept = len(first_prompt) + 8 - 1  # the prompt and every generated token but the last (never fed)
    assert b.usage.prompt_tokens_details.cached_tokens == kept
    assert server.metrics()["kvslim_prefilled_tokens_total"] - before == len(second_prompt) - kept
    plain = client.completions.create(model=NAME, prompt=second_prompt, max_tokens=8, temperature=0)
    assert b.choices[0].text == plain.choices[0].text  # exactly what one request with the whole history gives
    assert server.metrics()['kvslim_sessions{where="memory"}'] >= 1


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_requests_get_a_4xx_in_openai_shape(server, model):
    url = server.url
    post = lambda path, **kw: httpx.post(url + path, timeout=30, **kw)  # noqa: E731
    chat = {"model": NAME, "messages": MESSAGES, "max_tokens": 4}
    raw = {"Content-Type": "application/json"}
    assert _error(post("/v1/chat/completions", content=b"{not json", headers=raw), 400)["code"] == "invalid_json"
    assert _error(post("/v1/chat/completions", content=b"[" * 100_000, headers=raw), 400)["code"] == "invalid_json"
    nan = b'{"model": "tiny", "prompt": "a", "temperature": NaN}'
    assert _error(post("/v1/completions", content=nan, headers=raw), 400)["code"] == "invalid_json"
    _error(post("/v1/chat/completions", json=[1, 2]), 400)
    _error(post("/v1/chat/completions", json={"model": NAME}), 400)
    assert _error(post("/v1/chat/completions", json={**chat, "model": "gpt-9"}), 404)["code"] == "model_not_found"
    assert _error(post("/v1/completions", json={"model": NAME, "prompt": "x" * 5000, "max_tokens": 4}),
                  400)["code"] == "context_length_exceeded"
    assert _error(post("/v1/chat/completions", json={**chat, "max_tokens": 10**9}), 400)["param"] == "max_tokens"
    assert _error(post("/v1/chat/completions", json={**chat, "max_tokens": -1}), 400)["param"] == "max_tokens"
    assert _error(post("/v1/chat/completions", json={**chat, "temperature": 7}), 400)["param"] == "temperature"
    assert _error(post("/v1/chat/completions", json={**chat, "temperature": "hot"}), 400)["param"] == "temperature"
    assert _error(post("/v1/chat/completions", json={**chat, "kvslim_cache": "int9"}), 400)["param"] == "kvslim_cache"
    for spec in ("none,group=1000000", "int4,residual=100000", "int4,sink=5000,window=64", "int4,group=128,window=64"):
        assert _error(post("/v1/chat/completions", json={**chat, "kvslim_cache": spec}), 400)["param"] == "kvslim_cache"
    # a client never names a file on the server, and a seed past 2**63 is a 400, not a failed engine
    bias = {**chat, "kvslim_cache": "q4_0,mean_center=/etc/passwd"}
    assert "mean_center" in _error(post("/v1/chat/completions", json=bias), 400)["message"]
    assert _error(post("/v1/chat/completions", json={**chat, "temperature": 1, "seed": 2**64}), 400)["param"] == "seed"
    _error(post("/v1/completions", json={"model": NAME, "prompt": [], "max_tokens": 4}), 400)
    # a request whose cache cannot fit the memory budget even alone: 413
    from kvslim import SlimCache

    fp = SlimCache.from_config(kvslim.config.parse_spec("none"), config=model.config).projected_nbytes(4010)
    assert fp > _budget(model)
    body = {"model": NAME, "prompt": "hi", "max_tokens": 4000, "kvslim_cache": "none"}
    assert _error(post("/v1/completions", json=body), 413)["code"] == "request_too_large"
    _error(httpx.get(url + "/v1/nothing", timeout=10), 404)
    # the openai client raises its typed errors for these
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10**9)
    m = server.metrics()
    assert m['kvslim_requests_total{outcome="refused"}'] >= 12 and m["kvslim_up"] == 1
    # the server still serves after all that
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=3).usage.completion_tokens == 3


def test_metrics_are_prometheus_text(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("kvslim_requests_total", "kvslim_prompt_tokens_total", "kvslim_generated_tokens_total",
                 "kvslim_active_streams", "kvslim_queue_length", "kvslim_cache_bytes", "kvslim_cache_fp16_bytes",
                 "kvslim_sessions", "kvslim_memory_budget_bytes"):
        assert f"# TYPE {name} " in text
    assert all(len(line.split(" ")) == 2 for line in text.splitlines() if line and not line.startswith("#"))


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_metric_renders_its_own_figure(server):
    """Each /metrics sample is the runner figure it names: every figure of the runner's real schema gets a
    distinct value, so two samples swapped, or one reading the wrong figure, fail (issue 33's mutant)."""
    from kvslim.serve.metrics import prometheus

    m = server.runner.metrics()
    m["refusals"] = {"access": 0, "request": 0, "budget": 0}
    paths = [(k,) for k, v in m.items() if not isinstance(v, (dict, bool))]
    paths += [(k, sub) for k, v in m.items() if isinstance(v, dict) for sub in v]
    value = {path: 1000 + i for i, path in enumerate(paths)}  # distinct, none 0 or 1
    for path, v in value.items():
        if len(path) == 1:
            m[path[0]] = v
        else:
            m[path[0]][path[1]] = v
    m["alive"] = True
    mem = ("memory",)
    expected = {
        **{f'kvslim_requests_total{{outcome="{o}"}}': ("outcomes", o) for o in m["outcomes"]},
        "kvslim_prompt_tokens_total": ("prompt_tokens",),
        "kvslim_cached_prompt_tokens_total": ("cached_tokens",),
        "kvslim_prefilled_tokens_total": mem + ("prefilled_tokens",),
        "kvslim_generated_tokens_total": ("generated_tokens",),
        "kvslim_active_streams": ("active_streams",),
        "kvslim_queue_length": mem + ("waiting",),
        "kvslim_running_requests": mem + ("active",),
        'kvslim_cache_bytes{where="running"}': mem + ("cache_bytes",),
        'kvslim_cache_bytes{where="sessions"}': mem + ("session_bytes",),
        "kvslim_cache_fp16_bytes": mem + ("fp16_bytes",),
        "kvslim_reserved_bytes": mem + ("reserved_bytes",),
        "kvslim_kept_decoded_bytes": mem + ("kept_decoded_bytes",),
        "kvslim_packed_weight_bytes": mem + ("packed_weight_bytes",),
        "kvslim_memory_budget_bytes": mem + ("memory_budget",),
        'kvslim_sessions{where="memory"}': mem + ("sessions_kept",),
        'kvslim_sessions{where="disk"}': mem + ("sessions_on_disk",),
        **{f"kvslim_{k}_total": mem + (k,) for k in m["memory"]
           if k.startswith("sessions_") and k not in ("sessions_kept", "sessions_on_disk")},
        **{f'kvslim_refusals_total{{kind="{k}"}}': ("refusals", k) for k in m["refusals"]},
        "kvslim_engine_errors_total": ("engine_errors",),
        "kvslim_row_errors_total": mem + ("row_errors",),
    }
    got = _samples(prometheus(m))
    assert got.pop("kvslim_up") == 1
    assert got == {name: value[path] for name, path in expected.items()}
    m["alive"] = False
    assert _samples(prometheus(m))["kvslim_up"] == 0


def test_metrics_count_what_the_requests_did(model):
    """/metrics of a fresh server after known requests: each figure against what the requests themselves say
    (their usage, their status) and the model's shapes, not against the runner's own counters."""
    budget = _budget(model)
    app = build_app(model, char_tokenizer(), model_name=NAME, cache="int4", memory_budget=budget, prefill_chunk=64)
    srv = Server(app)
    try:
        c = srv.client()
        one = c.completions.create(model=NAME, prompt="hello there", max_tokens=5, temperature=0)
        two = c.completions.create(model=NAME, prompt="abc", max_tokens=7, temperature=0, extra_body={"session": "s1"})
        assert httpx.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10).status_code == 404
        got = _samples(httpx.get(srv.url + "/metrics", timeout=10).text)
        kept = app.state.runner.engine.sessions.kept["s1"].cache
    finally:
        srv.stop()
    assert (one.choices[0].finish_reason, two.choices[0].finish_reason) == ("length", "length")
    prompt = one.usage.prompt_tokens + two.usage.prompt_tokens  # 11 + 3 characters
    generated = one.usage.completion_tokens + two.usage.completion_tokens  # 5 + 7
    assert (prompt, generated) == (14, 12)
    cfg = model.config
    fp16_per_token = 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim  # K + V, 2 bytes each
    # the kept session holds its prompt and every generated token but the last (never fed back)
    held = two.usage.prompt_tokens + two.usage.completion_tokens - 1
    zero = ("cancelled", "error", "stop")
    assert {k: got[f'kvslim_requests_total{{outcome="{k}"}}'] for k in ("length", "refused", *zero)} == {
        "length": 2, "refused": 1, **dict.fromkeys(zero, 0)}
    assert got['kvslim_refusals_total{kind="request"}'] == 1
    assert got["kvslim_prompt_tokens_total"] == prompt and got["kvslim_prefilled_tokens_total"] == prompt
    assert got["kvslim_generated_tokens_total"] == generated and got["kvslim_cached_prompt_tokens_total"] == 0
    assert got['kvslim_cache_bytes{where="sessions"}'] == kept.nbytes() > 0
    assert got["kvslim_cache_fp16_bytes"] == held * fp16_per_token
    assert got["kvslim_memory_budget_bytes"] == budget
    assert got['kvslim_sessions{where="memory"}'] == 1 and got['kvslim_sessions{where="disk"}'] == 0
    for idle in ("kvslim_active_streams", "kvslim_queue_length", "kvslim_running_requests", "kvslim_reserved_bytes",
                 'kvslim_cache_bytes{where="running"}', "kvslim_engine_errors_total", "kvslim_row_errors_total"):
        assert got[idle] == 0, idle
    assert got["kvslim_up"] == 1


#: the default body limit, from the documentation (docs/serve.md: "JSON bodies of 8 MiB at most"), not from
#: kvslim.serve.defaults.MAX_BODY, which the test below checks
DOCUMENTED_BODY = 8 << 20


def test_the_default_body_limit_is_the_documented_8_mib(server):
    """The ``server`` fixture passes no max_body: a body of exactly 8 MiB is read and served, one byte more is
    refused (413), declared or chunked."""
    head = b'{"model": "tiny", "max_tokens": 1, "prompt": "ab"'
    body = head + b" " * (DOCUMENTED_BODY - len(head) - 1) + b"}"  # JSON whitespace: a tiny request, a big body
    assert len(body) == DOCUMENTED_BODY
    plain = {"Content-Type": "application/json"}
    resp = httpx.post(server.url + "/v1/completions", content=body, headers=plain, timeout=60)
    assert resp.status_code == 200, resp.text
    over = body[:-1] + b" }"
    resp = httpx.post(server.url + "/v1/completions", content=over, headers=plain, timeout=60)
    assert _error(resp, 413)["code"] == "request_too_large"
    chunked = (over[i : i + (1 << 20)] for i in range(0, len(over), 1 << 20))  # no Content-Length
    resp = httpx.post(server.url + "/v1/completions", content=chunked, headers=plain, timeout=60)
    assert _error(resp, 413)["code"] == "request_too_large"


def test_import_and_help_stay_light():
    import subprocess
    import sys

    code = ("import sys, kvslim, kvslim.cli; kvslim.cli.build_parser(); "
            "print(sorted(m for m in ('uvicorn', 'starlette', 'openai', 'httpx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_parse_bytes():
    from kvslim.cli.serve import parse_bytes

    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("500MB") == 500_000_000 and parse_bytes("1000") == 1000
    for bad in ("2 parsecs", "", "-1GB", "0"):
        with pytest.raises(ValueError, match="size"):
            parse_bytes(bad)


# -- access: Host, key, content type --------------------------------------------------------


def _healthy(srv) -> None:
    """The server still answers /health and a normal request correctly."""
    auth = {"Authorization": f"Bearer {srv.key}"}
    assert httpx.get(srv.url + "/health", timeout=10, headers=auth).json() == {"status": "ok"}
    assert srv.client().completions.create(model=NAME, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_every_endpoint_needs_the_key(guarded):
    url, ok = guarded.url, {"Authorization": f"Bearer {KEY}"}
    chat = {"model": NAME, "messages": MESSAGES, "max_tokens": 2}
    for wrong in ({}, {"Authorization": "Bearer sk-test-012345678"}, {"Authorization": f"Basic {KEY}"},
                  {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/nowhere"),
                             ("POST", "/v1/chat/completions"), ("DELETE", "/v1/sessions/x")):
            resp = httpx.request(method, url + path, json=chat if method == "POST" else None, headers=wrong, timeout=10)
            assert _error(resp, 401)["code"] == "invalid_api_key", (wrong, path)
            assert resp.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
    assert httpx.get(url + "/metrics", headers=ok, timeout=10).status_code == 200
    assert guarded.metrics()['kvslim_refusals_total{kind="access"}'] >= 30
    _healthy(guarded)


def test_posts_must_be_json_and_loopback_hosts_only(server):
    url, body = server.url, {"model": NAME, "prompt": "hi", "max_tokens": 2}
    data = json.dumps(body).encode()
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "application/jsonx"):
        headers = {} if ctype is None else {"Content-Type": ctype}
        resp = httpx.post(url + "/v1/completions", content=data, headers=headers, timeout=10)
        assert _error(resp, 415)["code"] == "unsupported_media_type", ctype
    for ctype in ("application/json; charset=utf-8", "Application/JSON"):
        resp = httpx.post(url + "/v1/completions", content=data, headers={"Content-Type": ctype}, timeout=30)
        assert resp.status_code == 200, resp.text
    # DNS rebinding: a page's own host name pointing at 127.0.0.1
    for host in ("evil.example", f"evil.example:{server.port}", "localhost.evil.example", "127.0.0.1.nip.io",
                 "[::2]", "localhost:80x"):
        for resp in (httpx.get(url + "/health", headers={"Host": host}, timeout=10),
                     httpx.post(url + "/v1/completions", json=body, headers={"Host": host}, timeout=10)):
            assert _error(resp, 421)["code"] == "misdirected_request", host
    for host in ("localhost", f"localhost:{server.port}", "LOCALHOST", "127.0.0.2", f"[::1]:{server.port}"):
        assert httpx.get(url + "/health", headers={"Host": host}, timeout=10).status_code == 200, host
    _healthy(server)


def test_loopback_names():
    from kvslim.serve.security import host_header_is_loopback, is_loopback_host

    assert all(map(is_loopback_host, ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "localhost.")))
    assert not any(map(is_loopback_host, ("0.0.0.0", "::", "10.0.0.1", "example.com", "", "127.0.0.1.example")))
    assert all(map(host_header_is_loopback, ("localhost:8000", "[::1]:1", "127.0.0.1", "[::1]")))
    assert not any(map(host_header_is_loopback, ("[::1", "[::1]x", "localhost:", "localhost:1234567", "::1",
                                                 "a.localhost", "127.0.0.1:80:80")))


def test_a_chunked_body_past_the_limit_is_refused_while_read(guarded):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    head = b'{"model": "tiny", "max_tokens": 2, "prompt": "'

    def chunks():  # no Content-Length: the server cannot know the size before reading
        yield head
        for _ in range(2 * SMALL_BODY // 1024):
            yield b"x" * 1024
        yield b'"}'

    resp = httpx.post(guarded.url + "/v1/completions", content=chunks(), headers=auth, timeout=30)
    assert "content-length" not in resp.request.headers
    assert _error(resp, 413)["code"] == "request_too_large"
    declared = {**auth, "Content-Length": str(SMALL_BODY + 1)}
    resp = httpx.post(guarded.url + "/v1/completions", content=b"{" + b" " * SMALL_BODY, headers=declared, timeout=30)
    assert _error(resp, 413)["code"] == "request_too_large"
    # just under the limit, chunked: read whole (a 400 for the prompt past the context, not a 413)
    small = head + b"y" * (SMALL_BODY - len(head) - 100) + b'"}'
    resp = httpx.post(guarded.url + "/v1/completions", content=iter([small[:1000], small[1000:]]), headers=auth,
                      timeout=30)
    assert _error(resp, 400)["code"] == "context_length_exceeded"
    _healthy(guarded)


# -- bounds on what a client controls --------------------------------------------------------


def test_session_ids_are_bounded_printable_unicode(server):
    url, raw = server.url, {"Content-Type": "application/json"}
    post = lambda body: httpx.post(url + "/v1/completions", content=body, headers=raw, timeout=30)  # noqa: E731
    for session in (r'"\ud800"', r'"a\udfffb"', '"' + "s" * 257 + '"', r'"a\nb"', r'"\u0000"', '""', "7", "[]"):
        body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1, "session": ' + session.encode() + b"}"
        assert _error(post(body), 400)["param"] == "session", session
    # a prompt or a message with a lone surrogate is a 400 too (no tokenizer takes it)
    assert _error(post(rb'{"model": "tiny", "prompt": "a\ud800", "max_tokens": 1}'), 400)["param"] == "prompt"
    chat = rb'{"model": "tiny", "messages": [{"role": "user", "content": "\udc00"}], "max_tokens": 1}'
    assert _error(httpx.post(url + "/v1/chat/completions", content=chat, headers=raw, timeout=30), 400)["param"] \
        == "messages"
    bad_header = {"X-Session-Id": b"\xff\xfe"}
    resp = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 1},
                      headers=bad_header, timeout=30)
    assert _error(resp, 400)["param"] == "session"
    ok = server.client().completions.create(model=NAME, prompt="hi", max_tokens=1,
                                            extra_body={"session": "ünïcödé 会话 " + "s" * 240})
    assert ok.usage.completion_tokens == 1
    _healthy(server)


UNHONOURED = [  # (endpoint, field, a value that is not honoured)
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "tool_choice", "auto"),
    ("chat", "functions", [{"name": "f"}]),
    ("chat", "function_call", "auto"),
    ("chat", "response_format", {"type": "json_object"}),
    ("chat", "logit_bias", {"5": 10}),
    ("chat", "presence_penalty", 0.5),
    ("chat", "frequency_penalty", -1),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "web_search_options", {}),
    ("chat", "reasoning_effort", "low"),
    ("chat", "store", True),
    ("chat", "service_tier", "flex"),
    ("chat", "n", 2),
    ("chat", "stream_options", {"include_obfuscation": True}),
    ("chat", "suffix", "x"),  # a completions field: unknown to chat
    ("chat", "frobnicate", 1),
    ("completions", "suffix", "the end"),
    ("completions", "echo", True),
    ("completions", "best_of", 3),
    ("completions", "logit_bias", {"5": 10}),
    ("completions", "presence_penalty", 1),
    ("completions", "n", 3),
    ("completions", "tools", []),  # a chat field: unknown to completions
]


def test_fields_not_honoured_are_refused_by_name(server):
    url = server.url
    base = {"chat": ("/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "max_tokens": 2}),
            "completions": ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2})}
    for endpoint, field, value in UNHONOURED:
        path, body = base[endpoint]
        err = _error(httpx.post(url + path, json={**body, field: value}, timeout=30), 400)
        assert err["param"] == field and field in err["message"], (endpoint, field, err)
    # the labels accepted unused are still typed as OpenAI's API has them
    bad_labels = [("chat", "user", 7), ("completions", "user", ["u"]), ("chat", "safety_identifier", 3),
                  ("chat", "prompt_cache_key", {}), ("chat", "metadata", "k=v"), ("chat", "metadata", {"k": 1}),
                  ("chat", "metadata", {f"k{i}": "v" for i in range(17)}), ("chat", "metadata", {"k" * 65: "v"}),
                  ("chat", "metadata", {"k": "v" * 513})]
    for endpoint, field, value in bad_labels:
        path, body = base[endpoint]
        err = _error(httpx.post(url + path, json={**body, field: value}, timeout=30), 400)
        assert err["param"] == field and field in err["message"], (endpoint, field, err)
    err = _error(httpx.post(url + base["chat"][0], json={**base["chat"][1], "frobnicate": 1}, timeout=30), 400)
    assert err["message"] == "Unrecognized request argument supplied: 'frobnicate'"
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    # neutral values and null mean "not asked": served
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
               "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "user": "u-1", "modalities": ["text"],
               "store": False, "parallel_tool_calls": False, "metadata": {f"k{i}": "v" * 512 for i in range(16)},
               "safety_identifier": "s", "prompt_cache_key": "", "audio": None, "seed": None,
               "stop": None, "max_tokens": None, "max_completion_tokens": 2, "logprobs": None, "temperature": None,
               "stream": None, "stream_options": {"include_usage": None}, "session": None, "kvslim_cache": None}
    resp = httpx.post(url + base["chat"][0], json={**base["chat"][1], **neutral}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2
    neutral = {"suffix": "", "echo": False, "best_of": 1, "n": None, "user": "u"}
    assert httpx.post(url + base["completions"][0], json={**base["completions"][1], **neutral},
                      timeout=30).status_code == 200
    # a message carrying tool calls or images is not a text message
    for message in ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                    {"role": "tool", "content": "4", "tool_call_id": "1"}):
        body = {**base["chat"][1], "messages": [*MESSAGES, message]}
        assert _error(httpx.post(url + base["chat"][0], json=body, timeout=30), 400)["param"] == "messages"
    _healthy(server)


def test_a_full_queue_answers_429_with_retry_after(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + 30
    while guarded.metrics()["kvslim_active_streams"]:  # an earlier test's cancelled request may still hold the slot
        assert time.monotonic() < deadline
        time.sleep(0.1)
    long = {"model": NAME, "prompt": "long", "max_tokens": 3000, "stream": True}
    with httpx.Client(timeout=30, headers=auth) as http, \
            http.stream("POST", guarded.url + "/v1/completions", json=long) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        next(lines), next(lines)  # admitted: it holds the one slot
        with http.stream("POST", guarded.url + "/v1/completions", json=long) as waiting:
            assert waiting.status_code == 200  # queued: the one place in the queue
            resp = http.post(guarded.url + "/v1/completions", json={**long, "stream": False})
            err = _error(resp, 429)
            assert err["code"] == "rate_limit_exceeded" and int(resp.headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                guarded.client().completions.create(model=NAME, prompt="x", max_tokens=1)
    deadline = time.monotonic() + 30
    while guarded.metrics()["kvslim_active_streams"]:  # both streams were cancelled when their clients left
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert guarded.metrics()['kvslim_refusals_total{kind="queue"}'] >= 2
    _healthy(guarded)


def test_limits_reach_the_engine(guarded, model):
    engine = guarded.runner.engine
    assert engine.max_queue == 1
    assert engine.max_prompt_tokens == model.config.max_position_embeddings  # the default: the model's context
    store = engine.sessions
    assert store.max_sessions == 1000 and store.ttl == 24 * 3600


def test_tokenizing_runs_off_the_event_loop_with_the_default_special_tokens(server, monkeypatch):
    seen = []
    encode, template = server.tok.encode, server.tok.apply_chat_template

    def spy_encode(text, *args, **kw):
        seen.append(("encode", threading.current_thread(), kw))
        return encode(text, *args, **kw)

    def spy_template(*args, **kw):
        seen.append(("template", threading.current_thread(), kw))
        return template(*args, **kw)

    monkeypatch.setattr(server.tok, "encode", spy_encode)
    monkeypatch.setattr(server.tok, "apply_chat_template", spy_template)
    client = server.client()
    client.completions.create(model=NAME, prompt="abc", max_tokens=1)
    client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1)
    assert [s[0] for s in seen] == ["encode", "template"]
    assert all(s[1] is not server.thread for s in seen)  # uvicorn's event loop runs in server.thread
    assert "add_special_tokens" not in seen[0][2]  # the tokenizer's default (a BOS for many models)


# -- errors never carry server paths ---------------------------------------------------------


def test_error_bodies_carry_no_server_paths(server, monkeypatch, caplog):
    from kvslim.serve.errors import scrub

    secret = "/srv/secret-dir/models/tok.json"

    def broken(*args, **kw):
        raise OSError(f"[Errno 2] No such file or directory: '{secret}'")

    monkeypatch.setattr(server.tok, "encode", broken)
    monkeypatch.setattr(server.tok, "apply_chat_template", broken)
    resp = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi"}, timeout=30)
    err = _error(resp, 500)
    assert "secret" not in resp.text and "Errno" not in resp.text and "err-" in err["message"]
    assert err["type"] == "server_error"
    resp = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES}, timeout=30)
    assert _error(resp, 400)["param"] == "messages" and "secret" not in resp.text
    monkeypatch.undo()
    assert scrub(f"cannot read {secret}: gone; C:\\Users\\me\\x.gguf too") == "cannot read <path>: gone; <path> too"
    assert scrub("tokens/s and 3/4 stay") == "tokens/s and 3/4 stay"
    _healthy(server)


# -- OpenAI compatibility ------------------------------------------------------------------


def _stop_case(text: str) -> tuple[str, int]:
    """A 3-character stop string from ``text`` (so it spans 3 tokens) whose first occurrence is at >= 5."""
    for k in range(5, len(text) - 3):
        if text.find(text[k : k + 3]) == k:
            return text[k : k + 3], k
    pytest.skip("the tiny model's reply repeats itself too much for a stop string")


def test_stop_strings_end_the_reply_and_are_never_sent(server):
    client = server.client()
    before = server.metrics()
    args = dict(model=NAME, prompt="abc", max_tokens=30, temperature=0)
    full = client.completions.create(**args).choices[0].text
    stop, at = _stop_case(full)
    for stops in (stop, [stop], ["~~never~~", stop]):
        whole = client.completions.create(**args, stop=stops)
        assert whole.choices[0].text == full[:at] and whole.choices[0].finish_reason == "stop"
        assert whole.usage.completion_tokens == at + len(stop)  # up to the token that completed the stop string
        parts = list(client.completions.create(**args, stop=stops, stream=True, stream_options={"include_usage": True}))
        texts = [p.choices[0].text for p in parts if p.choices]
        assert "".join(texts) == full[:at] and not any(stop in t for t in texts)
        assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "stop"
        assert parts[-1].usage.completion_tokens == at + len(stop)
    # a prefix of the stop string that turns out not to be one is held back, then sent
    prefix_stop = full[at : at + 2] + "\x7f"
    held = "".join(p.choices[0].text for p in client.completions.create(**args, stop=prefix_stop, stream=True))
    assert held == full
    never = client.completions.create(**args, stop=["\x7f\x7f"])
    assert never.choices[0].text == full and never.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=30, temperature=0)
    reply = chat.choices[0].message.content
    cstop, cat = _stop_case(reply)
    stopped = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=30, temperature=0, stop=cstop)
    assert stopped.choices[0].message.content == reply[:cat] and stopped.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 30
    while server.metrics()["kvslim_active_streams"]:  # the engine requests ended by stop strings are gone
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # 6 ended by a stop string (3 forms x whole and streamed) and the chat one: counted as stops, never as
    # cancellations (one whose engine request reached max_tokens before the cancel is counted as length)
    after = server.metrics()
    delta = {k: after[f'kvslim_requests_total{{outcome="{k}"}}'] - before[f'kvslim_requests_total{{outcome="{k}"}}']
             for k in ("stop", "length", "cancelled")}
    assert delta["cancelled"] == 0 and delta["stop"] >= 4 and delta["stop"] + delta["length"] >= 7 + 3, delta
    for bad in ("", ["a"] * 5, [1], "x" * 257):
        with pytest.raises(openai.BadRequestError, match="stop"):
            client.completions.create(**{**args, "max_tokens": 2}, stop=bad)
    _healthy(server)


def test_stop_text_matches_across_any_split():
    import random

    from kvslim.serve.stops import StopText

    rng = random.Random(0)
    text = "Hello, world. Hel-lo again: the end. END"
    for stops, expected in ((("world",), "Hello, "), (("lo a", "end."), "Hello, world. Hel-"), (("end.", "nd. E"), "Hello, world. Hel-lo again: the "),
                            (("end. EN", "nd."), "Hello, world. Hel-lo again: the e"),
                            (("END", "the"), "Hello, world. Hel-lo again: "), (("nope",), text),
                            (("Hello",), ""), (("d. H", "d. Hex"), "Hello, worl")):
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 10)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            st = StopText(stops)
            out = "".join(st.push(p) for p in pieces) + st.flush()
            assert out == expected, (stops, pieces)
            assert st.stopped == (expected != text)


def test_logprobs_in_openai_shapes(server):
    client = server.client()
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 3
        tops = [t.logprob for t in c.top_logprobs]
        assert tops == sorted(tops, reverse=True) and c.top_logprobs[0].token == c.token  # greedy: the top one
        assert abs(c.logprob - tops[0]) < 1e-6
    streamed = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                                   logprobs=True, stream=True))
    entries = [e for p in streamed if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert [e.token for e in entries] == [c.token for c in content] and all(e.top_logprobs == [] for e in entries)
    plain = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    text = client.completions.create(model=NAME, prompt="abc", max_tokens=5, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset == [0, 1, 2, 3, 4]
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert all(2 <= len(top) <= 3 and tok in top for top, tok in zip(lp.top_logprobs, lp.tokens))
    for bad in ({"logprobs": 6}, {"logprobs": True}, {"logprobs": -1}):
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.completions.create(model=NAME, prompt="abc", max_tokens=2, **bad)
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": 1}):
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, **bad)


def test_max_completion_tokens_and_nulls(server):
    client = server.client()
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="disagree"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=3, max_tokens=4)
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": NAME, "prompt": "abc", "max_tokens": None, "temperature": None, "top_p": None, "n": None,
        "stream": None, "stop": None, "seed": None, "logprobs": None, "echo": None, "suffix": None,
        "best_of": None, "logit_bias": None, "user": None, "presence_penalty": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256  # --default-max-tokens
    assert _error(httpx.post(server.url + "/v1/completions", json={"prompt": "abc"}, timeout=30), 400)["param"] \
        == "model"


def test_delete_a_session(server):
    client = server.client()
    client.completions.create(model=NAME, prompt="remember me", max_tokens=2, extra_body={"session": "to/delete é"})
    url = server.url + "/v1/sessions/" + "to%2Fdelete%20%C3%A9"
    assert httpx.delete(url, timeout=30).status_code == 204
    assert _error(httpx.delete(url, timeout=30), 404)["code"] == "session_not_found"
    assert _error(httpx.delete(server.url + "/v1/sessions/" + "x" * 300, timeout=30), 400)["param"] == "session"
    again = client.completions.create(model=NAME, prompt="remember me too", max_tokens=2,
                                      extra_body={"session": "to/delete é"})
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # it started over
    _healthy(server)


# -- shutdown --------------------------------------------------------------------------------


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_ends_streams_parks_sessions_and_returns(model, tmp_path, signals):
    """The first SIGTERM: no new requests, in-flight streams end with an error event after the grace,
    idle sessions parked, the server's run returns; a second signal ends them at once and still parks."""
    import signal

    app = build_app(model, char_tokenizer(), model_name=NAME, cache="int4", memory_budget=_budget(model),
                    session_dir=tmp_path, shutdown_grace=0.5 if signals == 1 else 30)
    srv = Server(app, graceful=0.5 if signals == 1 else 30)
    client = srv.client()
    client.completions.create(model=NAME, prompt="keep me", max_tokens=3, extra_body={"session": "kept"})
    body = {"model": NAME, "prompt": "a long one", "max_tokens": 4000, "stream": True}
    started = time.monotonic()
    with httpx.Client(timeout=60) as http, http.stream("POST", srv.url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        next(lines), next(lines)
        for _ in range(signals):
            srv.server.handle_exit(signal.SIGTERM, None)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
    srv.thread.join(30)
    assert not srv.thread.is_alive() and time.monotonic() - started < 20
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())  # the idle session was parked
    assert not app.state.runner.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)


# -- the CLI's parts ---------------------------------------------------------------------------


def test_cli_defaults_and_access_rules(monkeypatch):
    from kvslim.cli import serve as cli
    from kvslim.cli.common import UserError, cache_config_from_args

    parser = __import__("argparse").ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args([])
    assert cache_config_from_args(args).to_spec() == "int8"  # compressed by default (docs/serve.md: why int8)
    assert args.memory_budget == "auto" and args.session_ttl == 86400 and args.max_sessions == 1000
    assert parser.parse_args(["--kv-quantize", "none"]).kv_quantize == "none"
    assert parser.parse_args(["--session-ttl", "90m"]).session_ttl == 5400
    assert parser.parse_args(["--memory-budget", "1GiB"]).memory_budget == 1 << 30
    monkeypatch.delenv("KVSLIM_API_KEY", raising=False)
    assert cli.api_key_from(parser.parse_args([])) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        with pytest.raises(UserError, match="--allow-no-api-key"):
            cli.api_key_from(parser.parse_args(["--host", host]))
        assert cli.api_key_from(parser.parse_args(["--host", host, "--allow-no-api-key"])) is None
        assert cli.api_key_from(parser.parse_args(["--host", host, "--api-key", "k"])) == "k"
    monkeypatch.setenv("KVSLIM_API_KEY", "from-env")
    assert cli.api_key_from(parser.parse_args(["--host", "0.0.0.0"])) == "from-env"
    with pytest.raises(UserError, match="blank"):
        cli.api_key_from(parser.parse_args(["--api-key", " "]))


def test_parse_duration_and_the_default_budget(monkeypatch):
    from kvslim.cli.serve import parse_duration
    from kvslim.serve import defaults
    from kvslim.serve.defaults import available_memory, default_memory_budget

    assert parse_duration("24h") == 86400 and parse_duration("90") == 90 and parse_duration("1.5d") == 129600
    for bad in ("", "0", "-1h", "3 weeks", "h"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)
    available, source = available_memory()
    budget, why = default_memory_budget("cpu")
    assert available and 0 < budget <= available and abs(budget - available // 2) <= 1
    assert source in why and "50%" in why
    # a container's limit below the host's MemAvailable is the one that counts
    monkeypatch.setattr(defaults, "_meminfo_available", lambda: 64 << 30)
    monkeypatch.setattr(defaults, "_cgroup_room", lambda: 3 << 30)
    assert default_memory_budget("cpu") == (3 << 29, "50% of 3.0 GiB available (cgroup limit)")
    monkeypatch.setattr(defaults, "_cgroup_room", lambda: None)
    assert default_memory_budget("cpu")[0] == 32 << 30


@pytest.mark.slow
def test_embedded_model_two_turn_session(real_model, tmp_path):
    """The embedded model end to end: a 2-turn chat in one session; the second turn prefills only its new
    tokens and answers exactly as one request carrying the whole history."""
    model, tok = real_model
    from kvslim.cli.prompt import eos_ids

    app = build_app(kvslim.enable(model), tok, model_name="smol", cache="int4,sink=4,window=1020",
                    session_dir=tmp_path, stop_ids=eos_ids(model, tok))
    srv = Server(app)
    try:
        client = srv.client()
        history = [{"role": "user", "content": "What is the capital of France? One word."}]
        one = client.chat.completions.create(model="smol", messages=history, max_tokens=24, temperature=0,
                                             extra_body={"session": "s"})
        history += [{"role": "assistant", "content": one.choices[0].message.content},
                    {"role": "user", "content": "And of Italy?"}]
        before = srv.metrics()["kvslim_prefilled_tokens_total"]
        two = client.chat.completions.create(model="smol", messages=history, max_tokens=24, temperature=0,
                                             extra_body={"session": "s"})
        cached = two.usage.prompt_tokens_details.cached_tokens
        assert cached == one.usage.prompt_tokens + one.usage.completion_tokens - 1
        assert srv.metrics()["kvslim_prefilled_tokens_total"] - before == two.usage.prompt_tokens - cached
        plain = client.chat.completions.create(model="smol", messages=history, max_tokens=24, temperature=0)
        assert two.choices[0].message.content == plain.choices[0].message.content
        assert json.dumps(two.model_dump())  # a well-formed response
    finally:
        srv.stop()
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())  # idle sessions parked at shutdown


@pytest.fixture(scope="module")
def paged(model):
    """A server whose requests share one pool of int4 pages (``kvslim serve --pages``)."""
    app = build_app(model, char_tokenizer(), model_name=NAME, cache="int4", memory_budget=None, pages=400,
                    prefill_chunk=64)
    srv = Server(app)
    srv.runner = app.state.runner
    yield srv
    srv.stop()


def _streams_get_what_each_gets_alone(srv, prompts: list[str], max_tokens: int) -> None:
    """Each prompt asked alone, then all at once from as many threads, streaming: the same texts."""
    alone = [srv.client().completions.create(model=NAME, prompt=p, max_tokens=max_tokens, temperature=0)
             .choices[0].text for p in prompts]
    got: dict[int, str] = {}

    def work(i: int) -> None:
        got[i] = "".join(p.choices[0].text for p in srv.client().completions.create(
            model=NAME, prompt=prompts[i], max_tokens=max_tokens, temperature=0, stream=True))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(prompts))] == alone


def test_a_paged_server_serves_concurrent_clients_and_sessions(paged):
    """Through a real port: concurrent clients get what each gets alone; a session continues on its row of the
    pool; a request naming other cache settings gets a 400 naming why; every page is back at the end."""
    engine = paged.runner.engine
    client = paged.client()
    _streams_get_what_each_gets_alone(paged, [f"paged prompt {i}: " + "ab" * (7 * i) for i in range(5)], 12)
    first = "User: hi\nBot:"
    a = client.completions.create(model=NAME, prompt=first, max_tokens=6, temperature=0, extra_body={"session": "p"})
    second = first + a.choices[0].text + "\nUser: more\nBot:"
    b = client.completions.create(model=NAME, prompt=second, max_tokens=6, temperature=0, extra_body={"session": "p"})
    assert b.usage.prompt_tokens_details.cached_tokens == len(first) + 5
    plain = client.completions.create(model=NAME, prompt=second, max_tokens=6, temperature=0)
    assert b.choices[0].text == plain.choices[0].text
    resp = httpx.post(paged.url + "/v1/completions", timeout=30, json={
        "model": NAME, "prompt": "x", "max_tokens": 2, "kvslim_cache": "int8"})
    assert resp.status_code == 400 and "cannot bring its own cache settings" in resp.json()["error"]["message"]
    assert engine.pool.rows_alive == 1  # the session's row
    assert httpx.delete(paged.url + "/v1/sessions/p", timeout=10).status_code == 204
    assert engine.pool.rows_alive == 0 and engine.pool.free_pages == engine.pool.n_pages


def test_a_cpp_wrapper_server_gives_the_python_wrappers_text(model):
    """``kvslim serve --pages ... --compile cpp``: the engine's step is built with Inductor's C++ wrapper and warmed
    up with it, and each request's greedy text through a real port is the Python wrapper's server's."""
    texts = {}
    for wrapper in ("python", "cpp"):
        app = build_app(model, char_tokenizer(), model_name=NAME, cache="int4", memory_budget=None, pages=100,
                        prefill_chunk=64, max_concurrency=1, compile=wrapper)  # fmt: skip
        engine = app.state.runner.engine
        assert engine.compiled.wrapper == wrapper and engine.warm_up() == [1]
        srv = Server(app)
        try:
            texts[wrapper] = [
                srv.client().completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
                for p in ("cpp wrapper: ", "ab" * 9)
            ]
        finally:
            srv.stop()
        assert engine.compiled.buckets == {1} and engine.pool.rows_alive == 0
    assert texts["cpp"] == texts["python"]


def test_a_compiled_paged_server_warms_up_then_serves_without_compiling(model):
    """``kvslim serve --pages ... --compile``: the warm-up compiles every bucket before the port opens; concurrent
    streaming clients then get what each gets alone, on the runner's thread, and nothing compiles again."""
    app = build_app(model, char_tokenizer(), model_name=NAME, cache="int4", memory_budget=None, pages=200,
                    prefill_chunk=64, max_concurrency=3, compile=True)
    from torch._dynamo.utils import counters

    engine = app.state.runner.engine
    warm = engine.warm_up()
    assert warm and sorted(engine.compiled.buckets) == warm
    compile_s, graphs = engine.compiled.compile_s, counters["stats"]["unique_graphs"]
    srv = Server(app)
    try:
        _streams_get_what_each_gets_alone(srv, [f"compiled {i}: " + "xy" * (5 * i) for i in range(4)], 10)
    finally:
        srv.stop()
    assert sorted(engine.compiled.buckets) == warm and engine.compiled.compile_s == compile_s
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again on the runner's thread
    assert engine.pool.rows_alive == 0 and engine.pool.free_pages == engine.pool.n_pages
