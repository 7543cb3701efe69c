"""``kvslim sample``'s checks of its flags: the cheap ones before the model loads, and those that need the
prompt's length and the model's context.

:func:`check_args` refuses a bad flag or an unwritable output before any slow work; :func:`check_context`
refuses (or, with --allow-beyond-context, warns about) positions past the model's trained context without
StreamingLLM; :func:`nothing_quantized` says why a lossy format would quantize nothing in this run. Each
refusal is one :class:`~kvslim.cli.common.UserError` line naming the flag and the fix. This module reads
flags and numbers only: no model, no cache, no file contents (the --prompt-cache file's checks are in
:mod:`kvslim.cli.prompt_cache`).
"""

from __future__ import annotations

import argparse
import math

from .common import UserError, check_bias_file, check_model_args, check_output, distributed_run
from .errors import say


def check_args(args: argparse.Namespace) -> None:
    """Cheap checks of every flag and file, before the model loads."""
    if args.tokens < 1:
        raise UserError(f"--tokens must be >= 1, got {args.tokens}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    check_bias_file("--kv-mean-center", args.kv_mean_center)
    if args.compile and args.prompt_cache:
        raise UserError("--compile and --prompt-cache do not combine yet (a StaticSlimCache is not saved)")
    if args.compile and args.linears not in ("auto", "torch"):
        raise UserError(f"--linears {args.linears} does not combine with --compile (the compiled graph runs torch's linear)")
    if args.compile and distributed_run():
        raise UserError("--compile is not available under torchrun yet")
    check_output("--report-json", args.report_json)
    check_output("--rss-log", args.rss_log)
    check_model_args(args)


def check_context(args, cache_config, prompt_tokens: int, context: int | None) -> None:
    """Without StreamingLLM, positions past the model's trained context are an error (or a warning
    with --allow-beyond-context). With it, they are the point."""
    if context is None or cache_config.window is not None:
        return
    needed = prompt_tokens + args.tokens
    if needed <= context:
        return
    message = (
        f"a {prompt_tokens}-token prompt plus --tokens {args.tokens} needs {needed} positions, beyond the "
        f"model's context of {context}"
    )
    if not args.allow_beyond_context:
        raise UserError(
            f"{message}; bound the cache with --streaming-llm-window M (StreamingLLM), lower --tokens, "
            f"or pass --allow-beyond-context to generate past it anyway"
        )
    say(f"kvslim: warning: {message}; quality degrades past it")


def nothing_quantized(args, cache_config, prompt_tokens: int) -> str | None:
    """Why this run quantizes nothing although a lossy format was asked for (no token will ever
    leave the full-precision residual), or None."""
    c = cache_config
    if c.k_format == "none" and c.v_format == "none":
        return None
    start = c.residual_tokens + c.group_size  # tokens held (beyond the sinks) when the first group is encoded
    seen = prompt_tokens + args.tokens - 1  # the last token is generated, never stored
    held = seen - c.sink_tokens if c.window is None else min(seen - c.sink_tokens, c.window)
    if held >= start:
        return None
    why = (
        f"the window holds {c.window} tokens"
        if c.window is not None and c.window < start
        else (
            f"this run stores at most {max(held, 0)}"
            + (f" beyond the {c.sink_tokens} sinks" if c.sink_tokens else "")
            + f" (prompt {prompt_tokens} + --tokens {args.tokens}, the last token never stored)"
        )
    )
    return (
        f"nothing will be quantized: the newest {c.residual_tokens} tokens stay at full precision and older "
        f"ones are encoded {c.group_size} at a time, so quantizing starts at {start} stored tokens, "
        f"but {why}; lower --kv-group-size / --kv-residual"
    )
