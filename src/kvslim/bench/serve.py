"""``kvslim bench --concurrency C --serve``: the same streams through a real ``kvslim serve``.

The engine rows of :mod:`.concurrency` time the batch engine's decode step in process. A user meets the
server instead: HTTP, SSE, detokenization, the event loop and the engine thread. This starts ``kvslim
serve`` as a child process (127.0.0.1, a free port, the bench's model, threads and OpenMP wait policy) and,
for each cache spec, context length ``L`` and concurrency ``C``, drives it with ``C`` concurrent streaming
clients of ``/v1/completions``, the prompts the engine rows use (the seeded random ``L`` token ids, sent as
ids), the spec sent as ``kvslim_cache``, and ``ignore_eos`` so every reply has its fixed length:

1. *prefill*: the ``C`` prompts at once, one token each, each in a session of its own (the server keeps its
   cache); their times to first token are the ``ttft`` columns (``C`` prompts of ``L`` tokens arriving
   together, the server's chunked prefill);
2. *decode*: the ``C`` sessions continued at once by one more prompt token each (prefilled in a step) and
   ``warmup + steps + 1 + C + 2`` new tokens (the margin: the sessions join over a few steps). The window in
   which every stream decodes runs from the latest stream's ``warmup``-th streamed chunk to the earliest
   stream's last chunk; ``aggregate_tok_s`` is the chunks received in it over its length, ``ms_median`` (and
   the ``itl`` percentiles) the gaps between a stream's chunks in it: the inter-token latency a client sees,
   comparable to the engine's step.

A chunk carries one token unless detokenization held a token back (a character split over tokens) or the
token has no text (a special token): the note gives tokens per chunk (usage's completion tokens over the
chunks), 1.00 when every token came as its own chunk. ``bytes_per_stream`` is the server's
``kvslim_cache_bytes{where="sessions"}`` over ``C`` after the decode phase. The sessions are deleted after
each measurement.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from .concurrency import ConcurrencyRow
from .timing import quiet

SERVE_KIND = "serve"
#: seconds a request may take before it counts as lost (a 4,096-token prompt among 16 is slow on 2 cores)
REQUEST_TIMEOUT = 3600.0


def server_flags(model_flags: Sequence[str], concurrency: int, *, threads: int | None, omp_wait: str,
                 prefill_chunk: int | None = None) -> list[str]:
    """The ``kvslim serve`` flags of a bench run: the bench's model flags, ``concurrency`` rows at once, as many
    waiting, the bench's threads and OpenMP wait policy, and its ``--prefill-chunk`` (the server's default if
    None)."""
    flags = [*model_flags, "--max-concurrency", str(concurrency), "--max-queue", str(max(concurrency, 1))]
    if threads is not None:
        flags += ["--threads", str(threads)]
    if prefill_chunk is not None:
        flags += ["--prefill-chunk", str(prefill_chunk)]
    return [*flags, "--omp-wait", omp_wait]


def kvslim_command() -> list[str]:
    """This Python's kvslim: the server runs in the bench's own environment."""
    return [sys.executable, "-m", "kvslim.cli"]


def pct_ms(xs: Sequence[float], q: float) -> float | None:
    from .server import pct

    v = pct(list(xs), q)
    return None if v is None else v * 1e3


async def _phase(server, bodies: list[dict], timeout: float) -> list[dict]:
    """``bodies`` sent at once to /v1/completions, streamed; their records (:func:`stream_request`)."""
    import httpx

    from .server import stream_request

    t_origin = time.perf_counter()
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=None, headers=server.headers) as client:
        return list(await asyncio.gather(
            *(stream_request(client, "/v1/completions", b, timeout=timeout, t_origin=t_origin) for b in bodies)
        ))


def decode_window(records: Sequence[dict], warmup: int) -> dict | None:
    """The window in which every stream decodes (module docstring): ``{"start", "end", "chunks", "gaps"}``
    (seconds), or None when the streams did not overlap past their warm-up, or overlapped so briefly that no stream
    received two chunks inside the window (no gap to measure a step by)."""
    times = [r["times_s"] for r in records]
    if not times or any(len(t) <= warmup + 1 for t in times):
        return None
    start, end = max(t[warmup] for t in times), min(t[-1] for t in times)
    if end <= start:
        return None
    chunks = sum(1 for t in times for x in t if start < x <= end)
    gaps = [b - a for t in times for a, b in zip(t, t[1:]) if a >= start and b <= end]
    if not gaps:
        return None
    return {"start": start, "end": end, "chunks": chunks, "gaps": gaps}


def _failures(records: Sequence[dict]) -> str:
    bad = [r for r in records if r["outcome"] != "answered"]
    return "" if not bad else f"{len(bad)} of {len(records)} requests {bad[0]['outcome']}: {bad[0]['reason']}"


def measure_serve(
    server,
    spec: str,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    warmup: int = 1,
    tag: str = "bench",
    timeout: float = REQUEST_TIMEOUT,
    log: Callable[[str], None] | None = None,
) -> ConcurrencyRow:
    """One row: ``len(prompts)`` streams of cache ``spec`` through ``server`` (a started
    :class:`~kvslim.bench.server.Server`), prefilled then decoded ``warmup + steps + 1`` tokens each."""

    from .server import read_metrics

    log = log or quiet
    c, length = len(prompts), len(prompts[0])
    sessions = [f"{tag}-{i}" for i in range(c)]
    common = {"model": server.model, "temperature": 0, "stream": True, "ignore_eos": True,
              "stream_options": {"include_usage": True}, "kvslim_cache": spec}
    row = ConcurrencyRow(
        mode=f"{spec} via serve", kind=SERVE_KIND, length=length, concurrency=c, steps=steps,
        ms_median=float("nan"), ms_q1=float("nan"), ms_q3=float("nan"), aggregate_tok_s=0.0,
        ratio_to_dynamic=None, bytes_per_stream=None, cache_bytes=None,
    )
    try:
        t0 = time.perf_counter()
        first = asyncio.run(_phase(
            server, [{**common, "prompt": list(p), "max_tokens": 1, "session": s} for p, s in zip(prompts, sessions)],
            timeout,
        ))
        log(f"L={length} C={c} {row.mode}: prefilled in {time.perf_counter() - t0:.1f} s")
        if _failures(first):
            row.note = f"prefill: {_failures(first)}"
            return row
        ttft = [r["ttft_s"] for r in first if r["ttft_s"] is not None]
        row.ttft_p50_ms, row.ttft_p90_ms, row.ttft_p99_ms = (pct_ms(ttft, q) for q in (50, 90, 99))
        # c + 2 more: the continued sessions join the engine's steps over a few steps (a 16-stream run at 1,024
        # tokens had no window in which all 16 decoded with warmup + steps + 1 tokens each)
        new = warmup + steps + 1 + c + 2
        t0 = time.perf_counter()
        second = asyncio.run(_phase(
            server,
            [{**common, "prompt": [*p, p[-1]], "max_tokens": new, "session": s} for p, s in zip(prompts, sessions)],
            timeout,
        ))
        log(f"L={length} C={c} {row.mode}: decoded {new} tokens each in {time.perf_counter() - t0:.1f} s")
        if _failures(second):
            row.note = f"decode: {_failures(second)}"
            return row
        window = decode_window(second, warmup)
        if window is None:
            row.note = "the streams did not decode together past the warm-up (raise --steps)"
            return row
        gaps = window["gaps"]
        row.aggregate_tok_s = window["chunks"] / (window["end"] - window["start"])
        row.ms_median, row.ms_q1, row.ms_q3 = (pct_ms(gaps, q) for q in (50, 25, 75))
        row.itl_p50_ms, row.itl_p90_ms, row.itl_p99_ms = (pct_ms(gaps, q) for q in (50, 90, 99))
        tokens = sum(r["completion_tokens"] or 0 for r in second)
        chunks = sum(len(r["times_s"]) for r in second)
        cached = [r["cached_tokens"] for r in second]
        metrics = read_metrics(server.url, server.headers)
        held = metrics.get('kvslim_cache_bytes{where="sessions"}')
        if held is not None:
            row.cache_bytes, row.bytes_per_stream = int(held), int(held) // c
        row.note = (f"{tokens / chunks if chunks else float('nan'):.2f} tokens/chunk; sessions continued "
                    f"{sum(1 for x in cached if x)}/{c}")
        return row
    finally:
        delete_sessions(server, sessions)


def delete_sessions(server, sessions: Sequence[str]) -> None:
    """Delete a measurement's sessions from ``server`` (stop at the first that fails: the server is gone)."""
    import httpx

    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30.0) as client:
        for s in sessions:
            try:
                client.delete(f"/v1/sessions/{s}")
            except httpx.HTTPError:
                break


def run_serve(
    model_flags: Sequence[str],
    specs: Sequence[str],
    prompts_of: Callable[[int], Sequence[int]],
    lengths: Sequence[int],
    concurrencies: Sequence[int],
    steps: int,
    *,
    warmup: int = 1,
    threads: int | None = None,
    omp_wait: str = "auto",
    log: Callable[[str], None] | None = None,
    log_dir: str | None = None,
    after: Callable | None = None,
    prefill_chunk: int | None = None,
) -> tuple[list[ConcurrencyRow], str]:
    """Every spec at every length and concurrency through one ``kvslim serve`` child (started with room for
    the largest concurrency, and one more request with ``after``, stopped at the end). prompts_of(L): the L
    token ids every stream sends (the engine rows' prompt). after(server, spec, prompts, tag): a measurement run
    after each (:func:`kvslim.bench.join.join_after`). prefill_chunk: the server's ``--prefill-chunk`` (its
    default if None). Returns the rows and the server log's path (kept in
    ``log_dir``, else a temporary directory)."""
    from .server import Server

    log = log or quiet
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvslim-bench-serve-")
    log_path = os.path.join(log_dir, "serve.log")
    room = max(concurrencies) + (1 if after else 0)
    server = Server(kvslim_command(), server_flags(model_flags, room, threads=threads, omp_wait=omp_wait,
                                                         prefill_chunk=prefill_chunk), None,
                    log_path)
    # a --compile child compiles a graph a bucket of rows (1, 2, 4, ... up to room) before it answers: ~20-40 s each
    buckets = (room - 1).bit_length() + 1
    took = server.start(300.0 + (60.0 * buckets if "--compile" in model_flags else 0.0))
    log(f"kvslim serve answered /health in {took:.1f} s (log: {log_path})")
    rows: list[ConcurrencyRow] = []
    try:
        k = 0
        for length in lengths:
            ids = list(prompts_of(length))
            for c in concurrencies:
                for spec in specs:
                    k += 1
                    rows.append(measure_serve(server, spec, [ids] * c, steps, warmup=warmup, tag=f"bench{k}", log=log))
                    if after:
                        after(server, spec, [ids] * c, f"after{k}")
    finally:
        stopped = server.stop()
        if stopped.get("exit_code") not in (0, None) or stopped.get("killed"):
            log(f"kvslim serve stopped badly: {stopped}")
    return rows, log_path
