"""``kvslim calibrate``: measure the K mean-centering bias of a model on a text, write it as GGUF.

Parsing and printing only; the work is :func:`kvslim.calibration.calibrate.collect_k_means` and
:func:`kvslim.calibration.biasfile.write_bias_file` (atomic: a failed write leaves --out as it was, and the
``wrote ...`` line is printed only after the file is in place).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

from ..config import MEAN_CENTER_FORMATS, ROTATE
from .common import (
    UserError,
    add_model_flags,
    check_input_file,
    check_model_args,
    check_output,
    format_table,
    load_model_from_args,
    read_text_file,
)


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
        "(permuted for llama-arch models; kvslim converts such a file back when loading it)",
    )
    parser.add_argument(
        "--kv-rotate",
        default="auto",
        choices=[r for r in ROTATE if r != "fitted"],
        help="the K basis to calibrate for: k or kv (K Hadamard-rotated, records k_rot=true), none or v (K "
        "unrotated); auto (default): as the default cache stores a quantized K, rotated wherever the "
        "model's head_dim allows it, so that the file and the default cache's rotation add up",
    )
    parser.add_argument(
        "--kv-pre-rope",
        action="store_true",
        help="calibrate for a cache storing K before RoPE (records k_pre_rope=true)",
    )
    parser.add_argument(
        "--fit-rotation",
        action="store_true",
        help="also fit a rotation of K and V per layer and KV head to the text (eigenbasis + Hadamard mix, "
        "kvslim.calibration.rotation) and write it into the file (schema 2), for a cache with "
        "--kv-rotate fitted --kv-mean-center FILE; fit with --kv-pre-rope for a cache storing K before RoPE",
    )
    parser.add_argument("--out", required=True, metavar="BIAS.gguf", help="output bias file (GGUF)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--ctx", args.ctx), ("--chunks", args.chunks), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    if args.llama_cpp_order and args.kv_pre_rope:
        raise UserError(
            "--llama-cpp-order cannot be combined with --kv-pre-rope: llama.cpp caches K after RoPE"
        )
    if args.llama_cpp_order and args.fit_rotation:
        raise UserError("--llama-cpp-order cannot be combined with --fit-rotation: llama.cpp reads no fitted rotation")
    check_input_file("--text", args.text)
    check_output("--out", args.out)
    text = read_text_file("--text", args.text)
    check_model_args(args)

    from ..calibration.biasfile import write_bias_file
    from ..calibration.calibrate import collect_k_means
    from ..calibration.channelorder import to_llama_cpp_order

    model, tokenizer = load_model_from_args(args)
    _check_context(args.ctx, model.config)
    bias = collect_k_means(
        model,
        tokenizer,
        text,
        ctx=args.ctx,
        chunks=args.chunks,
        max_tokens=args.max_tokens,
        progress=not args.no_progress and sys.stderr.isatty(),
        cache_type=args.cache_type,
        rotate="auto" if args.kv_rotate == "auto" else args.kv_rotate in ("k", "kv"),
        pre_rope=args.kv_pre_rope,
        fit_rotation=args.fit_rotation,
    )
    if args.llama_cpp_order:
        bias = to_llama_cpp_order(bias, model.config.model_type)
    write_bias_file(args.out, bias)  # atomic: on failure --out is unchanged (one-line error, exit 2)

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
        f"K basis {'rotated' if bias.k_rot else 'unrotated'}{', pre-RoPE' if bias.pre_rope else ''}, "
        f"model {bias.model_fingerprint}"
        + (f", fitted K/V rotation ({bias.rotation}, schema 2)" if bias.rotations else "")
    )
    return 0


def _check_context(ctx: int, config) -> None:
    """--ctx past the model's trained context would average keys at positions it never saw: refused."""
    from ..shapes import ModelShapes

    context = ModelShapes.from_config(config).max_position_embeddings
    if context and ctx > context:
        raise UserError(
            f"--ctx {ctx} is beyond the model's context of {context} positions (each chunk starts at position 0); "
            f"use --ctx {context} or less"
        )
