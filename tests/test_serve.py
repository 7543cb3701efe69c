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
    """uvicorn serving ``app`` on 127.0.0.1 in a background thread; ``stop()`` ends it (bounded waits)."""

    def __init__(self, app):
        import uvicorn

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
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
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
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
    app = build_app(
        model, char_tokenizer(), model_name=NAME, cache="int4", memory_budget=_budget(model), prefill_chunk=64
    )
    srv = Server(app)
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
    assert _error(post("/v1/chat/completions", content=b"{not json"), 400)["code"] == "invalid_json"
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


@pytest.mark.slow
def test_embedded_model_two_turn_session(real_model, tmp_path):
    """The embedded model end to end: a 2-turn chat in one session; the second turn prefills only its new
    tokens and answers exactly as one request carrying the whole history."""
    model, tok = real_model
    from kvslim.cli.sample import _eos_ids

    app = build_app(kvslim.enable(model), tok, model_name="smol", cache="int4,sink=4,window=1020",
                    session_dir=tmp_path, stop_ids=_eos_ids(model, tok))
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
