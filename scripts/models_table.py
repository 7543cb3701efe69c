"""docs/models.md's table: every decoder family transformers ships x what SlimCache keeps per layer type,
which attention path serves it, and the bytes per token at 4,096 tokens for none / int4 / q4_0 against
transformers' default cache (DynamicCache) — all from the families' default (full-size) configs.

No model is built: each attention layer's cache is fed random K/V of the shapes the model would cache
(bf16, batch 1, 4,096 tokens in one update), so the bytes are exact for the K/V part. Linear-attention
(SSM / conv) layers keep a constant-size recurrent state that needs the model to fill; it does not grow
with the tokens and is left out of the per-token column (counted by ``nbytes()`` at run time).

    python scripts/models_table.py [--tokens 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

FAMILIES = {
    "Gemma 3": "Gemma3TextConfig",
    "gpt-oss": "GptOssConfig",
    "Cohere2": "Cohere2Config",
    "Olmo3": "Olmo3Config",
    "Mistral (sliding)": "MistralConfig",
    "Llama 4": "Llama4TextConfig",
    "Gemma-3n": "Gemma3nTextConfig",
    "Qwen3-Next": "Qwen3NextConfig",
    "Falcon-H1": "FalconH1Config",
    "Bamba": "BambaConfig",
    "Jamba": "JambaConfig",
    "LFM2": "Lfm2Config",
    "DeepSeek-V3": "DeepseekV3Config",
    "Llama 3 (reference)": "LlamaConfig",
}
FORMATS = ("none", "int4", "q4_0")


def _config(cls_name: str):
    import transformers as tf

    cls = getattr(tf, cls_name)
    if cls_name == "Gemma3nTextConfig":  # its defaults are inconsistent in this release: share 10 of 35 layers
        return cls(num_kv_shared_layers=10)
    return cls()


def _feed(cache, shapes, layers, tokens: int) -> None:
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(layers):
        if not hasattr(layer, "update") or type(layer).__name__ in ("DummyLayer", "LinearAttentionLayer"):
            continue
        k = torch.randn(1, shapes.n_kv_heads, tokens, shapes.k_head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(1, shapes.n_kv_heads, tokens, shapes.v_head_dim, generator=g).to(torch.bfloat16)
        cache.update(k, v, i)


def _tensor_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def row(name: str, cls_name: str, tokens: int) -> dict:
    from transformers import DynamicCache

    import kvslim
    from kvslim.shapes import ModelShapes

    out: dict = {"family": name, "config": cls_name}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = _config(cls_name)
            shapes = ModelShapes.from_config(config)
            probe = kvslim.SlimCache(config=config)
    except Exception as e:  # noqa: BLE001 - reported in the table
        out["supported"] = f"no: {e}"
        return out
    types: dict[str, int] = {}
    for layer in probe.layers:
        kind = getattr(layer, "layer_type", None) or type(layer).__name__
        types[kind] = types.get(kind, 0) + 1
    out["layer_types"] = types
    out["kv_layers"] = len(probe.stores())
    out["layers"] = len(probe.layers)
    out["supported"] = "yes"
    mla = shapes.k_head_dim != shapes.v_head_dim
    out["attention_path"] = "materializing (expands the latent)" if mla else "compressed on decode (kvslim.enable)"
    dyn = DynamicCache(config=config)
    _feed(dyn, shapes, dyn.layers, tokens)
    out["dynamic_bytes_per_token"] = _tensor_bytes(dyn) / tokens
    for fmt in FORMATS:
        cache = kvslim.SlimCache(kv_quantize=fmt, config=config)
        _feed(cache, shapes, cache.layers, tokens)
        kv = sum(s.nbytes() for s in cache.stores())
        out[f"{fmt}_bytes_per_token"] = kv / tokens
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import sys
    import time

    rows = []
    for n, c in FAMILIES.items():
        t0 = time.perf_counter()
        rows.append(row(n, c, args.tokens))
        print(f"{n}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print("| family | layers (types) | layers holding K/V | attention path | DynamicCache B/token | "
          "none | int4 | q4_0 | int4 vs DynamicCache |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["supported"] != "yes":
            print(f"| {r['family']} | {r['supported']} | | | | | | | |")
            continue
        types = ", ".join(f"{n} {t}" for t, n in r["layer_types"].items())
        dyn = r["dynamic_bytes_per_token"]
        print(
            f"| {r['family']} | {r['layers']} ({types}) | {r['kv_layers']} | {r['attention_path']} | {dyn:,.0f} | "
            f"{r['none_bytes_per_token']:,.0f} | {r['int4_bytes_per_token']:,.0f} | {r['q4_0_bytes_per_token']:,.0f} | "
            f"{r['int4_bytes_per_token'] / dyn:.2f}x |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
