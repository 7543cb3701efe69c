"""What a :class:`~kvslim.cache.layer.SlimLayer` may take on an append, asked before anything changes.

- :func:`check` raises one clear ValueError for keys/values the layer cannot store (not tensors, not
  ``(B, H, T, D)``, another batch, head count, head_dim or dtype than the layer's, non-finite values).
- :func:`one_token` says whether an append is the ragged step's common case, one decode token that goes into
  both residuals as float16 with nothing leaving them and no sink to fill, so that
  :meth:`~kvslim.cache.layer.SlimLayer.append` can commit it without planning (16 rows x 30 layers a step ask).

This module reads a layer's attributes and changes nothing; it knows nothing about transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layer import SlimLayer
    from .stream import Stream


def check(layer: SlimLayer, keys: torch.Tensor, values: torch.Tensor, *, finite_checked: bool = False) -> None:
    """Raise ValueError (changing nothing) unless keys/values (B, H, C, D) can be appended to ``layer``.
    finite_checked: the caller already checked that every value is finite (a ragged step checks its
    whole batch at once)."""
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise ValueError(f"keys and values must be tensors, got {type(keys).__name__} and {type(values).__name__}")
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys and values must be (B, H, T, D) with equal B, H, T; got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}"
        )
    if not keys.dtype.is_floating_point or values.dtype != keys.dtype:
        raise ValueError(f"keys and values must share one floating dtype, got {keys.dtype} and {values.dtype}")
    if layer.kv_shape is not None:
        b, h, d = layer.kv_shape
        if (keys.shape[0], keys.shape[1], keys.shape[3]) != (b, h, d) or values.shape[3] != layer.v_dim:
            raise ValueError(
                f"this layer stores batch {b} x {h} KV heads x head_dim {d}; got keys {tuple(keys.shape)}, "
                f"values {tuple(values.shape)} (a new batch or model needs a new cache, or reset())"
            )
        if keys.dtype != layer.dtype:
            raise ValueError(f"this layer stores {layer.dtype} K/V; got {keys.dtype} (a new model needs a new cache)")
    if not finite_checked and not bool(torch.isfinite(keys).all() & torch.isfinite(values).all()):
        bad = "keys" if not bool(torch.isfinite(keys).all()) else "values"
        raise ValueError(
            f"{bad} have non-finite values (NaN or inf) in a tensor of shape {tuple(keys.shape)}: the model "
            f"produced them; nothing was stored"
        )


def one_token(layer: SlimLayer, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether appending keys/values (1, H, 1, D) float32 to ``layer`` is the common decode case: a layer of one
    unpadded row that already holds tokens of this shape and dtype, keys stored after RoPE, its sinks full (or
    none), and each stream keeping the token in a float16 residual with nothing leaving it (no group to encode).
    Everything :func:`check` asks of such a token holds where this is True, but finiteness: the caller has checked
    the cast values (a ragged step's :func:`kvslim.kernels.cpu.to_half_finite`)."""
    shape = layer.kv_shape
    if shape is None or shape[0] != 1 or layer.pre_rope or not layer._unpadded():
        return False
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.ndim != 4 or values.ndim != 4:
        return False
    ks, vs = keys.shape, values.shape
    if ks[0] != 1 or ks[2] != 1 or ks[:3] != vs[:3] or ks[1] != shape[1] or ks[3] != shape[2] or vs[3] != layer.v_dim:
        return False
    if keys.dtype != torch.float32 or values.dtype != torch.float32 or layer.dtype != torch.float32:
        return False
    if layer.policy.n_to_sinks(layer.sink_len, 1):
        return False
    return _keeps_token(layer.k, keys) and _keeps_token(layer.v, values)


def _keeps_token(stream: Stream, x: torch.Tensor) -> bool:
    """Whether the one token of ``x`` (float32) appended to ``stream`` stays in its float16 residual and none
    leaves it (:meth:`~kvslim.cache.stream.Stream.plan` encodes nothing)."""
    if not stream.codec.lossy or stream._fp_dtype_for(x) != torch.float16:
        return False
    return len(stream.fp) + 1 - stream.residual_cap < stream.unit
