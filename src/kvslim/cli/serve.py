"""``kvslim serve``: an OpenAI-compatible server whose conversations live in bounded, compressed caches.

Parsing and printing only: the model comes from :func:`kvslim.cli.common.load_model_from_args`, the app
from :func:`kvslim.serve.build_app` (the batch engine on its thread, the HTTP side), the server is uvicorn.
Needs the ``serve`` extra (``pip install "kvslim[serve]"``). See docs/serve.md.
"""

from __future__ import annotations

import argparse
import os
import re

from .common import (
    UserError,
    add_cache_flags,
    add_model_flags,
    cache_config_from_args,
    check_bias_file,
    check_model_args,
    load_model_from_args,
)
from .errors import say

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1.5gb"``, ``"1000000"`` -> bytes (an int >= 1); ValueError naming the value."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: expected a number with an optional unit (e.g. 2GiB, 500MB, 1000000)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is not a size of at least one byte")
    return value


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    add_cache_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument(
        "--max-concurrency", type=int, default=16, metavar="N", help="requests decoded together at most (default: 16)"
    )
    parser.add_argument(
        "--memory-budget",
        type=_size,
        default=None,
        metavar="SIZE",
        help="bytes every running request's cache and every idle session in memory may hold together, e.g. 2GiB or "
        "500MB (default: no limit); a request waits until its cache fits, one that cannot fit alone is refused (413)",
    )
    parser.add_argument(
        "--session-dir",
        default=None,
        metavar="DIR",
        help="where idle sessions are written when the memory budget needs their room, and read back when they "
        "return (default: none: such sessions are dropped, counted in /metrics)",
    )
    parser.add_argument(
        "--prefill-chunk", type=int, default=256, metavar="N", help="prompt tokens read per engine step (default: 256)"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help=f"the model id clients send (default: {EMBEDDED_NAME} for the embedded model, else the --model basename)",
    )
    parser.add_argument(
        "--default-max-tokens", type=int, default=256, metavar="N", help="max_tokens when a request names none (256)"
    )


def run(args: argparse.Namespace) -> int:
    cache_config = cache_config_from_args(args)  # one line for a bad flag, before any slow work
    check_model_args(args)
    check_bias_file("--kv-mean-center", args.kv_mean_center)
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    for flag, value in (("--max-concurrency", args.max_concurrency), ("--prefill-chunk", args.prefill_chunk),
                        ("--default-max-tokens", args.default_max_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.session_dir is not None and os.path.exists(args.session_dir) and not os.path.isdir(args.session_dir):
        raise UserError(f"--session-dir {args.session_dir!r} is a file; expected a directory (or a new path)")
    try:
        import uvicorn
    except ImportError:
        raise UserError('kvslim serve needs its extra: pip install "kvslim[serve]" (starlette and uvicorn)') from None

    from ..serve import build_app
    from .sample import _eos_ids

    model, tokenizer = load_model_from_args(args, kvslim_attention=True)
    name = args.served_model_name or (
        EMBEDDED_NAME if args.model is None else os.path.basename(os.path.normpath(args.model))
    )
    app = build_app(
        model,
        tokenizer,
        model_name=name,
        cache=cache_config,
        memory_budget=args.memory_budget,
        max_concurrency=args.max_concurrency,
        prefill_chunk=args.prefill_chunk,
        session_dir=args.session_dir,
        stop_ids=_eos_ids(model, tokenizer),
        default_max_tokens=args.default_max_tokens,
    )
    budget = "no limit" if args.memory_budget is None else f"{args.memory_budget} bytes"
    say(
        f"kvslim: serving {name} on http://{args.host}:{args.port}/v1 (cache {cache_config.to_spec()}, "
        f"budget {budget}, {args.max_concurrency} at once, sessions in {args.session_dir or 'memory only'})"
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
