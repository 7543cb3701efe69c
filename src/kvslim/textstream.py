"""Incremental detokenization for streaming output: token ids in, printable text pieces out.

This module knows nothing about models or caches (:mod:`kvslim.generate` produces the ids); only the
tokenizer's ``decode``.
"""

from __future__ import annotations

from collections.abc import Sequence


class StreamDecoder:
    """Incremental detokenization: feed token ids, get the new text.

    Decoding tokens one at a time breaks multi-byte characters (a UTF-8 character split over
    byte-level BPE tokens) and word pieces (sentencepiece's leading-space marker). So each step
    decodes a short window — a few already-printed tokens for context plus the unprinted ones —
    and emits what the window's text gained, holding back while it ends in an incomplete
    character (U+FFFD). The window stays a few tokens long however long the stream runs (the
    offsets scheme of vLLM's and TGI's detokenizers).
    """

    REPLACEMENT = "\ufffd"

    def __init__(
        self, tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True, context: int = 5
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = [int(i) for i in list(prompt_ids)[-context:]]
        self._prefix = 0  # window start: context tokens already printed
        self._read = len(self._ids)  # tokens before this are printed

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token id; return the text it completes ('' while a character is incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith(self.REPLACEMENT):
            return ""
        piece = text[len(prefix_text) :]
        # Printed: slide the window, keeping the last printed tokens as context.
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 0:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return piece

    def flush(self) -> str:
        """Text still held back at the end of the stream (an incomplete character prints as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :] if len(text) > len(prefix_text) else ""
