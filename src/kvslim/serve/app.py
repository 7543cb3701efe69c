"""The HTTP side of ``kvslim serve``: OpenAI's request and response shapes, SSE, errors. Knows no tensors.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` true: Server-Sent Events,
``data: {json}`` chunks then ``data: [DONE]``, as OpenAI's clients read them; false: one JSON body with
``usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Beyond OpenAI's fields a request may carry ``session`` (or the ``X-Session-Id`` header): the conversation's
id, whose compressed cache the engine keeps between requests (:mod:`kvslim.engine.sessions`), and
``kvslim_cache``: a cache spec (``"int4,sink=4,window=1020"``) for this request instead of the server's.

Every refusal is a 4xx JSON body in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 a malformed body or a bad value, 404 an unknown model or path, 413 a body too large or a request
whose cache cannot fit the memory budget, 503 the engine is not running. A client that disconnects has
its request cancelled in the engine (its cache freed); the others go on.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..config import parse_spec
from ..engine import Request
from ..textstream import StreamDecoder
from .runner import Done, Runner

#: the largest request body read (bytes): a prompt of this many bytes is far past any context
MAX_BODY = 8 << 20


class APIError(Exception):
    """A refusal: HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.counted = False  # the runner has counted this request's outcome already

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def create_app(
    runner: Runner,
    tokenizer,
    *,
    model_name: str,
    stop_ids=(),
    default_max_tokens: int = 256,
    manage_runner: bool = True,
) -> Starlette:
    """The ASGI app serving ``runner``'s engine. tokenizer: a transformers tokenizer (its chat template for
    chat requests). model_name: the id clients name in ``model``. stop_ids: token ids that end a reply (the
    tokenizer's EOS is added). default_max_tokens: when a request names none. manage_runner: start the
    runner with the app and stop it (parking idle sessions) at shutdown."""
    api = _API(runner, tokenizer, model_name, stop_ids, default_max_tokens)

    @asynccontextmanager
    async def lifespan(app):
        if manage_runner:
            runner.start()
        try:
            yield
        finally:
            if manage_runner:
                await asyncio.get_running_loop().run_in_executor(None, runner.stop)

    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]

    async def not_found(request, exc):
        return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    async def bad_method(request, exc):
        return APIError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def crashed(request, exc):  # a bug: still OpenAI's shape, and said to be ours
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()

    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: bad_method, Exception: crashed},
    )


class _API:
    def __init__(self, runner: Runner, tokenizer, model_name: str, stop_ids, default_max_tokens: int):
        self.runner = runner
        self.tok = tokenizer
        self.model_name = model_name
        stops = {int(t) for t in stop_ids}
        if getattr(tokenizer, "eos_token_id", None) is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_ids = tuple(sorted(stops))
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    # -- endpoints ---------------------------------------------------------------------------
    async def chat(self, http: HTTPRequest) -> Response:
        try:
            body = await _json_body(http)
            messages = body.get("messages")
            _check_messages(messages)
            try:
                ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as e:  # a template that refuses these messages (roles out of order...)
                raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer tokenizers return an encoding
                ids = ids["input_ids"]
            return await self._serve(http, body, list(ids), chat=True)
        except APIError as e:
            if not e.counted:
                self.runner.refused()
            return e.response()

    async def completions(self, http: HTTPRequest) -> Response:
        try:
            body = await _json_body(http)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # one prompt in a list
            if isinstance(prompt, str) and prompt:
                ids = self.tok.encode(prompt, add_special_tokens=False) or []
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = prompt
            else:
                raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt)", param="prompt")
            if not ids:
                raise APIError(400, "prompt encodes to no tokens", param="prompt")
            return await self._serve(http, body, list(ids), chat=False)
        except APIError as e:
            if not e.counted:
                self.runner.refused()
            return e.response()

    async def models(self, http: HTTPRequest) -> Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvslim"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, http: HTTPRequest) -> Response:
        if not self.runner.alive:
            return APIError(503, self.runner.failure or "the engine is not running", type_="server_error").response()
        return JSONResponse({"status": "ok"})

    async def metrics(self, http: HTTPRequest) -> Response:
        m = await asyncio.get_running_loop().run_in_executor(None, self.runner.metrics)
        return PlainTextResponse(prometheus(m), media_type="text/plain; version=0.0.4")

    # -- one generation ----------------------------------------------------------------------
    async def _serve(self, http: HTTPRequest, body: dict, ids: list[int], *, chat: bool) -> Response:
        req, stream, include_usage = self._request(http, body, ids, chat=chat)
        if not self.runner.alive:
            raise APIError(503, self.runner.failure or "the engine is not running", type_="server_error")
        try:
            # off the event loop: submit takes the engine's lock (held for a whole step) and sizes the cache
            loop = asyncio.get_running_loop()
            rid, queue = await loop.run_in_executor(None, self.runner.submit, req, loop)
        except ValueError as e:
            raise _counted(_refusal(str(e), body, chat)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type_="server_error") from None
        kind = "chatcmpl" if chat else "cmpl"
        reply = _Reply(f"{kind}-{uuid.uuid4().hex[:24]}", self.model_name, chat, len(ids))
        decoder = StreamDecoder(self.tok, ids)
        if stream:
            return StreamingResponse(
                self._sse(http, rid, queue, reply, decoder, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._whole(http, rid, queue, reply, decoder)

    def _request(self, http: HTTPRequest, body: dict, ids: list[int], *, chat: bool):
        model = body.get("model")
        if model != self.model_name:
            raise APIError(
                404, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )
        n = body.get("n", 1)
        if n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {n!r}", param="n")
        if body.get("logprobs") or body.get("echo") or body.get("best_of", 1) not in (1, None):
            raise APIError(400, "logprobs, echo and best_of are not supported", param="logprobs")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        limit = self.runner.engine.shapes.max_position_embeddings or 1 << 20
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= limit:
            raise APIError(400, f"max_tokens must be an integer in 1..{limit}, got {max_tokens!r}", param="max_tokens")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0:
            raise APIError(400, "top_p must be in (0, 1], got 0", param="top_p")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise APIError(400, f"seed must be an integer in [0, 2**63), got {seed!r:.40}", param="seed")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"stream must be true or false, got {stream!r}", param="stream")
        options = body.get("stream_options") or {}
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        if body.get("stop"):
            raise APIError(400, "stop sequences are not supported (the model's end-of-turn token ends a reply)", param="stop")
        session = body.get("session", http.headers.get("x-session-id"))
        if session is not None and (not isinstance(session, str) or not session or len(session) > 256):
            raise APIError(400, f"session must be a non-empty string of at most 256 characters, got {session!r:.60}", param="session")
        spec = body.get("kvslim_cache")
        if spec is not None:
            if not isinstance(spec, str):
                raise APIError(400, f"kvslim_cache must be a cache spec string, got {spec!r:.60}", param="kvslim_cache")
            try:
                spec = parse_spec(spec)
            except ValueError as e:
                raise APIError(400, f"kvslim_cache: {e}", param="kvslim_cache") from None
            if spec.mean_center is not None:  # a client must not make the server open a file of its choosing
                raise APIError(
                    400, "kvslim_cache cannot name a mean_center file: the server's own flags choose it",
                    param="kvslim_cache",
                )
        vocab = self.runner.engine.vocab_size
        if vocab and any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        try:
            req = Request(
                prompt=ids,
                max_new_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                stop_ids=self.stop_ids,
                cache=spec,
                session=session,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return req, stream, include_usage

    async def _sse(self, http, rid, queue, reply, decoder, include_usage):
        finished = False
        try:
            yield _sse(reply.chunk(role=True))
            while True:
                item = await queue.get()
                ev = item.event if isinstance(item, Done) else item
                text = decoder.push(ev.token) if ev.token is not None else ""
                if isinstance(item, Done):
                    finished = True
                    text += decoder.flush()
                    if ev.finish_reason in ("error", "cancelled"):
                        if text:
                            yield _sse(reply.chunk(text=text))
                        yield _sse({"error": {"message": ev.error or _ENDED, "type": "server_error",
                                              "param": None, "code": None}})
                    else:
                        if text:
                            yield _sse(reply.chunk(text=text))
                        yield _sse(reply.chunk(finish=_finish_reason(ev)))
                        if include_usage:
                            yield _sse(reply.usage_chunk(item.result, ev))
                    yield "data: [DONE]\n\n"
                    return
                if text:
                    yield _sse(reply.chunk(text=text))
        finally:
            if not finished:  # the client went away mid-stream: free its cache now
                self._cancel(rid)

    def _cancel(self, rid: str) -> None:
        """Cancel in the engine without blocking the event loop (cancel waits for the engine's lock)."""
        asyncio.get_running_loop().run_in_executor(None, self.runner.cancel, rid)

    async def _whole(self, http, rid, queue, reply, decoder) -> Response:
        parts: list[str] = []
        watcher = asyncio.ensure_future(_disconnected(http))
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:  # the client went away: free its cache now
                    get.cancel()
                    self._cancel(rid)
                    return Response(status_code=499)
                item = get.result()
                ev = item.event if isinstance(item, Done) else item
                if ev.token is not None:
                    parts.append(decoder.push(ev.token))
                if isinstance(item, Done):
                    parts.append(decoder.flush())
                    break
        except asyncio.CancelledError:
            self._cancel(rid)
            raise
        finally:
            watcher.cancel()
        if ev.finish_reason == "cancelled":  # the server is shutting down (a client that left gets no reply)
            raise _counted(APIError(503, _ENDED, type_="server_error"))
        if ev.finish_reason == "error":
            raise _counted(APIError(500, ev.error or "generation failed", type_="server_error"))
        return JSONResponse(reply.whole("".join(parts), _finish_reason(ev), item.result, ev))


class _Reply:
    """OpenAI's response objects for one request (chat or text completion)."""

    def __init__(self, rid: str, model: str, chat: bool, prompt_tokens: int):
        self.id, self.model, self.chat, self.prompt_tokens = rid, model, chat, prompt_tokens
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, *, text: str = "", role: bool = False, finish: str | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def usage(self, result, ev) -> dict:
        completion = len(result.tokens) if result is not None else ev.index + (ev.token is not None)
        cached = result.cached_tokens if result is not None else 0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def usage_chunk(self, result, ev) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage(result, ev)}

    def whole(self, text: str, finish: str, result, ev) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(False), "choices": [choice], "usage": self.usage(result, ev)}


def prometheus(m: dict) -> str:
    """The runner's figures (:meth:`Runner.metrics`) as Prometheus text exposition."""
    mem = m["memory"]
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value}")

    metric("kvslim_requests_total", "counter", "requests by outcome (refused: a 4xx before generating)",
           [(f'{{outcome="{k}"}}', v) for k, v in sorted(m["outcomes"].items())])
    metric("kvslim_prompt_tokens_total", "counter", "prompt tokens of finished requests", [("", m["prompt_tokens"])])
    metric("kvslim_cached_prompt_tokens_total", "counter", "prompt tokens a kept session already held (not prefilled)",
           [("", m["cached_tokens"])])
    metric("kvslim_prefilled_tokens_total", "counter", "prompt tokens fed through prefill", [("", mem["prefilled_tokens"])])
    metric("kvslim_generated_tokens_total", "counter", "tokens generated", [("", m["generated_tokens"])])
    metric("kvslim_active_streams", "gauge", "requests in flight (waiting or running)", [("", m["active_streams"])])
    metric("kvslim_queue_length", "gauge", "requests waiting for admission", [("", mem["waiting"])])
    metric("kvslim_running_requests", "gauge", "requests admitted (prefilling or decoding)", [("", mem["active"])])
    metric("kvslim_cache_bytes", "gauge", "bytes held by caches: running requests and idle sessions in memory",
           [('{where="running"}', mem["cache_bytes"]), ('{where="sessions"}', mem["session_bytes"])])
    metric("kvslim_cache_fp16_bytes", "gauge",
           "bytes plain fp16 caches of the same tokens would hold (no window, no compression)", [("", mem["fp16_bytes"])])
    metric("kvslim_reserved_bytes", "gauge", "bytes reserved by admission for running requests", [("", mem["reserved_bytes"])])
    if mem["memory_budget"] is not None:
        metric("kvslim_memory_budget_bytes", "gauge", "the memory budget", [("", mem["memory_budget"])])
    metric("kvslim_sessions", "gauge", "sessions kept", [('{where="memory"}', mem["sessions_kept"]),
                                                          ('{where="disk"}', mem["sessions_on_disk"])])
    for key, help_ in (
        ("continued", "requests that continued a kept session"),
        ("reset", "session caches dropped because the prompt did not continue them"),
        ("evicted", "idle sessions written to disk to make room"),
        ("restored", "sessions read back from disk"),
        ("dropped", "idle sessions dropped (no session dir, a failed request or an unreadable file)"),
    ):
        metric(f"kvslim_sessions_{key}_total", "counter", help_, [("", mem[f"sessions_{key}"])])
    metric("kvslim_up", "gauge", "1 while the engine thread runs", [("", int(m["alive"]))])
    return "\n".join(lines) + "\n"


# -- helpers --------------------------------------------------------------------------------


async def _json_body(http: HTTPRequest) -> dict:
    size = http.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise APIError(413, f"request body of {size} bytes is larger than {MAX_BODY}", code="request_too_large")
    raw = await http.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"request body of {len(raw)} bytes is larger than {MAX_BODY}", code="request_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def _disconnected(http: HTTPRequest) -> None:
    """Return when the client of ``http`` (whose body was read) disconnects."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            m["content"] = "".join(str(p.get("text", "")) for p in content)
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param="messages")


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise APIError(400, f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}", param=name)
    return float(value)


def _refusal(msg: str, body: dict, chat: bool) -> APIError:
    """The engine's ValueError for a request it cannot serve, as an HTTP refusal."""
    if "memory budget" in msg:
        return APIError(413, msg, param="max_tokens", code="request_too_large")
    if "context" in msg:
        return APIError(400, msg, param="messages" if chat else "prompt", code="context_length_exceeded")
    return APIError(400, msg, param="kvslim_cache" if body.get("kvslim_cache") else None)


def _counted(e: APIError) -> APIError:
    e.counted = True
    return e


_ENDED = "the request was cancelled: the server is shutting down"


def _finish_reason(ev) -> str:
    """OpenAI's finish_reason; a request the server cancelled (shutdown) is reported as an error by the callers."""
    return "length" if ev.finish_reason == "length" else "stop"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
