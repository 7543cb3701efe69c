"""docs/models.md's table: every decoder family transformers ships x what SlimCache keeps per layer type,
which attention path serves it, and the bytes per token at 4,096 tokens for none / int4 / q4_0 against
transformers' default cache (DynamicCache) — all from the families' default (full-size) configs.

No model is built: attention layers are fed random K/V of the shapes the model would cache (bf16,
batch 1, 4,096 tokens in one update; one layer per layer type and one head, scaled by the heads and
layers of that type — storage is per head and per layer, so this is exact), so the bytes are exact for
the K/V part. Linear-attention
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


def _kv_layer_bytes(cache, shapes, tokens: int) -> int:
    """K/V bytes of every attention layer after ``tokens`` tokens, exactly, at a fraction of the cost:
    layers of one type have one shape and heads are stored independently, so one layer of each type is
    fed one head of random bf16 K/V and its bytes are scaled by the heads and the layers of that type."""
    g = torch.Generator().manual_seed(0)
    first: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ in ("DummyLayer", "LinearAttentionLayer"):
            continue
        kind = getattr(layer, "layer_type", None) or ("sliding" if getattr(layer, "is_sliding", False) else "full")
        first.setdefault(kind, i)
        count[kind] = count.get(kind, 0) + 1
    total = 0
    for kind, i in first.items():
        k = torch.randn(1, 1, tokens, shapes.k_head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(1, 1, tokens, shapes.v_head_dim, generator=g).to(torch.bfloat16)
        cache.update(k, v, i)
        layer = cache.layers[i]
        if hasattr(layer, "store"):
            one = layer.store.nbytes()
        else:
            one = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        total += one * shapes.n_kv_heads * count[kind]
    return total


def _supports_sdpa(config) -> bool:
    """Whether the family's model classes run through transformers' attention interface (sdpa)."""
    import importlib

    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    bases = [getattr(module, n) for n in dir(module) if n.endswith("PreTrainedModel") and n != "PreTrainedModel"]
    return all(getattr(b, "_supports_sdpa", False) for b in bases) if bases else False


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
    out["layer_types"] = {kind: row["layers"] for kind, row in probe.layer_type_bytes().items()}
    out["kv_layers"] = len(probe.stores())
    out["layers"] = len(probe.layers)
    out["supported"] = "yes"
    from kvslim.shapes import is_mla

    if is_mla(config):
        out["attention_path"] = "materializing (expands the latent)"
    elif not _supports_sdpa(config):
        out["attention_path"] = "materializing (eager attention only)"
    else:
        out["attention_path"] = "compressed on decode (kvslim.enable)"
    dyn = DynamicCache(config=config)
    out["dynamic_bytes_per_token"] = _kv_layer_bytes(dyn, shapes, tokens) / tokens
    for fmt in FORMATS:
        try:
            cache = kvslim.SlimCache(kv_quantize=fmt, config=config)
        except ValueError as e:  # e.g. a block format and a head_dim that is not a multiple of 32
            out[f"{fmt}_bytes_per_token"] = None
            out[f"{fmt}_why"] = str(e)
            continue
        out[f"{fmt}_bytes_per_token"] = _kv_layer_bytes(cache, shapes, tokens) / tokens
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
        ratio = f"{r['int4_bytes_per_token'] / dyn:.2f}x" if dyn else "-"
        cells = [
            "n/a" if r[f"{f}_bytes_per_token"] is None else f"{r[f'{f}_bytes_per_token']:,.0f}" for f in FORMATS
        ]
        print(
            f"| {r['family']} | {r['layers']} ({types}) | {r['kv_layers']} | {r['attention_path']} | {dyn:,.0f} | "
            f"{' | '.join(cells)} | {ratio} |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
