"""Per-layer relative error of q4_0/q5_0/q8_0 on the real K of an evaluation text, without and with centering.

usage: python kerr.py BIAS.gguf EVAL_TEXT N_TOKENS
"""

import sys

import torch
from transformers import DynamicCache

from kvslim.calibration.meancenter import load_mean_center
from kvslim.formats import dequantize_ggml, quantize_ggml
from kvslim.models import load_model

bias_path, text_path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, tok = load_model(None)
with open(text_path) as f:
    ids = torch.tensor([tok(f.read())["input_ids"][:n]])
bias = load_mean_center(bias_path, n_layers=30, n_kv_heads=3, head_dim=64)
cache = DynamicCache()
with torch.inference_mode():
    model(ids, cache=cache, use_cache=True)


def rel_err(k, kind):  # k: (1, H, T, D); relative squared error of the round trip
    back = dequantize_ggml(quantize_ggml(k, kind), kind)
    return float(((back - k) ** 2).sum() / (k**2).sum())


print("layer  " + "  ".join(f"{kind}: plain -> centered" for kind in ("q4_0", "q5_0", "q8_0")))
tot = {}
for il in range(30):
    k = cache.layers[il].keys.float()
    kc = k - bias[il][None, :, None, :]
    cells = []
    for kind in ("q4_0", "q5_0", "q8_0"):
        # error relative to |k|^2 in both cases (the attention logits see the error, not its ratio to |k - k_bar|)
        e0, e1 = (
            rel_err(k, kind),
            float(((dequantize_ggml(quantize_ggml(kc, kind), kind) - kc) ** 2).sum() / (k**2).sum()),
        )
        tot.setdefault(kind, [0.0, 0.0])
        tot[kind][0] += e0 / 30
        tot[kind][1] += e1 / 30
        cells.append(f"{e0:.2e} -> {e1:.2e}")
    print(f"{il:5d}  " + "  ".join(cells))
print("mean   " + "  ".join(f"{a:.2e} -> {b:.2e} ({a / b:.1f}x)" for a, b in tot.values()))
