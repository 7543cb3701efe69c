"""One process of the distributed checks in tests/test_distributed.py (also usable by hand).

    python tests/distributed_worker.py MODEL_DIR OUT_DIR [--split]

Under ``torchrun --nproc-per-node N`` (or with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set
as torchrun sets them) it loads MODEL_DIR tensor-parallel (transformers' ``tp_plan="auto"``: q/k/v_proj colwise,
o_proj rowwise, so each rank holds a contiguous block of KV heads) over gloo; alone, it loads MODEL_DIR whole —
or, with ``--split``, with a ``device_map`` that places the two layers on separate placements (layer 1 offloaded
to disk). Then it runs every case of :data:`CASES` through a :class:`~kvslim.SlimCache` built by
:func:`kvslim.distributed.rank_cache` and writes ``OUT_DIR/rank{RANK}.pt``: per case the greedy tokens, the
teacher-forced logits, the bytes, and the first layer's stored K/V; and the weights' fingerprint
(:func:`kvslim.calibration.fingerprint.model_fingerprint`, which gathers the sharded ones).

This script compares nothing: the test sets each rank's record against the single-process one.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

#: prompt, teacher-forced text and the greedy run's length (40 tokens in all: far past sink 2 + window 12)
PROMPT = [5, 17, 42, 99, 3, 250, 64, 7]
NEW_TOKENS = 32
TEXT = [(i * 37 + 11) % 256 for i in range(40)]

#: name -> (SlimCache kwargs, use the "kvslim" attention). Lossy formats with group_size 4 / residual 4 so that
#: tokens are really encoded (the defaults, 32 / 128, would keep these 40 tokens at full precision).
_Q = dict(group_size=4, residual=4)
_S = dict(sink=2, window=12)
CASES: dict[str, tuple[dict, bool]] = {
    "none": (dict(kv_quantize="none"), False),
    "none+stream": (dict(kv_quantize="none", **_S), False),
    "int8": (dict(kv_quantize="int8", **_Q), False),
    "int8+stream": (dict(kv_quantize="int8", **_Q, **_S), False),
    "q8_0": (dict(kv_quantize="q8_0", **_Q), False),
    "q8_0+stream": (dict(kv_quantize="q8_0", **_Q, **_S), False),
    "q8_0+center": (dict(kv_quantize="q8_0", **_Q, mean_center="bias"), False),
    "none/kvslim": (dict(kv_quantize="none"), True),
    "int8/kvslim": (dict(kv_quantize="int8", **_Q), True),
    "int8+stream/kvslim": (dict(kv_quantize="int8", **_Q, **_S), True),
    "q8_0/kvslim": (dict(kv_quantize="q8_0", **_Q), True),
    "q8_0+stream/kvslim": (dict(kv_quantize="q8_0", **_Q, **_S), True),
    "q8_0+center/kvslim": (dict(kv_quantize="q8_0", **_Q, mean_center="bias"), True),
}


def bias_for(config) -> list[torch.Tensor]:
    """A fixed, full-width mean-centering bias: one (H_kv, D) tensor per layer (every rank builds the same)."""
    from kvslim.shapes import ModelShapes

    s = ModelShapes.from_config(config)
    g = torch.Generator().manual_seed(1)
    return [torch.randn(s.n_kv_heads, s.head_dim, generator=g) * 0.5 for _ in range(s.n_layers)]


def split_map() -> dict[str, str]:
    """Layer 0 (with the embeddings, norm and head) on the CPU, layer 1 offloaded to disk: transformers'
    layer-split placement, the only two kinds a CPU-only machine has."""
    return {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }


def load(model_dir: str, *, tp: bool, split: bool, offload_dir: str | None = None):
    import transformers as tf

    kwargs: dict = {"dtype": torch.float32}
    if tp:
        try:  # the 5.x way; plain tp_plan= is its older spelling
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
        except ImportError:
            kwargs["tp_plan"] = "auto"
    elif split:
        kwargs.update(device_map=split_map(), offload_folder=offload_dir)
    return tf.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()


def run_cases(model, names=None) -> dict:
    """Every case of :data:`CASES` (or ``names``) through this process's model: a dict per case."""
    import kvslim
    from kvslim import distributed
    from kvslim.generate import greedy, teacher_forced

    out = {}
    attn = model.config._attn_implementation
    for name in names or CASES:
        kwargs, compressed = CASES[name]
        kwargs = dict(kwargs)
        if kwargs.get("mean_center") == "bias":
            kwargs["mean_center"] = bias_for(model.config)
        if compressed:
            kvslim.enable(model)
        else:
            model.set_attn_implementation(attn)
        cache = distributed.rank_cache(model, **kwargs)
        prompt = torch.tensor([PROMPT])
        tokens = greedy(model, prompt, cache, NEW_TOKENS)
        nbytes, live = cache.nbytes(), cache.live_nbytes()
        k, v = cache.stores()[0].read(torch.float32)  # (1, H_rank, stored, D)
        devices = [str(store.read(torch.float32)[0].device) for store in cache.stores()]
        summed = distributed.reduce_nbytes(cache)
        summed_live = distributed.reduce_nbytes(cache, live=True)
        cache = distributed.rank_cache(model, **kwargs)
        chunks = [
            logits for _, logits in teacher_forced(model, torch.tensor([TEXT]), cache, prefill=8, chunk=1)
        ]
        out[name] = {
            "tokens": tokens,
            "logits": torch.cat(chunks).clone(),  # (len(TEXT) - 8, V)
            "nbytes": nbytes,
            "live_nbytes": live,
            "nbytes_sum": summed,
            "live_nbytes_sum": summed_live,
            "components": cache.components(),
            "kv_heads": list(distributed.rank_kv_heads(model)),
            "devices": devices,
            "k0": k.clone(),
            "v0": v.clone(),
        }
    model.set_attn_implementation(attn)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--split", action="store_true", help="one process, layers on separate placements")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    args = p.parse_args(argv)
    from kvslim import distributed
    from kvslim.models import model_fingerprint

    world, rank = distributed.env_world_size(), distributed.env_rank()
    torch.manual_seed(0)
    if world > 1:
        # Joined here (transformers would do it with a 2-hour timeout): a 60 s timeout, so a rank that dies makes
        # the others fail within a minute instead of hanging the test.
        distributed.init_from_env("cpu")
    try:
        offload = os.path.join(args.out_dir, "offload") if args.split else None
        model = load(args.model_dir, tp=world > 1, split=args.split, offload_dir=offload)
        names = args.cases.split(",") if args.cases else None
        record = {
            "world": world,
            "rank": rank,
            "device_map": getattr(model, "hf_device_map", None),
            # a collective when sharded (every rank calls it); not read off disk-offloaded (meta) weights
            "fingerprint": None if args.split else model_fingerprint(model),
            "cases": run_cases(model, names),
        }
        torch.save(record, os.path.join(args.out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
