"""``kvslim serve``: an OpenAI-compatible server whose conversations live in bounded, compressed caches.

Parsing and printing only: the model comes from :func:`kvslim.cli.common.load_model_from_args`, the app
from :func:`kvslim.serve.build_app` (the batch engine on its thread, the HTTP side), the server is uvicorn.
Needs the ``serve`` extra (``pip install "kvslim[serve]"``). See docs/serve.md.
"""

from __future__ import annotations

import argparse
import os
import re

from .. import threads
from ..cache.paged_compiled import WRAPPERS
from ..heap import add_gc_flag, apply_gc_flag
from .common import (
    LINEAR_ROUTES,
    UserError,
    add_cache_flags,
    add_model_flags,
    cache_config_from_args,
    check_bias_file,
    check_model_args,
    load_model_from_args,
)
from .errors import say

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
#: the environment variable holding the API key when --api-key is not given
API_KEY_ENV = "KVSLIM_API_KEY"
_DURATIONS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1.5gb"``, ``"1000000"`` -> bytes (an int >= 1); ValueError naming the value."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: expected a number with an optional unit (e.g. 2GiB, 500MB, 1000000)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is not a size of at least one byte")
    return value


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_duration(text: str) -> float:
    """``"24h"``, ``"90m"``, ``"1.5d"``, ``"3600"`` (seconds), ``"30s"`` -> seconds (> 0); ValueError naming it."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _DURATIONS:
        raise ValueError(f"{text!r} is not a duration: expected a number with an optional unit s, m, h or d "
                         "(e.g. 24h, 90m, 3600)")
    value = float(m.group(1)) * _DURATIONS[unit]
    if value <= 0:
        raise ValueError(f"{text!r} is not a duration longer than zero")
    return value


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget(text: str):
    return "auto" if str(text).strip().lower() == "auto" else _size(text)


def configure(parser: argparse.ArgumentParser) -> None:
    from ..serve.defaults import (
        DEFAULT_CACHE,
        DEFAULT_MAX_QUEUE,
        DEFAULT_MAX_SESSIONS,
        DEFAULT_PREFILL_CHUNK,
        DEFAULT_SHUTDOWN_GRACE,
    )

    add_model_flags(parser)
    add_cache_flags(parser)
    # the server's default cache is compressed (docs/serve.md says why int8): --kv-quantize none for fp
    parser.set_defaults(kv_quantize=DEFAULT_CACHE)
    parser._option_string_actions["--kv-quantize"].help = (  # noqa: SLF001 - argparse has no public setter
        f"K and V storage format (default for the server: {DEFAULT_CACHE}, near-lossless; none: uncompressed)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="address to bind (default: 127.0.0.1, this machine only); another address needs --api-key "
        "(or --allow-no-api-key)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument(
        "--api-key", default=None, metavar="KEY",
        help=f"the key every request must bear as 'Authorization: Bearer KEY', every endpoint included "
        f"(default: the environment variable {API_KEY_ENV}, which keeps the key out of the process list)",
    )
    parser.add_argument(
        "--allow-no-api-key", action="store_true",
        help="serve a non-loopback --host without an API key (anyone who can reach the port can use it)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=16, metavar="N", help="requests decoded together at most (default: 16)"
    )
    parser.add_argument(
        "--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
        help=f"requests waiting for a slot at most; past it a request gets 429 with Retry-After "
        f"(default: {DEFAULT_MAX_QUEUE})",
    )
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=None, metavar="N",
        help="the longest prompt taken, in tokens (default: the model's context)",
    )
    parser.add_argument(
        "--memory-budget",
        type=_budget,
        default="auto",
        metavar="SIZE",
        help="bytes every running request's cache and every idle session in memory may hold together, e.g. 2GiB or "
        "500MB (default: auto: half the memory available once the model is loaded: MemAvailable or the "
        "cgroup's limit on a CPU, the free memory of a GPU); a request waits until its cache fits, one that "
        "cannot fit alone is refused (413)",
    )
    parser.add_argument(
        "--session-dir",
        default=None,
        metavar="DIR",
        help="where idle sessions are written when the memory budget needs their room and at shutdown, and read "
        "back when they return (default: none: such sessions are dropped, counted in /metrics)",
    )
    parser.add_argument(
        "--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS, metavar="N",
        help=f"idle sessions kept at most, in memory and on disk; the least recently used go first "
        f"(default: {DEFAULT_MAX_SESSIONS})",
    )
    parser.add_argument(
        "--session-ttl", type=_duration, default="24h", metavar="DURATION",
        help="how long an idle session is kept after its last turn: seconds, or with a unit s, m, h, d "
        "(default: 24h)",
    )
    parser.add_argument(
        "--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE, metavar="SECONDS",
        help=f"at the first SIGTERM / Ctrl-C, how long requests in flight may still run before they are ended "
        f"with an error (default: {DEFAULT_SHUTDOWN_GRACE:g}); a second signal ends them now; idle sessions are "
        "parked either way",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        metavar="N",
        help=f"prompt tokens read per engine step, the shortest prompts first (default: {DEFAULT_PREFILL_CHUNK}: "
        "a long prompt holds the others back by at most a chunk or two)"
    )
    parser.add_argument(
        "--linears", choices=LINEAR_ROUTES, default="auto",
        help="which library runs the model's linear layers in a step: auto (default: of torch and onednn, those whose "
        "product rounds a row alike at every step size, unlike MKL on AVX-512-FP16 Xeons; of both, the faster, timed "
        "at start-up), torch, onednn, packed (oneDNN "
        "with a second, reordered copy of the weights: the weights' bytes once more), or mkl (MKL's packed sgemm "
        "at a full step's rows, torch's bits, the weights' bytes once more; docs/performance.md)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help=f"the model id clients send (default: {EMBEDDED_NAME} for the embedded model, else the --model basename)",
    )
    parser.add_argument(
        "--default-max-tokens", type=int, default=256, metavar="N", help="max_tokens when a request names none (256)"
    )
    parser.add_argument(
        "--pages", type=_pages, default=None, metavar="N|auto",
        help="keep every request's cache in one pool of N pages a layer (32 tokens each), or auto: what "
        "--memory-budget holds, at most --max-concurrency requests at the model's context; a step is two kernel "
        "calls a layer whatever the requests (docs/serve.md, \"Pages\"): one cache format for all (the --kv flags; a "
        "window keeps keys at their original positions: --streaming-llm-positions original, sinks named), idle "
        "sessions in memory only (default: a cache of its own per request)",
    )
    parser.add_argument(
        "--compile", nargs="?", const=True, default=False, choices=WRAPPERS, metavar="WRAPPER",
        help="with --pages: decode steps through the compiled paged step (torch.compile, one graph per bucket of "
        "rows: 1, 2, 4, ... up to --max-concurrency), every bucket compiled at start-up (30-55 s each for the "
        "embedded model, a few once Inductor's cache has them; docs/compile.md); prompt chunks run eagerly, and "
        "--linears routes only their products. WRAPPER: what calls the graph's kernels, Inductor's generated python "
        "(the default) or cpp (a step a few percent faster, 80-105 s a bucket to compile the first time)",
    )
    parser.add_argument(
        "--no-warm-up", dest="warm_up", action="store_false",
        help="with --compile: compile each bucket on its first step instead of at start-up (that step waits)",
    )
    threads.add_thread_flags(parser)
    add_gc_flag(parser)


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key, else the environment's KVSLIM_API_KEY (empty: none); UserError for a blank key, and for a
    non-loopback --host without a key unless --allow-no-api-key."""
    from ..serve.security import is_loopback_host

    key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if key is not None and not key.strip():
        raise UserError("--api-key is blank: give a key, or leave the flag out")
    if key is None and not is_loopback_host(args.host) and not args.allow_no_api_key:
        raise UserError(
            f"--host {args.host} is reachable from other machines and no API key is set: pass --api-key "
            f"(or set {API_KEY_ENV}), bind 127.0.0.1, or pass --allow-no-api-key to serve anyone who can reach it"
        )
    return key


def run(args: argparse.Namespace) -> int:
    cache_config = cache_config_from_args(args)  # one line for a bad flag, before any slow work
    check_model_args(args)
    check_bias_file("--kv-mean-center", args.kv_mean_center)
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    for flag, value in (("--max-concurrency", args.max_concurrency), ("--prefill-chunk", args.prefill_chunk),
                        ("--default-max-tokens", args.default_max_tokens), ("--max-queue", args.max_queue),
                        ("--max-sessions", args.max_sessions), ("--max-prompt-tokens", args.max_prompt_tokens),
                        ("--threads", args.threads)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if not args.shutdown_grace >= 0 or args.shutdown_grace > 3600:
        raise UserError(f"--shutdown-grace must be in 0..3600 seconds, got {args.shutdown_grace}")
    if args.compile and args.pages is None:
        raise UserError("--compile compiles the paged step: give --pages N or --pages auto as well")
    if not args.warm_up and not args.compile:
        raise UserError("--no-warm-up goes with --compile (there is nothing to warm up without it)")
    key = api_key_from(args)
    if args.session_dir is not None and os.path.exists(args.session_dir) and not os.path.isdir(args.session_dir):
        raise UserError(f"--session-dir {args.session_dir!r} is a file; expected a directory (or a new path)")
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError('kvslim serve needs its extra: pip install "kvslim[serve]" (starlette and uvicorn)') from None

    from ..serve import build_app
    from ..serve.defaults import default_memory_budget
    from ..serve.shutdown import run_server
    from .prompt import eos_ids

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_from_args(args, kvslim_attention=True)
    name = args.served_model_name or (
        EMBEDDED_NAME if args.model is None else os.path.basename(os.path.normpath(args.model))
    )
    if args.pages is not None and args.session_dir is not None:
        raise UserError("--pages keeps idle sessions in memory only (parking pages on disk: not yet): leave "
                        "--session-dir out, or --pages")
    if args.compile:
        import torch

        from ..cache.paged_compiled import why_not

        with torch.no_grad():  # (as the engine steps)
            reason = why_not(model)
        if reason is not None:
            raise UserError(f"--compile: cannot compile the paged step for this model: {reason}")
    if isinstance(args.pages, int):
        if args.memory_budget != "auto":
            raise UserError("--pages N is the pool's size, which is its memory budget: leave --memory-budget out "
                            "(or use --pages auto to size the pool from it)")
        budget, why = None, f"--pages {args.pages}"
    elif args.memory_budget == "auto":
        budget, why = default_memory_budget(args.device)
    else:
        budget, why = args.memory_budget, "--memory-budget"
    context = getattr(model.config, "max_position_embeddings", None)
    max_prompt = args.max_prompt_tokens or context
    # builds the engine: a --kv-mean-center file is read and checked against this model once, here
    app = build_app(
        model,
        tokenizer,
        model_name=name,
        cache=cache_config,
        memory_budget=budget,
        max_concurrency=args.max_concurrency,
        prefill_chunk=args.prefill_chunk,
        session_dir=args.session_dir,
        stop_ids=eos_ids(model, tokenizer),
        default_max_tokens=args.default_max_tokens,
        max_queue=args.max_queue,
        max_prompt_tokens=max_prompt,
        max_sessions=args.max_sessions,
        session_ttl=args.session_ttl,
        api_key=key,
        bind_host=args.host,
        shutdown_grace=args.shutdown_grace,
        allow_other_model=args.kv_mean_center_any_model,
        linears=args.linears,
        pages=args.pages,
        compile=args.compile,
    )
    engine = app.state.runner.engine
    if args.compile and args.warm_up:
        _warm_up(engine)
    if engine.pool is not None:
        budget = engine.scheduler.memory_budget
        why = f"{engine.pool.n_pages} pages a layer of {engine.pool.page_bytes()} bytes ({why})"
    host = f"[{args.host}]" if ":" in args.host else args.host
    say(
        f"kvslim: serving {name} on http://{host}:{args.port}/v1 (cache {cache_config.to_spec()}, "
        f"memory budget {budget / 2**30:.2f} GiB: {why}; {args.max_concurrency} at once, {args.max_queue} "
        f"waiting, prompts up to {max_prompt or 'any number of'} tokens; sessions: at most {args.max_sessions}, "
        f"{_hours(args.session_ttl)} idle, in {args.session_dir or 'memory only'}; "
        f"{'API key required' if key else 'no API key'})"
    )
    heap = apply_gc_flag(args.gc_freeze)  # the model loaded and the engine built: the startup heap is what it is
    say(f"kvslim: {threads.banner(threads.describe(getattr(args, 'thread_policy', None)))}; "
        f"{app.state.runner.engine.linears}; {heap}")
    run_server(app, host=args.host, port=args.port, grace=args.shutdown_grace)
    return 0


def _warm_up(engine) -> None:
    """Compile every bucket of the compiled paged step before the server takes a request, a line each."""
    import time

    start = time.perf_counter()

    at = [0]

    def progress(rows: int, i: int, count: int) -> None:
        at[0] = rows
        say(f"kvslim: compiling the paged step for {rows} row(s) ({i + 1} of {count}; "
            f"{time.perf_counter() - start:.0f} s so far)")

    try:
        done = engine.warm_up(progress)
    except Exception as e:  # noqa: BLE001 - Inductor's compile (a C++ compiler missing, ...): one line, not a trace
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        instead = "without --compile"
        if engine.compiled.wrapper == "cpp":
            instead = "with --compile python, or " + instead
        raise UserError(f"--compile: compiling the paged step for {at[0]} row(s) failed: {first} (run "
                        f"{instead})") from None
    say(f"kvslim: compiled paged step: {len(done)} graph(s) (rows {done}) in {time.perf_counter() - start:.1f} s")


def _pages(text: str):
    """--pages: a positive number of pages, or auto."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of pages or auto, got {text!r}")
    return n


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"
