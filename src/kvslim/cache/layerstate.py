"""One layer's state as tensors and plain values: what a prompt-cache file holds of a :class:`SlimLayer`.

:func:`layer_state` reads everything a :class:`~kvslim.cache.layer.SlimLayer` holds — nothing decoded or
re-encoded — and :func:`check_state` checks such a state's parts against each other before a fresh layer is
filled from it (:meth:`~kvslim.cache.layer.SlimLayer.restore` commits it). The schema, written once here:

``k``/``v``: ``(body, offset, residual)`` per stream (:meth:`~kvslim.cache.stream.Stream.restore`);
``sink_k``/``sink_v`` (B, H, S, D) and ``sink_rot`` (B, S); ``pads``/``sink_start`` (B,); ``runs``
``[[tokens, base], ...]``; ``seen``, ``base``, ``dtype``, ``kv_shape`` (B, H_kv, D), ``v_dim``. Tensors may
be None.

This module knows nothing about files, headers or names of tensors in a file (:mod:`kvslim.promptcache`
writes and reads them), nor about transformers. It reads a layer only through its public attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .layer import SlimLayer


def layer_state(layer: SlimLayer) -> dict:
    """Everything ``layer`` holds (module docstring), as views valid until its next update."""
    return {
        "k": (layer.k.body(), layer.k.offset, layer.k.fp.view()),
        "v": (layer.v.body(), layer.v.offset, layer.v.fp.view()),
        "sink_k": layer.sink_k,
        "sink_v": layer.sink_v,
        "sink_rot": layer.sink_rot,
        "pads": layer.pads,
        "sink_start": layer.sink_start,
        "runs": [list(r) for r in layer.runs],
        "seen": layer.seen,
        "base": layer.base,
        "dtype": layer.dtype,
        "kv_shape": layer.kv_shape,
        "v_dim": layer.v_dim,
    }


def check_state(state: dict, *, max_sinks: int) -> tuple[tuple[int, int, int], int, list[list[int]]]:
    """Check a non-empty :func:`layer_state` for a layer that keeps at most ``max_sinks`` sinks: every part's
    shape against the others, the streams' lengths against the runs and the tokens seen. Returns
    ``(kv_shape, v_dim, runs)`` as plain ints; a ValueError naming the part otherwise."""
    b, h, d = state["kv_shape"]
    v_dim = state["v_dim"]
    n_sink = 0 if state["sink_k"] is None else state["sink_k"].shape[2]
    want = {
        "sink_k": (b, h, n_sink, d) if n_sink else None,
        "sink_v": (b, h, n_sink, v_dim) if n_sink else None,
        "sink_rot": (b, n_sink) if n_sink else None,
        "pads": (b,),
        "sink_start": (b,),
    }
    for name, shape in want.items():
        t = state[name]
        if (None if t is None else tuple(t.shape)) != shape:
            got = None if t is None else tuple(t.shape)
            raise ValueError(f"layer state: {name} has shape {got}, expected {shape}")
    lengths = []
    for role, dim in (("k", d), ("v", v_dim)):
        body, _, fp = state[role]
        n_body = {t.shape[2] for t in body.token.values()}
        parts = [*body.token.values(), *body.group.values()] + ([] if fp is None else [fp])
        if len(n_body) > 1 or any(tuple(t.shape[:2]) != (b, h) for t in parts):
            raise ValueError(f"layer state: {role} stream parts disagree on batch, heads or length")
        if fp is not None and fp.shape[3] != dim:
            raise ValueError(f"layer state: {role} residual has head_dim {fp.shape[3]}, expected {dim}")
        lengths.append(next(iter(n_body), 0) + (0 if fp is None else fp.shape[2]))
    runs = [[int(n), int(base)] for n, base in state["runs"]]
    if lengths[0] != lengths[1] or sum(n for n, _ in runs) != lengths[0]:
        raise ValueError(
            f"layer state: K stream holds {lengths[0]} tokens, V {lengths[1]}, runs {sum(n for n, _ in runs)}"
        )
    if n_sink > max_sinks or n_sink + lengths[0] > state["seen"]:
        raise ValueError(
            f"layer state: {n_sink} sinks (this layer keeps {max_sinks}) + {lengths[0]} stream tokens "
            f"for {state['seen']} seen"
        )
    return (b, h, d), int(v_dim), runs
