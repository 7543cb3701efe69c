"""``kvslim eval``'s tables and notes: each report of :mod:`kvslim.evaluate` as a text table on stdout, and the
notes that say what a column counts on stderr.

Printing only: the numbers are the report's (:mod:`kvslim.cli.eval_runs` runs the measurements). Every table has a
``bits/elem`` column, read from the caches the measurement filled (``memory``: by formula).
"""

from __future__ import annotations

import sys

from .common import format_table

#: ppl's columns: (header, key in report.records())
PPL_COLUMNS = (
    ("config", "config"),
    ("bits/elem", "bits_per_element"),
    ("ppl", "ppl"),
    ("±", "ppl_stderr"),
    ("ppl ratio", "ppl_ratio"),
    ("KLD mean", "kld_mean"),
    ("KLD p99", "kld_p99"),
    ("KLD max", "kld_max"),
    ("top-1", "top1"),
)


def print_ppl(records: list[dict]) -> None:
    """The perplexity table: one row per mode (``compare_perplexity(...).records(bucket)``)."""
    rows = [[r[key] for _, key in PPL_COLUMNS] for r in records]
    print(format_table([header for header, _ in PPL_COLUMNS], rows))


def print_greedy(report) -> None:
    """The greedy prefix-match table (one column per prompt) and the reference's continuation lengths."""
    names = [p.name for p in report.results[0].prompts]
    rows = [
        [r.config, r.bits_per_element, r.prefix_match_mean, *(p.prefix_match for p in r.prompts)]
        for r in report.results
    ]
    print(format_table(["config", "bits/elem", "mean", *names], rows, floatfmt=".3f"))
    ref_lens = ", ".join(f"{p.name} {p.reference_tokens}" for p in report.results[0].prompts)
    print(f"reference continuation lengths (tokens): {ref_lens}")


def print_long(report) -> None:
    """The long-generation summary table, the first divergence per prompt, and what the columns mean."""
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
    first = [[r.config, *(divergence(run) for run in r.runs)] for r in results]
    print(format_table(["first divergence", *names], first))
    lens = ", ".join(f"{run.name} {run.prompt_tokens}+{run.n}" for run in results[0].runs)
    print(
        f"tokens per prompt (prompt+generated): {lens}. div min / div median: tokens matched before the first "
        "divergence (the run's length when none); prefix: mean matched / generated; match: position-wise "
        "fraction of tokens equal to the reference's; KLD, ref top-1, ref ppl: each mode's own continuation "
        "scored by the reference, KL(reference || mode)",
        file=sys.stderr,
    )


def divergence(run) -> int | str:
    """A run's first divergence from the reference, or ``none``."""
    return "none" if run.first_divergence is None else run.first_divergence


def print_memory(rows, dtype: str) -> None:
    """The bytes table (``memory_table`` rows: one per mode and length) and what it counts."""
    table = [
        [
            r.config,
            r.seen,
            r.stored,
            mib(r.bytes),
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
        f"batch 1, model dtype {dtype}, by formula (kvslim.evaluate.cache_bytes; no forward pass); "
        "bits/elem: bytes x 8 / stored K/V elements; x fp16 / x fp32: how many times smaller than an "
        "unbounded fp16 / fp32 cache of the same tokens seen",
        file=sys.stderr,
    )


def mib(n: int) -> float:
    return n / 2**20


def print_passkey(report, trials: int, chunk: int) -> None:
    """The passkey accuracy table (one column per length@depth) and what a cell counts."""
    cells = report.results[0].cells
    headers = ["config", "bits/elem", "all", *(f"{c.length}@{c.depth:g}" for c in cells)]
    rows = [
        [r.config, r.bits_per_element, r.accuracy, *(c.accuracy for c in r.cells)] for r in report.results
    ]
    print(format_table(headers, rows, floatfmt=".2f"))
    bits_note(report.results)
    print(
        "columns: length@depth (prompt tokens @ relative key position); accuracy over "
        f"{trials} random key(s) each; prompt fed {chunk} tokens per forward",
        file=sys.stderr,
    )


def bits_note(results) -> None:
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


def note_unquantized(modes, longest: int) -> None:
    """A mode whose full-precision sinks and residual hold every token measured nothing of its format: say so.
    ``modes``: the resolved modes (``resolve_modes(specs)``), the reference first."""
    for m in modes[1:]:
        c = m.config
        if (
            c.window is None
            and c.sink_tokens + c.residual_tokens >= longest
            and (c.k_format != "none" or c.v_format != "none")
        ):
            held = f"residual of {c.residual_tokens} tokens" + (f" and {c.sink_tokens} sinks" if c.sink_tokens else "")
            print(
                f"note: {m.label}: every prompt + continuation ({longest} tokens at most) fits in the "
                f"full-precision {held}, so nothing was quantized; use residual=0 (and sink=0) "
                "or more --tokens to measure the format",
                file=sys.stderr,
            )
