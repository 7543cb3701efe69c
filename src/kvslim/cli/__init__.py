"""``kvslim``: one console script, lazy subcommands. Parsing and printing only.

Each subcommand lives in its own module under :mod:`kvslim.cli`, listed in :data:`SUBCOMMANDS`,
exposing ``configure(parser)`` (adds its flags to the ``ArgumentParser`` that :func:`main` builds for
it) and ``run(args) -> int`` (the exit code). The module is imported only when its subcommand runs,
so ``kvslim --help`` starts fast: the top-level parser holds placeholders named from
:data:`SUBCOMMANDS`.

:func:`main` keeps the error contract of :mod:`kvslim.cli.errors` for everything a run can meet:
a user's mistake, a library's ValueError, any OSError (a full disk, a read-only directory, a
file-size limit), a warning (one ``kvslim: warning:`` line), Ctrl-C at any moment -- imports included
(130) --, SIGTERM (143, after the same clean stop as Ctrl-C), and a reader that closed the pipe of
stdout or stderr (the rest of the output is dropped, exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
import warnings

from . import errors
from .errors import (
    EXIT_SIGINT,
    Terminated,
    UserError,
    fail,
    interrupt_code,
    one_line,
    say,
    silence,
    stderr_lost,
)

# name -> (module, one-line help)
SUBCOMMANDS = {
    "sample": ("kvslim.cli.sample", "stream text from a model through a compressed, bounded KV cache"),
    "calibrate": ("kvslim.cli.calibrate", "compute a K mean-centering bias file (GGUF) from text"),
    "eval": (
        "kvslim.cli.eval",
        "measure the quality cost of cache modes (ppl, KLD, greedy, memory, passkey)",
    ),
    "bench": ("kvslim.cli.bench", "time decode and prefill of cache modes side by side with the peers"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a UserError (one line, exit 2) instead of usage + SystemExit."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvslim",
        description="A bounded, compressed KV cache for transformers models, with the quality cost measured.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"kvslim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_) in SUBCOMMANDS.items():
        # A placeholder parser; the real one is built lazily in main() once the command is known.
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    received: list[int] = []  # signals that arrived during this run
    errors.LOST_FDS.clear()
    try:
        with _signals_as_exceptions(received), _warnings_as_lines():
            code = _main(argv, received)
        # stderr's reader left (`2>&1 | head`): messages (a report, a warning) were lost
        return 2 if code == 0 and stderr_lost() else code
    except KeyboardInterrupt as e:  # also during the imports of a subcommand
        code = interrupt_code(e)
        return fail("interrupted" + (" (SIGTERM)" if code != EXIT_SIGINT else ""), code)
    except BrokenPipeError:
        # The reader of stdout or stderr has gone (`kvslim ... 2>&1 | head -c 10`): nothing more can
        # be shown; drop the rest quietly instead of a traceback at exit.
        silence(sys.stdout)
        silence(sys.stderr)
        return 2


def _main(argv: list[str], received: list[int]) -> int:
    top = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        if argv and not argv[0].startswith("-"):
            return fail(f"unknown command {argv[0]!r}; expected one of: {', '.join(SUBCOMMANDS)}")
        try:
            top.parse_args(argv)  # handles --help / --version
        except UserError as e:
            return fail(str(e))
        top.print_help()
        return 2
    name = argv[0]
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        parser = _Parser(prog=f"kvslim {name}", description=SUBCOMMANDS[name][1])
        module.configure(parser)
        args = parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    except (UserError, ValueError, OSError) as e:
        if received:  # the error is the interrupt's doing (a library swallowed it and failed later)
            raise (Terminated() if received[-1] == signal.SIGTERM else KeyboardInterrupt()) from e
        if isinstance(e, BrokenPipeError):
            raise
        # UserError: the user's mistake; ValueError: the library's validation, naming what was wrong;
        # OSError: a missing or unwritable file, a full disk, a read-only file system, ...
        return fail(_os_error(e) if isinstance(e, OSError) else str(e))


def _os_error(e: OSError) -> str:
    """One line for an OSError: its own message when it has one (kvslim's), else strerror + file."""
    if e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    return one_line(str(e)) or type(e).__name__


@contextlib.contextmanager
def _signals_as_exceptions(received: list[int]):
    """While main() runs (in the main thread; restored after): SIGINT raises KeyboardInterrupt and
    SIGTERM :class:`Terminated`, and both are recorded in ``received`` -- a library that swallows the
    exception (a bare ``except:`` in an import) and fails later is still reported as interrupted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        received.append(signum)
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _warnings_as_lines():
    """Warnings become one ``kvslim: warning: ...`` line each (first occurrence only)."""

    def show(message, category, filename, lineno, file=None, line=None):
        say(f"kvslim: warning: {one_line(str(message)).removeprefix('kvslim: ')}")

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        yield


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
