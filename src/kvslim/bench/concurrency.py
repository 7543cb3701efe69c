"""Many streams at once: aggregate decode tokens/s and bytes per stream at each concurrency.

The workload kvslim exists for is many concurrent long streams, where the KV cache — not the weights — is
most of the bytes a decode step reads. For each context length ``L`` and concurrency ``C`` this measures,
in one process and interleaved round by round (as :mod:`.decode` does):

- ``dynamic``: transformers' plain ``DynamicCache`` batched as ``generate()`` batches — one ``(C, 1)``
  forward per step over a ``(C, H, L, D)`` cache (every row the same length here, so no row carries
  padding: the plain cache's best case);
- each kvslim spec through the batch engine's decode step (:func:`kvslim.generate.forward_rows`): ``C``
  batch-1 caches of their own, one ragged forward per step, attention on each row's codes, the linear layers
  through the engine's route (``linears``, :mod:`kvslim.engine.linears`; the plain cache keeps torch's);
- each ``SPEC+pages`` (``--pages``): the spec's rows in one pool of pages, as ``Engine(pages=...)`` keeps them
  (:mod:`.concurrency_pages`: one forward, two kernel calls a layer); ``SPEC+pages+compiled`` (``--pages
  --compile``): the same rows stepped by the compiled paged step (:mod:`kvslim.cache.paged_compiled`);
- ``continuous-batching``: transformers' own continuous batching (``model.generate_batch``, its paged
  cache), where it runs: ``C`` prompts of ``L`` tokens, decode throughput read from its per-token
  timestamps after every request has produced its first token (its prefill excluded).

To keep the set-up affordable the ``C`` rows of a mode are copies of one prefilled row (the same tokens):
a decode step's cost does not depend on what the tokens are. ``aggregate_tok_s`` is ``C`` over the median
step time; ``bytes_per_stream`` is the cache's bytes over ``C``.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..engine.linears import Linears, step_rows
from ..generate import decode_one_token, forward_rows, prefill
from .concurrency_pages import PagedRows, compiled_step, prefill_pages
from .memory import cache_nbytes
from .modes import DYNAMIC, Mode
from .timing import quartiles, quiet, sync

CONTINUOUS_BATCHING = "continuous-batching"


@dataclass
class ConcurrencyRow:
    """One mode at one context length and concurrency. Times in ms, bytes in bytes."""

    mode: str
    kind: str
    length: int
    concurrency: int
    steps: int
    ms_median: float  # one decode step of all rows
    ms_q1: float
    ms_q3: float
    aggregate_tok_s: float
    ratio_to_dynamic: float | None  # aggregate tok/s over dynamic's at the same length and concurrency
    bytes_per_stream: int | None
    cache_bytes: int | None
    note: str = ""
    # per-token latency a stream sees (engine rows: the step; serve rows: the gaps between streamed chunks) and,
    # for serve rows, the time to first token of C prompts arriving at once (None where not measured)
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    # with --peer-rounds N: each round's median step (ms; None for a round that failed), this row its median round's
    # (kvslim.bench.rounds); None for a row measured once
    rounds_ms: list | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def measure_concurrency(
    model,
    modes: Sequence[Mode],
    length: int,
    concurrency: int,
    steps: int,
    *,
    warmup: int = 1,
    seed: int = 0,
    continuous_batching: bool = True,
    log: Callable[[str], None] | None = None,
    built: dict | None = None,
    linears: Linears | str = "auto",
) -> list[ConcurrencyRow]:
    """One :class:`ConcurrencyRow` per mode (``modes[0]`` is ``dynamic``), plus transformers' continuous
    batching when asked and it runs here (else a row with a note saying why not). built: mode name ->
    a cache already prefilled with this length's tokens (:func:`prefilled`; copied, never changed). linears:
    the kvslim rows' route for the linear layers, as the engine's (a route name or a built
    :class:`~kvslim.engine.linears.Linears`)."""
    log = log or quiet
    route = linears if isinstance(linears, Linears) else Linears(model, linears, batch_hint=step_rows(concurrency))
    device = next(model.parameters()).device
    ids = _tokens(model, length, seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + length + 1)
    feed = torch.randint(0, model.get_input_embeddings().weight.shape[0], (warmup + steps, concurrency), generator=g)
    if built is None:
        built = prefilled(model, modes, length, seed=seed, log=log, rows=concurrency, extra=warmup + steps)

    rows_of: dict[str, object] = {}
    with torch.inference_mode():
        for mode in modes:
            base = built[mode.name]
            if mode.kind == "kvslim":
                rows_of[mode.name] = [copy.deepcopy(base) for _ in range(concurrency)]
            elif mode.kind == "pages":
                step = compiled_step(model, mode.compiled) if mode.compiled else None
                rows_of[mode.name] = PagedRows(*base, concurrency, step)
            else:
                cache = copy.deepcopy(base)
                cache.batch_repeat_interleave(concurrency)
                rows_of[mode.name] = cache

        times: dict[str, list[float]] = {m.name: [] for m in modes}
        for r in range(warmup + steps):
            k = r % len(modes)
            for mode in modes[k:] + modes[:k]:
                tokens = feed[r].tolist()
                sync(device)
                t0 = time.perf_counter()
                if mode.kind == "kvslim":
                    with route.routed() as routed:  # filler rows only where a product needs them (Engine's rule)
                        logits = forward_rows(model, tokens, rows_of[mode.name], row_multiple=routed.row_multiple())
                elif mode.kind == "pages":
                    with route.routed() as routed:
                        logits = rows_of[mode.name].step(model, tokens, routed.row_multiple())
                else:
                    logits = decode_one_token(model, torch.tensor(tokens, device=device)[:, None], rows_of[mode.name])
                logits.argmax(-1).tolist()  # what a sampler does; syncs the device
                dt = time.perf_counter() - t0
                if r >= warmup:
                    times[mode.name].append(dt)
            log(f"L={length} C={concurrency} round {r + 1}/{warmup + steps}")

    out = []
    base = None
    for mode in modes:
        med, q1, q3 = quartiles(times[mode.name])
        cache = rows_of[mode.name]
        if isinstance(cache, PagedRows):
            held = cache.nbytes()
            cache.close()
        else:
            held = sum(c.nbytes() for c in cache) if isinstance(cache, list) else cache_nbytes(cache)
        agg = concurrency / med
        if mode.name == DYNAMIC:
            base = agg
        out.append(
            ConcurrencyRow(
                mode=mode.name,
                kind=mode.kind,
                length=length,
                concurrency=concurrency,
                steps=steps,
                ms_median=med * 1e3,
                ms_q1=q1 * 1e3,
                ms_q3=q3 * 1e3,
                aggregate_tok_s=agg,
                ratio_to_dynamic=None,
                bytes_per_stream=held // concurrency,
                cache_bytes=held,
                itl_p50_ms=_pct(times[mode.name], 50),
                itl_p90_ms=_pct(times[mode.name], 90),
                itl_p99_ms=_pct(times[mode.name], 99),
            )
        )
    rows_of.clear()
    if continuous_batching:
        out.append(_continuous_batching(model, ids, concurrency, steps + warmup, log))
    for row in out:
        row.ratio_to_dynamic = None if base is None or not row.aggregate_tok_s else row.aggregate_tok_s / base
    return out


def _pct(xs: Sequence[float], q: float) -> float:
    """The q-th percentile of ``xs`` seconds, in ms (linear between order statistics)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return (s[lo] + (s[hi] - s[lo]) * (k - lo)) * 1e3


def link_ratios(rows: Sequence[ConcurrencyRow]) -> None:
    """Fill ``ratio_to_dynamic`` of rows measured elsewhere (serve, peers) from the ``dynamic`` row at the same
    length and concurrency, where there is one."""
    base = {(r.length, r.concurrency): r.aggregate_tok_s for r in rows if r.mode == DYNAMIC and r.aggregate_tok_s}
    for r in rows:
        b = base.get((r.length, r.concurrency))
        if r.ratio_to_dynamic is None and b and r.aggregate_tok_s:
            r.ratio_to_dynamic = r.aggregate_tok_s / b


def tokens(model, length: int, seed: int) -> torch.Tensor:
    """The seeded random prompt (1, length) every mode is prefilled with (the serve rows and the peers send
    the same ids)."""
    return _tokens(model, length, seed)


def _tokens(model, length: int, seed: int) -> torch.Tensor:
    """The seeded random prompt (1, length) every mode is prefilled with."""
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed * 1_000_003 + length)
    return torch.randint(0, vocab, (1, length), generator=g).to(next(model.parameters()).device)


def prefilled(
    model, modes: Sequence[Mode], length: int, *, seed: int = 0, log=None, rows: int = 1, extra: int = 0
) -> dict:
    """Mode name -> a batch-1 cache of that mode prefilled with the seeded ``length`` tokens (a ``pages`` mode: its
    pool, with room for ``rows`` copies of ``length + extra`` tokens, and the prefilled row)."""
    log = log or quiet
    ids = _tokens(model, length, seed)
    out = {}
    with torch.inference_mode():
        for mode in modes:
            t0 = time.perf_counter()
            if mode.kind == "pages":
                out[mode.name] = prefill_pages(model, mode, ids, rows=rows, tokens=length + extra + 1)
            else:
                cache = mode.make()
                prefill(model, ids, cache, chunk_size=1024)
                out[mode.name] = cache
            log(f"L={length} {mode.name}: prefilled in {time.perf_counter() - t0:.1f} s")
    return out


def _continuous_batching(model, ids: torch.Tensor, concurrency: int, new_tokens: int, log) -> ConcurrencyRow:
    """transformers' ``generate_batch`` on ``concurrency`` copies of the prompt; decode throughput from its
    per-token timestamps once every request has its first token (prefill excluded)."""
    row = ConcurrencyRow(
        mode=CONTINUOUS_BATCHING, kind="peer", length=ids.shape[1], concurrency=concurrency, steps=new_tokens,
        ms_median=float("nan"), ms_q1=float("nan"), ms_q3=float("nan"), aggregate_tok_s=0.0,
        ratio_to_dynamic=None, bytes_per_stream=None, cache_bytes=None,
    )
    if not callable(getattr(model, "generate_batch", None)):
        row.note = "this transformers has no generate_batch"
        return row
    import logging

    from transformers import GenerationConfig

    gc = GenerationConfig(
        max_new_tokens=new_tokens + 1, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    prompts = [ids[0].tolist() for _ in range(concurrency)]
    level = logging.getLogger("ContinuousBatchingLogger").level
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    attn = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # its own choice for a plain model; it refuses custom attentions
    t0 = time.perf_counter()
    try:
        out = model.generate_batch(prompts, generation_config=gc, record_timestamps=True, warmup=False)
    except Exception as e:  # noqa: BLE001 - a peer that does not run here is a note in the table, not a crash
        row.note = f"generate_batch failed here: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return row
    finally:
        logging.getLogger("ContinuousBatchingLogger").setLevel(level)
        model.set_attn_implementation(attn)  # it may switch the model to a paged attention
    log(f"L={ids.shape[1]} C={concurrency} {CONTINUOUS_BATCHING}: {time.perf_counter() - t0:.1f} s")
    stamps = [list(getattr(o, "timestamps", None) or []) for o in out.values()]
    if len(stamps) != concurrency or any(len(s) < 2 for s in stamps):
        row.note = "generate_batch returned no per-token timestamps"
        return row
    start = max(s[0] for s in stamps)  # every request has its first token: prefill is over
    end = max(s[-1] for s in stamps)
    decoded = sum(1 for s in stamps for t in s if t > start)
    if end <= start or not decoded:
        row.note = "too few tokens after the prefill to time"
        return row
    row.aggregate_tok_s = decoded / (end - start)
    steps_ms = [(b - a) * 1e3 for s in stamps for a, b in zip(s, s[1:]) if a >= start]
    row.ms_median = statistics.median(steps_ms) if steps_ms else float("nan")
    row.note = "paged cache; bytes not reported (preallocated from free memory)"
    return row


def run_concurrency(
    model,
    modes: Sequence[Mode],
    lengths: Sequence[int],
    concurrencies: Sequence[int],
    steps: int,
    *,
    warmup: int = 1,
    seed: int = 0,
    continuous_batching: bool = True,
    log: Callable[[str], None] | None = None,
    linears: Linears | str = "auto",
    built: dict | None = None,
) -> list[ConcurrencyRow]:
    """:func:`measure_concurrency` at every length and concurrency (``linears``: the kvslim rows' route, a name or a
    built :class:`~kvslim.engine.linears.Linears`). built: length -> :func:`prefilled`'s caches, kept across calls
    (filled here where a length is missing; a later call with the same dict prefills nothing)."""
    rows = []
    route = linears if isinstance(linears, Linears) else Linears(model, linears, batch_hint=step_rows(max(concurrencies)))
    kept = {} if built is None else built
    for length in lengths:
        if length not in kept:
            kept[length] = prefilled(model, modes, length, seed=seed, log=log, rows=max(concurrencies),
                                     extra=warmup + steps)  # fmt: skip
        built_here = kept[length]
        for c in concurrencies:
            rows += measure_concurrency(
                model, modes, length, c, steps, warmup=warmup, seed=seed,
                continuous_batching=continuous_batching, log=log, built=built_here, linears=route,
            )
    return rows


def render_concurrency(rows: Sequence[ConcurrencyRow]) -> str:
    """A text table: one line per mode, length and concurrency."""
    head = (f"{'mode':<34} {'L':>6} {'C':>3} {'ms/step':>9} {'agg tok/s':>10} {'x dynamic':>9} {'MiB/stream':>11} "
            f"{'ITL p50/p90/p99 ms':>20} {'TTFT p50/p90/p99 ms':>22}  note")
    lines = [
        "decode with many streams (aggregate tokens/s over all rows; engine rows are copies of one prefill; "
        "ITL: a stream's per-token latency; TTFT: C prompts arriving at once, serve rows only)",
        head,
    ]
    for r in rows:
        ratio = "" if r.ratio_to_dynamic is None else f"{r.ratio_to_dynamic:.2f}"
        mib = "" if r.bytes_per_stream is None else f"{r.bytes_per_stream / 2**20:.2f}"
        ms = "" if r.ms_median != r.ms_median else f"{r.ms_median:.1f}"
        agg = f"{r.aggregate_tok_s:.1f}" if r.aggregate_tok_s else ""
        itl = _three(r.itl_p50_ms, r.itl_p90_ms, r.itl_p99_ms)
        ttft = _three(r.ttft_p50_ms, r.ttft_p90_ms, r.ttft_p99_ms)
        lines.append(f"{r.mode:<34} {r.length:>6} {r.concurrency:>3} {ms:>9} {agg:>10} {ratio:>9} {mib:>11} "
                     f"{itl:>20} {ttft:>22}  {r.note}")
    return "\n".join(lines)


def _three(*xs) -> str:
    return "" if all(x is None for x in xs) else "/".join("-" if x is None else f"{x:.0f}" for x in xs)
