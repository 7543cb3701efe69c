"""Why K mean-centering can hurt: the first token's key, per layer, quantized with and without the bias.

usage: python scripts/centering_sink.py BIAS.gguf TEXT N_TOKENS [FORMAT]

One plain forward of the first N_TOKENS of TEXT (a DynamicCache, no quantization), then per layer: the
mean key norm of token 0 and of tokens 4.., the bias norm, token 0's distance to the bias, and the squared
round-trip error of FORMAT (default q4_0) without and with the bias subtracted, for token 0 and for the
rest, plus the fraction of tokens whose error centering lowers. docs/quality.md ("Centering and the
attention sink") prints this table.
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache

from kvslim.calibration.biasfile import read_bias_file
from kvslim.formats import make_codec
from kvslim.models import load_model


def main(argv: list[str]) -> int:
    bias_path, text, n, *rest = argv
    fmt = rest[0] if rest else "q4_0"
    model, tok = load_model(None)
    with open(text, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids[:, : int(n)]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    shapes = cache.layers[0].keys.shape
    bias = read_bias_file(bias_path, n_kv_heads=shapes[1], head_dim=shapes[3]).tensors
    codec = make_codec(fmt, "k")

    def err(x: torch.Tensor) -> torch.Tensor:  # squared round-trip error per token, (1, H, T)
        return (codec.decode(codec.encode(x), torch.float32) - x).pow(2).sum(-1)

    print(
        f"first token: {tok.convert_ids_to_tokens(ids[0, :1].tolist())[0]!r}; format {fmt}; {ids.shape[1]} tokens"
    )
    print("layer |k0|  |k|  |bias| |k0-bias|  err0 plain  err0 centered  err plain  err centered  helps")
    for il, layer in enumerate(cache.layers):
        k = layer.keys.float()  # (1, H, T, D)
        b = bias[il][None, :, None, :]
        ep, ec = err(k), err(k - b)
        row = (
            k[..., 0, :].norm(dim=-1).mean(),
            k[..., 4:, :].norm(dim=-1).mean(),
            b.norm(dim=-1).mean(),
            (k[..., 0, :] - b[..., 0, :]).norm(dim=-1).mean(),
            ep[..., 0].mean(),
            ec[..., 0].mean(),
            ep[..., 4:].mean(),
            ec[..., 4:].mean(),
            (ec < ep).float().mean(),
        )
        print(f"{il:5d} " + " ".join(f"{float(v):.3g}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
