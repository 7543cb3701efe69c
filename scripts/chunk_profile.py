"""A prompt chunk's forward over a long compressed cache: its time on the materialized path (the stored K/V decoded
to fp, then sdpa) against the op-by-op codes path, interleaved, and where the materialized chunk's time goes.

    python scripts/chunk_profile.py --chunk 32 --length 4096 --config int4 [--profile]

One stream of the embedded model is prefilled with ``--length`` seeded random tokens; then chunks of ``--chunk``
tokens are fed in turn with ``FAST_MAX_QUERY`` at its default (16: a longer chunk is handed materialized K/V), to a
copy of the cache that keeps its bodies decoded between chunks (``SlimCache.keep_decoded``: a chunk decodes only
what the last one encoded) and with ``FAST_MAX_QUERY`` raised to the chunk (the chunk reads the codes, op by op),
``--rounds`` of each; the table gives the median ms of each (the first round left out). ``--profile`` then runs 3
chunks of the kept cache under the torch profiler and prints the top ops by self CPU time. Measure on a quiet machine (``uptime`` before and after), alone.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--config", default="int4")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    import kvslim
    import kvslim.attention as att
    import kvslim.cache.layer_adapter as la
    import kvslim.cache.segments as seg
    from kvslim import SlimCache
    from kvslim.config import parse_spec
    from kvslim.generate import prefill
    from kvslim.models import load_model

    default = seg.FAST_MAX_QUERY

    def fast_max_query(n: int) -> None:
        seg.FAST_MAX_QUERY = la.FAST_MAX_QUERY = att.FAST_MAX_QUERY = n

    model, _ = load_model(None)
    kvslim.enable(model)
    c, length = a.chunk, a.length
    ids = torch.randint(0, model.config.vocab_size, (1, length + (2 * a.rounds + 8) * c),
                        generator=torch.Generator().manual_seed(0))
    cache = SlimCache.from_config(parse_spec(a.config), config=model.config)
    pos = {}

    def chunk(on=None) -> None:
        on = cache if on is None else on
        p = pos[id(on)]
        model(input_ids=ids[:, p : p + c], past_key_values=on, use_cache=True, logits_to_keep=1,
              position_ids=torch.arange(p, p + c)[None], cache_position=torch.arange(p, p + c))
        pos[id(on)] = p + c

    modes = ("materialized", "kept", "codes")
    times: dict[str, list[float]] = {m: [] for m in modes}
    with torch.inference_mode():
        prefill(model, ids[:, :length], cache)
        kept = copy.deepcopy(cache)  # the same tokens, its bodies kept decoded between chunks
        kept.keep_decoded(True)
        pos[id(cache)] = pos[id(kept)] = length
        try:
            for r in range(a.rounds):
                for m in modes if r % 2 else modes[::-1]:
                    fast_max_query(c if m == "codes" else default)
                    t0 = time.perf_counter()
                    chunk(kept if m == "kept" else cache)
                    times[m].append(time.perf_counter() - t0)
        finally:
            fast_max_query(default)
        print(f"{a.config}: a {c}-token chunk after {length} tokens, {a.threads} threads, {a.rounds} rounds each")
        names = {"materialized": "materialized K/V + sdpa", "kept": "the same, bodies kept decoded",
                 "codes": "codes, op by op"}
        for m in modes:
            print(f"  {names[m]:<30} median {statistics.median(times[m][1:]) * 1e3:7.1f} ms")
        print(f"  kept decoded bodies: {kept.kept_nbytes() / 2**20:.1f} MiB")
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    chunk(kept)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
