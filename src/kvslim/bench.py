"""Speed and memory of cache modes, side by side with the plain cache and the peers, in one process.

For each context length ``L`` every mode's cache is built (by a timed prefill of the same seeded
random ``L`` tokens, or by handing it the plain cache's K/V, see ``prefill_lengths``), all caches of
that length stay alive, and single-token decode steps are *interleaved*: round ``r`` runs one step
of every mode (in an order rotated by ``r``), so slow drifts of a shared, noisy machine hit every
mode alike and the ratios to the baseline stay meaningful. The baseline is transformers' plain
``DynamicCache``, always included under the name ``dynamic``.

What is reported, per mode and length (:class:`DecodeRow`):

- decode ms/token: median, quartiles, min/max of the timed steps (each a full ``model(...)`` call
  with an explicit ``position_ids`` and ``logits_to_keep=1``), tok/s, the ratio of medians to
  ``dynamic`` and the median of the per-round paired ratios;
- prefill tok/s (when prefilled) and its ratio to ``dynamic``;
- ``cache_bytes``: every byte the cache holds (``SlimCache.nbytes()``; for transformers' caches the
  sum of every tensor in its layers, quantized payloads, scales and residuals included);
- memory: ``resident_bytes`` is the process RSS growth (``/proc/self/statm``, after a
  ``malloc_trim``) caused by building this cache; ``step_transient_bytes`` the largest RSS rise
  *inside* one decode step of this mode (Linux ``VmHWM``, reset to the current RSS before each
  step by writing ``5`` to ``/proc/self/clear_refs``); ``peak_bytes`` their sum: what this mode
  adds to the process (over the loaded model) at its decode peak. ``ru_maxrss`` is monotonic over
  the process, so it cannot separate modes; it is reported once, in ``memory``.
- the memory-bandwidth floor: ``(weight bytes read per step + cache bytes read per step) /
  bandwidth``, the bandwidth measured with a large tensor copy just before that length's decode
  steps (so it sees the same machine load), and the measured step's ratio to it.

Two more measurements: the *append cost* (``cache.update`` of one token on layer 0 with random K/V of
the model's shapes, at two history lengths; :class:`AppendRow`) and *StreamingLLM flatness* (decode
step time of windowed modes at growing numbers of tokens seen, the history advanced cheaply by
feeding the cache real K/V chunks through ``cache.update``, not the model; :class:`SeenRow`). Both
keep one cache per (mode, length) alive and interleave over all of them.

This module knows nothing about argument parsing or printing (see :mod:`kvslim.cli.bench`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import importlib.util
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

DYNAMIC = "dynamic"
ATTN_CHOICES = ("sdpa", "kvslim", "auto")
#: transformers' QuantizedCache backends that need an optional package: backend -> (module, pip name).
PEER_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
PEER_NBITS = (4, 2)
#: transformers' QuantizedCache backends benched by ``peers=True`` (``fp8`` needs no extra package).
PEER_BACKENDS = ("quanto", "hqq", "fp8")
_MB = 1 << 20


# ---------------------------------------------------------------------------------------------
# modes


@dataclass(frozen=True)
class Mode:
    """One cache mode under test.

    name: the table label (``dynamic``, a canonical kvslim spec, or a peer such as ``quanto-int4``).
    kind: ``dynamic`` | ``kvslim`` | ``peer``.
    make: builds a fresh, empty cache.
    bits: nominal code width of K and V (4 for int4/q4_0/quanto-int4), None for unquantized modes;
        used only to pair kvslim modes with peers of the same width.
    window: the StreamingLLM window (None: unbounded).
    """

    name: str
    kind: str
    make: Callable[[], object] = field(repr=False, compare=False)
    bits: int | None = None
    window: int | None = None


def peer_availability() -> dict[str, str | None]:
    """For each optional peer backend: None when importable, else why not (one line)."""
    out: dict[str, str | None] = {}
    for backend, (module, pip_name) in PEER_PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        out[backend] = None if found else f"{pip_name} is not installed (pip install {pip_name})"
    return out


def build_modes(
    model, configs: Sequence[str], *, peers: bool | Sequence[str] = False
) -> tuple[list[Mode], dict[str, str]]:
    """The modes for ``configs`` (kvslim spec strings), ``dynamic`` first, then the peers if asked.

    peers: False, True (every backend of :data:`PEER_BACKENDS`), or a list of backend names.
    Returns ``(modes, peer_notes)``: ``peer_notes`` maps each requested peer backend to
    ``"available"`` or the reason it was skipped (a missing package is a note, not an error).
    """
    from transformers import DynamicCache

    from .config import parse_spec

    backends = _peer_backends(peers)
    config = model.config
    modes = [Mode(DYNAMIC, "dynamic", lambda: DynamicCache(config=config))]
    seen_names = {DYNAMIC}
    specs = [configs] if isinstance(configs, str) else list(configs)
    for spec in specs:
        cfg = parse_spec(spec)
        name = cfg.to_spec()
        if name in seen_names:
            raise ValueError(f"cache config {spec!r} is given twice (as {name!r}); each mode is benched once")
        seen_names.add(name)
        from .cache import SlimCache

        SlimCache.from_config(cfg, config=config)  # validate against the model now, not mid-run
        bits = _nominal_bits(cfg.k_format) if cfg.k_format == cfg.v_format else None
        modes.append(
            Mode(name, "kvslim", lambda cfg=cfg: SlimCache.from_config(cfg, config=config), bits, cfg.window)
        )
    notes: dict[str, str] = {}
    if backends:
        from transformers import QuantizedCache

        availability = peer_availability()
        for backend in backends:
            missing = availability.get(backend)  # fp8 needs no package: per-tensor scale, appended as-is
            notes[backend] = missing or "available"
            if missing:
                continue
            if backend == "fp8":
                modes.append(Mode("tf-fp8", "peer", lambda: QuantizedCache("fp8", config=config), 8))
                continue
            for nbits in PEER_NBITS:
                make = lambda b=backend, n=nbits: QuantizedCache(b, config=config, nbits=n)  # noqa: E731
                modes.append(Mode(f"{backend}-int{nbits}", "peer", make, nbits))
    return modes, notes


def _peer_backends(peers) -> list[str]:
    if isinstance(peers, bool):
        return list(PEER_BACKENDS) if peers else []
    names = [peers] if isinstance(peers, str) else list(peers)
    bad = [n for n in names if n not in PEER_BACKENDS]
    if bad:
        raise ValueError(f"unknown peer backend(s) {bad}; expected some of: {', '.join(PEER_BACKENDS)}")
    return list(dict.fromkeys(names))


def _nominal_bits(fmt: str) -> int | None:
    if fmt in ("none", "fp16", "bf16"):
        return None
    m = re.search(r"\d+", fmt)
    return int(m.group()) if m else None


# ---------------------------------------------------------------------------------------------
# attention implementation


def kvslim_attention_available() -> bool:
    """Whether the ``kvslim`` attention function is registered with transformers (after importing
    :mod:`kvslim.attention`, when that module exists)."""
    try:
        importlib.import_module("kvslim.attention")
    except ModuleNotFoundError as e:
        if e.name != "kvslim.attention":
            raise
        return False
    from transformers import AttentionInterface

    return "kvslim" in AttentionInterface()


def resolve_attn(choice: str) -> str:
    """``sdpa`` | ``kvslim`` | ``auto`` (kvslim when available, else sdpa) -> the implementation name."""
    if choice not in ATTN_CHOICES:
        raise ValueError(f"attn must be one of {', '.join(ATTN_CHOICES)}, got {choice!r}")
    if choice == "sdpa":
        return "sdpa"
    available = kvslim_attention_available()
    if choice == "kvslim" and not available:
        raise ValueError("attn='kvslim' but no 'kvslim' attention function is registered (kvslim.attention)")
    return "kvslim" if available else "sdpa"


@contextlib.contextmanager
def _attn_implementation(model, name: str | None):
    """Switch the model's attention implementation for the block, then switch it back."""
    before = getattr(model.config, "_attn_implementation", None)
    if name is None or name == before:
        yield before
        return
    model.set_attn_implementation(name)
    try:
        yield name
    finally:
        model.set_attn_implementation(before)


# ---------------------------------------------------------------------------------------------
# bytes: weights, caches, bandwidth


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters one decode step reads: every parameter once (tied weights once), except
    an input embedding table not shared with the output head, of which one row is read."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    if emb is not None and (out is None or out.weight.data_ptr() != emb.weight.data_ptr()):
        w = emb.weight
        total -= w.numel() * w.element_size() - w.shape[-1] * w.element_size()
    return total


def _tensor_bytes(obj, seen: set[int]) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensors, tensor subclasses that flatten into
    inner tensors such as optimum-quanto's, tuples, lists, dicts), each storage counted once."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n), seen) for n in names)
        if obj.numel() == 0:
            return 0
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(x, seen) for x in obj.values())
    return 0


def cache_nbytes(cache) -> int:
    """Every byte a cache holds. SlimCache reports its own; for transformers' caches every tensor
    attribute of every layer is counted (keys/values, quantized payloads, scales, zeros)."""
    from .cache import SlimCache

    if isinstance(cache, SlimCache):
        return cache.nbytes()
    seen: set[int] = set()
    return sum(_tensor_bytes(vars(layer), seen) for layer in cache.layers)


def cache_read_bytes(cache) -> int:
    """Bytes one decode step must read from the cache at least: the stored tokens, without the
    preallocated slack a SlimCache buffer may hold."""
    from .cache import SlimCache

    if isinstance(cache, SlimCache):
        return cache.live_nbytes()
    return cache_nbytes(cache)


def stored_tokens(cache) -> int:
    from .cache import SlimCache

    if isinstance(cache, SlimCache):
        return cache.stored_tokens()
    return cache.get_seq_length()


def measure_bandwidth(nbytes: int = 256 * _MB, repeats: int = 5, device="cpu") -> float:
    """Memory bandwidth in bytes/s: ``2 * nbytes / best time`` of copying an ``nbytes`` tensor into
    a preallocated one (a read and a write of every byte), best of ``repeats``."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: fault the pages in outside the timing
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


# ---------------------------------------------------------------------------------------------
# process memory


class MemoryProbe:
    """Process memory on Linux: the current RSS (``/proc/self/statm``) and the high-water mark
    (``VmHWM``), which can be reset to the current RSS by writing ``5`` to ``/proc/self/clear_refs``
    (Linux >= 4.0). Elsewhere every reading is None."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.has_rss = self.rss() is not None
        self.can_reset = self.reset_peak()
        self._libc = None
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            libc.malloc_trim  # noqa: B018 - glibc only
            self._libc = libc

    def rss(self) -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self.page
        except (OSError, ValueError, IndexError):
            return None

    def reset_peak(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def peak(self) -> int | None:
        """VmHWM: the largest RSS since the last :meth:`reset_peak` (or process start)."""
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
        return None

    @staticmethod
    def max_rss_ever() -> int:
        """ru_maxrss in bytes: monotonic over the whole process."""
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def settle(self, collect: bool = False) -> int | None:
        """Give freed heap back to the OS (glibc ``malloc_trim``), then read RSS. ``collect``: run
        a full garbage collection first (slow with transformers loaded: ~1 s on a busy machine; only
        needed where reference cycles, such as a dropped cache's, must be freed)."""
        if collect:
            gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        return self.rss()


# ---------------------------------------------------------------------------------------------
# results


@dataclass
class DecodeRow:
    """One mode at one length. Times in ms; bytes in bytes."""

    mode: str
    kind: str
    length: int
    steps: int
    ms_median: float
    ms_q1: float
    ms_q3: float
    ms_min: float
    ms_max: float
    tok_s: float
    ratio_to_dynamic: float
    paired_ratio_to_dynamic: float
    built_by: str  # "prefill" (timed model prefill) or "copy" (the dynamic cache's K/V via cache.update)
    build_s: float
    prefill_tok_s: float | None
    prefill_ratio_to_dynamic: float | None
    cache_bytes: int
    cache_read_bytes: int
    tokens_stored: int
    one_layer_fp_bytes: int  # a full-precision K and V of one layer of the stored tokens
    resident_bytes: int | None
    step_transient_bytes: int | None
    peak_bytes: int | None
    bandwidth_gb_s: float  # measured just before this length's decode steps
    floor_ms: float
    ratio_to_floor: float


@dataclass
class AppendRow:
    """``cache.update`` of one token on layer 0, median microseconds at each history length."""

    mode: str
    kind: str
    us: dict[int, float]
    ratio: float  # longest history over shortest


@dataclass
class SeenRow:
    """A windowed mode's decode step at ``seen`` tokens seen."""

    mode: str
    seen: int
    tokens_stored: int
    ms_median: float
    ms_q1: float
    ms_q3: float
    ratio_to_first: float


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


# ---------------------------------------------------------------------------------------------
# the benchmark


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
    bandwidth_bytes: int = 256 * _MB,
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
    modes, peer_notes = build_modes(model, configs, peers=peers)
    seen_modes: list[Mode] = []
    if seen:  # validated now, not after the long part
        seen = _positive_ints("seen", seen)
        if seen_configs is None:
            seen_modes = _windowed_modes(model, configs)
        else:
            seen_modes = _windowed_modes(model, seen_configs, strict=True)
    log = _logger(progress)
    device = next(model.parameters()).device
    probe = MemoryProbe()

    with (
        torch.no_grad(),
        _attn_implementation(model, None if attn is None else resolve_attn(attn)) as attn_used,
    ):
        weights = weight_bytes_per_step(model)
        _warm_up(model, modes)
        base_rss = probe.settle(collect=True)  # the model loaded and warmed up, no cache alive
        log(f"modes: {', '.join(m.name for m in modes)}")
        decode_rows: list[DecodeRow] = []
        for length in lengths:
            decode_rows += _bench_length(
                model, modes, length, steps, warmup, seed, prefill_set, bandwidth_bytes, weights, probe, log
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

    shapes = _shapes(model)
    result = BenchResult(
        settings=dict(
            lengths=list(lengths),
            steps=steps,
            warmup=warmup,
            seed=seed,
            threads=torch.get_num_threads(),
            attn=attn_used,
            prefill_lengths="all" if prefill_set is None else sorted(prefill_set),
            modes=[m.name for m in modes],
            mode_bits={m.name: m.bits for m in modes},
            torch=torch.__version__,
            transformers=importlib.import_module("transformers").__version__,
            device=str(device),
        ),
        model=dict(
            name=getattr(model.config, "_name_or_path", "") or type(model).__name__,
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            weight_bytes_per_step=weights,
            **shapes,
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
    return result


def _bench_length(
    model, modes, length, steps, warmup, seed, prefill_set, bandwidth_bytes, weights, probe, log
):
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + length)
    ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
    next_tokens = torch.randint(0, vocab, (warmup + steps, 1, 1), generator=gen).to(device)
    prefill_all = prefill_set is None or length in prefill_set

    caches, build_s, built_by, resident = {}, {}, {}, {}
    for mode in modes:  # dynamic first: the others may be built from its K/V
        r0 = probe.settle()
        cache = mode.make()
        by = "prefill" if (prefill_all or mode.name == DYNAMIC) else "copy"
        _sync(device)
        t0 = time.perf_counter()
        if by == "prefill":
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        else:
            for i, layer in enumerate(caches[DYNAMIC].layers):
                cache.update(layer.keys, layer.values, i)
        _sync(device)
        build_s[mode.name] = time.perf_counter() - t0
        r1 = probe.settle()
        resident[mode.name] = None if r0 is None or r1 is None else r1 - r0
        caches[mode.name], built_by[mode.name] = cache, by
        log(f"L={length} {mode.name}: {by} {build_s[mode.name]:.2f} s")

    bandwidth = measure_bandwidth(bandwidth_bytes, device=device)
    log(f"L={length}: memory bandwidth {bandwidth / 1e9:.2f} GB/s ({bandwidth_bytes / _MB:.0f} MB copy)")
    times = {m.name: [] for m in modes}
    transients = {m.name: [] for m in modes}
    for r in range(warmup + steps):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            probe.reset_peak()
            before = probe.rss()
            dt = _decode_step(model, caches[mode.name], next_tokens[r], length + r)
            peak = probe.peak() if probe.can_reset else None
            if r >= warmup:
                times[mode.name].append(dt)
                if peak is not None and before is not None:
                    transients[mode.name].append(max(0, peak - before))
        log(f"L={length} round {r + 1}/{warmup + steps}")

    base = times[DYNAMIC]
    base_med = statistics.median(base)
    dyn_prefill = length / build_s[DYNAMIC]
    shapes = _shapes(model)
    elsize = next(model.parameters()).element_size()
    rows = []
    for mode in modes:
        t = times[mode.name]
        med, q1, q3 = _quartiles(t)
        cache = caches[mode.name]
        read = cache_read_bytes(cache)
        floor_s = (weights + read) / bandwidth
        prefilled = built_by[mode.name] == "prefill"
        ptok = length / build_s[mode.name] if prefilled else None
        stored = stored_tokens(cache)
        transient = max(transients[mode.name]) if transients[mode.name] else None
        res = resident[mode.name]
        rows.append(
            DecodeRow(
                mode=mode.name,
                kind=mode.kind,
                length=length,
                steps=steps,
                ms_median=med * 1e3,
                ms_q1=q1 * 1e3,
                ms_q3=q3 * 1e3,
                ms_min=min(t) * 1e3,
                ms_max=max(t) * 1e3,
                tok_s=1.0 / med,
                ratio_to_dynamic=med / base_med,
                paired_ratio_to_dynamic=statistics.median(a / b for a, b in zip(t, base, strict=True)),
                built_by=built_by[mode.name],
                build_s=build_s[mode.name],
                prefill_tok_s=ptok,
                prefill_ratio_to_dynamic=None if ptok is None else ptok / dyn_prefill,
                cache_bytes=cache_nbytes(cache),
                cache_read_bytes=read,
                tokens_stored=stored,
                one_layer_fp_bytes=2
                * ids.shape[0]
                * shapes["n_kv_heads"]
                * stored
                * shapes["head_dim"]
                * elsize,
                resident_bytes=res,
                step_transient_bytes=transient,
                peak_bytes=None if res is None or transient is None else res + transient,
                bandwidth_gb_s=bandwidth / 1e9,
                floor_ms=floor_s * 1e3,
                ratio_to_floor=med / floor_s,
            )
        )
    caches.clear()
    probe.settle(collect=True)
    return rows


def _warm_up(model, modes: Sequence[Mode], length: int = 8) -> None:
    """One short prefill and decode step per mode, untimed: first-call costs (lazy imports, kernel
    selection, allocator growth) land here, not in the first measured mode."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, length), dtype=torch.long, device=device)
    for mode in modes:
        cache = mode.make()
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        _decode_step(model, cache, ids[:, :1], length)


def _decode_step(model, cache, token: torch.Tensor, position: int) -> float:
    """One timed single-token forward: token (1, 1) at ``position``; seconds."""
    pos = torch.tensor([[position]], device=token.device)
    _sync(token.device)
    t0 = time.perf_counter()
    model(input_ids=token, cache=cache, use_cache=True, position_ids=pos, logits_to_keep=1)
    _sync(token.device)
    return time.perf_counter() - t0


def measure_append(
    model,
    modes: Sequence[Mode],
    lengths: Sequence[int],
    *,
    reps: int = 50,
    warmup: int = 5,
    seed: int = 0,
    log=None,
) -> list[AppendRow]:
    """Median time of ``cache.update(k, v, 0)`` for one token (random K/V ``(1, H_kv, 1, D)`` in the
    model's dtype) at each history length.

    One cache per (mode, length), its layer 0 grown to that length with random K/V; then the
    single-token updates are interleaved over every (mode, length) pair, so the ratio between two
    lengths is not a ratio between two moments of a noisy machine. What is timed is the whole
    ``update`` call: for caches whose update returns the materialized history (DynamicCache
    concatenates, QuantizedCache dequantizes) that read is part of the cost.
    """
    log = log or (lambda msg: None)
    shapes = _shapes(model)
    param = next(model.parameters())
    gen = torch.Generator().manual_seed(seed + 7)

    def rand(t: int) -> torch.Tensor:
        x = torch.randn((1, shapes["n_kv_heads"], t, shapes["head_dim"]), generator=gen)
        return x.to(device=param.device, dtype=param.dtype)

    lengths = sorted(set(lengths))
    pairs = [(m, n) for n in lengths for m in modes]
    caches = {}
    for mode, n in pairs:
        cache = mode.make()
        cache.update(rand(n), rand(n), 0)
        caches[mode.name, n] = cache
    log(f"append cost: {len(pairs)} caches filled")
    ones = [(rand(1), rand(1)) for _ in range(warmup + reps)]
    samples: dict[tuple[str, int], list[float]] = {(m.name, n): [] for m, n in pairs}
    for r in range(warmup + reps):
        k = r % len(pairs)
        for mode, n in pairs[k:] + pairs[:k]:
            key, value = ones[r]
            _sync(param.device)
            t0 = time.perf_counter()
            caches[mode.name, n].update(key, value, 0)
            _sync(param.device)
            if r >= warmup:
                samples[mode.name, n].append(time.perf_counter() - t0)
    us = {m.name: {n: statistics.median(samples[m.name, n]) * 1e6 for n in lengths} for m in modes}
    lo, hi = lengths[0], lengths[-1]
    return [AppendRow(m.name, m.kind, us[m.name], us[m.name][hi] / us[m.name][lo]) for m in modes]


def measure_streaming(
    model, modes: Sequence[Mode], seen: Sequence[int], steps: int, *, warmup: int = 2, seed: int = 0, log=None
) -> list[SeenRow]:
    """Decode step time of windowed ``modes`` at each number of tokens seen.

    One cache per (mode, seen value): each gets the K/V of one real prefill of ``min(seen)`` tokens
    (a DynamicCache's), fed again in chunks through ``cache.update`` on every layer until it has
    seen its number of tokens (cheap: no model forward; a windowed cache stays small). Then
    ``steps`` decode steps at the true position are interleaved over every (mode, seen) pair, so
    ``ratio_to_first`` compares moments of the same rounds.
    """
    from transformers import DynamicCache

    log = log or (lambda msg: None)
    seen = sorted(set(seen))
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 99)
    first = seen[0]
    src = DynamicCache(config=model.config)
    model(
        input_ids=torch.randint(0, vocab, (1, first), generator=gen).to(device),
        cache=src,
        use_cache=True,
        logits_to_keep=1,
    )
    chunks = [(layer.keys, layer.values) for layer in src.layers]
    pairs = [(m, n) for n in seen for m in modes]
    caches = {}
    for mode, target in pairs:
        cache = mode.make()
        while (missing := target - cache.get_seq_length()) > 0:
            n = min(missing, first)
            for i, (k, v) in enumerate(chunks):
                cache.update(k[:, :, :n], v[:, :, :n], i)
        caches[mode.name, target] = cache
        log(f"streaming: {mode.name} advanced to {target} tokens seen")
    del src, chunks
    tokens = torch.randint(0, vocab, (warmup + steps, 1, 1), generator=gen).to(device)
    times: dict[tuple[str, int], list[float]] = {(m.name, n): [] for m, n in pairs}
    for r in range(warmup + steps):
        k = r % len(pairs)
        for mode, target in pairs[k:] + pairs[:k]:
            cache = caches[mode.name, target]
            dt = _decode_step(model, cache, tokens[r], cache.get_seq_length())
            if r >= warmup:
                times[mode.name, target].append(dt)
        log(f"streaming: round {r + 1}/{warmup + steps}")
    rows: list[SeenRow] = []
    for mode in modes:
        first_ms = statistics.median(times[mode.name, first]) * 1e3
        for target in seen:
            med, q1, q3 = _quartiles(times[mode.name, target])
            stored = stored_tokens(caches[mode.name, target])
            rows.append(
                SeenRow(mode.name, target, stored, med * 1e3, q1 * 1e3, q3 * 1e3, med * 1e3 / first_ms)
            )
    return rows


def _windowed_modes(model, specs: Sequence[str], *, strict: bool = False) -> list[Mode]:
    """Modes of the windowed specs among ``specs``; ``strict``: every spec must have a window."""
    from .config import parse_spec

    specs = [specs] if isinstance(specs, str) else list(specs)
    windowed = [s for s in specs if parse_spec(s).window is not None]
    if strict and len(windowed) != len(specs):
        bad = [s for s in specs if s not in windowed]
        raise ValueError(
            f"seen_configs {bad} have no window: the tokens-seen measurement is for StreamingLLM specs "
            f"such as 'int4,sink=4,window=1020'"
        )
    modes, _ = build_modes(model, windowed)
    return [m for m in modes if m.kind == "kvslim"]


# ---------------------------------------------------------------------------------------------
# helpers


def _shapes(model) -> dict:
    from .models import model_shapes

    s = model_shapes(model.config)
    return {k: s[k] for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim")}


def _quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q1, q3


def _positive_ints(name: str, values) -> list[int]:
    values = [values] if isinstance(values, int) else list(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {values!r}")
    return values


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _logger(enabled: bool) -> Callable[[str], None]:
    if not enabled:
        return lambda msg: None
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[bench {time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    return log
