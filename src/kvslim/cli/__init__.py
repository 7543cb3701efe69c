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

Under ``torchrun`` (``WORLD_SIZE`` > 1; ``sample`` and ``eval`` load the model tensor parallel) every rank
runs the same command and rank 0 alone speaks: the other ranks' stdout and stderr go to /dev/null for the
whole run (their text, banners, warnings, progress bars, and transformers' and gloo's messages would repeat
rank 0's). An error is every rank's alike -- the same arguments, files and model --, or the consequence of
a peer's failure (a collective that lost its peer, torchrun's SIGTERM to the survivors), so rank 0's line
is the one shown; a rank that dies of an unexpected exception prints one line of its own
(``kvslim: error: rank N: ...``), since rank 0 may not share it. The process group is left at the end (after
a barrier when the run succeeded).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import warnings

from .. import threads
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
    "serve": ("kvslim.cli.serve", "an OpenAI-compatible server; conversations kept in bounded, compressed caches"),
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
    rank = _torchrun_rank()
    with _quiet_rank(rank):
        try:
            with _signals_as_exceptions(received), _warnings_as_lines():
                code = _main(argv, received)
            # stderr's reader left (`2>&1 | head`): messages (a report, a warning) were lost
            return 2 if code == 0 and stderr_lost() else code
        except KeyboardInterrupt as e:  # also during the imports of a subcommand
            code = interrupt_code(e)
            why = " (SIGTERM)" if code != EXIT_SIGINT else ""
            if rank is not None and why:  # torchrun stops the survivors of a failed rank this way
                why = " (SIGTERM: torchrun stops every rank when one fails or when it is stopped itself)"
            return fail("interrupted" + why, code)
        except BrokenPipeError:
            # The reader of stdout or stderr has gone (`kvslim ... 2>&1 | head -c 10`): nothing more can
            # be shown; drop the rest quietly instead of a traceback at exit.
            silence(sys.stdout)
            silence(sys.stderr)
            return 2
        except Exception as e:
            # a bug: rank 0 shows the traceback (as one process would); another rank one line of its own
            if not rank:
                raise
            _say_anyway(f"kvslim: error: rank {rank}: {type(e).__name__}: {one_line(str(e))}")
            return 1


def _torchrun_rank() -> int | None:
    """This process's rank when ``torchrun`` started several (``WORLD_SIZE`` > 1), else None. Read from the
    environment: the top-level CLI imports no torch."""
    if _launcher_missing():
        return None  # not started by torchrun: this process speaks (and _main says why it cannot run)
    try:
        if int(os.environ.get("WORLD_SIZE") or 1) > 1:
            return int(os.environ.get("RANK") or 0)
    except ValueError:
        pass  # malformed: kvslim.distributed says so when the run gets there
    return None


def _launcher_missing() -> str | None:
    """Why ``WORLD_SIZE`` > 1 cannot be a torchrun launch (``MASTER_ADDR`` / ``MASTER_PORT`` unset: a
    variable left over in a shell), or None."""
    try:
        if int(os.environ.get("WORLD_SIZE") or 1) <= 1:
            return None
    except ValueError:
        return None
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if not missing:
        return None
    return (
        f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {' and '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not, so this is not a torchrun launch: start it with "
        f"`torchrun --nproc-per-node N kvslim ...`, or unset WORLD_SIZE and RANK for one process"
    )


#: The real stderr of a quiet rank (a duplicate of fd 2 made before it was pointed at /dev/null).
_REAL_STDERR: list[int] = []


@contextlib.contextmanager
def _quiet_rank(rank: int | None):
    """On a rank other than 0, stdout and stderr point at /dev/null while the run lasts: the file descriptors
    (C++ and child output) and ``sys.stdout`` / ``sys.stderr`` (which may write elsewhere, as under pytest's
    capture). Restored afterwards."""
    if not rank:
        yield
        return
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    devnull = os.open(os.devnull, os.O_WRONLY)
    null = open(os.devnull, "w")  # noqa: SIM115 - closed below
    _REAL_STDERR.append(saved[2])
    try:
        for fd in saved:
            os.dup2(devnull, fd)
        sys.stdout = sys.stderr = null
        yield
    finally:
        sys.stdout, sys.stderr = streams
        null.close()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)
        _REAL_STDERR.pop()


def _say_anyway(line: str) -> None:
    """One line on the real stderr, also from a quiet rank."""
    fd = _REAL_STDERR[-1] if _REAL_STDERR else 2
    with contextlib.suppress(OSError):
        os.write(fd, (line + "\n").encode("utf-8", "replace"))


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
    ok = False
    try:
        # the OpenMP thread policy is environment the runtime reads when torch loads: set before the import
        policy = threads.prepare(name, argv[1:])
        module = importlib.import_module(SUBCOMMANDS[name][0])
        parser = _Parser(prog=f"kvslim {name}", description=SUBCOMMANDS[name][1])
        module.configure(parser)
        args = parser.parse_args(argv[1:])
        args.thread_policy = policy
        launcher = _launcher_missing()
        if launcher is not None:
            raise UserError(launcher)
        if sys.stdout is None:  # started with fd 1 closed (`>&-`): Python then has no sys.stdout at all
            raise UserError(f"stdout is closed: kvslim {name} writes its results there; redirect it (> FILE) instead")
        code = int(module.run(args) or 0)
        ok = code == 0
        return code
    except (UserError, ValueError, OSError) as e:
        if received:  # the error is the interrupt's doing (a library swallowed it and failed later)
            raise (Terminated() if received[-1] == signal.SIGTERM else KeyboardInterrupt()) from e
        if isinstance(e, BrokenPipeError):
            raise
        # UserError: the user's mistake; ValueError: the library's validation, naming what was wrong;
        # OSError: a missing or unwritable file, a full disk, a read-only file system, ...
        return fail(_os_error(e) if isinstance(e, OSError) else str(e))
    except RuntimeError as e:
        if not _distributed_error(e):
            raise
        # a collective that failed: a peer died (its own line says why) or the group waited out its timeout
        return fail(
            f"lost the other ranks ({_first_sentence(str(e))}): another rank failed, or they stalled past the "
            "process group's 60 s timeout"
        )
    finally:
        _leave_process_group(ok)


def _distributed_error(e: BaseException) -> bool:
    """Whether ``e`` is a failed collective: torch.distributed's own errors (DistBackendError,
    DistNetworkError, DistStoreError, ...), or gloo's, which arrive as plain RuntimeErrors naming gloo
    ("gloo/transport/tcp/pair.cc:537] Read error ... Connection reset by peer", "Timed out waiting")."""
    dist = sys.modules.get("torch.distributed")
    kind = getattr(dist, "DistError", None) if dist is not None else None
    if kind is not None and isinstance(e, kind):
        return True
    text = str(e).lower()
    return _torchrun_rank() is not None and ("gloo" in text or "nccl" in text)


def _first_sentence(text: str) -> str:
    """gloo's message without its source location and advice: "Read error [127.0.0.1]:34223: Connection
    reset by peer" out of "[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer.
    This is typically caused by ..."."""
    line = one_line(text)
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". ", 1)[0].rstrip(".")


def _leave_process_group(ok: bool) -> None:
    """Leave the process group a tensor-parallel run joined (after a barrier when it succeeded, so that no
    rank tears gloo down while a peer still talks to it). Nothing outside torchrun: a caller's own group, if
    any, is the caller's."""
    if _torchrun_rank() is None or "torch.distributed" not in sys.modules:
        return
    from ..distributed import shutdown

    with contextlib.suppress(RuntimeError):  # the barrier lost a peer after the work was done: nothing to add
        shutdown(wait=ok)


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
