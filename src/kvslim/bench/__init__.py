"""Speed and memory of cache modes, side by side with the plain cache and the peers, in one process.

The baseline is transformers' plain ``DynamicCache``, always included under the name ``dynamic``;
the peers are transformers' ``QuantizedCache`` backends. Every measurement keeps one cache per
(mode, size) alive and interleaves its timed steps over all of them, so slow drifts of a shared,
noisy machine hit every mode alike. Every forward goes through :mod:`kvslim.generate`.

- :mod:`.modes`: the modes under test (:func:`build_modes`) and the attention implementation;
- :mod:`.decode`: decode and prefill speed, cache bytes, memory and the bandwidth floor per length
  (:class:`DecodeRow`);
- :mod:`.append`: the cost of one ``cache.update`` at two history lengths (:class:`AppendRow`);
- :mod:`.streaming`: StreamingLLM flatness, decode step time against tokens seen (:class:`SeenRow`);
- :mod:`.memory`: cache bytes, weight bytes per step, bandwidth, process RSS (:class:`MemoryProbe`);
- :mod:`.timing`: the timed decode step and the statistics the measurements share;
- :mod:`.suite`: :func:`run_bench`, all of it in one call, and its :class:`BenchResult`;
- :mod:`.plot`: :func:`plot_bench`, ms/token and cache MiB against context length as a PNG.

This package knows nothing about argument parsing or printing (see :mod:`kvslim.cli.bench`).
"""

from .append import AppendRow, measure_append
from .decode import DecodeRow, measure_decode
from .memory import (
    MemoryProbe,
    cache_nbytes,
    cache_read_bytes,
    measure_bandwidth,
    stored_tokens,
    weight_bytes_per_step,
)
from .modes import (
    ATTN_CHOICES,
    DYNAMIC,
    PEER_BACKENDS,
    PEER_NBITS,
    PEER_PACKAGES,
    Mode,
    build_modes,
    kvslim_attention_available,
    peer_availability,
    resolve_attn,
)
from .plot import plot_bench
from .streaming import SeenRow, measure_streaming
from .suite import BenchResult, run_bench

__all__ = [
    "ATTN_CHOICES",
    "DYNAMIC",
    "PEER_BACKENDS",
    "PEER_NBITS",
    "PEER_PACKAGES",
    "AppendRow",
    "BenchResult",
    "DecodeRow",
    "MemoryProbe",
    "Mode",
    "SeenRow",
    "build_modes",
    "cache_nbytes",
    "cache_read_bytes",
    "kvslim_attention_available",
    "measure_append",
    "measure_bandwidth",
    "measure_decode",
    "measure_streaming",
    "peer_availability",
    "plot_bench",
    "resolve_attn",
    "run_bench",
    "stored_tokens",
    "weight_bytes_per_step",
]
