"""OpenAI's response objects: chat and text completions, whole or as stream chunks, with usage and logprobs.

Logprobs come from the engine as token ids and floats (:class:`kvslim.engine.Event`'s ``logprob`` and
``top_logprobs``); here they become OpenAI's two shapes:

- chat: ``choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}], "refusal": null}``;
- completions: ``choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}],
  "text_offset"}``; ``text_offset`` counts characters from the start of the completion's text, and each
  ``top_logprobs`` dict holds the sampled token as well as the alternatives (OpenAI's legacy rule).

A token's text is its own decoding, which for a piece of a multi-byte character is U+FFFD; ``bytes`` are
then its real bytes when the tokenizer is byte-level BPE (GPT-2's byte alphabet), as OpenAI gives them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

#: what a logprob too small for JSON (-inf) is reported as, as OpenAI does
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob entry. offset: characters of the completion's text before it."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    offset: int


class TokenText:
    """A token id's text and bytes for logprob entries, cached per id (at most the vocabulary)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = "ByteLevel" in type(getattr(backend, "decoder", None)).__name__
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tok.decode([token], skip_special_tokens=False)
            raw = list(text.encode("utf-8"))
            if "\ufffd" in text and self._byte_level and token not in self._special:
                piece = self.tok.convert_ids_to_tokens(token)
                table = _unicode_to_byte()
                if isinstance(piece, str) and all(c in table for c in piece):
                    raw = [table[c] for c in piece]
            hit = self._cache[token] = (text, raw)
        return hit


def _lp(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


class Reply:
    """OpenAI's response objects for one request (chat or text completion)."""

    def __init__(self, rid: str, model: str, chat: bool, prompt_tokens: int, token_text: TokenText | None = None):
        self.id, self.model, self.chat, self.prompt_tokens = rid, model, chat, prompt_tokens
        self.token_text = token_text
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """The ``logprobs`` object for ``entries`` (None: the request asked for none)."""
        if entries is None or self.token_text is None:
            return None
        tt = self.token_text
        if self.chat:
            content = []
            for e in entries:
                text, raw = tt(e.token)
                top = [{"token": tt(t)[0], "logprob": _lp(lp), "bytes": tt(t)[1]} for t, lp in e.top]
                content.append({"token": text, "logprob": _lp(e.logprob), "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        tops = []
        for e in entries:
            top = {tt(t)[0]: _lp(lp) for t, lp in e.top}
            top.setdefault(tt(e.token)[0], _lp(e.logprob))
            tops.append(top)
        return {
            "tokens": [tt(e.token)[0] for e in entries],
            "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": tops,
            "text_offset": [e.offset for e in entries],
        }

    def chunk(self, *, text: str = "", role: bool = False, finish: str | None = None,
              logprobs: list[TokenLogprob] | None = None) -> dict:
        lp = self.logprobs(logprobs) if logprobs else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def usage(self, completion_tokens: int, cached_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def usage_chunk(self, completion_tokens: int, cached_tokens: int) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage(completion_tokens, cached_tokens)}

    def whole(self, text: str, finish: str, completion_tokens: int, cached_tokens: int,
              logprobs: list[TokenLogprob] | None = None) -> dict:
        lp = self.logprobs(logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**self._head(False), "choices": [choice], "usage": self.usage(completion_tokens, cached_tokens)}


_TABLE: dict[str, int] = {}


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character standing for each byte -> the byte
    (``bytes_to_unicode`` of openai/gpt-2's encoder.py)."""
    if not _TABLE:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _TABLE.update({chr(c): b for b, c in zip(bs, cs)})
    return _TABLE
