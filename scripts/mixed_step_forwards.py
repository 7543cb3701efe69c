"""Count the model forwards of each engine step while a long prompt joins decoding rows (issue 30, item 2).

Counted, not timed: a forward pre-hook on the model records each forward and the tokens it carries, step by
step, while a ``--prompt``-token request prefills beside ``--rows`` decoding ones. Uses a small random Llama
(no download; the count does not depend on the weights) and only the public engine API, so the same command
runs against an older checkout (``PYTHONPATH=<old>/src``) for the before/after comparison.

    python scripts/mixed_step_forwards.py --rows 15 --prompt 4096 --prefill-chunk 256
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers as tf

import kvslim
from kvslim.engine import Engine, Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=15, help="decoding rows when the prompt joins")
    ap.add_argument("--prompt", type=int, default=4096, help="tokens of the joining prompt")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--cache", default="int4", help="cache spec of every request")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2 * (args.prompt + 64), pad_token_id=0,
    )
    model = kvslim.enable(tf.LlamaForCausalLM(config).eval())
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 128, (n,), generator=g).tolist()  # noqa: E731
    steps_needed = -(-args.prompt // args.prefill_chunk) + 4
    engine = Engine(model, max_batch=args.rows + 1, prefill_chunk=args.prefill_chunk, cache=args.cache)
    decoding = [engine.submit(Request(ids(8), max_new_tokens=steps_needed + 8)) for _ in range(args.rows)]
    while not all(engine.results[r].tokens for r in decoding):
        engine.step()
    forwards: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: forwards.append(int(kw["input_ids"].numel())), with_kwargs=True
    )
    joiner = engine.submit(Request(ids(args.prompt), max_new_tokens=2))
    per_step = []
    while not engine.results[joiner].tokens:
        events = engine.step()
        decoded = sum(1 for e in events if e.request_id in decoding and e.token is not None)
        per_step.append({"forwards": len(forwards), "tokens_per_forward": list(forwards), "decode_tokens": decoded})
        forwards.clear()
    hook.remove()
    summary = {
        "rows": args.rows,
        "prompt": args.prompt,
        "prefill_chunk": args.prefill_chunk,
        "steps_until_first_token": len(per_step),
        "forwards": sum(s["forwards"] for s in per_step),
        "forwards_per_step": sorted({s["forwards"] for s in per_step}),
        "decode_tokens_while_prefilling": sum(s["decode_tokens"] for s in per_step),
        "steps": per_step,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}))
    print(json.dumps(per_step[:2] + per_step[-1:]))


if __name__ == "__main__":
    main()
