"""The bytes one layer's store holds and would hold: what :mod:`kvslim.cache.accounting` adds up over a cache.

:func:`components` counts every tensor a :class:`~kvslim.cache.layer.SlimLayer` holds (codes, scales, residual,
sinks, bias, per-row bookkeeping), :func:`projected_nbytes` the most it holds while fed a number of tokens, and
:func:`live_nbytes` its stored tokens without buffer slack. It reads a layer only through its public attributes.

This module knows nothing about transformers or files.
"""

from __future__ import annotations

import torch


def components(layer) -> dict[str, int]:
    """Bytes per part of ``layer`` (a SlimLayer): both streams' buffers, the sinks, the bias, the row state."""
    out = {**layer.k.components("k"), **layer.v.components("v")}
    out["k_sinks"] = _bytes(layer.sink_k)
    out["v_sinks"] = _bytes(layer.sink_v)
    out["mean_center_bias"] = _bytes(layer.k_bias)
    # per-row bookkeeping: left padding, sink start and the sinks' rotation positions, int64
    out["row_state"] = _bytes(layer.pads) + _bytes(layer.sink_start) + _bytes(layer.sink_rot)
    return out


def projected_nbytes(layer, tokens: int, kv: tuple[int, int, int], v_dim: int, dtype: torch.dtype) -> int:
    """The most bytes ``layer`` holds while fed ``tokens`` tokens of rows ``kv = (B, H_kv, D)`` (V of ``v_dim``
    channels) in ``dtype``: sinks, both streams (:meth:`~kvslim.cache.stream.Stream.projected_nbytes`), the bias and
    the per-row bookkeeping. An upper bound a memory budget can reserve up front."""
    b, h, d = kv
    n_sink = min(tokens, layer.policy.sink)
    rest = tokens - n_sink
    probe = torch.zeros(1, 1, 1, 1, dtype=dtype)
    sink_entry = layer.k.cast(probe).element_size() * b * h
    total = n_sink * sink_entry * (d + v_dim) + b * n_sink * 8  # sink K, V and their rotation positions
    total += layer.k.projected_nbytes(rest, (b, h, d), dtype) + layer.v.projected_nbytes(
        rest, (b, h, v_dim), dtype
    )
    total += _bytes(layer.k_bias) + 2 * b * 8  # bias; pads and sink start per row
    return total


def live_nbytes(layer) -> int:
    """Bytes of ``layer``'s stored tokens alone (no buffer slack)."""
    c = components(layer)
    return layer.k.live_nbytes() + layer.v.live_nbytes() + c["k_sinks"] + c["v_sinks"] + c["mean_center_bias"]


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
