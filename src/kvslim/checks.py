"""Argument validation shared by the library: one integer check, one message shape.

It knows nothing about kvslim's objects and imports nothing from it, so every module (formats,
kernels, config, the tools) can use it without an import cycle.
"""

from __future__ import annotations


def check_int(
    name: str,
    value,
    *,
    minimum: int,
    below: int | None = None,
    hint: str = "",
    expected: str | None = None,
) -> int:
    """Return ``value`` if it is an ``int`` (a ``bool`` is not) with ``minimum <= value`` and, when
    ``below`` is given, ``value < below``; else raise ValueError naming ``name``, the legal range
    and the value.

    Messages: a non-integer gives ``"{name} must be an integer >= {minimum}, {hint}, got {value!r}"``,
    one too small ``"{name} must be >= {minimum} {hint}, got {value}"``; with ``below`` both give
    ``"{name} must be an integer in [{minimum}, {below}), got {value!r}"``. ``expected`` words the
    legal values instead (both cases: ``"{name} must be {expected}, {hint}, got {value!r}"``), e.g.
    ``expected="a positive integer"``.
    """
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and minimum <= value and (below is None or value < below):
        return value
    if expected is None and below is not None:
        expected = f"an integer in [{minimum}, {below})"
    if expected is not None:
        raise ValueError(f"{name} must be {expected}{', ' + hint if hint else ''}, got {value!r}")
    if not is_int:
        raise ValueError(
            f"{name} must be an integer >= {minimum}{', ' + hint if hint else ''}, got {value!r}"
        )
    raise ValueError(f"{name} must be >= {minimum}{' ' + hint if hint else ''}, got {value}")
