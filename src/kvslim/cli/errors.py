"""The CLI's error contract, importable without torch: a user's mistake is one stderr line, exit 2.

Exit codes: 0 success, 2 a one-line ``kvslim: error: ...`` (bad flag or file, a model or output
that cannot be used, a failed write), 130 Ctrl-C (SIGINT), 143 SIGTERM. ``kvslim sample`` prints its
report on 130 and 143 too.
"""

from __future__ import annotations

import errno
import os
import sys

#: Exit codes of a run stopped by a signal: 128 + the signal number, as a shell reports them.
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class UserError(Exception):
    """A user's mistake: printed as one line on stderr, exit code 2, no traceback."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is (the handler :func:`kvslim.cli.main` installs). A
    KeyboardInterrupt, so every ``except KeyboardInterrupt`` that stops cleanly on Ctrl-C also
    stops cleanly on SIGTERM; :func:`interrupt_code` tells them apart."""


def interrupt_code(e: BaseException) -> int:
    """The exit code for a KeyboardInterrupt: 143 for SIGTERM, 130 for Ctrl-C."""
    return EXIT_SIGTERM if isinstance(e, Terminated) else EXIT_SIGINT


def say(message: str) -> bool:
    """Print on stderr; whether it got there. If the reader of stderr has gone (a closed pipe), say
    nothing and point stderr at /dev/null so that nothing later (the interpreter's exit) fails on it."""
    try:
        print(message, file=sys.stderr, flush=True)
        return True
    except (BrokenPipeError, ValueError):  # ValueError: stderr already closed
        silence(sys.stderr)
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.EBADF):
            raise
        silence(sys.stderr)
    return False


#: File descriptors whose reader left during this run (:func:`silence`); :func:`kvslim.cli.main`
#: clears it when a run starts and turns a lost stderr into exit code 2.
LOST_FDS: set[int] = set()


def silence(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null (after its reader left), and remember that."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        LOST_FDS.add(-1)
        return
    LOST_FDS.add(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def stderr_lost() -> bool:
    """Whether stderr's reader left during this run (so messages were lost)."""
    return 2 in LOST_FDS or -1 in LOST_FDS


def one_line(text: str) -> str:
    """The first non-empty line of ``text`` (messages from libraries can span several)."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def fail(message: str, code: int = 2) -> int:
    say(f"kvslim: error: {one_line(message) or 'failed'}")
    return code
