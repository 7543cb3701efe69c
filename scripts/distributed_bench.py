"""docs/distributed.md's numbers: the KV bytes each tensor-parallel rank holds.

Three subcommands:

    python scripts/distributed_bench.py make-tiny DIR                  # a tiny random Llama (4 KV heads) in DIR
    torchrun --nproc-per-node 2 scripts/distributed_bench.py tiny DIR  # measured, per rank (also with 1)
    python scripts/distributed_bench.py paper                          # Llama-3-70B on 8 GPUs at 128K, on paper

``tiny`` loads DIR tensor parallel over every process torchrun started (gloo on the CPU, NCCL on GPUs),
feeds the same tokens through a cache per mode (:func:`kvslim.distributed.rank_cache`) and prints, from rank
0, each rank's ``nbytes()`` / ``live_nbytes()`` next to :func:`kvslim.evaluate.memory.cache_bytes` for that
rank's heads (they agree: the formula counts what ``live_nbytes`` counts) and the sum over the ranks
(:func:`kvslim.distributed.reduce_nbytes`).

``paper`` builds no model: it evaluates the same formula for a model shape. Storage is per KV head, so a
rank holding ``H_kv / N`` heads holds exactly ``1 / N`` of the K/V bytes (plus its own copy of the RoPE
frequencies and per-row state, a few hundred bytes, which the formula leaves out).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

#: the window modes with group=16, residual=16: under the defaults (32, 128) a 60-token window never encodes a token
TINY_MODES = (
    "none",
    "int8",
    "int4",
    "q4_0",
    "int4,sink=4,window=60,group=16,residual=16",
    "q4_0,sink=4,window=60,group=16,residual=16",
)
PAPER_MODES = ("none", "int4", "q4_0", "int4,sink=4,window=4092", "q4_0,sink=4,window=4092")
#: Llama-3-70B's attention geometry (config.json: 80 layers, 64 query heads, 8 KV heads of 128)
LLAMA3_70B = dict(layers=80, kv_heads=8, head_dim=128)


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def make_tiny(path: str) -> None:
    """The tests' tiny Llama: hidden 128, 4 query and 4 KV heads of 32, 2 layers, vocab 256, seed 0."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
    )
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    print(f"saved a tiny Llama ({config.num_key_value_heads} KV heads) to {path}")


def tiny(path: str, tokens: int, dtype: torch.dtype) -> None:
    import transformers as tf

    from kvslim import distributed
    from kvslim.config import parse_spec
    from kvslim.evaluate.memory import ModelShape, cache_bytes
    from kvslim.generate import prefill

    world = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs: dict = {"dtype": dtype}
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
    model = tf.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    heads = distributed.rank_kv_heads(model)
    layers = model.config.num_hidden_layers
    head_dim = model.config.head_dim
    ids = torch.arange(tokens).remainder(model.config.vocab_size)[None].to(model.device)  # (1, T)
    rows = []
    for spec in TINY_MODES:
        cfg = parse_spec(spec)
        cache = distributed.rank_cache(model, **cfg.to_dict())
        prefill(model, ids, cache, chunk_size=64)
        _, formula = cache_bytes(ModelShape(layers, len(heads), head_dim, dtype), cfg, tokens, prefill=64)
        local = torch.tensor([heads.start, heads.stop, cache.nbytes(), cache.live_nbytes(), formula])
        per_rank = [local]
        if world > 1:
            per_rank = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(per_rank, local)
        rows.append(
            (spec, per_rank, distributed.reduce_nbytes(cache), distributed.reduce_nbytes(cache, live=True))
        )
    if not distributed.is_main_process():
        return
    print(
        f"tiny Llama, {world} rank(s), {tokens} tokens, {str(dtype).replace('torch.', '')}; rank 0 holds KV heads "
        f"{heads.start}..{heads.stop - 1}"
    )
    print("| mode | rank | KV heads | nbytes | live_nbytes | cache_bytes (formula) | sum nbytes | sum live |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for spec, per_rank, total, total_live in rows:
        for r, t in enumerate(per_rank):
            start, stop, nb, live, formula = (int(x) for x in t)
            sums = (f"{total:,}", f"{total_live:,}") if r == 0 else ("", "")
            print(
                f"| {spec if r == 0 else ''} | {r} | {start}..{stop - 1} | {nb:,} | {live:,} | "
                f"{formula:,} | {sums[0]} | {sums[1]} |"
            )
    if world > 1:
        dist.destroy_process_group()


def paper(gpus: int, tokens: int) -> None:
    from kvslim.config import parse_spec
    from kvslim.evaluate.memory import ModelShape, cache_bytes

    heads = LLAMA3_70B["kv_heads"]
    if heads % gpus:
        raise SystemExit(f"{heads} KV heads do not split over {gpus} GPUs")
    whole = ModelShape(LLAMA3_70B["layers"], heads, LLAMA3_70B["head_dim"], torch.float16)
    rank = ModelShape(LLAMA3_70B["layers"], heads // gpus, LLAMA3_70B["head_dim"], torch.float16)
    print(
        f"Llama-3-70B shape (80 layers, 8 KV heads x 128, fp16 model) on {gpus} GPUs: {heads // gpus} KV "
        f"head(s) per GPU; {tokens:,} tokens seen, batch 1, one token per step"
    )
    print("| mode | tokens stored | KV bytes per GPU | whole model | x smaller than fp16 |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for spec in PAPER_MODES:
        cfg = parse_spec(spec)
        stored, per_gpu = cache_bytes(rank, cfg, tokens)
        _, total = cache_bytes(whole, cfg, tokens)
        if total != gpus * per_gpu:  # storage is per head: the shares are exact
            raise RuntimeError(f"{spec}: {gpus} x {per_gpu} bytes per GPU != {total} for the whole model")
        base = per_gpu if base is None else base
        label = "none (fp16)" if spec == "none" else spec
        print(f"| {label} | {stored:,} | {_fmt(per_gpu)} | {_fmt(total)} | {base / per_gpu:.1f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("make-tiny", help="save the tiny random Llama to DIR")
    s.add_argument("dir")
    s = sub.add_parser("tiny", help="per-rank bytes on the tiny model (run under torchrun)")
    s.add_argument("dir")
    s.add_argument("--tokens", type=int, default=256)
    s.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    s = sub.add_parser("paper", help="KV bytes per GPU for Llama-3-70B, from kvslim's byte formula")
    s.add_argument("--gpus", type=int, default=8)
    s.add_argument("--tokens", type=int, default=131072)
    args = p.parse_args(argv)
    if args.cmd == "make-tiny":
        make_tiny(args.dir)
    elif args.cmd == "tiny":
        tiny(args.dir, args.tokens, getattr(torch, args.dtype))
    else:
        paper(args.gpus, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
