"""Decode time and cache memory against context length as a PNG (matplotlib, imported only when a
plot is asked for).

Reads a :class:`~kvslim.bench.suite.BenchResult` or its JSON (``kvslim bench --json``), so a saved
run can be drawn again without re-running it. Knows nothing about how the numbers were measured.
"""

from __future__ import annotations

import json
import os

MIB = 2**20


def _decode_rows(result) -> tuple[list[dict], str]:
    """(decode rows as dicts, header) from a BenchResult, its ``to_dict()``, or a JSON file path."""
    if isinstance(result, (str, os.PathLike)):
        with open(result, encoding="utf-8") as f:
            result = json.load(f)
    data = result if isinstance(result, dict) else result.to_dict()
    rows = data.get("decode") or []
    if not rows:
        raise ValueError("the bench result has no decode rows to plot (was every length skipped?)")
    model = data.get("model") or {}
    settings = data.get("settings") or {}
    name = str(model.get("name") or "")
    parts = [os.path.basename(name.rstrip("/")) or name]  # a local directory: its name, not its path
    if settings.get("attn"):
        parts.append(f"attention {settings['attn']}")
    return rows, " | ".join(p for p in parts if p)


def plot_bench(result, path: str | os.PathLike, *, title: str = "") -> None:
    """Write a PNG with two panels sharing a log2 context-length axis, one line per mode:
    decode ms per token (median, with the interquartile range as a band) and the bytes the cache
    holds (MiB). kvslim modes are solid, the plain ``dynamic`` cache black, transformers'
    QuantizedCache peers dashed.

    result: a BenchResult, its ``to_dict()``, or the path of ``kvslim bench --json`` output.
    Needs matplotlib; uses its object API with the Agg canvas (no global backend switch).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'kvslim[plot]'") from None
    rows, header = _decode_rows(result)
    modes: dict[str, list[dict]] = {}
    for row in rows:
        modes.setdefault(row["mode"], []).append(row)

    fig = Figure(figsize=(9, 7.5), dpi=120)
    FigureCanvasAgg(fig)
    ax_ms, ax_mb = fig.subplots(2, 1, sharex=True)
    colour = 0
    for mode, pts in modes.items():
        pts = sorted(pts, key=lambda r: r["length"])
        xs = [r["length"] for r in pts]
        kind = pts[0].get("kind", "kvslim")
        if mode == "dynamic":
            style = dict(color="black", linewidth=2.2, linestyle="-")
        else:
            style = dict(color=f"C{colour % 10}", linewidth=1.5, linestyle="--" if kind == "peer" else "-")
            colour += 1
        label = {
            "peer": f"{mode} (transformers' QuantizedCache)",
            "dynamic": "dynamic (transformers' plain cache)",
        }.get(kind if mode != "dynamic" else "dynamic", mode)
        ax_ms.plot(xs, [r["ms_median"] for r in pts], marker="o", markersize=3, label=label, **style)
        ax_ms.fill_between(
            xs, [r["ms_q1"] for r in pts], [r["ms_q3"] for r in pts], color=style["color"], alpha=0.12
        )
        ax_mb.plot(xs, [r["cache_bytes"] / MIB for r in pts], marker="o", markersize=3, label=label, **style)

    ax_ms.set_ylabel("decode ms / token (median)")
    ax_ms.set_title(
        title or ("decode time and cache memory against context length" + (f"\n{header}" if header else ""))
    )
    ax_mb.set_ylabel("cache held (MiB)")
    ax_mb.set_xlabel("context length (tokens)")
    ax_mb.set_xscale("log", base=2)
    lengths = sorted({r["length"] for r in rows})
    ax_mb.set_xticks(lengths, [f"{n:,}" for n in lengths])
    for ax in (ax_ms, ax_mb):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_ms.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")
