"""Quality through a pool of kvslim pages against the SlimCache of the same spec: teacher-forced, token by token.

    python scripts/paged_quality.py /usr/share/common-licenses/GPL-3 --tokens 512 --prefill 128 --config int4 q4_0

The first ``--tokens`` tokens of the text (the embedded model's tokenizer): a ``--prefill`` chunk, then one decode
step per token, through a :class:`kvslim.cache.pagepool.PagePool` (``forward_pages``) and through a SlimCache
(``forward_rows``, the engine's step) of each ``--config``, each scored against the reference: one plain forward of
the whole text (no cache) in the same run. Prints, per config and path, the perplexity ratio, the mean and p99
KL(reference || path) over the full vocabulary (float64) and top-1 agreement, as ``kvslim eval ppl`` does, and
the K/V bytes each holds at the end. ``OMP_NUM_THREADS`` as you like: quality does not depend on timing.
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def _scores(logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict:
    lp, lr = torch.log_softmax(logits.double(), -1), torch.log_softmax(ref.double(), -1)
    kld = (lr.exp() * (lr - lp)).sum(-1)
    nll, nll_ref = -lp.gather(1, targets[:, None])[:, 0], -lr.gather(1, targets[:, None])[:, 0]
    return {
        "ppl_ratio": math.exp(float(nll.mean() - nll_ref.mean())),
        "kld_mean": float(kld.mean()),
        "kld_p99": float(torch.quantile(kld, 0.99)),
        "top1": float((logits.argmax(-1) == ref.argmax(-1)).double().mean()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--config", nargs="+", default=["int4", "q4_0"])
    p.add_argument("--json")
    a = p.parse_args()
    if not 0 < a.prefill < a.tokens:
        p.error(f"--prefill must be between 1 and --tokens - 1, got {a.prefill}")

    import kvslim
    from kvslim.cache.paged_adapter import forward_pages
    from kvslim.cache.pagepool import pool_for
    from kvslim.generate import forward_rows, prefill
    from kvslim.models.load import load_model

    model, tok = load_model(None)[:2]
    kvslim.enable(model)
    with open(a.text, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[0, : a.tokens].tolist()
    if len(ids) < a.tokens:
        p.error(f"the text has {len(ids)} tokens, fewer than --tokens {a.tokens}")
    targets = torch.tensor(ids[a.prefill :])
    out = {}
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, a.prefill - 1 : -1].float()
        for spec in a.config:
            pool = pool_for(model, spec, pages=-(-a.tokens // 32) + 1, max_rows=1)
            row = pool.new_row()
            cache = kvslim.SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
            got = {
                "pages": [forward_pages(model, pool, [(ids[: a.prefill], row)], row_multiple=1)[0]],
                "slimcache": [prefill(model, torch.tensor([ids[: a.prefill]]), cache)[0]],
            }
            for t in ids[a.prefill : -1]:
                got["pages"].append(forward_pages(model, pool, [([t], row)], row_multiple=1)[0])
                got["slimcache"].append(forward_rows(model, [t], [cache], row_multiple=1)[0])
            for path, rows in got.items():
                s = _scores(torch.stack(rows), ref, targets)
                s["kv_bytes"] = (
                    pool.nbytes(row) + pool.stage_bytes() // pool.max_rows
                    if path == "pages"
                    else cache.nbytes()
                )
                out[f"{spec} {path}"] = s
    print(
        f"{len(targets)} scored tokens (a {a.prefill}-token prefill, then one decode step each) of {a.text}\n"
    )
    print(f"{'config':18s} {'ppl ratio':>9s} {'KLD mean':>10s} {'KLD p99':>9s} {'top-1':>6s} {'KV MiB':>7s}")
    for name, s in out.items():
        print(
            f"{name:18s} {s['ppl_ratio']:9.4f} {s['kld_mean']:10.5f} {s['kld_p99']:9.4f} {s['top1']:6.3f} "
            f"{s['kv_bytes'] / 2**20:7.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
