"""Where a windowed ragged step's time goes, beside an unbounded one: call counts and cProfile shares, in one process.

    OMP_NUM_THREADS=1 python scripts/window_profile.py --rows 16 --length 1100 --steps 8 \
        --config int4 'int4,sink=4,window=1020'

Prefills one cache per ``--config`` with ``--length`` seeded random tokens of the embedded model (or, with
``--tiny``, a random-weight Llama of the embedded model's shape: 30 layers, 3 KV heads of 64 channels), copies it
into ``--rows`` rows and staggers them (row ``i`` is fed ``2 i`` more tokens alone), so that rows leave their
residual groups at different steps, as the engine's rows do. Then ``--steps`` engine decode steps
(:func:`kvslim.generate.forward_rows`) per configuration, interleaved (one step of each in turn), each
configuration under its own cProfile. Prints, per configuration: the step's median wall time, the Python calls a
step makes, and the functions with the largest cumulative share of the profiled time.

The machine may be shared: compare the ratios between the configurations of one run, not the milliseconds.
``--length 4100`` puts every windowed row in two RoPE frames (a re-base at 4,096: a key run off the frame).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import time

import torch


def _model(tiny: bool):
    if not tiny:
        from kvslim.models.load import load_model

        return load_model(None)[0]
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=1100)
    p.add_argument("--config", nargs="+", default=["int4", "int4,sink=4,window=1020"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tiny", action="store_true", help="random weights of the embedded model's shape")
    p.add_argument("--dump", help="write each configuration's pstats to DUMP.<n> (for pstats or snakeviz)")
    a = p.parse_args()

    import kvslim
    from kvslim.generate import forward_rows, prefill

    model = _model(a.tiny)
    kvslim.enable(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, a.length), generator=g)
    sets = {}
    with torch.inference_mode():
        for spec in a.config:
            base = kvslim.SlimCache.from_config(kvslim.parse_spec(spec), config=model.config)
            prefill(model, ids, base, chunk_size=1024)
            rows = [copy.deepcopy(base) for _ in range(a.rows)]
            for i, row in enumerate(rows):  # stagger: rows leave their residual groups at different steps
                for t in range(2 * i):
                    forward_rows(model, [int(ids[0, t])], [row])
            sets[spec] = rows
        feed = torch.randint(0, vocab, (a.warmup + a.steps, a.rows), generator=g).tolist()
        profs = {spec: cProfile.Profile() for spec in a.config}
        times: dict = {spec: [] for spec in a.config}
        for r in range(a.warmup + a.steps):
            for spec in a.config:
                prof = profs[spec] if r >= a.warmup else None
                t = time.perf_counter()
                if prof:
                    prof.enable()
                forward_rows(model, feed[r], sets[spec]).argmax(-1).tolist()
                if prof:
                    prof.disable()
                    times[spec].append((time.perf_counter() - t) * 1e3)
    print(
        f"{a.rows} rows x {a.length} tokens (staggered by 2), {a.steps} profiled steps, "
        f"{torch.get_num_threads()} threads, {'tiny random' if a.tiny else 'embedded'} model"
    )
    for n, spec in enumerate(a.config):
        if a.dump:
            profs[spec].dump_stats(f"{a.dump}.{n}")
        st = pstats.Stats(profs[spec])
        total_calls = sum(v[1] for v in st.stats.values())
        total_t = st.total_tt
        print(
            f"\n== {spec}: step median {statistics.median(times[spec]):.1f} ms under cProfile "
            f"(min {min(times[spec]):.1f}); {total_calls / a.steps:,.0f} Python calls a step"
        )
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[: a.top]
        print(f"   {'cum %':>6} {'self %':>6} {'calls/step':>10}  function")
        for (file, line, name), (_, nc, tt, ct, _) in rows:
            where = file.split("/src/")[-1].split("site-packages/")[-1]
            print(
                f"   {100 * ct / total_t:6.1f} {100 * tt / total_t:6.1f} {nc / a.steps:10.0f}  {where}:{line} {name}"
            )


if __name__ == "__main__":
    main()
