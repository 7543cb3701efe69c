"""Bytes a bounded cache holds once full, per stream: what it allocated (``nbytes``), what its stored tokens
take (``live``), and an fp16 cache of the same stored tokens — for several windows and formats.

    python scripts/bounded_bytes.py [--tokens 2500] [--json FILE]

The embedded model's KV shape (30 layers, 3 KV heads, head_dim 64, fp32): a 1-layer random-weight Llama
of that shape is fed a 500-token prompt, then one token per step until ``--tokens`` tokens were seen; the
numbers are per layer times 30. No model download, no timing: safe on a loaded machine.
"""

from __future__ import annotations

import argparse
import json

import torch

SPECS = [
    "int4,sink=4,window=1020",
    "q4_0,sink=4,window=1020",
    "int8,sink=4,window=1020",
    "int4,sink=4,window=124",
    "int4,sink=4,window=124,residual=32",
    "int4,sink=4,window=32",
    "none,sink=4,window=1020",
]


def measure(spec: str, tokens: int, layers: int = 30) -> dict:
    import transformers as tf

    import kvslim
    from kvslim import SlimCache, parse_spec
    from kvslim import generate as gen

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=1, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192,
    )
    model = kvslim.enable(tf.LlamaForCausalLM(cfg).eval())
    cache = SlimCache.from_config(parse_spec(spec), config=model.config)
    most_live = 0
    with torch.inference_mode():
        gen.prefill(model, torch.randint(0, 256, (1, 500)), cache)
        for i in range(tokens - 500):
            gen.decode_one_token(model, torch.tensor([[i % 256]]), cache)
            most_live = max(most_live, cache.live_nbytes())
    held = cache.nbytes()
    fp16 = cache.fp16_full_cache_bytes(cache.stored_tokens())
    report = cache.report()
    return {
        "spec": spec,
        "residual": report.get("residual", parse_spec(spec).residual),
        "tokens_seen": cache.get_seq_length(),
        "tokens_stored": cache.stored_tokens(),
        "cache_mib": layers * held / 2**20,
        "live_mib": layers * cache.live_nbytes() / 2**20,
        "most_live_mib": layers * most_live / 2**20,
        "fp16_same_tokens_mib": layers * fp16 / 2**20,
        "cache_over_most_live": held / most_live,
        "cache_over_fp16": held / fp16,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2500)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [measure(s, args.tokens) for s in SPECS]
    print(f"{'spec':<38} {'resid':>5} {'cache MiB':>9} {'live MiB':>8} {'max live':>8} {'fp16 MiB':>8} {'/max live':>9} {'/fp16':>6}")
    for r in rows:
        print(
            f"{r['spec']:<38} {r['residual']:>5} {r['cache_mib']:>9.2f} {r['live_mib']:>8.2f} {r['most_live_mib']:>8.2f} "
            f"{r['fp16_same_tokens_mib']:>8.2f} {r['cache_over_most_live']:>9.3f} {r['cache_over_fp16']:>6.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
