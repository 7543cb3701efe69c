"""Print scripts/levers_table.py's results as a markdown table, in the order the specs are given.

usage: python scripts/levers_print.py OUT_DIR [SPEC...]   (no SPEC: every result, in file order)

Columns: the spec (bias paths shortened to their file name), bits per element at the run's length (the cache's
bytes per stored K/V element, scales and residual included), ppl ratio, KLD mean / p99, top-1, the KLD as a
fraction of the plain row of its format (the same spec with every lever off: rotate=none, pre_rope=0, no
mean_center, sink=0 — written out since 2026-12-04, when sink=auto became the default; results written before, whose
plain rows named no sink, print nan there), and a ``varnorm=on`` row's KLD as a fraction of its ``varnorm=off`` twin (the same spec
otherwise), when those rows were run.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    out_dir, *specs = argv
    with open(os.path.join(out_dir, "results.jsonl")) as f:
        rows = {r["config"]: r for r in map(json.loads, filter(str.strip, f))}
    specs = specs or [c for c in rows if c != "none"]
    plain = {}  # format part of a spec -> KLD of its row with every lever off
    for spec, r in rows.items():
        fmt, off = _split(spec)
        if off:
            plain[fmt] = r["kld_mean"]
    print(
        "| config | bits/elem | ppl ratio | KLD mean | KLD p99 | top-1 | KLD vs plain | KLD vs varnorm=off |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec in specs:
        r = rows.get(spec)
        if r is None:
            print(f"| `{_short(spec)}` | (not run) | | | | | | |")
            continue
        base = plain.get(_split(spec)[0])
        rel = r["kld_mean"] / base if base else float("nan")
        twin = rows.get(spec.replace("varnorm=on", "varnorm=off")) if "varnorm=on" in spec else None
        vs_off = f"{r['kld_mean'] / twin['kld_mean']:.2f}" if twin and twin["kld_mean"] else ""
        print(
            f"| `{_short(spec)}` | {r.get('bits_per_element', float('nan')):.3f} | {r['ppl_ratio']:.3f} | "
            f"{r['kld_mean']:.4g} | {r['kld_p99']:.3g} | {r['top1']:.4f} | {rel:.2f} | {vs_off} |"
        )
    return 0


_LEVERS = ("rotate=", "pre_rope=", "mean_center=", "sink=")


def _split(spec: str) -> tuple[str, bool]:
    """(the spec without its lever parts, whether every lever is explicitly off: rotate=none, pre_rope=0,
    no mean_center, no sink). A spec that leaves rotate or pre_rope out gets the default, 'auto'."""
    parts = spec.split(",")
    levers = {p.split("=", 1)[0]: p.split("=", 1)[1] for p in parts if p.startswith(_LEVERS)}
    fmt = ",".join(p for p in parts if not p.startswith(_LEVERS))
    off = (
        levers.get("rotate") == "none"
        and levers.get("pre_rope", "").lower() in ("0", "false", "no", "off")
        and "mean_center" not in levers
        # sinks off: said (sink=auto, the default since 2026-12-04, keeps 16 in a quantized cache without a window)
        and (levers.get("sink") == "0" or (levers.get("sink", "auto") == "auto" and "window=" in spec))
    )
    return fmt, off


def _short(spec: str) -> str:
    return ",".join(
        p if not p.startswith("mean_center=") else "mean_center=" + os.path.basename(p.split("=", 1)[1])
        for p in spec.split(",")
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
