"""``kvslim eval``: the quality cost of cache modes, side by side with the reference, in one run.

Subcommands ``ppl``, ``greedy``, ``long``, ``memory`` and ``passkey``. Parsing and printing only; the work
is :mod:`kvslim.evaluate` (``compare_perplexity``, ``greedy_prefix_match``, ``long_generation``,
``memory_table``, ``passkey``). Every ``--config SPEC`` is one mode (``FORMAT[,key=value...]``, see
:func:`kvslim.config.parse_spec`); the reference ``none`` is always run and reported first. Every table
has a ``bits/elem`` column: the bits per stored K/V element of each mode's cache, metadata included
(:class:`kvslim.evaluate.KVBits`), read from the caches the measurement filled (``memory``: by formula).

Under ``torchrun`` the model is loaded tensor parallel (:func:`kvslim.cli.common.load_model_from_args`), every
rank measures alike through caches for its own KV heads, and rank 0 alone prints, shows progress bars and
writes --json and --plot: the numbers are one process's (each rank sees the whole logits).

Three modules: this one declares the flags (:func:`configure`) and dispatches (:func:`run`);
:mod:`kvslim.cli.eval_runs` checks the flags, loads the model and measures, one runner per subcommand;
:mod:`kvslim.cli.eval_tables` prints each report as a table.
"""

from __future__ import annotations

import argparse

from .common import add_any_model_flag, add_model_flags, seed_int, spec_keys_help
from .eval_runs import DEFAULT_CONFIGS, RUNNERS

#: The lengths ``eval memory`` tabulates when no --lengths is given.
DEFAULT_LENGTHS = (1024, 4096, 32768, 131072)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_command", metavar="WHAT", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        add_model_flags(p)
        p.add_argument(
            "--config",
            action="append",
            default=None,
            metavar="SPEC",
            help=f"a cache mode FORMAT[,key=value...] (keys: {spec_keys_help()}); repeatable; the reference 'none' "
            f"is always included (default: {' '.join(DEFAULT_CONFIGS)})",
        )
        p.add_argument(
            "--json", default=None, metavar="FILE", help="also write the results as JSON (NaN as null)"
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        add_any_model_flag(p)
        return p

    p = add("ppl", "teacher-forced perplexity, KL divergence and top-1 agreement through the cache")
    p.add_argument("--text", required=True, metavar="FILE", help="evaluation text (UTF-8)")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens of the text to use (default: 1024, or the whole text if shorter)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="P",
        help="tokens fed in one forward first (default: N // 4)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=1,
        metavar="C",
        help="tokens per forward after the prefill (default 1: decode steps)",
    )
    p.add_argument(
        "--bucket", type=int, default=256, metavar="B", help="tokens per point of the ppl curve (256)"
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot the ppl curves (needs matplotlib)")

    p = add("greedy", "greedy prefix match against the reference's greedy continuation")
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="one prompt per line ('chat:' prefix = chat template; \\n = newline); default: a built-in set",
    )
    p.add_argument("--tokens", type=int, default=64, metavar="N", help="tokens generated per prompt (64)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode every mode with a compiled step on a StaticSlimCache (docs/compile.md); the first "
        "step of each mode compiles",
    )

    p = add(
        "long",
        "free-running greedy generation of N tokens per prompt: first divergence from the reference, "
        "agreement over the run, and each mode's own continuation scored by the reference (KL)",
    )
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="one prompt per line ('chat:' prefix = chat template; \\n = newline); default: a built-in set of 5",
    )
    p.add_argument(
        "--tokens", type=int, default=2048, metavar="N", help="tokens generated per prompt and mode (2048)"
    )
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end each prompt's runs where the reference emits EOS (default: exactly N tokens, EOS included)",
    )
    p.add_argument(
        "--bucket",
        type=int,
        default=256,
        metavar="B",
        help="generated positions per point of the KL curve (256)",
    )

    p = add("memory", "bytes of each mode at each length, for the model's real shapes")
    p.add_argument(
        "--lengths",
        default=",".join(map(str, DEFAULT_LENGTHS)),
        metavar="N,N,...",
        help=f"tokens seen (default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )

    p = add("passkey", "retrieve a 5-digit key hidden in filler text at several depths")
    p.add_argument("--lengths", default="1024", metavar="N,N,...", help="prompt lengths in tokens (1024)")
    p.add_argument(
        "--depths", default="0.1,0.5,0.9", metavar="D,D,...", help="relative key depths (0.1,0.5,0.9)"
    )
    p.add_argument("--trials", type=int, default=3, metavar="K", help="random keys per length and depth (3)")
    p.add_argument("--chunk", type=int, default=64, metavar="C", help="prompt tokens per forward (64)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the keys (0)")


def run(args: argparse.Namespace) -> int:
    return RUNNERS[args.eval_command](args)
