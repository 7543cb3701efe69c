"""The whole benchmark in one process: decode at every length, then append cost and StreamingLLM
flatness, gathered in a :class:`BenchResult`.

Validates every argument before the long part, switches the attention implementation for the run
(and back), warms every mode up, and reads the model's shapes and the process memory once. The
measurements themselves are :func:`.decode.measure_decode`, :func:`.append.measure_append` and
:func:`.streaming.measure_streaming`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..compiled import compile_decode, uncompile
from ..shapes import ModelShapes
from .append import AppendRow, measure_append
from .decode import DecodeRow, measure_decode, warm_up
from .memory import MB, MemoryProbe, weight_bytes_per_step
from .modes import Mode, attn_implementation, build_modes, resolve_attn, windowed_modes
from .streaming import SeenRow, measure_streaming
from .timing import quiet


@dataclass
class BenchResult:
    settings: dict
    model: dict
    bandwidth_gb_s: float  # the best of the per-length measurements
    peers: dict[str, str]
    decode: list[DecodeRow]
    append: list[AppendRow] = field(default_factory=list)
    streaming: list[SeenRow] = field(default_factory=list)
    memory: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        for row in out["append"]:
            row["us"] = {str(k): v for k, v in row["us"].items()}
        return out

    def peer_ratios(self) -> list[dict]:
        """kvslim modes against peers of the same nominal bits at each length: ms ratio of medians."""
        bits = {m: b for m, b in self.settings.get("mode_bits", {}).items()}
        out = []
        by_len: dict[int, list[DecodeRow]] = {}
        for row in self.decode:
            by_len.setdefault(row.length, []).append(row)
        for length, rows in by_len.items():
            for mine in (r for r in rows if r.kind == "kvslim" and bits.get(r.mode)):
                for peer in (r for r in rows if r.kind == "peer" and bits.get(r.mode) == bits[mine.mode]):
                    out.append(
                        dict(
                            mode=mine.mode,
                            peer=peer.mode,
                            length=length,
                            ratio=mine.ms_median / peer.ms_median,
                        )
                    )
        return out


def run_bench(
    model,
    configs: Sequence[str],
    lengths: Sequence[int],
    steps: int,
    *,
    peers: bool | Sequence[str] = False,
    warmup: int = 2,
    seed: int = 0,
    progress: bool = True,
    attn: str | None = None,
    prefill_lengths: Sequence[int] | None = None,
    append_lengths: Sequence[int] | None = (1024, 8192),
    append_reps: int = 50,
    seen: Sequence[int] | None = (1024, 4096, 16384, 65536),
    seen_configs: Sequence[str] | None = None,
    bandwidth_bytes: int = 256 * MB,
    compile: bool = False,
) -> BenchResult:
    """Bench ``configs`` (kvslim spec strings) against ``dynamic`` (and the peers) on ``model``.

    peers: transformers' QuantizedCache backends to add: True (all of ``quanto``, ``hqq``, ``fp8``),
        False, or a list of names; a backend whose package is missing is noted, not an error.
    lengths: context lengths to decode at; steps: timed decode steps per mode and length (after
    ``warmup`` untimed ones, interleaved the same way).
    attn: ``sdpa`` | ``kvslim`` | ``auto`` | None (None: leave the model's setting); switched back after.
    prefill_lengths: lengths at which every mode is built by a timed model prefill; at the others
        only ``dynamic`` is prefilled and every other cache gets its K/V through ``cache.update``
        (what a prefill hands a cache, without recomputing the model; prefill is then not
        reported). None: prefill every mode at every length; empty: prefill only ``dynamic``.
    append_lengths / append_reps: history lengths and repetitions of the append-cost measurement
        (None or empty: skip it).
    seen / seen_configs: tokens-seen values and windowed specs of the StreamingLLM flatness
        measurement (seen_configs None: the windowed specs among ``configs``; seen None: skip).
    compile: also bench compiled decode steps (:mod:`kvslim.modes`' compiled modes: transformers' StaticCache
        and a StaticSlimCache per spec, each holding ``max(lengths) + warmup + steps`` tokens); the model's
        one-token forward is compiled for the run (the compilations happen in the warm-up, their count and
        seconds are in ``settings``) and back to eager after.
    Global torch settings (threads) are the caller's; nothing here changes them.
    """
    lengths = _positive_ints("lengths", lengths)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    prefill_set = None
    if prefill_lengths is not None:
        prefill_set = (
            set(_positive_ints("prefill_lengths", prefill_lengths)) if len(prefill_lengths) else set()
        )
    capacity = max(lengths) + warmup + steps + 16 if compile else None
    if compile and (resolve_attn(attn) if attn is not None else model.config._attn_implementation) != "kvslim":
        raise ValueError("--compile benches kvslim's compiled attention: run with --attn kvslim (or auto)")
    log = _logger(progress)
    device = next(model.parameters()).device
    probe = MemoryProbe()

    with (
        contextlib.ExitStack() as stack,
        torch.no_grad(),
        attn_implementation(model, None if attn is None else resolve_attn(attn)) as attn_used,
    ):
        # validated now (with the attention the run uses), not after the long part
        modes, peer_notes = build_modes(model, configs, peers=peers, compile_capacity=capacity)
        seen_modes: list[Mode] = []
        if seen:
            seen = _positive_ints("seen", seen)
            if seen_configs is None:
                seen_modes = windowed_modes(model, configs)
            else:
                seen_modes = windowed_modes(model, seen_configs, strict=True)
        weights = weight_bytes_per_step(model)
        compiled = compile_decode(model) if compile else None
        if compiled is not None:
            stack.callback(uncompile, model)  # back to eager, even on an error
            # the eager modes are eager on purpose here: no warning that they are not compiled
            compiled.warned.update(type(m.make()).__name__ for m in modes if not m.compiled)
        if compiled is not None:
            log("compiling the decode step of each compiled mode (in the warm-up)")
        warm_up(model, modes)
        if compiled is not None:
            log(f"compiled {compiled.compiles} graph(s) in {compiled.compile_s:.1f} s")
        base_rss = probe.settle(collect=True)  # the model loaded and warmed up, no cache alive
        log(f"modes: {', '.join(m.name for m in modes)}")
        decode_rows: list[DecodeRow] = []
        for length in lengths:
            decode_rows += measure_decode(
                model,
                modes,
                length,
                steps,
                warmup=warmup,
                seed=seed,
                prefill_all=prefill_set is None or length in prefill_set,
                bandwidth_bytes=bandwidth_bytes,
                weights=weights,
                probe=probe,
                log=log,
            )
        append_rows: list[AppendRow] = []
        if append_lengths:
            append_rows = measure_append(
                model,
                modes,
                _positive_ints("append_lengths", append_lengths),
                reps=append_reps,
                seed=seed,
                log=log,
            )
        seen_rows: list[SeenRow] = []
        if seen and seen_modes:
            seen_rows = measure_streaming(model, seen_modes, seen, steps, warmup=warmup, seed=seed, log=log)

    shapes = ModelShapes.from_config(model.config)
    return BenchResult(
        settings=dict(
            lengths=list(lengths),
            steps=steps,
            warmup=warmup,
            seed=seed,
            threads=torch.get_num_threads(),
            attn=attn_used,
            prefill_lengths="all" if prefill_set is None else sorted(prefill_set),
            modes=[m.name for m in modes],
            compiled_modes=[m.name for m in modes if m.compiled],
            compile_s=None if compiled is None else compiled.compile_s,
            compiles=None if compiled is None else compiled.compiles,
            mode_bits={m.name: m.bits for m in modes},
            torch=torch.__version__,
            transformers=importlib.import_module("transformers").__version__,
            device=str(device),
        ),
        model=dict(
            name=getattr(model.config, "_name_or_path", "") or type(model).__name__,
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            weight_bytes_per_step=weights,
            n_layers=shapes.n_layers,
            n_heads=shapes.n_heads,
            n_kv_heads=shapes.n_kv_heads,
            head_dim=shapes.head_dim,
        ),
        bandwidth_gb_s=max((r.bandwidth_gb_s for r in decode_rows), default=0.0),
        peers=peer_notes,
        decode=decode_rows,
        append=append_rows,
        streaming=seen_rows,
        memory=dict(
            method="VmHWM reset per step" if probe.can_reset else "unavailable (no /proc/self/clear_refs)",
            base_rss_bytes=base_rss,
            process_max_rss_bytes=probe.max_rss_ever(),
        ),
    )


def _positive_ints(name: str, values) -> list[int]:
    values = [values] if isinstance(values, int) else list(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {values!r}")
    return values


def _logger(enabled: bool) -> Callable[[str], None]:
    """Progress lines on stderr, each stamped with the seconds since the run began."""
    if not enabled:
        return quiet
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[bench {time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    return log
