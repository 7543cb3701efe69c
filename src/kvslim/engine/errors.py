"""Why the engine will not take a request, as types a caller can act on without reading the message.

:class:`Refusal` (a ValueError, so ``except ValueError`` still catches every one) is raised by
:meth:`kvslim.engine.Engine.submit` before anything is queued; its ``kind`` says which limit was hit, so the
HTTP layer maps a refusal to a status by type (input and settings 400, context 400, budget 413, queue 429
with ``Retry-After``), never by matching message text. :class:`ShuttingDown` (a RuntimeError) is the
runner's answer once it stops admitting. :class:`RequestLimits` bounds what a request may ask of its own
cache: every number a client sends has a maximum, checked before anything is allocated.

:func:`describe` words an exception for a client: one line, no server paths.

This module knows no tensors and no HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..checks import check_int
from ..config import DEFAULT_GROUP_SIZE, CacheConfig


class Refusal(ValueError):
    """The engine will not take this request; nothing was queued. ``kind`` names the limit it hit."""

    kind = "refused"


class InputRefusal(Refusal):
    """Bad input: a token id outside the vocabulary, a prompt past ``max_prompt_tokens``, an id in use."""

    kind = "input"


class SettingsRefusal(Refusal):
    """Cache settings this model or this server will not take (a format the head_dim cannot hold, a value
    past :class:`RequestLimits`)."""

    kind = "settings"


class ContextRefusal(Refusal):
    """The prompt plus ``max_new_tokens`` run past the model's context, and the cache keeps no bounded
    position ids (no window)."""

    kind = "context"


class BudgetRefusal(Refusal):
    """The request's cache could outgrow the whole memory budget even alone (waiting would never help)."""

    kind = "budget"


class QueueFull(Refusal):
    """``max_queue`` requests are already waiting. retry_after: whole seconds (>= 1) after which a retry
    may find room, estimated from recent step times (the HTTP ``Retry-After`` header)."""

    kind = "queue"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class ShuttingDown(RuntimeError):
    """The runner is draining or stopped (or its engine thread is gone): no new request is taken."""


@dataclass(frozen=True)
class RequestLimits:
    """The largest cache settings a request may ask for in its own ``cache`` (never applied to the engine's
    default, which the operator chose). A group or a residual is held at full precision and allocated whole,
    a window is allocated at its capacity up front, sinks are kept forever: unbounded, one request could
    make the server allocate gigabytes for a one-token answer.

    max_group: tokens per quantization group; max_residual: full-precision recent tokens; max_window: the
    StreamingLLM window (None: the model's context); max_sink: attention-sink tokens. A group larger than the
    default (32) must also fit in the window when there is one (the default group with a shorter window
    costs at most 32 tokens; the CLI shrinks it, the engine takes it as given).
    """

    max_group: int = 1024
    max_residual: int = 4096
    max_window: int | None = None
    max_sink: int = 1024

    def __post_init__(self):
        check_int("max_group", self.max_group, minimum=1)
        check_int("max_residual", self.max_residual, minimum=0)
        if self.max_window is not None:
            check_int("max_window", self.max_window, minimum=1, hint="or None for the model's context")
        check_int("max_sink", self.max_sink, minimum=0)

    def check(self, cfg: CacheConfig, *, context: int | None) -> None:
        """Raise :class:`SettingsRefusal` naming the first setting of ``cfg`` past its maximum. context: the
        model's context length, the window's maximum when ``max_window`` is None (None: unknown)."""
        max_window = self.max_window if self.max_window is not None else context
        checks = [
            ("group", cfg.group_size, self.max_group),
            ("residual", cfg.residual_tokens, self.max_residual),
            ("sink", cfg.sink_tokens, self.max_sink),
        ]
        auto = {"sink": cfg.sink == "auto", "residual": cfg.residual == "auto"}
        if cfg.window is not None and max_window is not None:
            checks.append(("window", cfg.window, max_window))
        if cfg.v_group_size is not None:
            checks.append(("v_group", cfg.v_group_size, self.max_group))
        for key, value, most in checks:
            if value > most:
                why = f" ({key}=auto's default; ask {key}={most} or less)" if auto.get(key) else ""
                raise SettingsRefusal(f"cache setting {key}={value}{why} is past this server's maximum of {most}")
        if cfg.window is not None and cfg.group_size > max(cfg.window, DEFAULT_GROUP_SIZE):
            raise SettingsRefusal(
                f"cache setting group={cfg.group_size} is larger than window={cfg.window}: a group must fit in "
                f"the window (use group <= {cfg.window})"
            )


#: an absolute file path inside an error message (elided: a client never learns the server's layout)
_PATH = re.compile(r"(?<![\w.])(?:[A-Za-z]:)?[/\\](?:[\w.~-]+[/\\])+[\w.~-]*")


def describe(exc: BaseException) -> str:
    """One line naming what went wrong, for a client: a ValueError's message (kvslim's refusals say what and
    why), an OSError's reason (never its file name), else the exception's type and message; absolute paths
    are elided and the line is cut at 300 characters."""
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{type(exc).__name__}: {exc.strerror}"
    elif isinstance(exc, ValueError) and str(exc):
        text = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = _PATH.sub("<path>", " ".join(text.split()))
    return text if len(text) <= 300 else text[:297] + "..."
