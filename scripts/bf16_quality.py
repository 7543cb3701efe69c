"""bfloat16 against float32 through the cached path (issue 30, item 4): KLD of every (dtype, config) pair
against both references — float32 ``none`` and bfloat16 ``none`` — on the same text, teacher-forced as
``kvslim eval ppl`` does it (:func:`kvslim.evaluate.perplexity_through_cache`: a prefill, then one token per
decode step through a real SlimCache, the model on the ``kvslim`` attention as the CLI loads it).

``kvslim eval ppl --dtype D`` scores each mode against the reference *of its own dtype*; this script also
scores the bfloat16 runs against the float32 reference (the question "what does bf16 cost"), which one CLI
run cannot, since it loads one model. The two models are loaded one after the other (one alive at a time);
every mode's logits are kept (``4 * scored * vocab`` bytes each: 100 MB per mode at 512 scored tokens of
SmolLM2's 49,152) and the KLDs computed at the end in float64 (:func:`kvslim.evaluate.perplexity.
kl_from_log_probs`).

    OMP_NUM_THREADS=1 python scripts/bf16_quality.py --text tests/data/GPL-3.txt --tokens 1024 --prefill 512 \
        --config int8 --config int4 --config q4_0 --json bf16-quality.json

A ``--dtypes`` entry ``DTYPE:ROUTE`` runs that dtype's forwards (prefill and decode) with the linear layers on
``ROUTE`` (:mod:`kvslim.engine.linears`, as a single stream: ``kvslim sample --linears``); a plain ``DTYPE`` runs
torch's own. ``--dtypes float32,bfloat16,bfloat16:kvslim`` scores kvslim's bfloat16 linear (the engine's route for
a bfloat16 model on an AVX512-BF16 CPU) beside torch's, against the same float32 reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time

import torch


def _scores(logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict:
    """KLD(ref || logits) mean / p99 / max and top-1 agreement over the scored tokens (n, V) in float64."""
    from kvslim.evaluate.perplexity import kl_from_log_probs

    kl = torch.cat(
        [
            kl_from_log_probs(torch.log_softmax(r.double(), -1), torch.log_softmax(x.double(), -1))
            for r, x in zip(ref.split(64), logits.split(64), strict=True)
        ]
    )
    top1 = (logits.argmax(-1) == ref.argmax(-1)).double().mean()
    return {
        "kld_mean": float(kl.mean()),
        "kld_p99": float(torch.quantile(kl, 0.99)),
        "kld_max": float(kl.max()),
        "top1": float(top1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", required=True)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument(
        "--config", action="append", default=None, help="a cache spec (repeatable; 'none' is always run)"
    )
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from kvslim.cli.common import load_model_from_args
    from kvslim.engine.linears import Linears
    from kvslim.evaluate.modes import cache_maker, resolve_modes
    from kvslim.evaluate.perplexity import perplexity_through_cache

    specs = ["none", *[c for c in (args.config or ["int8", "int4", "q4_0"]) if c != "none"]]
    dtypes = args.dtypes.split(",")
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    runs = []  # (dtype, spec, result, logits)
    for dtype in dtypes:
        base, _, route = dtype.partition(":")
        ns = argparse.Namespace(model=None, device="cpu", dtype=base, verify=False)
        model, tokenizer = load_model_from_args(ns, kvslim_attention=True)
        linears = Linears(model, route or "torch", batch_hint=1, single=True)
        ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
        make = cache_maker(model, None)
        for mode in resolve_modes(specs):
            if any(r[0] == dtype and r[1] == mode.label for r in runs):
                continue  # resolve_modes puts the reference "none" first; a "none" asked for again is the same run
            print(f"{dtype} {mode.label} ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            with linears.routed():
                res, logits = perplexity_through_cache(
                    model,
                    ids,
                    lambda m=mode, mk=make: mk(m.config),
                    prefill=args.prefill,
                    keep_logits=True,
                    progress=False,
                    label=mode.label,
                )
            runs.append((dtype, mode.label, res, logits))
            print(f"  ppl {res.ppl:.3f} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        targets = ids[0, args.prefill :]
        del model
        gc.collect()
    refs = {d: next(r[3] for r in runs if r[0] == d and r[1] == "none") for d in dtypes}
    rows = []
    for dtype, label, res, logits in runs:
        row = {
            "dtype": dtype,
            "config": label,
            "ppl": res.ppl,
            "ppl_stderr": res.ppl_stderr,
            "bits_per_element": res.bits_per_element,
        }
        for ref_dtype, ref in refs.items():
            row[f"vs_{ref_dtype}"] = _scores(logits, ref, targets)
        rows.append(row)
    cols = [f"vs_{d}" for d in dtypes]
    head = f"{'dtype':16} {'config':12} {'ppl':>7} {'±':>5}" + "".join(
        f" {c + ' KLD mean':>20} {'p99':>8} {'top-1':>6}" for c in cols
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r['dtype']:16} {r['config']:12} {r['ppl']:7.3f} {r['ppl_stderr']:5.2f}"
        for c in cols:
            s = r[c]
            line += f" {s['kld_mean']:20.6f} {s['kld_p99']:8.4f} {s['top1']:6.4f}"
        print(line)
    if args.json:
        record = {
            "text": args.text,
            "tokens": args.tokens,
            "prefill": args.prefill,
            "chunk": 1,
            "scored_tokens": args.tokens - args.prefill,
            "results": rows,
        }
        with open(args.json + ".tmp", "w", encoding="utf-8") as f:
            json.dump(
                record, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x
            )
        import os

        os.replace(args.json + ".tmp", args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
