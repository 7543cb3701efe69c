"""``kvslim``: one console script, lazy subcommands. Parsing and printing only.

Each subcommand lives in its own module under :mod:`kvslim.cli`, listed in :data:`SUBCOMMANDS`,
exposing ``configure(parser)`` (adds its flags to the ``ArgumentParser`` that :func:`main` builds for
it) and ``run(args) -> int`` (the exit code). The module is imported only when its subcommand runs,
so ``kvslim --help`` starts fast: the top-level parser holds placeholders named from
:data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UserError, fail

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
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = _Parser(prog=f"kvslim {name}", description=SUBCOMMANDS[name][1])
    module.configure(parser)
    try:
        args = parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    except UserError as e:
        return fail(str(e))
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        # Validation in the library raises ValueError with a message naming what was wrong.
        return fail(str(e))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
