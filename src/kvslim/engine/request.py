"""What a client asks the batch engine for, and what it gets back. Pure data: no tensors, no model.

A :class:`Request` is validated on construction (one ValueError naming the field); what depends on the
model (vocabulary, context length, whether its KV fits the cache settings) is checked by the engine when
the request is submitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..checks import check_int
from ..config import CacheConfig, parse_spec

#: the most alternatives a request may ask for each token (OpenAI's top_logprobs maximum)
MAX_LOGPROBS = 20

#: why a request ended: a stop token, max_new_tokens reached, refused or failed, cancelled by the client
FINISH_REASONS = ("stop", "length", "error", "cancelled")


@dataclass(frozen=True)
class Request:
    """One generation request.

    prompt: the prompt's token ids (at least one). max_new_tokens: tokens to generate at most (>= 1).
    temperature, top_p: sampling (temperature 0: greedy), drawn from a generator seeded with ``seed``
    (None: fresh entropy) — each request has its own, so a seeded request is reproducible whatever shares
    its steps. stop_ids: the request ends after emitting one of these. cache: this request's cache
    settings (a :class:`~kvslim.config.CacheConfig` or a spec such as ``"int4,sink=4,window=1020"``; None:
    the engine's default). request_id: a name for events (None: the engine numbers it). session: a
    conversation's id (None: none): the request continues the session's kept cache when its prompt starts
    with the tokens that cache holds, and leaves its own cache there when it ends
    (:mod:`kvslim.engine.sessions`). logprobs: None (none reported), or 0..20 (:data:`MAX_LOGPROBS`): each
    token's event carries its log-probability and that many most likely alternatives.
    """

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: Sequence[int] = ()
    cache: CacheConfig | str | None = None
    request_id: str | None = None
    session: str | None = None
    logprobs: int | None = None

    def __post_init__(self):
        from ..generate import check_sampling

        prompt = self.prompt
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not len(prompt):
            raise ValueError(f"prompt must be a non-empty sequence of token ids, got {_show(prompt)}")
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"prompt must hold token ids (integers >= 0), got {bad[0]!r} among them")
        object.__setattr__(self, "prompt", tuple(prompt))
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_sampling(self.temperature, self.top_p)
        if self.seed is not None:
            check_int("seed", self.seed, minimum=0, below=2**63, expected="an integer in [0, 2**63) or None")
        stops = self.stop_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Sequence):
            raise ValueError(f"stop_ids must be a sequence of token ids, got {_show(stops)}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_ids must hold token ids (integers >= 0), got {list(stops)!r}")
        object.__setattr__(self, "stop_ids", tuple(stops))
        if isinstance(self.cache, str):
            object.__setattr__(self, "cache", parse_spec(self.cache))
        elif self.cache is not None and not isinstance(self.cache, CacheConfig):
            raise ValueError(f"cache must be a CacheConfig, a spec string or None, got {_show(self.cache)}")
        if self.request_id is not None and not isinstance(self.request_id, str):
            raise ValueError(f"request_id must be a string or None, got {_show(self.request_id)}")
        if self.session is not None and (not isinstance(self.session, str) or not self.session):
            raise ValueError(f"session must be a non-empty string or None, got {_show(self.session)}")
        if self.logprobs is not None:
            check_int(
                "logprobs", self.logprobs, minimum=0, below=MAX_LOGPROBS + 1,
                expected=f"an integer in 0..{MAX_LOGPROBS} or None",
            )


@dataclass(frozen=True)
class Event:
    """What one engine step did for one request.

    token: the new token id (None on a final event that carries no token: a refusal, a failure, a
    cancellation). index: 0-based index of ``token`` among the request's generated tokens. finished: the
    request is over; finish_reason: one of :data:`FINISH_REASONS`; error: the reason, for ``error``.
    logprob, top_logprobs: for a request with ``logprobs`` set, ``token``'s log-probability and the
    ``logprobs`` most likely ``(token id, log-probability)`` pairs, most likely first — log-softmax of the
    model's raw logits (before temperature and top_p, as OpenAI reports them), float32; None otherwise.
    """

    request_id: str
    token: int | None
    index: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class Result:
    """A finished request: its tokens, why it ended, and what its cache held at most."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a kept session already held (not prefilled)
    cache_bytes: int = 0  # the most bytes the request's cache held
    reserved_bytes: int = 0  # what admission reserved for it


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
