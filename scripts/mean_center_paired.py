"""Paired KLD difference (centered - plain) per token, with its standard error, through the cached path.

usage: python paired.py BIAS.gguf EVAL_TEXT N_TOKENS PREFILL CHUNK FORMAT [FORMAT...]
(each FORMAT is a spec without mean_center, e.g. none,k=q4_0,residual=0)
"""

import math
import sys

from kvslim.evaluate import compare_perplexity
from kvslim.models import load_model

bias, text, n, prefill, chunk, *bases = sys.argv[1:]
model, tok = load_model(None)
with open(text) as f:
    ids = tok(f.read(), return_tensors="pt").input_ids[:, : int(n)]
specs = [s for b in bases for s in (b, f"{b},mean_center={bias}")]
rep = compare_perplexity(model, ids, specs, prefill=int(prefill), chunk=int(chunk), progress=False)
res = {r.config: r for r in rep.results}
print(
    f"{ids.shape[1]} tokens of {text}, prefill {prefill}, chunk {chunk}; reference ppl {rep.reference.ppl:.3f}"
)
for b in bases:
    plain, cent = res[b], res[f"{b},mean_center={bias}"]
    d = cent.kld - plain.kld  # (n,) paired per-token difference
    se = float(d.std(unbiased=True)) / math.sqrt(d.numel())
    print(
        f"{b:28s} KLD {plain.kld_mean:.5f} -> {cent.kld_mean:.5f}  diff {float(d.mean()):+.5f} +- {se:.5f}  "
        f"({float(d.mean()) / plain.kld_mean:+.0%})  top-1 {plain.top1:.4f} -> {cent.top1:.4f}  "
        f"ppl {plain.ppl:.3f} -> {cent.ppl:.3f}"
    )
