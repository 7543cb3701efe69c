"""``kvslim eval``'s runners, one per subcommand: check the flags (before a model loads), load the model, call
:mod:`kvslim.evaluate`, print the tables (:mod:`kvslim.cli.eval_tables`) and write --json / --plot.

Every check that can fail without the model runs first, so a user's mistake costs no model load: the --config
specs and their bias files, the numbers, the output paths. Under ``torchrun`` every rank measures and rank 0
alone writes (:func:`~kvslim.cli.common.is_main_rank`).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from .common import (
    UserError,
    bias_cache_maker,
    check_bias_file,
    check_input_file,
    check_model_args,
    check_output,
    is_main_rank,
    load_model_from_args,
    read_text_file,
    write_json,
)
from .errors import say
from .eval_tables import (
    bits_note,
    note_unquantized,
    print_greedy,
    print_long,
    print_memory,
    print_passkey,
    print_ppl,
)

#: The modes measured when no --config is given.
DEFAULT_CONFIGS = ("fp8", "int8", "int4", "int2", "q8_0", "q4_0", "q4_1")


# -- checks before a model loads ----------------------------------------------------------------
def checked_specs(args) -> list[str]:
    """The --config specs, validated now (before a model loads): ValueError names a bad one, a
    bias file (mean_center=) that is missing or malformed, or a bad --model / --device."""
    from ..evaluate import resolve_modes

    specs = list(args.config or DEFAULT_CONFIGS)
    for mode in resolve_modes(specs):
        check_bias_file(f"--config {mode.label}: mean_center", mode.config.mean_center)
    check_model_args(args)
    return specs


def int_list(flag: str, text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise UserError(f"{flag} must be comma-separated integers >= {minimum}, got {text!r}")
    return values


def float_list(flag: str, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated numbers in [0, 1], got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise UserError(f"{flag} must be comma-separated numbers in [0, 1], got {text!r}")
    return values


def positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"{flag} must be a positive integer, got {value}")


def check_out(flag: str, path: str | None) -> None:
    check_output(flag, path)
    if flag == "--plot" and path is not None and not path.lower().endswith(".png"):
        raise UserError(f"--plot {path}: the plot is written as PNG; name a .png file")


def check_png(path) -> None:
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            raise ValueError("the plot written is not a PNG file")


def read_prompts(path: str | None):
    """The --prompts file's prompts (None: no file); a UserError for a file that is not UTF-8."""
    from ..evaluate import load_prompts

    try:
        return load_prompts(path) if path else None
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# -- shared by the runners ---------------------------------------------------------------------
def warn_beyond_context(n: int, specs: list[str], model) -> None:
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


def note_unquantized_specs(specs: list[str], longest: int) -> None:
    from ..evaluate import resolve_modes

    note_unquantized(resolve_modes(specs), longest)


def load(args):
    return load_model_from_args(args, kvslim_attention=True)  # decode on the codes, as users run it


def model_name(args) -> str:
    return args.model or "SmolLM2-135M-Instruct (embedded)"


def progress(args) -> bool:
    return not args.no_progress and sys.stderr.isatty() and is_main_rank()


def out(obj, args) -> None:
    if args.json and is_main_rank():
        write_json(args.json, obj)
        print(f"wrote {args.json}", file=sys.stderr)


# -- the runners -------------------------------------------------------------------------------
def ppl(args) -> int:
    text = read_text_file("--text", args.text)
    for flag, value in (
        ("--tokens", args.tokens),
        ("--prefill", args.prefill),
        ("--chunk", args.chunk),
        ("--bucket", args.bucket),
    ):
        positive(flag, value)
    if args.tokens is not None and args.tokens < 2:
        raise UserError(
            f"--tokens must be >= 2, got {args.tokens}: perplexity scores each token after the first "
            f"(at least one token is fed first, one scored)"
        )
    check_out("--json", args.json)
    check_out("--plot", args.plot)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib: pip install 'kvslim[plot]'")
    specs = checked_specs(args)

    from ..evaluate import compare_perplexity, plot_ppl_curves

    model, tokenizer = load(args)
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
    warn_beyond_context(n, specs, model)

    print(
        f"{model_name(args)}: {n} tokens of {args.text}, prefill {prefill}, then {n - 1 - prefill} tokens "
        f"{'one per step' if args.chunk == 1 else f'{args.chunk} per forward'}; scoring {n - prefill} tokens",
        file=sys.stderr,
    )
    report = compare_perplexity(
        model,
        ids,
        specs,
        prefill=prefill,
        chunk=args.chunk,
        progress=progress(args),
        make_cache=bias_cache_maker(model, args),
    )
    records = report.records(args.bucket)
    print_ppl(records)
    bits_note(report.results)
    out(
        {
            "model": model_name(args),
            "dtype": args.dtype,
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

        with atomic_path(args.plot, verify=check_png, what="--plot") as tmp:
            plot_ppl_curves(
                report, str(tmp), bucket=args.bucket, title=f"{os.path.basename(args.text)}, {n} tokens"
            )
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def greedy(args) -> int:
    positive("--tokens", args.tokens)
    check_out("--json", args.json)
    check_input_file("--prompts", args.prompts)
    specs = checked_specs(args)

    from ..evaluate import greedy_prefix_match

    prompts = read_prompts(args.prompts)
    model, tokenizer = load(args)
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
            progress=progress(args),
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
    print_greedy(report)
    bits_note(report.results)
    note_unquantized_specs(
        specs, max(p.prompt_tokens + p.reference_tokens for p in report.results[0].prompts)
    )
    record = {"model": model_name(args), "tokens": args.tokens, "results": report.records()}
    if compiled is not None:
        record["compile"] = {
            "graphs": compiled.compiles,
            "compile_s": compiled.compile_s,
            "steps": compiled.steps,
        }
    out(record, args)
    return 0


def long(args) -> int:
    positive("--tokens", args.tokens)
    positive("--bucket", args.bucket)
    check_out("--json", args.json)
    check_input_file("--prompts", args.prompts)
    specs = checked_specs(args)

    from ..evaluate import LONG_PROMPTS, encode_prompt, long_generation

    prompts = read_prompts(args.prompts) or list(LONG_PROMPTS)
    model, tokenizer = load(args)
    prompt_lens = [encode_prompt(tokenizer, p).shape[1] for p in prompts]
    warn_beyond_context(max(prompt_lens) + args.tokens, specs, model)
    report = long_generation(
        model,
        tokenizer,
        prompts,
        specs,
        tokens=args.tokens,
        stop_at_eos=args.stop_at_eos,
        progress=progress(args),
        make_cache=bias_cache_maker(model, args),
    )
    runs = report.results[0].runs
    print_long(report)
    bits_note(report.results)
    note_unquantized_specs(specs, max(run.prompt_tokens + run.n for run in runs))
    out(
        {
            "model": model_name(args),
            "tokens": args.tokens,
            "stop_at_eos": args.stop_at_eos,
            "bucket": args.bucket,
            "prompts": [
                {"name": run.name, "prompt_tokens": run.prompt_tokens, "reference_tokens": run.n}
                for run in runs
            ],
            "results": report.records(args.bucket),
        },
        args,
    )
    return 0


def memory(args) -> int:
    lengths = int_list("--lengths", args.lengths, minimum=0)
    check_out("--json", args.json)
    specs = checked_specs(args)

    from ..evaluate import memory_records, memory_table

    model, _ = load(args)  # only its config and dtype are used
    rows = memory_table(model.config, specs, lengths, dtype=model.dtype)
    print_memory(rows, args.dtype)
    out(
        {
            "model": model_name(args),
            "tokens": max(lengths),
            "lengths": lengths,
            "dtype": args.dtype,
            "results": memory_records(rows),
        },
        args,
    )
    return 0


def passkey(args) -> int:
    lengths = int_list("--lengths", args.lengths)
    depths = float_list("--depths", args.depths)
    positive("--trials", args.trials)
    positive("--chunk", args.chunk)
    check_out("--json", args.json)
    specs = checked_specs(args)

    from ..evaluate import passkey as measure_passkey

    model, tokenizer = load(args)
    report = measure_passkey(
        model,
        tokenizer,
        specs,
        lengths,
        depths,
        args.trials,
        seed=args.seed,
        chunk=args.chunk,
        progress=progress(args),
        make_cache=bias_cache_maker(model, args),
    )
    print_passkey(report, args.trials, args.chunk)
    out(
        {
            "model": model_name(args),
            "tokens": max(lengths),
            "lengths": lengths,
            "depths": depths,
            "trials": args.trials,
            "results": report.records(),
        },
        args,
    )
    return 0


#: subcommand -> runner
RUNNERS = {"ppl": ppl, "greedy": greedy, "long": long, "memory": memory, "passkey": passkey}
