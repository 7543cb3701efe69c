"""StreamingLLM far past the training context, cheaply: perplexity of 1K-token buckets deep in a long
text, for window-only / sinks with original positions / sinks with in-cache positions (docs/streaming.md).

A bounded cache's state at token ``p`` depends only on the sink tokens and the last ``window`` tokens —
and, through RoPE, on the position ``p`` itself. So instead of streaming all ``p`` tokens, each bucket
``[p, p + bucket)`` is measured on a fresh cache that holds the text's first ``sink`` tokens (at
positions 0..sink-1), whose token counter is then advanced to ``p - warm`` (the tokens in between are
counted as seen and evicted, as a full stream would have them), and which is fed ``warm`` tokens of
the text before the bucket. The scored tokens see exactly the positions, sinks and window a full
stream would give them; what the protocol approximates is the deep-layer K/V of the window tokens,
which a full stream computes with their own full windows (``warm = 2 x window`` makes every window
token's own context at least one window long). Everything goes through kvslim's decode loop
(:func:`kvslim.generate.forward`), whose position ids stay bounded on long streams.

    python scripts/long_stream.py --text FILE --starts 1024,12288,16384,23552 \\
        --config none,window=1024 --config none,sink=4,window=1020,positions=original \\
        --config none,sink=4,window=1020,positions=cache --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch


def bucket_ppl(model, ids, spec: str, start: int, *, bucket: int, warm: int, chunk: int) -> dict:
    from kvslim import SlimCache, parse_spec
    from kvslim.generate import forward

    cfg = parse_spec(spec)
    cache = SlimCache.from_config(cfg, config=model.config)
    cache.set_left_padding(None)
    sink = cfg.sink_tokens  # a window's sinks, or an unbounded quantized cache's (sink=auto): the text's first tokens
    with torch.inference_mode():
        if sink:
            forward(model, ids[:, :sink], cache)  # the sinks: the text's first tokens, positions 0..sink-1
        lo = max(start - warm, sink)
        for store in cache.stores():  # the tokens in between: seen and evicted, as in a full stream
            store.seen = lo
        forward(model, ids[:, lo:start], cache)  # warm-up: the window before the bucket
        nll = []
        prev = ids[:, start - 1 : start]
        logits = None
        pos = start
        while pos < start + bucket:  # score tokens start .. start+bucket-1, chunk at a time
            end = min(pos + chunk, start + bucket)
            feed = torch.cat([prev, ids[:, pos : end - 1]], dim=1)  # token t-1 predicts token t
            logits = forward(model, feed, cache, logits_to_keep=0)[0].double()  # (C, V)
            targets = ids[0, pos:end]
            nll.append(-(torch.log_softmax(logits, -1).gather(-1, targets[:, None]))[:, 0])
            prev = ids[:, end - 1 : end]
            pos = end
    nll = torch.cat(nll)
    return {
        "config": spec,
        "start": start,
        "tokens": int(nll.numel()),
        "ppl": math.exp(float(nll.mean())),
        "stored": cache.stored_tokens(),
        "seen": cache.get_seq_length(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", required=True)
    parser.add_argument("--starts", default="1024,12288,16384,23552", help="bucket starts (token indices)")
    parser.add_argument("--bucket", type=int, default=1024)
    parser.add_argument("--warm", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="plot the JSON files given with --merge")
    parser.add_argument("--merge", nargs="*", default=None, metavar="JSON", help="only plot these result files")
    args = parser.parse_args()
    if args.merge is not None:
        rows = []
        for path in args.merge:
            with open(path, encoding="utf-8") as f:
                rows += json.load(f)
        plot(rows, args.plot)
        return 0

    from kvslim.models import load_model

    model, tok = load_model(None)
    with open(args.text, encoding="utf-8") as f:
        ids = torch.tensor([tok(f.read())["input_ids"]])
    starts = [int(s) for s in args.starts.split(",")]
    need = max(starts) + args.bucket
    if ids.shape[1] < need:
        print(f"the text has {ids.shape[1]} tokens; the buckets need {need}", file=sys.stderr)
        return 2
    rows = []
    for spec in args.config:
        for start in starts:
            t0 = time.perf_counter()
            r = bucket_ppl(model, ids, spec, start, bucket=args.bucket, warm=args.warm, chunk=args.chunk)
            rows.append(r)
            print(f"{spec:45s} {start:6d}  ppl {r['ppl']:9.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
            if args.json:  # rewritten after every bucket: a long run keeps what it measured
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(rows, f, indent=1)
    return 0


def plot(rows: list[dict], path: str) -> None:
    """Perplexity per bucket start, one line per config (log scale), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvslim.atomic import atomic_path

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for spec in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["start"] + r["tokens"] / 2, r["ppl"]) for r in rows if r["config"] == spec)
        style = "-" if len(pts) > 2 else "none"  # a few spot checks: points, not a line
        ax.plot([x / 1000 for x, _ in pts], [y for _, y in pts], marker="o", linestyle=style, label=spec)
    ax.axvline(8.192, color="grey", linestyle=":", label="training context (8K)")
    ax.set_yscale("log")
    ax.set_xlabel("position in the stream (K tokens)")
    ax.set_ylabel("perplexity of the 1K-token bucket")
    ax.set_title("SmolLM2-135M, StreamingLLM sink 4 + window 1020: in-cache vs original positions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
