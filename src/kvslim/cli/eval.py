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
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from .common import (
    UserError,
    add_any_model_flag,
    add_model_flags,
    bias_cache_maker,
    check_bias_file,
    check_input_file,
    check_model_args,
    check_output,
    format_table,
    is_main_rank,
    load_model_from_args,
    read_text_file,
    seed_int,
    spec_keys_help,
    write_json,
)
from .errors import say

#: The modes measured when no --config is given.
DEFAULT_CONFIGS = ("fp8", "int8", "int4", "int2", "q8_0", "q4_0", "q4_1")
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
    commands = {"ppl": _ppl, "greedy": _greedy, "long": _long, "memory": _memory, "passkey": _passkey}
    return commands[args.eval_command](args)


# --------------------------------------------------------------------------------------------
def _specs(args) -> list[str]:
    """The --config specs, validated now (before a model loads): ValueError names a bad one, a
    bias file (mean_center=) that is missing or malformed, or a bad --model / --device."""
    from ..evaluate import resolve_modes

    specs = list(args.config or DEFAULT_CONFIGS)
    for mode in resolve_modes(specs):
        check_bias_file(f"--config {mode.label}: mean_center", mode.config.mean_center)
    check_model_args(args)
    return specs


def _int_list(flag: str, text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise UserError(f"{flag} must be comma-separated integers >= {minimum}, got {text!r}")
    return values


def _float_list(flag: str, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated numbers in [0, 1], got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise UserError(f"{flag} must be comma-separated numbers in [0, 1], got {text!r}")
    return values


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"{flag} must be a positive integer, got {value}")


def _check_out(flag: str, path: str | None) -> None:
    check_output(flag, path)
    if flag == "--plot" and path is not None and not path.lower().endswith(".png"):
        raise UserError(f"--plot {path}: the plot is written as PNG; name a .png file")


def _warn_beyond_context(n: int, specs: list[str], model) -> None:
    """Perplexity past the model's trained context measures the model there, not the cache (a warning: a
    long stream's dense baseline is sometimes the point, docs/streaming.md)."""
    from ..evaluate import resolve_modes
    from ..shapes import ModelShapes

    context = ModelShapes.from_config(model.config).max_position_embeddings
    if not context or n <= context:
        return
    unbounded = [m.label for m in resolve_modes(specs)[1:] if m.config.window is None]  # [0]: the reference
    say(
        f"kvslim: warning: --tokens {n} runs past the model's context of {context} positions in the "
        f"uncompressed reference{' and ' + ', '.join(unbounded) if unbounded else ''} (no "
        f"--config window); the scores there measure the model beyond its training, not the cache"
    )


def _read_text(path: str) -> str:
    return read_text_file("--text", path)


def _load(args):
    return load_model_from_args(args, kvslim_attention=True)  # decode on the codes, as users run it


def _model_name(args) -> str:
    return args.model or "SmolLM2-135M-Instruct (embedded)"


def _progress(args) -> bool:
    return not args.no_progress and sys.stderr.isatty() and is_main_rank()


def _bits_note(results) -> None:
    """Say on stderr what the bits/elem column counts and at which length it was read."""
    seen = sorted({r.bits.tokens_seen for r in results if r.bits is not None})
    if not seen:
        return
    at = (
        f"after {seen[0]} tokens seen"
        if len(seen) == 1
        else "after each mode's longest run (bits.tokens_seen in --json)"
    )
    print(
        "bits/elem: bytes of every stored K/V tensor (codes, scales, zeros, full-precision residual and sinks, "
        f"bias; every layer) x 8 / stored K/V elements, read from each mode's real cache {at}",
        file=sys.stderr,
    )


def _note_unquantized(specs: list[str], longest: int) -> None:
    """A mode whose full-precision residual holds every token measured nothing of its format: say so."""
    from ..evaluate import resolve_modes

    for m in resolve_modes(specs)[1:]:
        c = m.config
        if (
            c.window is None
            and c.residual_tokens >= longest
            and (c.k_format != "none" or c.v_format != "none")
        ):
            print(
                f"note: {m.label}: every prompt + continuation ({longest} tokens at most) fits in the "
                f"full-precision residual of {c.residual_tokens} tokens, so nothing was quantized; use residual=0 "
                "or more --tokens to measure the format",
                file=sys.stderr,
            )


def _out(obj, args) -> None:
    if args.json and is_main_rank():
        write_json(args.json, obj)
        print(f"wrote {args.json}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
def _ppl(args) -> int:
    text = _read_text(args.text)
    for flag, value in (
        ("--tokens", args.tokens),
        ("--prefill", args.prefill),
        ("--chunk", args.chunk),
        ("--bucket", args.bucket),
    ):
        _positive(flag, value)
    if args.tokens is not None and args.tokens < 2:
        raise UserError(
            f"--tokens must be >= 2, got {args.tokens}: perplexity scores each token after the first "
            f"(at least one token is fed first, one scored)"
        )
    _check_out("--json", args.json)
    _check_out("--plot", args.plot)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib: pip install 'kvslim[plot]'")
    specs = _specs(args)

    from ..evaluate import compare_perplexity, plot_ppl_curves

    model, tokenizer = _load(args)
    ids = tokenizer(text, return_tensors="pt").input_ids
    available = ids.shape[1]
    if args.tokens is not None and args.tokens > available:
        raise UserError(f"--tokens {args.tokens} is more than the {available} tokens of {args.text}")
    n = args.tokens if args.tokens is not None else min(1024, available)
    if n < 2:
        raise UserError(f"{args.text} has {available} token(s); perplexity needs at least 2")
    prefill = args.prefill if args.prefill is not None else max(1, n // 4)
    if prefill >= n:
        raise UserError(
            f"--prefill {prefill} must be smaller than --tokens {n} (at least one token is scored)"
        )
    ids = ids[:, :n]
    _warn_beyond_context(n, specs, model)

    print(
        f"{_model_name(args)}: {n} tokens of {args.text}, prefill {prefill}, then {n - 1 - prefill} tokens "
        f"{'one per step' if args.chunk == 1 else f'{args.chunk} per forward'}; scoring {n - prefill} tokens",
        file=sys.stderr,
    )
    report = compare_perplexity(
        model,
        ids,
        specs,
        prefill=prefill,
        chunk=args.chunk,
        progress=_progress(args),
        make_cache=bias_cache_maker(model, args),
    )
    records = report.records(args.bucket)
    rows = [
        [
            r["config"],
            r["bits_per_element"],
            r["ppl"],
            r["ppl_stderr"],
            r["ppl_ratio"],
            r["kld_mean"],
            r["kld_p99"],
            r["kld_max"],
            r["top1"],
        ]
        for r in records
    ]
    print(
        format_table(
            ["config", "bits/elem", "ppl", "±", "ppl ratio", "KLD mean", "KLD p99", "KLD max", "top-1"], rows
        )
    )
    _bits_note(report.results)
    _out(
        {
            "model": _model_name(args),
            "tokens": n,
            "prefill": prefill,
            "chunk": args.chunk,
            "text": args.text,
            "bucket": args.bucket,
            "results": records,
        },
        args,
    )
    if args.plot and is_main_rank():
        from ..atomic import atomic_path

        with atomic_path(args.plot, verify=_check_png, what="--plot") as tmp:
            plot_ppl_curves(
                report, str(tmp), bucket=args.bucket, title=f"{os.path.basename(args.text)}, {n} tokens"
            )
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _check_png(path) -> None:
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            raise ValueError("the plot written is not a PNG file")


def _greedy(args) -> int:
    _positive("--tokens", args.tokens)
    _check_out("--json", args.json)
    check_input_file("--prompts", args.prompts)
    specs = _specs(args)

    from ..evaluate import greedy_prefix_match, load_prompts

    try:
        prompts = load_prompts(args.prompts) if args.prompts else None
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts {args.prompts}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    model, tokenizer = _load(args)
    static_len = compiled = None
    if args.compile:
        from ..compiled import compile_decode, uncompile
        from ..evaluate import BUILTIN_PROMPTS
        from ..evaluate.greedy import encode_prompt

        longest = max(encode_prompt(tokenizer, p).shape[1] for p in (prompts or BUILTIN_PROMPTS))
        static_len = longest + args.tokens  # every prompt and its continuation fit
        compiled = compile_decode(model)
    try:
        report = greedy_prefix_match(
            model,
            tokenizer,
            prompts,
            specs,
            tokens=args.tokens,
            progress=_progress(args),
            make_cache=bias_cache_maker(model, args, static_len=static_len),
        )
    finally:
        if compiled is not None:
            uncompile(model)
    if compiled is not None:
        say(
            f"compiled decode step: {compiled.compiles} graph(s) compiled in {compiled.compile_s:.1f} s, "
            f"{compiled.steps} compiled steps"
        )
    names = [p.name for p in report.results[0].prompts]
    rows = [
        [r.config, r.bits_per_element, r.prefix_match_mean, *(p.prefix_match for p in r.prompts)]
        for r in report.results
    ]
    print(format_table(["config", "bits/elem", "mean", *names], rows, floatfmt=".3f"))
    ref_lens = ", ".join(f"{p.name} {p.reference_tokens}" for p in report.results[0].prompts)
    print(f"reference continuation lengths (tokens): {ref_lens}")
    _bits_note(report.results)
    longest = max(p.prompt_tokens + p.reference_tokens for p in report.results[0].prompts)
    _note_unquantized(specs, longest)
    record = {"model": _model_name(args), "tokens": args.tokens, "results": report.records()}
    if compiled is not None:
        record["compile"] = {
            "graphs": compiled.compiles,
            "compile_s": compiled.compile_s,
            "steps": compiled.steps,
        }
    _out(record, args)
    return 0


def _long(args) -> int:
    _positive("--tokens", args.tokens)
    _positive("--bucket", args.bucket)
    _check_out("--json", args.json)
    check_input_file("--prompts", args.prompts)
    specs = _specs(args)

    from ..evaluate import LONG_PROMPTS, encode_prompt, load_prompts, long_generation

    try:
        prompts = load_prompts(args.prompts) if args.prompts else list(LONG_PROMPTS)
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts {args.prompts}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    model, tokenizer = _load(args)
    prompt_lens = [encode_prompt(tokenizer, p).shape[1] for p in prompts]
    _warn_beyond_context(max(prompt_lens) + args.tokens, specs, model)
    report = long_generation(
        model,
        tokenizer,
        prompts,
        specs,
        tokens=args.tokens,
        stop_at_eos=args.stop_at_eos,
        progress=_progress(args),
        make_cache=bias_cache_maker(model, args),
    )
    results = report.results
    names = [r.name for r in results[0].runs]
    rows = [
        [
            r.config,
            r.bits_per_element,
            f"{r.diverged}/{len(r.runs)}",
            r.divergence_min,
            r.divergence_median,
            r.prefix_mean,
            r.match_mean,
            r.kld_mean,
            r.kld_p99,
            r.ref_top1,
            r.ref_ppl,
        ]
        for r in results
    ]
    headers = ["config", "bits/elem", "diverged", "div min", "div median", "prefix", "match", "KLD mean",
               "KLD p99", "ref top-1", "ref ppl"]  # fmt: skip
    print(format_table(headers, rows))
    print()
    first = [[r.config, *(_divergence(run) for run in r.runs)] for r in results]
    print(format_table(["first divergence", *names], first))
    lens = ", ".join(f"{run.name} {run.prompt_tokens}+{run.n}" for run in results[0].runs)
    print(
        f"tokens per prompt (prompt+generated): {lens}. div min / div median: tokens matched before the first "
        "divergence (the run's length when none); prefix: mean matched / generated; match: position-wise "
        "fraction of tokens equal to the reference's; KLD, ref top-1, ref ppl: each mode's own continuation "
        "scored by the reference, KL(reference || mode)",
        file=sys.stderr,
    )
    _bits_note(results)
    _note_unquantized(specs, max(run.prompt_tokens + run.n for run in results[0].runs))
    _out(
        {
            "model": _model_name(args),
            "tokens": args.tokens,
            "stop_at_eos": args.stop_at_eos,
            "bucket": args.bucket,
            "prompts": [
                {"name": run.name, "prompt_tokens": run.prompt_tokens, "reference_tokens": run.n}
                for run in results[0].runs
            ],
            "results": report.records(args.bucket),
        },
        args,
    )
    return 0


def _divergence(run) -> int | str:
    return "none" if run.first_divergence is None else run.first_divergence


def _memory(args) -> int:
    lengths = _int_list("--lengths", args.lengths, minimum=0)
    _check_out("--json", args.json)
    specs = _specs(args)

    from ..evaluate import memory_records, memory_table

    model, _ = _load(args)  # only its config and dtype are used
    rows = memory_table(model.config, specs, lengths, dtype=model.dtype)
    table = [
        [
            r.config,
            r.seen,
            r.stored,
            _mib(r.bytes),
            r.bytes_per_token,
            r.bits_per_element,
            r.ratio_fp16,
            r.ratio_fp32,
        ]
        for r in rows
    ]
    headers = ["config", "seen", "stored", "MiB", "B/stored tok", "bits/elem", "x fp16", "x fp32"]
    print(format_table(headers, table, floatfmt=".4g"))
    print(
        "bytes: every stored tensor (codes, scales, zeros, full-precision residual, sinks, bias), all layers, "
        f"batch 1, model dtype {args.dtype}, by formula (kvslim.evaluate.cache_bytes; no forward pass); "
        "bits/elem: bytes x 8 / stored K/V elements; x fp16 / x fp32: how many times smaller than an "
        "unbounded fp16 / fp32 cache of the same tokens seen",
        file=sys.stderr,
    )
    _out(
        {
            "model": _model_name(args),
            "tokens": max(lengths),
            "lengths": lengths,
            "dtype": args.dtype,
            "results": memory_records(rows),
        },
        args,
    )
    return 0


def _mib(n: int) -> float:
    return n / 2**20


def _passkey(args) -> int:
    lengths = _int_list("--lengths", args.lengths)
    depths = _float_list("--depths", args.depths)
    _positive("--trials", args.trials)
    _positive("--chunk", args.chunk)
    _check_out("--json", args.json)
    specs = _specs(args)

    from ..evaluate import passkey

    model, tokenizer = _load(args)
    report = passkey(
        model,
        tokenizer,
        specs,
        lengths,
        depths,
        args.trials,
        seed=args.seed,
        chunk=args.chunk,
        progress=_progress(args),
        make_cache=bias_cache_maker(model, args),
    )
    cells = report.results[0].cells
    headers = ["config", "bits/elem", "all", *(f"{c.length}@{c.depth:g}" for c in cells)]
    rows = [
        [r.config, r.bits_per_element, r.accuracy, *(c.accuracy for c in r.cells)] for r in report.results
    ]
    print(format_table(headers, rows, floatfmt=".2f"))
    _bits_note(report.results)
    print(
        "columns: length@depth (prompt tokens @ relative key position); accuracy over "
        f"{args.trials} random key(s) each; prompt fed {args.chunk} tokens per forward",
        file=sys.stderr,
    )
    _out(
        {
            "model": _model_name(args),
            "tokens": max(lengths),
            "lengths": lengths,
            "depths": depths,
            "trials": args.trials,
            "results": report.records(),
        },
        args,
    )
    return 0
