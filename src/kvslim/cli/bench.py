"""``kvslim bench``: decode and prefill speed and memory of cache modes, side by side with the plain
transformers cache and the peers, in one process.

Parsing and printing only; the work is :func:`kvslim.bench.run_bench`.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import threads
from ..cache.paged_compiled import WRAPPERS
from ..heap import add_gc_flag, apply_gc_flag
from .bench_concurrency import CONCURRENCY_PEERS, run_concurrency, with_load_after
from .common import (
    LINEAR_ROUTES,
    UserError,
    add_model_flags,
    check_bias_file,
    check_model_args,
    check_output,
    format_table,
    load_model_from_args,
    seed_int,
    write_json,
)

DEFAULT_CONFIGS = ["none", "int8", "int4", "q8_0", "q4_0", "none,sink=4,window=1020"]
SMOKE_CONFIGS = ["int4", "q4_0,sink=4,window=28"]
# --smoke: a seconds-long run for CI.
#: --threads beyond this many per CPU is refused (a typo, not a setting: torch would start them all).
MAX_THREADS_PER_CPU = 4
#: --peers of the single-stream bench (transformers' QuantizedCache backends) and of --concurrency (serving peers)
SINGLE_PEERS = ("quanto", "hqq", "fp8")
SMOKE = dict(lengths=[16, 32], steps=2, warmup=1, append_lengths=[64, 256], append_reps=3, seen=[64, 256])


def _int_list(flag: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag} takes positive integers, got {text!r}")
        return values

    return parse


def _all_or(parse):
    def parse_all(text: str):
        word = text.strip().lower()
        return "all" if word == "all" else [] if word == "none" else parse(text)

    return parse_all


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    parser.add_argument(
        "--config",
        action="extend",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="cache modes to bench, e.g. int4 'q4_0,sink=4,window=1020' (default: "
        + " ".join(DEFAULT_CONFIGS)
        + "); the plain DynamicCache is always included as 'dynamic'",
    )
    parser.add_argument(
        "--lengths",
        type=_int_list("--lengths"),
        default=[512, 2048, 4096, 8192],
        metavar="L,...",
        help="context lengths (default: 512,2048,4096,8192)",
    )
    parser.add_argument(
        "--steps", type=int, default=10, metavar="N", help="timed decode steps per mode (default: 10)"
    )
    parser.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps first (default: 2)")
    parser.add_argument(
        "--prefill-lengths",
        type=_all_or(_int_list("--prefill-lengths")),
        default="all",
        metavar="L,...|all|none",
        help="lengths at which every mode is built by a timed prefill; elsewhere only 'dynamic' is "
        "prefilled and the others get its K/V through cache.update (default: all; none: only 'dynamic')",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=None,
        choices=[*SINGLE_PEERS, *CONCURRENCY_PEERS],
        metavar="BACKEND",
        help="add transformers' QuantizedCache with these backends (quanto, hqq, fp8; none named: all), "
        "2 and 4 bits; with --concurrency: the serving peers instead, each in its own venv as a subprocess "
        "(openvino: OpenVINO GenAI's ContinuousBatchingPipeline, `make openvino`; vllm: vLLM's CPU build, "
        "`make vllm`; none named: both); a peer that is missing is reported, not an error",
    )
    parser.add_argument(
        "--peer-rounds",
        type=int,
        default=1,
        metavar="N",
        help="with --concurrency --peers: measure kvslim's rows and the peers in turn N times (kvslim's caches "
        "prefilled once), each row its median round, and print the peer's step over kvslim's in each round "
        "(default: 1)",
    )
    parser.add_argument(
        "--append-lengths",
        type=_int_list("--append-lengths"),
        default=[1024, 8192],
        metavar="L,...",
        help="history lengths of the append-cost measurement (default: 1024,8192)",
    )
    parser.add_argument(
        "--append-reps", type=int, default=50, metavar="N", help="append repetitions (default: 50)"
    )
    parser.add_argument("--no-append", action="store_true", help="skip the append-cost measurement")
    parser.add_argument(
        "--seen",
        type=_int_list("--seen"),
        default=[1024, 4096, 16384, 65536],
        metavar="N,...",
        help="tokens-seen values of the StreamingLLM flatness measurement (default: 1024,4096,16384,65536)",
    )
    parser.add_argument(
        "--seen-config",
        action="extend",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="windowed specs for the flatness measurement (default: the windowed --config specs)",
    )
    parser.add_argument("--no-seen", action="store_true", help="skip the StreamingLLM flatness measurement")
    threads.add_thread_flags(parser)
    add_gc_flag(parser)
    parser.add_argument(
        "--attn",
        default="auto",
        choices=["sdpa", "kvslim", "auto"],
        help="attention implementation (auto: kvslim when registered, else sdpa)",
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0, help="seed of the random token sequences (default: 0)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every number as JSON")
    parser.add_argument(
        "--plot", default=None, metavar="FILE.png", help="plot ms/token and MB against context length (needs matplotlib)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a seconds-long run for CI: lengths 16,32, 2 steps, small append and tokens-seen "
        "measurements (overrides those flags)",
    )
    parser.add_argument(
        "--concurrency",
        type=_int_list("--concurrency"),
        default=None,
        metavar="C,...",
        help="measure many streams at once instead: aggregate decode tok/s and bytes per stream at each "
        "concurrency and --lengths, the plain cache batched as generate() batches and transformers' continuous "
        "batching side by side (e.g. 1,4,16)",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="with --concurrency: also drive a real `kvslim serve` (started on 127.0.0.1, a free port) with C "
        "concurrent streaming clients per --config: aggregate tok/s, inter-token latency and TTFT percentiles",
    )
    parser.add_argument("--join", type=int, default=None, metavar="J", help="with --serve: after each "
                        "measurement, a J-token prompt joins the decoding streams; what it adds to their latency")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N", help="with --serve: the server's "
                        "--prefill-chunk (prompt tokens a step carries beside the decoding rows; its default if "
                        "not given)")
    parser.add_argument("--linears", choices=LINEAR_ROUTES, default=None, help="with --concurrency: the engine rows' (and "
                        "--serve's) linear layers (kvslim.engine.linears; default auto, as the engine's)")
    parser.add_argument("--pages", action="store_true", help="with --concurrency: also each --config that pages can "
                        "store with every stream in one pool of pages, as `kvslim serve --pages` keeps them "
                        "('SPEC+pages'; with --serve, the server runs with --pages auto)")
    parser.add_argument(
        "--no-continuous-batching",
        action="store_true",
        help="with --concurrency: leave out transformers' generate_batch (it prefills every stream)",
    )
    parser.add_argument(
        "--compile",
        nargs="?", const=True, default=False, choices=WRAPPERS, metavar="WRAPPER",
        help="also bench compiled decode steps side by side: transformers' StaticCache + torch.compile "
        "('tf-static') and each --config as a StaticSlimCache ('SPEC+compiled'); needs --attn kvslim or auto. With "
        "--concurrency --pages: each pages row also through the compiled paged step ('SPEC+pages+compiled'), its "
        "graphs called from Inductor's Python wrapper (--compile, --compile python) or its C++ one (--compile cpp: "
        "faster a step, longer to compile once; docs/compile.md)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    for flag, value, minimum in (
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--append-reps", args.append_reps, 1),
        ("--threads", args.threads, 1),
    ):
        if value is not None and value < minimum:
            raise UserError(f"{flag} must be an integer >= {minimum}, got {value}")
    cpus = os.cpu_count() or 1
    if args.threads is not None and args.threads > MAX_THREADS_PER_CPU * cpus:
        # torch would try to start them all: "can't start new thread", then a crash
        raise UserError(
            f"--threads {args.threads} is more than {MAX_THREADS_PER_CPU} per CPU of this machine ({cpus} CPUs); "
            f"use at most {MAX_THREADS_PER_CPU * cpus} (the CPU count is usually fastest)"
        )
    settings = dict(
        lengths=args.lengths,
        steps=args.steps,
        warmup=args.warmup,
        append_lengths=None if args.no_append else args.append_lengths,
        append_reps=args.append_reps,
        seen=None if args.no_seen else args.seen,
    )
    configs = args.config or DEFAULT_CONFIGS
    bandwidth_bytes = 256 << 20
    if args.smoke:
        settings.update({k: v for k, v in SMOKE.items() if settings.get(k) is not None})
        configs = args.config or SMOKE_CONFIGS
        bandwidth_bytes = 16 << 20
    prefill = None if args.prefill_lengths == "all" else args.prefill_lengths
    if args.compile and args.concurrency is not None and not args.pages:
        raise UserError("--compile with --concurrency needs --pages (the compiled ragged step runs on pages)")
    if args.compile not in (True, False) and args.concurrency is None:
        raise UserError(f"--compile {args.compile}: a wrapper applies to the compiled paged step (--concurrency C "
                        "--pages); give --compile alone here")
    if args.join is not None and (not args.serve or args.join < 1):
        raise UserError(f"--join {args.join}: a prompt length of at least 1 token, with --serve")
    if args.linears is not None and not args.concurrency:
        raise UserError(f"--linears {args.linears} applies to --concurrency's engine rows; add --concurrency C,...")
    if args.prefill_chunk is not None and (not args.serve or args.prefill_chunk < 1):
        raise UserError(f"--prefill-chunk {args.prefill_chunk}: a chunk of at least 1 token, with --serve")
    if args.pages and not args.concurrency:
        raise UserError("--pages applies to --concurrency's engine rows; add --concurrency C,...")
    if args.serve and args.concurrency is None:
        raise UserError("--serve measures many streams through the server: give --concurrency too (e.g. 1,16)")
    if args.peer_rounds < 1:
        raise UserError(f"--peer-rounds must be an integer >= 1, got {args.peer_rounds}")
    if args.peer_rounds > 1 and (args.concurrency is None or args.peers is None):
        raise UserError(f"--peer-rounds {args.peer_rounds} alternates --concurrency's rows with its serving peers: "
                        f"give --concurrency C,... and --peers too")
    wrong = [p for p in args.peers or () if p not in (CONCURRENCY_PEERS if args.concurrency else SINGLE_PEERS)]
    if wrong:
        kind, legal = (("--concurrency", CONCURRENCY_PEERS) if args.concurrency
                       else ("the single-stream bench", SINGLE_PEERS))
        raise UserError(f"--peers {' '.join(wrong)}: not a peer of {kind}; expected some of {', '.join(legal)}")
    check_output("--json", args.json)
    check_output("--plot", args.plot)
    import importlib.util

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib: pip install 'kvslim[plot]'")
    from ..config import parse_spec

    for spec in [*configs, *(args.seen_config or [])]:
        check_bias_file(f"--config {spec}: mean_center", parse_spec(spec).mean_center)
    check_model_args(args)

    import torch

    from ..bench import resolve_attn, run_bench

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    policy = threads.describe(getattr(args, "thread_policy", None))
    print(threads.banner(policy), flush=True)
    attn = resolve_attn(args.attn)  # fails fast, before the model loads
    model, _ = load_model_from_args(args)
    if args.concurrency is not None:
        return run_concurrency(args, model, configs, settings, policy)
    print(apply_gc_flag(args.gc_freeze), flush=True)
    result = run_bench(
        model,
        configs,
        settings["lengths"],
        settings["steps"],
        peers=False if args.peers is None else (args.peers or True),
        warmup=settings["warmup"],
        seed=args.seed,
        progress=not args.quiet,
        attn=attn,
        prefill_lengths=prefill,
        append_lengths=settings["append_lengths"],
        append_reps=settings["append_reps"],
        seen=settings["seen"],
        seen_configs=args.seen_config,
        bandwidth_bytes=bandwidth_bytes,
        compile=args.compile,
    )
    print(render(result))
    if args.json:
        write_json(args.json, {**result.to_dict(), "thread_policy": with_load_after(policy), "gc_freeze": args.gc_freeze})
        print(f"wrote {args.json}")
    if args.plot:
        from ..atomic import atomic_path
        from ..bench.plot import plot_bench

        with atomic_path(args.plot, what="--plot") as tmp:
            plot_bench(result, tmp)
        print(f"wrote {args.plot}")
    return 0


def render(result) -> str:
    """The report as text: settings, decode table, memory, peers at the same bits, append, flatness."""
    s, m = result.settings, result.model
    mb = 1 / (1 << 20)
    out = [
        f"model {m['name']} ({m['dtype']}, {m['n_layers']} layers, "
        f"{m['n_kv_heads']} KV heads x {m['head_dim']}); "
        f"{s['threads']} torch threads; attention {s['attn']}; device {s['device']}",
        f"{s['steps']} timed decode steps per mode and length after {s['warmup']} warm-up, interleaved; "
        f"seed {s['seed']}; every mode prefilled at lengths: {_prefill_text(s['prefill_lengths'])}",
        f"memory bandwidth (copy, measured before each length's decode): "
        f"{', '.join(sorted({f'{r.bandwidth_gb_s:.2f}' for r in result.decode}, key=float))} GB/s; "
        f"weights read per step "
        f"{m['weight_bytes_per_step'] * mb:.1f} MB",
    ]
    for backend, note in result.peers.items():
        out.append(f"peer {backend}: {note}")
    out.append("")
    headers = ["mode", "length", "ms/tok", "IQR ms", "tok/s", "x dyn", "prefill tok/s", "x dyn pf", "cache MB",
               "peak MB", "floor ms", "x floor"]
    rows = []
    for r in result.decode:
        rows.append(
            [
                r.mode,
                r.length,
                r.ms_median,
                f"{r.ms_q1:.4g}-{r.ms_q3:.4g}",
                r.tok_s,
                r.ratio_to_dynamic,
                _opt(r.prefill_tok_s),
                _opt(r.prefill_ratio_to_dynamic),
                r.cache_bytes * mb,
                _opt(None if r.peak_bytes is None else r.peak_bytes * mb),
                r.floor_ms,
                r.ratio_to_floor,
            ]
        )
    out.append(format_table(headers, rows))
    out.append(
        "\nx dyn: ratio of median ms/token to 'dynamic' (transformers DynamicCache) at the same length; "
        "peak MB: RSS this mode adds at its decode peak (resident cache + largest in-step rise, "
        f"{result.memory.get('method')}); floor: (weights + cache bytes read) / bandwidth"
    )
    mem_rows = [
        [
            r.mode,
            r.length,
            r.cache_bytes * mb,
            _opt(r.resident_bytes, mb),
            _opt(r.step_transient_bytes, mb),
            r.one_layer_fp_bytes * mb,
            _opt(r.peak_bytes, mb),
            _opt(None if r.peak_bytes is None else r.peak_bytes / (r.cache_bytes + r.one_layer_fp_bytes)),
        ]
        for r in result.decode
    ]
    out += [
        "\nmemory (MB)",
        format_table(
            [
                "mode",
                "length",
                "nbytes",
                "resident",
                "step rise",
                "1 layer fp K+V",
                "peak",
                "peak/(nbytes+layer)",
            ],
            mem_rows,
        ),
    ]
    pairs = result.peer_ratios()
    if pairs:
        out += [
            "\nkvslim vs peers at the same bits (ratio of median ms/token)",
            format_table(
                ["mode", "peer", "length", "ratio"],
                [[p["mode"], p["peer"], p["length"], p["ratio"]] for p in pairs],
            ),
        ]
    if result.append:
        lengths = sorted({n for r in result.append for n in r.us})
        out += [
            f"\nappend cost: cache.update of one token on layer 0, median us "
            f"({lengths[0]} vs {lengths[-1]} tokens)",
            format_table(
                ["mode", *[f"us @{n}" for n in lengths], f"x ({lengths[-1]}/{lengths[0]})"],
                [[r.mode, *[r.us[n] for n in lengths], r.ratio] for r in result.append],
            ),
        ]
    if result.streaming:
        out += [
            "\nStreamingLLM: decode step vs tokens seen",
            format_table(
                ["mode", "seen", "stored", "ms/tok", "IQR ms", "x first"],
                [
                    [
                        r.mode,
                        r.seen,
                        r.tokens_stored,
                        r.ms_median,
                        f"{r.ms_q1:.4g}-{r.ms_q3:.4g}",
                        r.ratio_to_first,
                    ]
                    for r in result.streaming
                ],
            ),
        ]
    return "\n".join(out)


def _prefill_text(lengths) -> str:
    if lengths == "all":
        return "all"
    if not lengths:
        return "none (only 'dynamic' prefilled; the others get its K/V)"
    return ",".join(str(n) for n in lengths) + " (elsewhere only 'dynamic'; the others get its K/V)"


def _opt(value, scale: float = 1.0):
    return "-" if value is None else value * scale


if __name__ == "__main__":  # pragma: no cover
    from . import main

    sys.exit(main(["bench", *sys.argv[1:]]))
