"""Perplexity curves as a PNG (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from .perplexity import PerplexityReport


def plot_ppl_curves(report: PerplexityReport, path: str, *, bucket: int = 256, title: str = "") -> None:
    """Write a PNG: perplexity (top) and mean KL to the reference (bottom, log scale) per bucket of
    positions, one line per mode (needs matplotlib).

    Uses matplotlib's object API with the Agg canvas: no global backend switch.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'kvslim[plot]'") from None
    fig = Figure(figsize=(8, 7), dpi=120)
    FigureCanvasAgg(fig)
    ax_ppl, ax_kl = fig.subplots(2, 1, sharex=True)
    for i, r in enumerate(report.results):
        pts = r.curve(bucket)
        xs = [(p["start"] + p["end"]) / 2 for p in pts]
        width = 2.0 if r is report.reference else 1.2
        style = dict(marker="o", markersize=3, label=r.config, linewidth=width, color=f"C{i % 10}")
        ax_ppl.plot(xs, [p["ppl"] for p in pts], **style)
        kl = [p.get("kld_mean", 0.0) for p in pts]
        if any(k > 0 for k in kl):  # log axis: the reference (KL 0) has no line there
            ax_kl.plot(xs, [k if k > 0 else float("nan") for k in kl], **style)
    ax_ppl.set_ylabel("perplexity")
    ax_ppl.set_title(title or "through the cache, per position")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean KL(reference || mode)")
    ax_kl.set_xlabel(f"token position (buckets of {bucket})")
    for ax in (ax_ppl, ax_kl):
        ax.grid(alpha=0.3)
    ax_ppl.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
