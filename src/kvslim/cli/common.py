"""Helpers shared by the subcommands: errors as one line, the cache flags, tables, JSON."""

from __future__ import annotations

import argparse
import json
import math

from ..config import CacheConfig
from ..formats import format_names
from .errors import UserError, fail  # noqa: F401  (re-exported for the subcommands)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a local transformers directory, a .gguf file, or a hub id (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (default: float32)",
    )


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The seed's flag surface for one cache mode."""
    names = format_names()
    parser.add_argument(
        "--streaming-llm-sink", type=int, default=0, metavar="N", help="keep the first N tokens forever"
    )
    parser.add_argument(
        "--streaming-llm-window",
        type=int,
        default=None,
        metavar="M",
        help="keep only the last M tokens beyond the sinks",
    )
    parser.add_argument(
        "--kv-quantize", default="none", choices=names, help="K and V storage format (default: none)"
    )
    parser.add_argument(
        "--k-quantize", default=None, choices=names, help="K storage format (overrides --kv-quantize)"
    )
    parser.add_argument(
        "--v-quantize", default=None, choices=names, help="V storage format (overrides --kv-quantize)"
    )
    parser.add_argument(
        "--kv-group-size", type=int, default=32, metavar="G", help="KIVI token group (default: 32)"
    )
    parser.add_argument(
        "--kv-residual",
        type=int,
        default=128,
        metavar="R",
        help="recent tokens kept at full precision (default: 128)",
    )
    parser.add_argument(
        "--kv-mean-center", default=None, metavar="FILE", help="K mean-centering bias file (GGUF)"
    )


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    """Build the validated CacheConfig from the cache flags; ValueError names the flag's field."""
    return CacheConfig(
        kv_quantize=args.kv_quantize,
        k_quantize=args.k_quantize,
        v_quantize=args.v_quantize,
        sink=args.streaming_llm_sink,
        window=args.streaming_llm_window,
        group_size=args.kv_group_size,
        residual=args.kv_residual,
        mean_center=args.kv_mean_center,
    )


def format_table(headers: list[str], rows: list[list], floatfmt: str = ".4g") -> str:
    """A plain aligned text table (numbers right-aligned)."""

    def cell(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else format(v, floatfmt)
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    numeric = [
        all(isinstance(r[i], (int, float)) for r in rows) if rows else False for i in range(len(headers))
    ]

    def line(cells):
        return "  ".join(
            c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in text]
    return "\n".join(out)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
