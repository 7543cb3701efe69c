"""``kvslim calibrate``: measure the K mean-centering bias of a model on a text, write it as GGUF.

Parsing and printing only; the work is :func:`kvslim.calibrate.collect_k_means` and
:func:`kvslim.biasfile.write_bias_file`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

from ..config import MEAN_CENTER_FORMATS
from .common import UserError, add_model_flags, format_table


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    parser.add_argument("--text", required=True, metavar="FILE", help="calibration text (UTF-8)")
    parser.add_argument(
        "--ctx",
        type=int,
        default=512,
        metavar="N",
        help="tokens per chunk; the cache is cleared per chunk (512)",
    )
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--chunks", type=int, default=None, metavar="N", help="use at most N chunks")
    limit.add_argument(
        "--max-tokens", type=int, default=None, metavar="N", help="use at most N tokens of the text"
    )
    parser.add_argument(
        "--cache-type",
        default="q4_0",
        choices=MEAN_CENTER_FORMATS,
        help="the K format the bias is meant for, recorded in the file (default: q4_0)",
    )
    parser.add_argument(
        "--llama-cpp-order",
        action="store_true",
        help="write each head's K channels in llama.cpp's order, for its --kv-mean-center "
        "(permuted for llama-arch models; kvslim itself refuses such a file)",
    )
    parser.add_argument("--out", required=True, metavar="BIAS.gguf", help="output bias file (GGUF)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.text):
        raise UserError(f"--text {args.text}: no such file")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UserError(f"--out {args.out}: directory {out_dir} does not exist")
    for flag, value in (("--ctx", args.ctx), ("--chunks", args.chunks), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"--text {args.text}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise UserError(f"--text {args.text}: the file is empty")

    from ..biasfile import to_llama_cpp_order, write_bias_file
    from ..calibrate import collect_k_means
    from ..models import load_model

    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    bias = collect_k_means(
        model,
        tokenizer,
        text,
        ctx=args.ctx,
        chunks=args.chunks,
        max_tokens=args.max_tokens,
        progress=not args.no_progress and sys.stderr.isatty(),
        cache_type=args.cache_type,
    )
    if args.llama_cpp_order:
        bias = to_llama_cpp_order(bias, model.config.model_type)
    write_bias_file(args.out, bias)

    rows = bias.summary_rows()
    print(
        f"calibrated on {bias.n_tokens} tokens in {bias.n_chunks} chunk(s) of ctx {bias.ctx} "
        f"(text sha256 {bias.text_sha256[:12]}...)"
    )
    print(
        "ratio = mean over heads of |k_bar_h| / mean |k| per row: near 0 means K is already centered "
        "(centering cannot help), larger means more of K's range is a constant offset"
    )
    print(
        format_table(
            ["layer", "|bias|", "mean |k|", "ratio"],
            [[r["layer"], r["bias_norm"], r["k_row_norm"], r["ratio"]] for r in rows],
            floatfmt=".3f",
        )
    )
    with open(args.out, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    print(
        f"wrote {args.out} ({os.path.getsize(args.out)} bytes, sha256 {digest[:12]}...): "
        f"{bias.n_layers} layers, K format {bias.cache_type}, channel order {bias.channel_order}, "
        f"model {bias.model_fingerprint}"
    )
    return 0
