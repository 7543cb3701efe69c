"""The CLI's error contract, importable without torch: a user's mistake is one stderr line, exit 2."""

from __future__ import annotations

import sys


class UserError(Exception):
    """A user's mistake: printed as one line on stderr, exit code 2, no traceback."""


def fail(message: str, code: int = 2) -> int:
    print(f"kvslim: error: {message}", file=sys.stderr)
    return code
