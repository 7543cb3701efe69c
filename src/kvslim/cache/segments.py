"""What attention on the codes reads of one layer: a frozen view of its stored segments.

:class:`Segments` is handed out by :meth:`kvslim.cache.layer.SlimLayer.segments` (and, per row, inside a
ragged step's view) and consumed by the ``kvslim`` attention (:mod:`kvslim.attention`); its
:meth:`~Segments.materialize` is also the standard attention's read (every stored token decoded, keys moved
to the rotation the current forward must see). :data:`FAST_MAX_QUERY` is the contract between the two
sides: a forward carrying at most that many new tokens gets a view, a longer one materialized tensors.

This module knows nothing about how the segments are stored, evicted or positioned (:mod:`kvslim.cache.layer`
decides what goes in a view), nor about transformers or the attention kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..formats import Codec, Encoded
from .basis import CENTERED, BodyBasis
from .rotary import Rotary

#: Forwards with more new tokens than this (prefill chunks) are handed materialized K/V and run sdpa: their
#: cost is the matmuls, not reading the cache. (Read by the layer adapter and by :mod:`kvslim.attention`.)
FAST_MAX_QUERY = 16


@dataclass(frozen=True)
class Segments:
    """One layer's stored K and V as segments, oldest first: what attention on the codes reads.

    ``[ sinks (fp) | body (encoded) | residual (fp) ]`` per stream. K and V may split at different
    points (per-channel K leaves the residual a group at a time). Tensors are views into the layer's
    buffers, valid until that layer's next update; nothing here may be written.

    k_sink, v_sink: (B, H, S, D) or None (keys already at the rotation this forward must see);
    k_body, v_body: :class:`~kvslim.formats.Encoded` or None, decoded with ``k_codec``/``v_codec``
    and ``k_offset``/``v_offset`` (tokens already evicted from the first per-channel group);
    k_res, v_res: (B, H, R, D) or None; length: stored tokens; kv_shape: (B, H_kv, D);
    dtype: the dtype the standard path returns.
    k_runs: ``((tokens, delta), ...)`` over the K stream (body then residual, oldest first): each
    run's keys sit ``delta`` positions off the current frame and must be moved by ``delta`` with
    ``rotary``. Empty: nothing to move (always, with ``k_pos``).
    k_basis, v_basis: the basis of each encoded body (:class:`~kvslim.cache.basis.BodyBasis`; None: the
    stream's own). k_pos: (B, L) int64, the position each K stream key (body, then residual) must be
    rotated to with ``rope`` — set when the K stream holds keys before RoPE (``pre_rope``), None otherwise.
    """

    k_sink: torch.Tensor | None
    v_sink: torch.Tensor | None
    k_codec: Codec
    v_codec: Codec
    k_body: Encoded | None
    v_body: Encoded | None
    k_offset: int
    v_offset: int
    k_res: torch.Tensor | None
    v_res: torch.Tensor | None
    length: int
    kv_shape: tuple[int, int, int]
    dtype: torch.dtype
    k_runs: tuple[tuple[int, int], ...] = ()
    rotary: Rotary | None = None
    k_basis: BodyBasis | None = None
    v_basis: BodyBasis | None = None
    k_pos: torch.Tensor | None = None
    rope: Rotary | None = None
    k_stream: torch.Tensor | None = None
    v_stream: torch.Tensor | None = None

    @classmethod
    def of(cls, **values) -> Segments:
        """The Segments of ``values``, every field given by name: what the constructor makes, without the frozen
        dataclass' ``object.__setattr__`` per field (~4 us a view; a decode step makes one a row and layer)."""
        if values.keys() != _FIELDS:
            raise TypeError(f"Segments.of takes every field by name: missing {sorted(_FIELDS - values.keys())}, "
                            f"unknown {sorted(values.keys() - _FIELDS)}")
        view = object.__new__(cls)
        view.__dict__.update(values)
        return view

    @property
    def shape(self) -> torch.Size:
        """(B, H_kv, length, D), like the materialized keys."""
        b, h, d = self.kv_shape
        return torch.Size((b, h, self.length, d))

    @property
    def head_dim(self) -> int:
        return self.kv_shape[2]

    def n_body(self, role: str) -> int:
        body = self.k_body if role == "k" else self.v_body
        return 0 if body is None else next(iter(body.token.values())).shape[2]

    def materialize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The full (B, H, T, D) tensors in ``dtype`` (default: the layer's), keys moved as due: bodies
        decoded back from their stored basis, pre-RoPE keys rotated to ``k_pos``."""
        dtype = self.dtype if dtype is None else dtype
        out = []
        for role, sink, codec, body, offset, res, basis, whole in (
            ("k", self.k_sink, self.k_codec, self.k_body, self.k_offset, self.k_res, self.k_basis, self.k_stream),
            ("v", self.v_sink, self.v_codec, self.v_body, self.v_offset, self.v_res, self.v_basis, self.v_stream),
        ):
            decoded = None
            if whole is None and body is not None:
                decoded = codec.decode(body, dtype if basis is None else torch.float32, offset)
                if basis is not None:
                    decoded = basis.decode(decoded, body.token.get(CENTERED))
            stream = [t for t in ((whole,) if whole is not None else (decoded, res)) if t is not None and t.shape[2]]
            if stream and role == "k" and self.k_pos is not None:
                joined = torch.cat([t.float() for t in stream], dim=2)
                stream = [self.rope.rotate(joined, self.k_pos)]
            stream = [t.to(dtype) for t in stream]
            if stream and role == "k" and self.k_runs:
                stream = [self._move_runs(torch.cat(stream, dim=2))]
            parts = ([] if sink is None or not sink.shape[2] else [sink.to(dtype)]) + stream
            # a kept stream alone is handed as it is (a view of its buffer, valid until the next update), not copied
            out.append(parts[0] if len(parts) == 1 and whole is not None else torch.cat(parts, dim=2))
        return out[0], out[1]

    def _move_runs(self, keys: torch.Tensor) -> torch.Tensor:
        """Stream keys (B, H, L, D) with each run moved by its delta."""
        pieces, start = [], 0
        for n, delta in self.k_runs:
            piece = keys[:, :, start : start + n]
            pieces.append(piece if delta == 0 else self.rotary.move(piece, delta))
            start += n
        return torch.cat(pieces, dim=2)


#: every field of :class:`Segments`, by name (:meth:`Segments.of`)
_FIELDS = frozenset(f.name for f in fields(Segments))
