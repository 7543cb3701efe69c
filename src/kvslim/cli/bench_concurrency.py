"""``kvslim bench --concurrency``: many streams at once (:mod:`kvslim.bench.concurrency`), with ``--serve`` the same
streams through ``kvslim serve``, with ``--peers`` the serving peers in their own venvs, with ``--pages`` each spec's
streams also in one pool of pages."""

from __future__ import annotations

from .. import threads
from ..heap import GcPauses, apply_gc_flag
from .common import UserError, write_json

CONCURRENCY_PEERS = ("openvino", "vllm")


def with_load_after(policy: dict) -> dict:
    """The thread policy record with the load average at the end of the run beside the one at its start."""
    return {**policy, "load_average_after": threads.load_average()}


def run_concurrency(args, model, configs, settings, policy) -> int:
    """``--concurrency``: many streams at once (kvslim.bench.concurrency), a table and JSON; with --serve the
    same streams through ``kvslim serve``; with --peers the serving peers in their own venvs."""
    import kvslim

    from ..bench.concurrency import link_ratios, render_concurrency, run_concurrency, tokens
    from ..bench.modes import build_modes
    from ..bench.rounds import merge_rounds, render_round_ratios, round_ratios
    from ..bench.suite import _logger
    from ..engine.linears import Linears, step_rows
    from ..kernels.clib import bf16_instructions

    kvslim.enable(model)  # the engine's ragged steps attend on each row's codes
    modes, _ = build_modes(model, configs)
    log = _logger(not args.quiet)
    extra: dict = {}
    if args.pages:
        from ..bench.concurrency_pages import pages_modes

        paged, extra["pages_refused"] = pages_modes(modes, compiled=args.compile)
        for spec, why in extra["pages_refused"].items():
            log(f"{spec}: no pages row ({why})")
        modes += paged
    args.linears = args.linears or "auto"
    route = Linears(model, args.linears, batch_hint=step_rows(max(args.concurrency)))
    log(f"{route}; {apply_gc_flag(args.gc_freeze)}")  # the heap frozen after the engine's startup, as serve does
    def prompt(length: int) -> list[int]:
        return tokens(model, length, args.seed)[0].tolist()

    # kvslim's rows, and with --peers the peers after them: N rounds in turn with --peer-rounds N (kvslim.bench.rounds)
    n = args.peer_rounds if args.peers is not None else 1
    ours, theirs, built = [], [], {}
    for i in range(n):
        if n > 1:
            log(f"round {i + 1}/{n} of kvslim's rows and the peers")
        with GcPauses() as pauses:
            ours.append(run_concurrency(model, modes, settings["lengths"], args.concurrency, settings["steps"],
                                        warmup=settings["warmup"], seed=args.seed, log=log, linears=route,
                                        continuous_batching=not args.no_continuous_batching and i == 0, built=built))
        if i == 0:
            extra["gc"] = {"freeze": args.gc_freeze, **pauses.to_dict()}
        if args.peers is not None:
            from ..bench.concurrency_peers import run_peers

            found, extra["peers"] = run_peers(
                args.peers or list(CONCURRENCY_PEERS), model, list(configs), prompt, settings["lengths"],
                args.concurrency, settings["steps"], warmup=settings["warmup"], threads=policy["torch_threads"],
                log=log,
            )
            theirs.append(found)
    built.clear()
    rows = merge_rounds(ours)
    if args.compile:
        from ..bench.concurrency_pages import compiled_step

        step = compiled_step(model, args.compile)
        extra["compiled_pages"] = {"buckets": sorted(step.buckets), "compile_s": step.compile_s, "wrapper": step.wrapper}
        log(f"compiled paged step: {step.compiles} graph(s) (rows {sorted(step.buckets)}) in {step.compile_s:.1f} s")

    if args.serve:
        paged_names = [m.name for m in modes if m.kind == "pages"]
        rows += _serve(args, model, configs, paged_names, settings, prompt, log, extra)
    if args.peers is not None:
        rows += merge_rounds(theirs)
        for line in extra["peers"].values():
            print(line)
    link_ratios(rows)
    print(render_concurrency(rows))
    if n > 1:
        extra["peer_rounds"] = round_ratios(ours, theirs)
        print(render_round_ratios(extra["peer_rounds"], n))
    if args.json:
        write_json(
            args.json,
            {
                "concurrency": [r.to_dict() for r in rows],
                "settings": {"lengths": settings["lengths"], "concurrency": args.concurrency, "steps": settings["steps"],
                             "threads": args.threads, "configs": list(configs), "serve": args.serve, "pages": args.pages,
                             "peer_rounds": n,
                             "dtype": args.dtype, "cpu_bf16": bf16_instructions(), "linears": args.linears,
                             "linears_route": route.route, "linears_reason": route.reason},
                "thread_policy": with_load_after(policy),
                **extra,
            },
        )
        print(f"wrote {args.json}")
    return 0


def _serve(args, model, configs, paged: list[str], settings: dict, prompt, log, extra: dict) -> list:
    """``--serve``: the specs through one ``kvslim serve`` child; with ``--pages`` each spec pages can store (``paged``,
    named ``SPEC+pages``) through a child of its own, started with that spec's cache flags and ``--pages auto`` (and
    with ``--compile``, ``SPEC+pages+compiled``: a child started with ``--compile`` as well, its warm-up before the
    clients start)."""
    from ..bench.concurrency import tokens
    from ..bench.join import join_after, render_join
    from ..bench.serve import run_serve
    from ..config import parse_spec
    from .common import cache_flags

    flags = ["--dtype", args.dtype, "--device", args.device, *(["--model", args.model] if args.model else []),
             "--linears", args.linears, "--gc-freeze", args.gc_freeze]
    joins: list = []  # a prompt of --join tokens joins each spec's streams (kvslim.bench.join)
    join = args.join and tokens(model, args.join, args.seed + 1)[0].tolist()
    runs = [(flags, list(configs), "")]
    from ..bench.concurrency_pages import COMPILED, SUFFIX
    from ..cache.paged_compiled import wrapper_of

    for name in paged:
        suffix = name[name.index(SUFFIX):]  # "+pages" or "+pages+compiled"
        spec = name[: -len(suffix)]
        compiled = ["--compile", wrapper_of(args.compile)] if suffix.endswith(COMPILED) else []
        runs.append((flags + cache_flags(parse_spec(spec)) + ["--pages", "auto", *compiled], [spec], suffix))
    rows, logs = [], []
    for run_flags, specs, suffix in runs:
        before = len(joins)
        try:
            served, log_path = run_serve(
                run_flags, specs, prompt, settings["lengths"], args.concurrency, settings["steps"],
                warmup=settings["warmup"], threads=args.threads, omp_wait=args.omp_wait, log=log,
                after=join and join_after(join, settings["steps"], settings["warmup"], joins, log,
                                          chunk=args.prefill_chunk),
                prefill_chunk=args.prefill_chunk)
        except RuntimeError as e:  # the server did not start: its log's last line says why
            lines = [x for x in str(e).splitlines() if x.strip()]
            raise UserError(f"--serve: {lines[0]} {lines[-1] if len(lines) > 1 else ''}".strip()) from None
        for row in served:  # "int4 via serve" -> "int4+pages via serve"
            row.mode = row.mode.replace(" via serve", f"{suffix} via serve")
        for j in joins[before:]:
            j.spec += suffix
        rows += served
        logs.append(log_path)
    extra["serve_log"] = logs[0]
    if len(logs) > 1:
        extra["serve_pages_logs"] = logs[1:]
    if joins:
        print(render_join(joins))
        extra["serve_join"] = [j.to_dict() for j in joins]
    return rows
