"""The HTTP side of ``kvslim serve``: endpoints, SSE and refusals over the engine's runner. Knows no tensors.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` true: Server-Sent Events,
``data: {json}`` chunks then ``data: [DONE]``, as OpenAI's clients read them; false: one JSON body with
``usage``), ``DELETE /v1/sessions/{id}``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus
text). Every endpoint is behind :class:`~kvslim.serve.security.Guard` (Host, API key, JSON content type).

Beyond OpenAI's fields a request may carry ``session`` (or the ``X-Session-Id`` header): the conversation's
id, whose compressed cache the engine keeps between requests (:mod:`kvslim.engine.sessions`), and
``kvslim_cache``: a cache spec (``"int4,sink=4,window=1020"``) for this request instead of the server's.
Request bodies are read by :mod:`kvslim.serve.openai` (every field honoured or a 400 naming it), responses
built by :mod:`kvslim.serve.shapes`, ``stop`` strings matched by :mod:`kvslim.serve.stops`.

Every refusal is a JSON body in OpenAI's shape (:mod:`kvslim.serve.errors`): 400 a malformed body or a bad
value, 401 no or a wrong key, 404 an unknown model, path or session, 413 a body too large or a request whose
cache cannot fit the memory budget, 415 not JSON, 421 a foreign Host, 429 the queue is full (Retry-After),
503 the engine is not running or shutting down. The engine's refusals are typed
(:class:`kvslim.engine.Refusal` by ``kind``), never matched by their text. A client that disconnects has
its request cancelled in the engine (its cache freed); the others go on.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import Refusal, Request
from ..textstream import StreamDecoder
from . import openai as oai
from .defaults import DEFAULT_SHUTDOWN_GRACE, MAX_BODY
from .errors import APIError, internal_error, log, scrub
from .metrics import prometheus
from .runner import Done, Runner
from .security import Guard
from .shapes import Reply, TokenText
from .stops import ReplyText, StopText

#: bodies larger than this are parsed off the event loop
_BIG_JSON = 1 << 16
#: how long a request whose stop string matched waits for the engine's final event (its usage figures)
_STOP_WAIT = 10.0
_ENDED = "the request was cancelled: the server is shutting down"
_NOT_RUNNING = "the engine is not running (shutting down, or failed: see the server log)"


def create_app(
    runner: Runner,
    tokenizer,
    *,
    model_name: str,
    stop_ids=(),
    default_max_tokens: int = 256,
    manage_runner: bool = True,
    api_key: str | None = None,
    loopback_only: bool = True,
    max_body: int = MAX_BODY,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
) -> Starlette:
    """The ASGI app serving ``runner``'s engine. tokenizer: a transformers tokenizer (its chat template for
    chat requests). model_name: the id clients name in ``model``. stop_ids: token ids that end a reply (the
    tokenizer's EOS is added). default_max_tokens: when a request names none. manage_runner: start the
    runner with the app and, at shutdown, drain it (``shutdown_grace`` seconds for what is in flight) and
    park idle sessions. api_key: the Bearer key every request must bear (None: none). loopback_only: refuse
    Host headers that do not name loopback (the server is bound to loopback). max_body: the largest request
    body in bytes."""
    api = _API(runner, tokenizer, model_name, stop_ids, default_max_tokens, max_body)

    @asynccontextmanager
    async def lifespan(app):
        if manage_runner:
            runner.start()
        try:
            yield
        finally:
            if manage_runner:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, runner.drain, shutdown_grace)
                await loop.run_in_executor(None, runner.stop)

    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/sessions/{session_id:path}", api.delete_session, methods=["DELETE"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]

    async def not_found(request, exc):
        return APIError(404, f"no route {request.method} {request.url.path[:200]}", code="not_found").response()

    async def bad_method(request, exc):
        return APIError(405, f"{request.method} is not allowed on {request.url.path[:200]}").response()

    async def crashed(request, exc):  # a bug: OpenAI's shape, an id, and nothing of the server's insides
        return internal_error(exc, f"{request.method} {request.url.path[:200]}").response()

    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(Guard, api_key=api_key, loopback_only=loopback_only,
                               refused=lambda: runner.refused("access"))],
        exception_handlers={404: not_found, 405: bad_method, Exception: crashed},
    )


def _refusals(handler):
    """An endpoint whose APIError becomes its response (counted as refused unless the runner counted it)."""

    async def endpoint(self, http: HTTPRequest) -> Response:
        try:
            return await handler(self, http)
        except APIError as e:
            if not e.counted and e.status < 500:  # a 4xx is a refusal; a 503 or a failure is not
                self.runner.refused("request")
            return e.response()

    return endpoint


class _API:
    def __init__(self, runner: Runner, tokenizer, model_name: str, stop_ids, default_max_tokens: int, max_body: int):
        self.runner = runner
        self.tok = tokenizer
        self.model_name = model_name
        stops = {int(t) for t in stop_ids}
        if getattr(tokenizer, "eos_token_id", None) is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_ids = tuple(sorted(stops))
        self.default_max_tokens = default_max_tokens
        self.max_body = max_body
        self.created = int(time.time())
        self.token_text = TokenText(tokenizer)

    # -- endpoints ---------------------------------------------------------------------------
    @_refusals
    async def chat(self, http: HTTPRequest) -> Response:
        body = await read_json(http, self.max_body)
        params = self._params(http, body, chat=True)
        msgs = oai.messages(body)
        ids = await asyncio.get_running_loop().run_in_executor(None, self._template, msgs)
        return await self._serve(http, params, ids, chat=True)

    @_refusals
    async def completions(self, http: HTTPRequest) -> Response:
        body = await read_json(http, self.max_body)
        params = self._params(http, body, chat=False)
        prompt = oai.prompt(body)
        if isinstance(prompt, str):  # the special tokens the tokenizer adds by default (a BOS for many models)
            ids = await asyncio.get_running_loop().run_in_executor(None, self.tok.encode, prompt)
            if not ids:
                raise APIError(400, "prompt encodes to no tokens", param="prompt")
        else:
            ids = prompt
        return await self._serve(http, params, list(ids), chat=False)

    @_refusals
    async def delete_session(self, http: HTTPRequest) -> Response:
        session = oai.parse_session(http.path_params["session_id"])
        found = await asyncio.get_running_loop().run_in_executor(None, self.runner.delete_session, session)
        if not found:
            raise APIError(404, f"no session {session!r:.80} is kept", param="session", code="session_not_found")
        return Response(status_code=204)

    async def models(self, http: HTTPRequest) -> Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvslim"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, http: HTTPRequest) -> Response:
        if not self.runner.alive:
            return APIError(503, _NOT_RUNNING,
                            type_="server_error").response()
        return JSONResponse({"status": "ok"})

    async def metrics(self, http: HTTPRequest) -> Response:
        m = await asyncio.get_running_loop().run_in_executor(None, self.runner.metrics)
        return PlainTextResponse(prometheus(m), media_type="text/plain; version=0.0.4")

    # -- one generation ----------------------------------------------------------------------
    def _params(self, http: HTTPRequest, body: dict, *, chat: bool) -> oai.Params:
        oai.check_fields(body, chat=chat)
        model = body.get("model")
        if model is None:
            raise APIError(400, "model is required: the id from GET /v1/models", param="model")
        if model != self.model_name:
            raise APIError(404, f"model {oai.show(model)} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        header = next((v for k, v in http.scope["headers"] if k.lower() == b"x-session-id"), None)
        limit = self.runner.engine.shapes.max_position_embeddings or 1 << 20
        return oai.parse(body, chat=chat, max_tokens_limit=limit, session_header=header)

    def _template(self, messages: list[dict]) -> list[int]:
        """The chat template's token ids (run off the event loop: a long history takes a while)."""
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template that refuses these messages (roles out of order...)
            raise APIError(400, f"the chat template refused these messages: {_template_error(e)}",
                           param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer tokenizers return an encoding
            ids = ids["input_ids"]
        return list(ids)

    async def _serve(self, http: HTTPRequest, p: oai.Params, ids: list[int], *, chat: bool) -> Response:
        try:
            req = Request(prompt=ids, max_new_tokens=p.max_tokens or self.default_max_tokens,
                          temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                          stop_ids=() if p.ignore_eos else self.stop_ids,
                          cache=p.cache, session=p.session, logprobs=p.logprobs)
        except ValueError as e:
            raise APIError(400, scrub(str(e))) from None
        most = self.runner.engine.max_prompt_tokens
        if most is not None and len(ids) > most:  # OpenAI's code, which clients read to trim a history
            raise APIError(400, f"the prompt is {len(ids)} tokens, more than this server's maximum of {most} "
                                "(--max-prompt-tokens)", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if not self.runner.alive:
            raise APIError(503, _NOT_RUNNING,
                           type_="server_error")
        loop = asyncio.get_running_loop()
        try:  # off the event loop: submit takes the engine's lock (held for a whole step) and sizes the cache
            rid, queue = await loop.run_in_executor(None, self.runner.submit, req, loop)
        except Refusal as e:
            raise _counted(_refusal(e, p, chat)) from None
        except RuntimeError:  # ShuttingDown: draining, stopped, or the engine thread is gone
            why = "the engine is not running (see the server log)" if self.runner.failure else "the server is shutting down"
            raise APIError(503, why, type_="server_error") from None
        kind = "chatcmpl" if chat else "cmpl"
        reply = Reply(f"{kind}-{uuid.uuid4().hex[:24]}", self.model_name, chat, len(ids), self.token_text)
        turn = ReplyText(StreamDecoder(self.tok, ids), StopText(p.stop), p.logprobs is not None)
        if p.stream:
            return StreamingResponse(
                self._sse(rid, queue, reply, turn, p.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._whole(http, rid, queue, reply, turn)

    async def _sse(self, rid, queue, reply: Reply, turn: ReplyText, include_usage: bool):
        finished = False
        try:
            yield _sse(reply.chunk(role=True))
            while True:
                item = await queue.get()
                done = isinstance(item, Done)
                ev = item.event if done else item
                text = turn.feed(ev)
                if turn.stops.stopped or done:
                    finished = True
                    failed = done and not turn.stops.stopped and ev.finish_reason in ("error", "cancelled")
                    text += turn.finish()
                    if text or turn.pending:
                        yield _sse(reply.chunk(text=text, logprobs=turn.take_logprobs()))
                    if failed:
                        yield _sse(_error_event(ev))
                        yield "data: [DONE]\n\n"
                        return
                    if not done:  # a stop string: end the request in the engine, a normal stop for the client
                        self._cancel(rid, "stop")
                    yield _sse(reply.chunk(finish=turn.finish_reason(ev)))
                    if include_usage:
                        result = item.result if done else await _final(queue)
                        yield _sse(reply.usage_chunk(turn.tokens, _cached(result)))
                    yield "data: [DONE]\n\n"
                    return
                if text:  # with the logprobs of the tokens it holds (a held-back token's wait for its text)
                    yield _sse(reply.chunk(text=text, logprobs=turn.take_logprobs()))
        except Exception as e:  # a bug mid-stream: the status is sent already, so an error event
            finished = True
            self._cancel(rid)
            yield _sse(internal_error(e, "a stream").body())
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream: free its cache now
                self._cancel(rid)

    def _cancel(self, rid: str, reason: str = "cancelled") -> None:
        """Cancel in the engine without blocking the event loop (cancel waits for the engine's lock)."""
        asyncio.get_running_loop().run_in_executor(None, self.runner.cancel, rid, reason)

    async def _whole(self, http, rid, queue, reply: Reply, turn: ReplyText) -> Response:
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
                parts.append(turn.feed(ev))
                if turn.stops.stopped:
                    if isinstance(item, Done):
                        result = item.result
                    else:  # a stop string: end the request in the engine, a normal stop for the client
                        self._cancel(rid, "stop")
                        result = await _final(queue)
                    break
                if isinstance(item, Done):
                    result = item.result
                    if ev.finish_reason in ("error", "cancelled"):
                        # ended by the shutdown (503: try again elsewhere or later), or by its own failure (500)
                        status = 503 if ev.finish_reason == "cancelled" or not self.runner.alive else 500
                        message = scrub(ev.error or (_ENDED if status == 503 else "generation failed"))
                        raise _counted(APIError(status, message, type_="server_error"))
                    parts.append(turn.finish())
                    break
        except asyncio.CancelledError:
            self._cancel(rid)
            raise
        finally:
            watcher.cancel()
        body = reply.whole("".join(parts), turn.finish_reason(ev), turn.tokens, _cached(result), turn.take_logprobs())
        return JSONResponse(body)


def _refusal(e: Refusal, p: oai.Params, chat: bool) -> APIError:
    """The engine's typed refusal (nothing was queued) as an HTTP refusal, by its kind."""
    msg, prompt = scrub(str(e)), ("messages" if chat else "prompt")
    if e.kind == "queue":
        retry = max(1, int(getattr(e, "retry_after", 1)))
        return APIError(429, msg, type_="requests", code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
    if e.kind == "budget":
        return APIError(413, msg, param="max_tokens", code="request_too_large")
    if e.kind == "context":
        return APIError(400, msg, param=prompt, code="context_length_exceeded")
    if e.kind == "settings":
        return APIError(400, msg, param="kvslim_cache" if p.cache is not None else None)
    return APIError(400, msg, param=prompt)


async def read_json(http: HTTPRequest, limit: int) -> dict:
    """The request body as a JSON object, read at most ``limit`` bytes far: a declared length past it is
    refused before reading, and a chunked body (no declared length) is counted as it arrives (413)."""
    size = http.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"request body of {size} bytes is larger than {limit}", code="request_too_large")
    chunks, n = [], 0
    try:
        async for chunk in http.stream():
            n += len(chunk)
            if n > limit:
                raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body was read: nobody to answer, nothing to log as a failure
        raise APIError(400, "the client disconnected while sending the request body") from None
    raw = b"".join(chunks)
    if len(raw) > _BIG_JSON:
        body = await asyncio.get_running_loop().run_in_executor(None, _parse_json, raw)
    else:
        body = _parse_json(raw)
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _parse_json(raw: bytes):
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, NaN, an integer of too many digits
        raise APIError(400, f"the request body is not valid JSON ({str(e)[:200]})", code="invalid_json") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


async def _disconnected(http: HTTPRequest) -> None:
    """Return when the client of ``http`` (whose body was read) disconnects."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _final(queue: asyncio.Queue):
    """After a stop string cancelled the request: its Result, from the final event (None if it is late)."""

    async def done():
        while True:
            item = await queue.get()
            if isinstance(item, Done):
                return item.result

    try:
        return await asyncio.wait_for(done(), _STOP_WAIT)
    except asyncio.TimeoutError:
        log.warning("no final event %.0f s after a stop string's cancel", _STOP_WAIT)
        return None


def _cached(result) -> int:
    return result.cached_tokens if result is not None else 0


def _template_error(e: Exception) -> str:
    """A template's own refusal (jinja's raise_exception) is shown; anything else may carry paths."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # pragma: no cover - transformers needs jinja2 for templates
        TemplateError = ()  # noqa: N806
    if isinstance(e, TemplateError) and not isinstance(e, OSError):
        return scrub(str(e))[:300]
    log.warning("chat template failed: %r", e)
    return f"{type(e).__name__} (see the server log)"


def _error_event(ev) -> dict:
    message = scrub(ev.error or (_ENDED if ev.finish_reason == "cancelled" else "generation failed"))
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def _counted(e: APIError) -> APIError:
    e.counted = True
    return e


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
