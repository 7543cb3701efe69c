"""OpenAI's request bodies, read strictly: every field is either honoured, or a 400 that names it.

A client that sends ``tools`` and gets an answer has been told the model saw its tools; one that sends
``logit_bias`` has been told it was applied. So a field this server does not honour is refused when it is
set to anything but its neutral value (``tools: []``, ``response_format: {"type": "text"}``, a penalty of
0...), and a field it does not know is refused as OpenAI refuses it ("Unrecognized request argument
supplied"). ``null`` is the same as leaving a field out, for every field. kvslim's own fields
(``session``, ``kvslim_cache``) are read here too, and vLLM's ``ignore_eos`` (the reply does not end at the
model's end-of-sequence token: a benchmark's fixed-length replies, ``kvslim bench --serve``).

Pure parsing: a JSON object in, :class:`Params` and the prompt (messages or text) out. No engine, no
tokenizer; :mod:`kvslim.serve.app` turns the result into an engine request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import CacheConfig, parse_spec
from .errors import APIError

#: OpenAI's limit on ``stop`` strings; each at most this many characters
MAX_STOPS, MAX_STOP_CHARS = 4, 256
#: session ids and cache specs longer than this are refused (the id names a file and a metrics entry)
MAX_SESSION_CHARS, MAX_SPEC_CHARS = 256, 256
#: OpenAI's ranges: chat ``top_logprobs`` 0..20, completions ``logprobs`` 0..5
MAX_CHAT_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5


@dataclass(frozen=True)
class Params:
    """What a generation request asks, validated. max_tokens None: the server's default. logprobs: None for
    none, else how many top alternatives each token's entry lists (0: the sampled token's logprob only)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    logprobs: int | None
    session: str | None
    cache: CacheConfig | None
    ignore_eos: bool = False


# -- which fields exist -------------------------------------------------------------------------

#: fields honoured by both endpoints (kvslim's own included); ``user`` and the other identifiers are
#: labels for the provider's bookkeeping that change no output, accepted and unused
_COMMON = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "stream",
    "stream_options", "stop", "logprobs", "user", "session", "kvslim_cache", "ignore_eos",
})
_CHAT = _COMMON | {"messages", "top_logprobs", "metadata", "safety_identifier", "prompt_cache_key"}
_COMPLETION = _COMMON | {"prompt"}


def _never(value) -> bool:
    return False


#: fields not honoured: name -> (is this value neutral?, what to send instead); set to anything else: a 400
_UNHONOURED = {
    "tools": (lambda v: v == [], "[] or null: tool calling is not supported"),
    "functions": (lambda v: v == [], "[] or null: function calling is not supported"),
    "tool_choice": (lambda v: v == "none", '"none" or null: tool calling is not supported'),
    "function_call": (lambda v: v == "none", '"none" or null: function calling is not supported'),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean or null (there are no tools to call)"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"} or null: structured output is not supported'),
    "logit_bias": (lambda v: v == {}, "{} or null: logit bias is not supported"),
    "presence_penalty": (lambda v: _zero(v), "0 or null: penalties are not supported"),
    "frequency_penalty": (lambda v: _zero(v), "0 or null: penalties are not supported"),
    "modalities": (lambda v: v == ["text"], '["text"] or null: text is the only modality'),
    "store": (lambda v: v is False, "false or null: completions are not stored"),
    "service_tier": (lambda v: v in ("auto", "default"), '"auto", "default" or null: there is one tier'),
    "audio": (_never, "null: audio output is not supported"),
    "prediction": (_never, "null: predicted outputs are not supported"),
    "web_search_options": (_never, "null: web search is not supported"),
    "reasoning_effort": (_never, "null: this model has no reasoning settings"),
    "verbosity": (_never, "null: verbosity is not supported"),
    "moderation": (_never, "null: moderation is not supported"),
    "prompt_cache_options": (_never, "null: use the session field for kept caches"),
    "prompt_cache_retention": (_never, "null: use the session field for kept caches"),
    "best_of": (lambda v: v == 1, "1 or null: one completion per request"),
    "echo": (lambda v: v is False, "false or null: the prompt is not echoed"),
    "suffix": (lambda v: v == "", '"" or null: insertion (a suffix) is not supported'),
}
_CHAT_UNHONOURED = frozenset(_UNHONOURED) - {"best_of", "echo", "suffix"}
_COMPLETION_UNHONOURED = frozenset({"best_of", "echo", "suffix", "logit_bias", "presence_penalty",
                                    "frequency_penalty"})


def _zero(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == 0


def check_fields(body: dict, *, chat: bool) -> None:
    """400 for a field this endpoint does not know, or one it does not honour set to a non-neutral value."""
    known = _CHAT if chat else _COMPLETION
    unhonoured = _CHAT_UNHONOURED if chat else _COMPLETION_UNHONOURED
    for name, value in body.items():
        if value is None or name in known:
            continue
        if name in unhonoured:
            neutral, instead = _UNHONOURED[name]
            if not neutral(value):
                raise APIError(
                    400, f"{name} is not supported by this server, got {show(value)}; send {instead}",
                    param=name, code="unsupported_parameter",
                )
            continue
        raise APIError(400, f"Unrecognized request argument supplied: {show(name, 80)}", param=str(name)[:80])


# -- the fields ---------------------------------------------------------------------------------


def parse(body: dict, *, chat: bool, max_tokens_limit: int, session_header: bytes | None = None) -> Params:
    """The generation fields of ``body``, validated (call :func:`check_fields` first: it refuses the fields
    not honoured). max_tokens_limit: the model's context. session_header: the raw ``X-Session-Id`` header,
    used when the body names no session."""
    _labels(body)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise APIError(400, f"n must be 1 (one choice per request), got {show(n)}", param="n")
    max_tokens = _max_tokens(body, max_tokens_limit)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise APIError(400, "top_p must be in (0, 1], got 0", param="top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise APIError(400, f"seed must be an integer in [0, 2**63), got {show(seed)}", param="seed")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, f"stream must be true or false, got {show(stream)}", param="stream")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise APIError(400, f"ignore_eos must be true or false, got {show(ignore_eos)}", param="ignore_eos")
    return Params(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stream=bool(stream),
        include_usage=_stream_options(body.get("stream_options")),
        stop=_stop(body.get("stop")),
        logprobs=_chat_logprobs(body) if chat else _completion_logprobs(body),
        session=_session(body.get("session"), session_header),
        cache=_cache(body.get("kvslim_cache")),
        ignore_eos=bool(ignore_eos),
    )


#: the labels a client may attach for the provider's bookkeeping (accepted, unused): strings, as OpenAI's API has them
_LABELS = ("user", "safety_identifier", "prompt_cache_key")
#: OpenAI's bounds on ``metadata``: pairs, characters in a key, characters in a value
_METADATA = (16, 64, 512)


def _labels(body: dict) -> None:
    """400 for a label of the wrong type: ``user`` and the other identifiers are strings, ``metadata`` an object of
    at most 16 string values of at most 512 characters under keys of at most 64. They change no output, but a client
    that sends a number there has a bug it should hear of, as OpenAI's API tells it."""
    for name in _LABELS:
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise APIError(400, f"{name} must be a string, got {show(value)}", param=name)
    meta = body.get("metadata")
    if meta is None:
        return
    pairs, key_chars, value_chars = _METADATA
    if not isinstance(meta, dict) or len(meta) > pairs:
        raise APIError(400, f"metadata must be an object of at most {pairs} string values, got {show(meta)}",
                       param="metadata")
    for key, value in meta.items():
        if len(key) > key_chars:
            raise APIError(400, f"metadata keys must be at most {key_chars} characters, got {show(key, 40)}",
                           param="metadata")
        if not isinstance(value, str) or len(value) > value_chars:
            raise APIError(400, f"metadata[{show(key, 40)}] must be a string of at most {value_chars} characters, "
                                f"got {show(value)}", param="metadata")


def _max_tokens(body: dict, limit: int) -> int | None:
    values = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    if len(values) == 2 and values["max_tokens"] != values["max_completion_tokens"]:
        raise APIError(400, f"max_tokens ({show(values['max_tokens'])}) and max_completion_tokens "
                            f"({show(values['max_completion_tokens'])}) disagree: send one", param="max_tokens")
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise APIError(400, f"{name} must be an integer in 1..{limit}, got {show(value)}", param=name)
        return value
    return None


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    # the range first: an int too large for a float makes math.isfinite raise OverflowError
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi
            or not math.isfinite(value)):
        raise APIError(400, f"{name} must be a number in [{lo:g}, {hi:g}], got {show(value)}", param=name)
    return float(value)


def _stream_options(options) -> bool:
    """include_usage; the other option OpenAI knows (include_obfuscation: padding against length side
    channels) is not done, so only false is taken."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise APIError(400, f"stream_options must be an object, got {show(options)}", param="stream_options")
    for key, value in options.items():
        if value is None:
            continue
        if key == "include_usage" and isinstance(value, bool):
            continue
        if key == "include_obfuscation" and value is False:
            continue
        what = ("is not supported (no obfuscation padding is added); send false or null"
                if key == "include_obfuscation" else "is not a stream option this server knows")
        raise APIError(400, f"stream_options.{show(key, 40)} {what}, got {show(value)}", param="stream_options")
    return bool(options.get("include_usage"))


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise APIError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings, got {show(stop)}",
                       param="stop")
    for s in stops:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise APIError(400, f"each stop string must be a string of 1..{MAX_STOP_CHARS} characters, got "
                                f"{show(s)}", param="stop")
        utf8(s, "stop")
    return tuple(dict.fromkeys(stops))


def _chat_logprobs(body: dict) -> int | None:
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise APIError(400, f"logprobs must be true or false, got {show(want)}", param="logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_CHAT_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in 0..{MAX_CHAT_LOGPROBS}, got {show(top)}",
                           param="top_logprobs")
        if not want:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if want else None


def _completion_logprobs(body: dict) -> int | None:
    k = body.get("logprobs")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_COMPLETION_LOGPROBS):
        raise APIError(400, f"logprobs must be an integer in 0..{MAX_COMPLETION_LOGPROBS} or null, got {show(k)}",
                       param="logprobs")
    return k


def _session(session, header: bytes | None) -> str | None:
    if session is None and header is not None:
        try:
            session = header.decode("utf-8")
        except UnicodeDecodeError:
            raise APIError(400, "the X-Session-Id header is not valid UTF-8", param="session") from None
    return None if session is None else parse_session(session)


def parse_session(session) -> str:
    """A session id: 1..256 printable characters of valid UTF-8 (no lone surrogate: the id names a file)."""
    ok = isinstance(session, str) and 1 <= len(session) <= MAX_SESSION_CHARS and session.isprintable()
    if not ok or not _encodes(session):
        raise APIError(400, f"session must be 1..{MAX_SESSION_CHARS} printable characters of valid UTF-8, got "
                            f"{show(session)}", param="session")
    return session


def _cache(spec) -> CacheConfig | None:
    if spec is None:
        return None
    if not isinstance(spec, str) or len(spec) > MAX_SPEC_CHARS or not _encodes(spec):
        raise APIError(400, f"kvslim_cache must be a cache spec string of at most {MAX_SPEC_CHARS} characters, "
                            f"got {show(spec)}", param="kvslim_cache")
    try:
        cfg = parse_spec(spec)
    except ValueError as e:
        raise APIError(400, f"kvslim_cache: {e}", param="kvslim_cache") from None
    if cfg.mean_center is not None:  # a client must not make the server open a file of its choosing
        raise APIError(400, "kvslim_cache cannot name a mean_center file: the server's own flags choose it",
                       param="kvslim_cache")
    return cfg


# -- the prompt ---------------------------------------------------------------------------------

#: message keys passed to the chat template; any other key set on a message is a 400
_MESSAGE_KEYS = frozenset({"role", "content", "name"})


def messages(body: dict) -> list[dict]:
    """``messages`` as plain ``{role, content[, name]}`` dicts for the chat template (text parts joined)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise APIError(400, f"messages[{i}] must be an object with a string role", param="messages")
        for key, value in m.items():
            if key not in _MESSAGE_KEYS and value is not None:
                raise APIError(400, f"messages[{i}].{show(key, 40)} is not supported (text messages only: role, "
                                    "content, name)", param="messages", code="unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        msg = {"role": utf8(m["role"], "messages"), "content": utf8(content, "messages")}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise APIError(400, f"messages[{i}].name must be a string", param="messages")
            msg["name"] = utf8(m["name"], "messages")
        out.append(msg)
    return out


def prompt(body: dict) -> str | list[int]:
    """``prompt``: a non-empty string or a list of token ids, alone or as the one element of a list."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list
    if isinstance(p, str) and p:
        return utf8(p, "prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                   param="prompt")


def utf8(text: str, param: str) -> str:
    """``text`` unless it holds a lone surrogate (JSON's ``"\\ud800"``), which no tokenizer or file name takes."""
    if not _encodes(text):
        raise APIError(400, f"{param} holds a lone surrogate (e.g. \\ud800): not valid Unicode text", param=param)
    return text


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def show(value, width: int = 60) -> str:
    """A short repr for a message (a huge value must not make a huge error body)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
