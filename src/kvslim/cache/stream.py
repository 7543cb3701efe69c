"""One K or V stream of one layer: the encoded body and the full-precision residual, with their capacities.

:class:`Stream` is the non-sink tokens of one tensor of one layer — the encoded body (a codec's token and
group parts, each a :class:`~kvslim.cache.timebuffer.TimeBuffer`) and the full-precision residual. Appends
are a plan (encode; may fail) and a commit (cannot fail), so a layer can make an update a transaction. A
stream's encoded body may sit in another basis than the tokens appended (:class:`~kvslim.cache.basis.BodyBasis`);
the residual never does. :func:`_capacities` is the arithmetic of a bounded stream's buffer sizes, and
:meth:`Stream.projected_nbytes` the most bytes a stream holds for a given number of tokens.

This module knows nothing about positions, sinks, eviction policy or transformers (see
:mod:`kvslim.cache.layer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import Codec, Encoded
from .basis import CENTERED, BodyBasis, encode_in_basis
from .timebuffer import TimeBuffer


@dataclass(frozen=True)
class _Plan:
    """A stream append, decided and encoded but not applied: ``encoded`` joins the body,
    ``drop_fp`` tokens leave the front of the residual, ``fp`` (B, H, n, D) joins its end."""

    encoded: Encoded | None
    drop_fp: int
    fp: torch.Tensor


#: the fewest new body tokens a kept decode adds alone (:meth:`Stream.kept_stream`): below it the body is decoded
#: whole again, as a basis' matmul (a fitted rotation's) gives a few rows other bits than the same rows in a long run
KEPT_MIN_TOKENS = 16


class Stream:
    """The non-sink tokens of one tensor (K or V) of one layer: encoded body + fp residual."""

    _keep = False  # keep_decoded() on: reads keep the body decoded (_kept) and decode only what is new
    _kept: tuple | None = None  # (dtype, buffer (B, H, capacity, D), tokens decoded)

    def __init__(
        self,
        codec: Codec,
        residual: int,
        unit: int = 1,
        min_slack: int = 64,
        fp_dtype: torch.dtype | str | None = None,
        basis: BodyBasis | None = None,
        bound: int | None = None,
    ):
        self.codec = codec
        #: the basis of the encoded body (None: the tokens as appended); a lossless stream has no body
        self.basis = basis if basis is not None and not basis.identity and codec.lossy else None
        #: dtype of the full-precision tokens of a lossy stream (None: as given; "auto": float16 for
        #: float32 tokens, else as given); a lossless stream's tokens are its storage and keep theirs
        self.fp_dtype = fp_dtype if codec.lossy else None
        self.residual_cap = residual if codec.lossy else 0
        if unit % codec.token_group:
            raise ValueError(f"unit={unit} must be a multiple of the codec's token group {codec.token_group}")
        self.unit = unit  # tokens leave the residual this many at a time
        self.tokens: dict[str, TimeBuffer] = {}  # encoded per-token parts
        self.groups: dict[str, TimeBuffer] = {}  # encoded per-group parts
        self.offset = 0  # tokens already evicted from the first group
        #: at most this many tokens stay after an eviction (a bounded layer's window; None: unbounded)
        self.bound = bound
        self._caps = _capacities(codec, residual if codec.lossy else 0, unit, bound)
        self.fp = TimeBuffer(min_slack, self._caps["fp"])  # residual (everything, for an identity codec)
        self.min_slack = min_slack

    # -- sizes ---------------------------------------------------------------------------
    @property
    def n_body(self) -> int:
        return len(next(iter(self.tokens.values()))) if self.tokens else 0

    def __len__(self) -> int:
        return self.n_body + len(self.fp)

    # -- writes --------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> None:
        """x: (B, H, C, D) new tokens, already in their final (e.g. mean-centered) form."""
        self.commit(self.plan(x))

    def _fp_dtype_for(self, x: torch.Tensor) -> torch.dtype | None:
        """The residual's storage dtype for tokens of ``x``'s dtype (None: as given); "auto" is float16 for
        float32 tokens."""
        if self.fp_dtype == "auto":
            return torch.float16 if x.dtype == torch.float32 else None
        return self.fp_dtype

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        """Full-precision tokens (B, H, C, D) in this stream's fp storage dtype. A finite value beyond
        float16's range is a ValueError (never an inf in the cache)."""
        dtype = self._fp_dtype_for(x)
        if dtype is None or x.dtype == dtype:
            return x
        y = x.to(dtype)
        if dtype == torch.float16 and not bool(torch.isfinite(y).all()) and bool(torch.isfinite(x).all()):
            big = float(x.abs().max())
            raise ValueError(
                f"a K/V value of magnitude {big:.4g} is beyond float16's range (65504), where this cache keeps "
                "its full-precision tokens: use residual_dtype='model' (or 'bfloat16')"
            )
        return y

    def half_residual(self, x: torch.Tensor) -> bool:
        """Whether appending ``x`` puts every one of its tokens into the residual, cast to float16 (so a check
        of ``x.to(float16)`` is finite checks both ``x``'s values and :meth:`cast`'s range at once)."""
        if not self.codec.lossy or x.dtype == torch.float16 or self._fp_dtype_for(x) != torch.float16:
            return False
        n_fp = len(self.fp)
        return ((n_fp + x.shape[2] - self.residual_cap) // self.unit) * self.unit <= n_fp

    def flush(self, n_new: int) -> int:
        """How many of the residual's oldest tokens an append of ``n_new`` tokens encodes (0: none, or an append
        that encodes straight from its own tokens): what :meth:`plan` encodes as ``self.fp.view()[:, :, :n]``."""
        if not self.codec.lossy:
            return 0
        n_fp = len(self.fp)
        ready = ((n_fp + n_new - self.residual_cap) // self.unit) * self.unit
        return ready if 0 < ready <= n_fp else 0

    def plan(self, x: torch.Tensor, cast: torch.Tensor | None = None, encoded: Encoded | None = None) -> _Plan:
        """Everything appending x (B, H, C, D) will do, computed without changing the stream: the
        encoding of the tokens that leave the residual (the step that can fail) is done here.
        cast: ``x.to(float16)`` already made and checked finite by the caller (:meth:`half_residual`).
        encoded: the encoding of the :meth:`flush` tokens, made by the caller (a ragged step encodes the groups
        its rows flush in one call, :mod:`kvslim.cache.ragged`); used only where it holds exactly those tokens."""
        if not self.codec.lossy:
            return _Plan(None, 0, x)
        # Only what stays in the residual is cast to its storage dtype; tokens that go straight to the
        # encoder are encoded from the values given (never rounded to, or refused by, float16 first).
        g = self.unit
        n_fp = len(self.fp)
        ready = ((n_fp + x.shape[2] - self.residual_cap) // g) * g  # tokens that leave the residual now
        if ready <= n_fp:
            y = self.cast(x) if cast is None else cast
            if ready <= 0:
                return _Plan(None, 0, y)
            if encoded is None or next(iter(encoded.token.values())).shape[2] != ready:
                encoded = self._encode(self.fp.view()[:, :, :ready])
            return _Plan(encoded, ready, y)
        # A long chunk (prefill): encode straight from it; only the newest tokens enter the residual.
        head = x[:, :, : ready - n_fp]
        enc = self._encode(head if n_fp == 0 else torch.cat([self.fp.view().to(x.dtype), head], dim=2))
        return _Plan(enc, n_fp, self.cast(x[:, :, ready - n_fp :]))

    def _encode(self, x: torch.Tensor) -> Encoded:
        return encode_in_basis(self.codec, self.basis, x)

    def commit(self, plan: _Plan) -> None:
        """Apply a :meth:`plan` (made on this stream's current state; nothing here can fail)."""
        if plan.encoded is not None:
            self._append_encoded(plan.encoded)
        if plan.drop_fp:
            self.fp.drop_front(plan.drop_fp)
        self.fp.append(plan.fp)

    def _append_encoded(self, enc: Encoded) -> None:
        """Append encoded tokens (a multiple of token_group) to the body."""
        for name, t in enc.token.items():
            self.tokens.setdefault(name, TimeBuffer(self.min_slack, self._caps["token"])).append(t)
        g_slack = max(1, self.min_slack // self.codec.token_group)
        for name, t in enc.group.items():
            self.groups.setdefault(name, TimeBuffer(g_slack, self._caps["group"])).append(t)

    def drop_front(self, k: int) -> None:
        """Evict the ``k`` oldest tokens (token-granular, whatever the grouping)."""
        from_body = min(k, self.n_body)
        if from_body:
            self._kept = None
            for buf in self.tokens.values():
                buf.drop_front(from_body)
            self.offset += from_body
            g = self.codec.token_group
            gone = self.offset // g
            if self.n_body == 0:  # the body is empty: drop every group, partial ones included
                gone = len(next(iter(self.groups.values()))) if self.groups else 0
                self.offset = 0
            else:
                self.offset -= gone * g
            for buf in self.groups.values():
                buf.drop_front(gone)
        if k - from_body:
            self.fp.drop_front(k - from_body)

    def crop_back(self, k: int) -> None:
        """Remove the ``k`` newest tokens; only the full-precision residual can give tokens back."""
        if k > len(self.fp):
            raise ValueError(
                f"cannot crop {k} tokens: only the {len(self.fp)} newest tokens are at full precision "
                f"(the rest are encoded with {self.codec.name} in groups and cannot be un-appended); "
                f"use residual >= {k} to make such crops possible"
            )
        self.fp.drop_back(k)

    # -- reads ---------------------------------------------------------------------------
    def body(self) -> Encoded:
        return Encoded(
            token={n: b.view() for n, b in self.tokens.items()},
            group={n: b.view() for n, b in self.groups.items()},
        )

    def decode_body(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The body decoded back to the basis the tokens were appended in: (B, H, n_body, D)."""
        if self.n_body == 0:
            return None
        return self._decode(self.body(), self.offset, dtype).to(dtype)

    def _decode(self, enc: Encoded, offset: int, dtype: torch.dtype) -> torch.Tensor:
        """Encoded body tokens decoded back to the appended basis: in ``dtype``, or in float32 where there is a basis."""
        if self.basis is None:
            return self.codec.decode(enc, dtype, offset)
        return self.basis.decode(self.codec.decode(enc, torch.float32, offset), enc.token.get(CENTERED))

    # -- a kept decoded body: a prefilling stream's chunks each read the whole body materialized ----------
    def keep_decoded(self, on: bool) -> None:
        """Keep the body decoded between :meth:`kept_stream` reads (on) or not (off: the copy is freed). Kept, a read
        decodes only the tokens encoded since the last one (decoding is per token and group, and the basis' matmul
        per row: the same bits as decoding the whole body, :data:`KEPT_MIN_TOKENS`); an eviction from the body, a
        restore or a re-batch start it over; asked again, it keeps what it has. Costs a full-precision copy of the body (:meth:`kept_nbytes`)."""
        on = bool(on) and self.codec.lossy
        if on != self._keep:
            self._keep, self._kept = on, None

    @property
    def keeps_decoded(self) -> bool:
        return self._keep

    def kept_nbytes(self) -> int:
        return 0 if self._kept is None else self._kept[1].numel() * self._kept[1].element_size()

    def projected_kept_nbytes(self, tokens: int, kv: tuple[int, int, int], dtype: torch.dtype) -> int:
        """The most bytes :meth:`kept_stream` holds for a stream of up to ``tokens`` tokens of rows ``kv = (B, H, D)``
        read in ``dtype`` (its buffer's slack included)."""
        if not self.codec.lossy or tokens <= 0:
            return 0
        b, h, d = kv
        item = (dtype if self.basis is None else torch.float32).itemsize
        return b * h * d * item * (tokens + max(self.min_slack, tokens // 4))

    def kept_stream(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The stream, body then residual, as :meth:`~kvslim.cache.segments.Segments.materialize` decodes it before
        any move (in ``dtype``, or in float32 where the body has a basis): (B, H, len, D); None while nothing is
        encoded. In one buffer, kept while :meth:`keep_decoded` is on (which it must be): the body decoded before,
        grown by the tokens encoded since, the residual written after it (no copy of the whole stream)."""
        if not self._keep:
            raise ValueError("kept_stream() reads the copy keep_decoded(True) keeps; this stream keeps none")
        n = self.n_body
        if n == 0:
            return None
        want = dtype if self.basis is None else torch.float32
        kept = self._kept
        have = kept[2] if kept is not None and kept[0] == want and kept[2] <= n else 0
        if have and self.basis is not None and n - have < KEPT_MIN_TOKENS and have < n:
            have = 0  # (the buffer is kept: its decoded tokens are written again)
        new = None
        if have < n:
            new = self._decode(*self.body().narrow(have, n, self.offset, self.codec.token_group), want)
        res = self.fp.view()
        r = 0 if res is None else res.shape[2]
        buf = kept[1] if kept is not None and kept[0] == want else None
        if buf is None or buf.shape[2] < n + r:
            ref = new if new is not None else buf
            size = n + r + max(self.min_slack, (n + r) // 4)
            grown = ref.new_empty(*ref.shape[:2], size, ref.shape[3])
            if have:
                grown[:, :, :have] = buf[:, :, :have]
            buf = grown
        if new is not None:
            buf[:, :, have:n] = new
        if r:
            buf[:, :, n : n + r] = res
        self._kept = (want, buf, n)
        return buf[:, :, : n + r]

    def materialize(self, dtype: torch.dtype) -> torch.Tensor | None:
        """All stream tokens, oldest first: (B, H, L, D) in ``dtype``."""
        body = self.decode_body(dtype)
        res = self.fp.view()
        if body is None:
            return None if res is None else res.to(dtype)
        if res is None or res.shape[2] == 0:
            return body
        return torch.cat([body, res.to(dtype)], dim=2)

    def front(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        """The ``k`` oldest tokens, decoded: (B, H, k, D)."""
        full = self.materialize(dtype)
        return full[:, :, :k]

    # -- save / restore --------------------------------------------------------------------
    def restore(self, body: Encoded, offset: int, fp: torch.Tensor | None) -> None:
        """Fill this empty stream with what another stream of the same codec held: its :meth:`body`
        (token parts (B, H, n_body, ...), group parts (B, H, n_groups, ...)), ``offset`` and residual
        ``fp.view()`` (B, H, R, D) or None. Rebuilt through the buffers' own appends, so the values are
        the same whatever the buffers' layout (kvslim.promptcache saves and loads caches with it)."""
        if len(self) or self.tokens or self.groups:
            raise ValueError(f"restore() fills an empty stream; this one holds {len(self)} tokens")
        self._kept = None
        if body.token or body.group:
            self._append_encoded(body)
        self.offset = int(offset)
        if fp is not None:
            self.fp.append(fp)

    # -- batch ---------------------------------------------------------------------------
    def map_batch(self, fn) -> None:
        self._kept = None
        for buf in (*self.tokens.values(), *self.groups.values(), self.fp):
            buf.map_batch(fn)

    def components(self, prefix: str) -> dict[str, int]:
        out = {}
        for name, buf in self.tokens.items():
            out[f"{prefix}_{name}"] = buf.nbytes()
        for name, buf in self.groups.items():
            out[f"{prefix}_{name}"] = buf.nbytes()
        out[f"{prefix}_residual"] = self.fp.nbytes()
        return out

    def live_nbytes(self) -> int:
        return sum(b.live_nbytes() for b in (*self.tokens.values(), *self.groups.values(), self.fp))

    def _entry_bytes(self, h: int, d: int, dtype: torch.dtype) -> tuple[int, int, int]:
        """Bytes of one full-precision token, one encoded token and one encoded group's scales, for one batch
        row of ``h`` heads x ``d`` channels in ``dtype``: from encoding one group of zeros of a single row (a
        group's worth of memory, whatever the batch), remembered per (h, d, dtype)."""
        memo = self.__dict__.setdefault("_entry_memo", {})
        key = (h, d, dtype)
        if key not in memo:
            zeros = torch.zeros(1, h, self.unit, d, dtype=dtype)
            fp = self.cast(zeros[:, :, :1]).element_size() * h * d
            enc = self._encode(zeros) if self.codec.lossy else None
            tok = 0 if enc is None else sum(t[:, :, :1].numel() * t.element_size() for t in enc.token.values())
            grp = 0 if enc is None else sum(t[:, :, :1].numel() * t.element_size() for t in enc.group.values())
            memo[key] = (fp, tok, grp)
        return memo[key]

    def projected_nbytes(self, tokens: int, kv: tuple[int, int, int], dtype: torch.dtype) -> int:
        """The most bytes this stream's buffers hold while it is fed ``tokens`` tokens (a prompt, then one per
        step), for rows of ``kv = (B, H, D)`` tokens in ``dtype``; what a memory budget reserves.

        The stored tokens with the growing buffers' slack (a quarter of the live size, at least
        ``min_slack`` entries), for a bounded stream never past the buffers' capacities (:func:`_capacities`):
        a prefill chunk longer than the window is a transient above this, given back at its eviction. Entry sizes come from encoding one
        group of zeros (one batch row) with this stream's own codec and basis: no per-format table to keep in
        step, and no allocation that grows with the batch.
        """
        b, h, d = kv
        fp_entry, tok_entry, grp_entry = (n * b for n in self._entry_bytes(h, d, dtype))
        held = tokens if self.bound is None else min(tokens, self.bound + 1)
        if not self.codec.lossy or held < self.residual_cap + self.unit:
            fp = held
            body = 0
        else:
            fp = self.residual_cap + self.unit - 1
            body = held - self.residual_cap
        if not body:
            tok_entry = grp_entry = 0
        groups = -(-body // self.codec.token_group) + 1 if body else 0
        caps = self._caps  # growing buffers (capped ones: never past their capacity)

        def grown(n: int, slack: int, cap: int | None) -> int:
            size = n + max(slack, n // 4) if n else 0
            return size if cap is None else min(size, cap)

        g_slack = max(1, self.min_slack // self.codec.token_group)
        return (
            grown(fp, self.min_slack, caps["fp"]) * fp_entry
            + grown(body, self.min_slack, caps["token"]) * tok_entry
            + grown(groups, g_slack, caps["group"]) * grp_entry
        )


def _capacities(codec: Codec, residual: int, unit: int, bound: int | None) -> dict[str, int | None]:
    """Entries each buffer of a stream needs at most, for a stream that keeps ``bound`` tokens after every
    eviction and is fed one token per step (None everywhere: unbounded, growing buffers).

    Before its eviction a decode step holds ``bound + 1`` tokens. A lossy stream's residual holds at least
    ``residual`` of them (tokens leave it ``unit`` at a time, only while ``residual`` stay) and at most
    ``residual + unit - 1`` after a step; the encoded body holds the rest: at most ``bound + 1 - residual``
    tokens, and their per-group parts one entry per ``token_group`` tokens plus the partly evicted first
    group. A lossless stream keeps every token in its residual. Longer chunks (prefill) grow a buffer for
    the chunk and give the memory back at the eviction that follows (:class:`TimeBuffer`).
    """
    if bound is None:
        return {"fp": None, "token": None, "group": None}
    if not codec.lossy:
        return {"fp": bound + 1, "token": 1, "group": 1}
    fp = max(1, min(bound + 1, residual + unit - 1))
    body = max(1, bound + 1 - residual)
    groups = -(-body // codec.token_group) + 1
    return {"fp": fp, "token": body, "group": groups}
