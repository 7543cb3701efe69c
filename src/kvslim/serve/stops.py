"""OpenAI's ``stop`` strings, matched in the decoded text as it streams.

A stop string can span tokens (``"\\n\\nUser:"`` arrives as several), so matching works on text, not
token ids. :class:`StopText` sits between the detokenizer and the client: it passes text through, but
holds back any tail that could be the start of a stop string, until the next text shows whether it is.
The reply ends where a stop string is first completed (of two overlapping ones, the one that ends first):
the text before it is released and the rest (the stop string itself and whatever followed it in the same
piece) is never sent: OpenAI's rule, ``finish_reason: "stop"``, the stop text not included. The result does
not depend on how the text was split into tokens.

:class:`ReplyText` puts a reply together: the detokenizer, the stop strings, the logprob entries.
Knows no tokenizer and no engine: token ids and text in, text out.
"""

from __future__ import annotations

from .shapes import TokenLogprob


class StopText:
    """Stop-string matching over streamed text. stops: the strings (none: a pass-through)."""

    def __init__(self, stops: tuple[str, ...] = ()):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self.stops = tuple(stops)
        self._held = ""  # text received but not released: a possible start of a stop string
        self.stopped = False  # a stop string was found; nothing more is released

    def push(self, text: str) -> str:
        """Add ``text``; return what may be sent now (the text before a stop string, once one completes)."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # The reply ends where a stop string is first completed (generation halts there), whatever the token
        # boundaries: everything before _held held no complete stop string, so the match that ends first in
        # buf ends first in the whole text (ties: the longer one, which starts first).
        ends = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if ends:
            self.stopped, self._held = True, ""
            return buf[: min(ends)[1]]
        keep = max((_overlap(buf, s) for s in self.stops), default=0)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The stream ended without a stop string: release what was held back."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


def _overlap(text: str, stop: str) -> int:
    """The length of the longest proper prefix of ``stop`` that ``text`` ends with (0: none)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


class ReplyText:
    """One reply's text as it is generated: token ids through the detokenizer (``decoder``, a
    :class:`kvslim.textstream.StreamDecoder`), cut at a stop string (``stops``), with each token's logprob
    entry when asked (``logprobs``: events carry ``logprob`` / ``top_logprobs``)."""

    def __init__(self, decoder, stops: StopText, logprobs: bool):
        self.decoder, self.stops = decoder, stops
        self.tokens = 0  # tokens of the reply (up to the one that completed a stop string)
        self.decoded = 0  # characters decoded so far: the next token's text_offset
        self.pending: list[TokenLogprob] | None = [] if logprobs else None

    def feed(self, ev) -> str:
        """The text ``ev`` lets us send (held back while it may be the start of a stop string)."""
        if ev.token is None or self.stops.stopped:
            return ""
        self.tokens += 1
        if self.pending is not None and ev.logprob is not None:
            top = tuple((int(t), float(lp)) for t, lp in (ev.top_logprobs or ()))
            self.pending.append(TokenLogprob(int(ev.token), float(ev.logprob), top, self.decoded))
        piece = self.decoder.push(ev.token)
        self.decoded += len(piece)
        return self.stops.push(piece)

    def finish(self) -> str:
        """The text still held back when the reply ends."""
        return self.stops.push(self.decoder.flush()) + self.stops.flush()

    def take_logprobs(self) -> list[TokenLogprob] | None:
        out = self.pending
        if self.pending is not None:
            self.pending = []
        return out

    def finish_reason(self, ev) -> str:
        """OpenAI's finish_reason: "stop" for a stop string or token, "length" for max_tokens."""
        return "stop" if self.stops.stopped or ev.finish_reason != "length" else "length"
