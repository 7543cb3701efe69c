"""Quality of cache modes on a long text, token by token, with the reference computed once and shared.

usage: python scripts/levers_table.py TEXT N_TOKENS PREFILL OUT_DIR [--shard I/N] [--op-by-op] SPEC [SPEC...]

Runs ``kvslim.evaluate.perplexity_through_cache`` (chunk 1: every scored token is a decode step) for each
SPEC against the uncompressed reference ``none``, whose next-token logits are computed once and kept in
OUT_DIR/reference.pt (later runs and shards reuse them). One JSON line per finished mode is appended to
OUT_DIR/results.jsonl (``PerplexityResult.summary``: ppl, ppl ratio, KLD mean/p99/max, top-1), so an
interrupted run loses only the mode in progress and a rerun skips what is done. ``--shard I/N`` runs
every N-th spec from the I-th, for N processes side by side. ``--op-by-op`` attends op by op
(``kvslim.attention.FUSED_DECODE = False``) instead of through the fused decode call: the same modes, another
fp32 summation order (use its own OUT_DIR: rows are keyed by spec). Specs are ``kvslim eval`` specs (e.g.
``int2,rotate=kv,pre_rope=1``; ``mean_center=FILE`` bias files are loaded for the embedded model).
This is what docs/quality.md's "Low-bit levers" tables were printed with (scripts/levers_print.py prints
the table from results.jsonl).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import kvslim
from kvslim import SlimCache, attention, parse_spec
from kvslim.evaluate.perplexity import perplexity_through_cache
from kvslim.models import load_model


def main(argv: list[str]) -> int:
    shard = (0, 1)
    if "--shard" in argv:
        i = argv.index("--shard")
        a, b = argv[i + 1].split("/")
        shard = (int(a), int(b))
        del argv[i : i + 2]
    if "--op-by-op" in argv:
        argv.remove("--op-by-op")
        attention.FUSED_DECODE = False
    text, n_tokens, prefill, out_dir, *specs = argv
    n_tokens, prefill = int(n_tokens), int(prefill)
    os.makedirs(out_dir, exist_ok=True)
    model, tok = load_model(None)
    kvslim.enable(model)  # decode steps attend on the codes, as users run it (the reference is the same)
    with open(text, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise SystemExit(f"{text} has {ids.shape[1]} tokens, fewer than {n_tokens}")

    def make(spec: str):
        return lambda: SlimCache.from_config(parse_spec(spec), config=model.config)

    ref_path = os.path.join(out_dir, "reference.pt")
    if os.path.exists(ref_path):
        saved = torch.load(ref_path)
        if saved["ids"].shape != ids.shape or not torch.equal(saved["ids"], ids):
            raise SystemExit(f"{ref_path} was computed for other tokens")
        ref_logits, ref_summary = saved["logits"], saved["summary"]
    else:
        ref, ref_logits = perplexity_through_cache(
            model, ids, make("none"), prefill=prefill, keep_logits=True, progress=False, label="none"
        )
        ref_summary = ref.summary(None)
        tmp = ref_path + ".tmp"
        torch.save({"ids": ids, "logits": ref_logits, "summary": ref_summary}, tmp)
        os.replace(tmp, ref_path)
    results = os.path.join(out_dir, "results.jsonl")
    done = set()
    if os.path.exists(results):
        with open(results) as f:
            done = {json.loads(line)["config"] for line in f if line.strip()}
    if "none" not in done and shard[0] == 0:
        _append(
            results, {**ref_summary, "config": "none", "text": text, "tokens": n_tokens, "prefill": prefill}
        )
    for spec in specs[shard[0] :: shard[1]]:
        if spec in done:
            continue
        r = perplexity_through_cache(
            model, ids, make(spec), prefill=prefill, reference_logits=ref_logits, progress=False, label=spec
        )
        row = r.summary(ref_summary["ppl"])
        row.update(config=spec, text=text, tokens=n_tokens, prefill=prefill)
        _append(results, row)
        print(
            f"{spec}: ppl ratio {row['ppl_ratio']:.4f} KLD {row['kld_mean']:.4g} top-1 {row['top1']:.4f}",
            flush=True,
        )
    return 0


def _append(path: str, row: dict) -> None:
    row = {k: v for k, v in row.items() if k != "curve"}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
