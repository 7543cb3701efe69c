"""Whether the fused decode changes a mode's quality: free-running greedy generation of the embedded model with
``kvslim.attention.FUSED_DECODE`` on (the C rows call) and off (op by op), the same prompts and modes.

usage: python scripts/fused_routing_quality.py TOKENS N_PROMPTS SPEC [SPEC ...]

Runs :func:`kvslim.evaluate.longgen.long_generation` (the reference ``none`` first) on the first N_PROMPTS of
its default prompts, TOKENS tokens each, once per routing, and prints per mode and routing the first divergence
from the reference (per prompt), the position-wise match, the mean KL divergence of the mode's own continuation
scored by the reference, and whether the two routings generated the same tokens. Specs are ``kvslim eval``
specs (``mean_center=FILE`` loaded for the embedded model).
"""

from __future__ import annotations

import sys

import kvslim
from kvslim import attention
from kvslim.evaluate.longgen import LONG_PROMPTS, long_generation
from kvslim.models import load_model


def main(argv: list[str]) -> None:
    tokens, n_prompts, specs = int(argv[0]), int(argv[1]), argv[2:]
    model, tok = load_model(None)
    kvslim.enable(model)
    runs = {}
    for fused in (True, False):
        attention.FUSED_DECODE = fused
        report = long_generation(
            model, tok, LONG_PROMPTS[:n_prompts], ["none", *specs], tokens=tokens, progress=False
        )
        runs[fused] = report.results
    attention.FUSED_DECODE = True
    print(f"{tokens} tokens x {n_prompts} prompts, greedy")
    print(f"{'mode':55s} {'routing':8s} {'first divergence':>18s} {'match':>7s} {'KLD mean':>10s} same tokens")
    for i, spec in enumerate(["none", *specs]):
        same = [a.tokens == b.tokens for a, b in zip(runs[True][i].runs, runs[False][i].runs, strict=True)]
        for fused in (True, False):
            res = runs[fused][i]
            div = ",".join(str(r.first_divergence) for r in res.runs)
            print(
                f"{spec:55s} {'fused' if fused else 'op':8s} {div:>18s} {res.match_mean:7.4f} {res.kld_mean:10.3e} "
                f"{all(same)}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
