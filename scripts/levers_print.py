"""Print scripts/levers_table.py's results as a markdown table, in the order the specs are given.

usage: python scripts/levers_print.py OUT_DIR [SPEC...]   (no SPEC: every result, in file order)

Columns: the spec (bias paths shortened to their file name), ppl ratio, KLD mean / p99, top-1, and the
KLD as a fraction of the plain row of its format (the same spec with every lever off: rotate=none,
pre_rope=0, no mean_center, no sink), when that row was run.
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
    print("| config | ppl ratio | KLD mean | KLD p99 | top-1 | KLD vs plain |")
    print("|---|---|---|---|---|---|")
    for spec in specs:
        r = rows.get(spec)
        if r is None:
            print(f"| `{_short(spec)}` | (not run) | | | | |")
            continue
        base = plain.get(_split(spec)[0])
        rel = r["kld_mean"] / base if base else float("nan")
        print(
            f"| `{_short(spec)}` | {r['ppl_ratio']:.3f} | {r['kld_mean']:.4g} | {r['kld_p99']:.3g} | "
            f"{r['top1']:.4f} | {rel:.2f} |"
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
        and levers.get("sink", "0") == "0"
    )
    return fmt, off


def _short(spec: str) -> str:
    return ",".join(
        p if not p.startswith("mean_center=") else "mean_center=" + os.path.basename(p.split("=", 1)[1])
        for p in spec.split(",")
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
