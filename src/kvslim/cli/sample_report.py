"""``kvslim sample``'s words on stderr and its report: the banner line, the report (text and JSON), RSS.

:func:`banner` says what runs (model, cache formats and bits per element, policy, levers, device and
dtype); :func:`build_report` is the cache's own report plus timings and peak RSS, as JSON-able values;
:func:`format_report` prints it; :func:`current_rss_bytes` / :func:`peak_rss_bytes` read the process's
memory (what --rss-log records). This module formats numbers it is given: it runs nothing and decides
nothing.
"""

from __future__ import annotations

import math
import os
import sys

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (embedded)"


def _bits_for(fmt: str, role: str, model, head_dim: int, cache_config) -> float:
    import torch

    from ..formats import make_codec

    if fmt == "none":
        return float(torch.finfo(model.dtype).bits)
    codec = make_codec(fmt, role, group_size=cache_config.group_size, v_group_size=cache_config.v_group_size)
    return codec.bits_per_element(head_dim)


def banner(args, cache_config, model, head_dim: int, quantizes: bool = True, cache=None) -> str:
    c = cache_config
    k_bits = _bits_for(c.k_format, "k", model, head_dim, c)
    v_bits = _bits_for(c.v_format, "v", model, head_dim, c)
    parts = [f"K {c.k_format} ({k_bits:.2f} bits/elem), V {c.v_format} ({v_bits:.2f} bits/elem)"]
    if c.k_format != "none" or c.v_format != "none":
        parts.append(
            f"group {c.group_size}/residual {c.residual_tokens}"
            + (" (auto)" if c.residual == "auto" else "")
            + ("" if quantizes else " (nothing quantized in this run)")
        )
    if c.window is None:
        parts.append("unbounded" + (f", first {c.sink_tokens} at full precision" if c.sink_tokens else ""))
    else:
        parts.append(f"sink {c.sink_tokens}/window {c.window}")
    if cache is not None and cache.rotate != "none":
        parts.append(f"{cache.rotate.upper()} Hadamard-rotated")
    if cache is not None and cache.pre_rope:
        parts.append("K pre-RoPE")
    if c.mean_center:
        parts.append(f"K mean-centered ({os.path.basename(c.mean_center)})")
    model_name = DEFAULT_MODEL_NAME if args.model is None else args.model
    dtype = str(model.dtype).replace("torch.", "")
    return f"kvslim sample | model {model_name} | cache {', '.join(parts)} | {model.device} {dtype}"


def build_report(cache, stats, *, args=None, interrupted: bool = False) -> dict:
    """The cache's report plus timings and peak RSS, as plain JSON-able values (NaN -> None)."""
    report = dict(cache.report())
    report.update(
        prompt_tokens=stats.prompt_tokens,
        new_tokens=stats.new_tokens,
        prefill_s=stats.prefill_s,
        decode_s=stats.decode_s,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        peak_rss_bytes=peak_rss_bytes(),
        interrupted=interrupted,
    )
    if args is not None:
        report.update(
            model=args.model or DEFAULT_MODEL_NAME,
            device=args.device,
            dtype=args.dtype,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in report.items()}


def format_report(r: dict) -> str:
    stored = f"{r['tokens_stored']}"
    if r.get("capacity") is not None:
        cfg = r.get("config") or {}
        stored += f" (cap sink+window = {r.get('sink', '?')}+{cfg.get('window', '?')} = {r['capacity']})"
    fp16 = r["fp16_full_cache_bytes"]
    ratio = f"{r['cache_bytes'] / fp16:.3f}x" if fp16 else "n/a"
    live = r.get("live_bytes")
    live = (
        f" (stored tokens {_mib(live)}, the rest preallocated)" if live and live != r["cache_bytes"] else ""
    )
    ranks = f" across {r['ranks']} ranks" if r.get("ranks", 1) > 1 else ""
    if r.get("bytes_of_rank") is not None:
        ranks = f" on rank {r['bytes_of_rank']} alone (interrupted: not summed over the ranks)"
    lines = [
        ("interrupted | " if r.get("interrupted") else "")
        + f"tokens seen {r['tokens_seen']} | tokens stored {stored}",
        f"cache {_mib(r['cache_bytes'])}{ranks}{live} | fp16 full cache {_mib(fp16)} | ratio {ratio}",
        f"prefill {r['prompt_tokens']} tokens at {_rate(r['prefill_tokens_per_s'])} | "
        f"generated {r['new_tokens']} tokens, decode at {_rate(r['decode_tokens_per_s'])} | "
        f"peak RSS {_mib(r['peak_rss_bytes'])}" + (" (rank 0)" if ranks else ""),
    ]
    c = r.get("compile")
    if c:  # the decode rate above includes the compiling first step
        lines.append(f"compiled decode step: {c['graphs']} graph(s) compiled in {c['compile_s']:.1f} s, {c['steps']} compiled steps")
    return "\n".join("kvslim: " + line for line in lines)


def _mib(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _rate(x) -> str:
    return "n/a tok/s" if x is None else f"{x:.1f} tok/s"


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc; elsewhere the peak, the best portable stand-in)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
