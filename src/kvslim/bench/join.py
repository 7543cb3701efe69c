"""``kvslim bench --concurrency C --serve --join J``: what a joining long prompt costs the streams already decoding.

The server mixes prompt chunks into its decode steps (:mod:`kvslim.engine.step`): a step carries every decoding
stream's token plus up to ``--prefill-chunk`` prompt tokens of a joining request, so a joining prompt never pauses
the others, it makes each of their steps longer while its chunks last. This measures by how much, through a real
``kvslim serve`` (the ``--serve`` child, :mod:`.serve`):

1. ``C`` sessions of the bench's ``L``-token prompt are prefilled (one token each), then continued at once, each
   decoding ``max_tokens`` tokens (enough to outlast the join);
2. once every stream has streamed ``warmup + steps`` chunks, one more client sends a fresh prompt of ``J`` token
   ids (seeded, no session, ``max_tokens`` 1) with the same cache spec;
3. the decoding streams' inter-token gaps are split at that moment: *before* (every stream decoding, after the
   warm-up, until the join is sent) and *during* (gaps that end after the join was sent and up to its first
   token, the steps that carried its ``ceil(J / chunk)`` chunks).

``extra_per_chunk_ms`` is the gaps' mean excess during the join over the median before, times the gaps during it,
over the chunks: what each chunk added to a stream's wait. The issue's bound is one step per chunk
(``extra_per_chunk_ms <= itl_before_p50_ms``, reported as ``within_one_step``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .serve import REQUEST_TIMEOUT, _failures, _phase, delete_sessions, pct_ms
from .timing import quiet


@dataclass
class JoinRow:
    """One join measurement (module docstring); times in ms."""

    spec: str
    length: int
    concurrency: int
    join_tokens: int
    chunk: int
    chunks: int
    itl_before_p50_ms: float | None = None
    itl_during_p50_ms: float | None = None
    itl_during_p90_ms: float | None = None
    itl_during_max_ms: float | None = None
    gaps_during: int = 0
    join_ttft_ms: float | None = None
    extra_per_chunk_ms: float | None = None
    within_one_step: bool | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


#: decode steps the streams run past the join's chunks and their own count (:func:`measure_join`): the join
#: request's own way in (its HTTP request and admission: at a small model's millisecond steps, 8 were once too few)
JOIN_MARGIN = 40


def split_gaps(times: Sequence[Sequence[float]], start: float, sent: float, first: float) -> tuple[list, list]:
    """The streams' gaps (seconds) before the join (both ends in ``[start, sent]``) and during it (ending in
    ``(sent, first]``). times: each stream's chunk arrival times."""
    before = [b - a for t in times for a, b in zip(t, t[1:]) if a >= start and b <= sent]
    during = [b - a for t in times for a, b in zip(t, t[1:]) if sent < b <= first]
    return before, during


def summarize(row: JoinRow, before: Sequence[float], during: Sequence[float]) -> JoinRow:
    """Fill ``row``'s latency columns from the gaps (seconds)."""
    row.itl_before_p50_ms = pct_ms(before, 50)
    row.itl_during_p50_ms, row.itl_during_p90_ms = pct_ms(during, 50), pct_ms(during, 90)
    row.itl_during_max_ms = max(during) * 1e3 if during else None
    row.gaps_during = len(during)
    if row.itl_before_p50_ms is not None and during:
        streams = max(row.concurrency, 1)
        excess = sum(g * 1e3 - row.itl_before_p50_ms for g in during) / streams  # one stream's added wait
        row.extra_per_chunk_ms = excess / row.chunks
        row.within_one_step = row.extra_per_chunk_ms <= row.itl_before_p50_ms
    return row


def measure_join(
    server,
    spec: str,
    prompts: Sequence[Sequence[int]],
    join_ids: Sequence[int],
    steps: int,
    *,
    chunk: int,
    warmup: int = 1,
    tag: str = "join",
    timeout: float = REQUEST_TIMEOUT,
    log: Callable[[str], None] | None = None,
) -> JoinRow:
    """One join row (module docstring) through ``server`` (a started :class:`~kvslim.bench.server.Server` whose
    ``--prefill-chunk`` is ``chunk``)."""
    log = log or quiet
    c, length = len(prompts), len(prompts[0])
    chunks = math.ceil(len(join_ids) / chunk)
    row = JoinRow(spec=spec, length=length, concurrency=c, join_tokens=len(join_ids), chunk=chunk, chunks=chunks)
    sessions = [f"{tag}-{i}" for i in range(c)]
    common = {"model": server.model, "temperature": 0, "stream": True, "ignore_eos": True, "kvslim_cache": spec}
    try:
        first = asyncio.run(_phase(
            server, [{**common, "prompt": list(p), "max_tokens": 1, "session": s} for p, s in zip(prompts, sessions)],
            timeout,
        ))
        if _failures(first):
            row.note = f"prefill: {_failures(first)}"
            return row
        # enough tokens to decode through the warm-up, the steps before the join, its chunks (one a step, the
        # streams' tokens riding along) and a margin
        new = warmup + steps + chunks + c + JOIN_MARGIN
        bodies = [{**common, "prompt": [*p, p[-1]], "max_tokens": new, "session": s} for p, s in zip(prompts, sessions)]
        t0 = time.perf_counter()
        records, joined = asyncio.run(_with_join(server, bodies, {**common, "prompt": list(join_ids), "max_tokens": 1},
                                                 warmup + steps, timeout))
        log(f"L={length} C={c} {spec}: {len(join_ids)}-token join during {new} decoded tokens each, "
            f"{time.perf_counter() - t0:.1f} s")
        bad = _failures([*records, joined])
        if bad:
            row.note = f"decode/join: {bad}"
            return row
        times = [r["times_s"] for r in records]
        start = max(t[warmup] for t in times)
        sent, got = joined["start_s"], joined["start_s"] + joined["first_token_s"]
        row.join_ttft_ms = joined["first_token_s"] * 1e3
        if any(t[-1] <= got for t in times):
            row.note = "a stream ended before the join's first token: its gaps during the join are missing"
        return summarize(row, *split_gaps(times, start, sent, got))
    finally:
        delete_sessions(server, sessions)


def join_after(join_ids: Sequence[int], steps: int, warmup: int, rows: list, log=None,
               chunk: int | None = None) -> Callable:
    """The ``after`` of :func:`kvslim.bench.serve.run_serve` that measures ``join_ids`` joining each spec's
    streams, appending a :class:`JoinRow` to ``rows``. chunk: the server's ``--prefill-chunk`` (its default if
    None)."""
    from ..serve.defaults import DEFAULT_PREFILL_CHUNK

    chunk = DEFAULT_PREFILL_CHUNK if chunk is None else chunk

    def after(server, spec: str, prompts, tag: str) -> None:
        rows.append(measure_join(server, spec, prompts, join_ids, steps, chunk=chunk, warmup=warmup,
                                 tag=tag, log=log))

    return after


async def _with_join(server, bodies: list[dict], join: dict, after: int, timeout: float) -> tuple[list[dict], dict]:
    """``bodies`` streamed at once; ``join`` sent once each of them has streamed ``after`` chunks. Returns their
    records and the join's (times relative to one origin)."""
    import httpx

    from .server import stream_request

    t_origin = time.perf_counter()
    live = [{"times_s": []} for _ in bodies]
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=None, headers=server.headers) as client:
        streams = [
            asyncio.ensure_future(stream_request(client, "/v1/completions", b, timeout=timeout, t_origin=t_origin,
                                                 record=rec))
            for b, rec in zip(bodies, live, strict=True)
        ]
        deadline = time.perf_counter() + timeout
        while any(len(r["times_s"]) < after for r in live) and not all(s.done() for s in streams):
            if time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.005)
        joined = await stream_request(client, "/v1/completions", join, timeout=timeout, t_origin=t_origin)
        return list(await asyncio.gather(*streams)), joined


def render_join(rows: Sequence[JoinRow]) -> str:
    """The join table: one line per measurement."""
    def f(x) -> str:
        return "-" if x is None else f"{x:.0f}"

    lines = ["joining prompt through kvslim serve (ms; extra/chunk: a stream's added wait per prompt chunk)",
             f"{'config':<28} {'L':>5} {'C':>3} {'join':>5} {'chunks':>6} {'ITL before':>10} {'during p50':>10} "
             f"{'p90':>6} {'max':>6} {'extra/chunk':>11} {'<=1 step':>8} {'join TTFT':>9}"]
    for r in rows:
        ok = "-" if r.within_one_step is None else ("yes" if r.within_one_step else "no")
        lines.append(f"{r.spec:<28} {r.length:>5} {r.concurrency:>3} {r.join_tokens:>5} {r.chunks:>6} "
                     f"{f(r.itl_before_p50_ms):>10} {f(r.itl_during_p50_ms):>10} {f(r.itl_during_p90_ms):>6} "
                     f"{f(r.itl_during_max_ms):>6} {f(r.extra_per_chunk_ms):>11} {ok:>8} {f(r.join_ttft_ms):>9}"
                     + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)
