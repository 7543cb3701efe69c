"""Relative squared error of the K and V a cache stores, against the uncompressed cache's, on the embedded model.

usage: python scripts/stored_error.py TEXT N SPEC...

Fills a cache of each SPEC with TEXT's first N tokens in one forward (residual 0 is the caller's to ask for, so
that every token is encoded) and prints, per role, ``sum |x' - x|^2 / sum |x|^2`` over each layer's stored
tokens (decoded, in the model's frame), the mean over layers, and in how many layers it is below the previous
SPEC's. Behind docs/quality.md's "Lloyd-Max codebooks" (what the codebook does to the squared error, next to
what it does to the KL divergence).
"""

from __future__ import annotations

import sys

import torch

from kvslim import SlimCache, parse_spec
from kvslim.models import load_model


def main(argv: list[str]) -> int:
    text, n, *specs = argv
    model, tok = load_model(None)
    with open(text, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[:, : int(n)]

    def fill(spec: str) -> SlimCache:
        cache = SlimCache.from_config(parse_spec(spec), config=model.config)
        with torch.inference_mode():
            model(ids, past_key_values=cache)
        return cache

    ref = fill("none")
    prev = None
    for spec in specs:
        cache = fill(spec)
        errs = [
            [
                float((getattr(a, x) - getattr(b, x)).square().sum() / getattr(b, x).square().sum())
                for a, b in zip(cache.layers, ref.layers, strict=True)
            ]
            for x in ("keys", "values")
        ]
        for j, role in enumerate("KV"):
            lower = "" if prev is None else sum(a < b for a, b in zip(errs[j], prev[j], strict=True))
            print(
                f"{spec} {role}: relative squared error {sum(errs[j]) / len(errs[j]):.4g}"
                + ("" if prev is None else f" (below the previous spec's in {lower}/{len(errs[j])} layers)")
            )
        prev = errs
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
