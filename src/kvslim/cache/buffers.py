"""Storage along the time axis: growing buffers and one K or V stream (encoded body + fp residual).

:class:`TimeBuffer` is a tensor growing along dim 2 with amortized O(1) appends and O(1) drops of the
oldest entries; :class:`Stream` is the non-sink tokens of one tensor of one layer — the encoded body
(a codec's token and group parts, each a TimeBuffer) and the full-precision residual. Appends are a
plan (encode; may fail) and a commit (cannot fail), so a layer can make an update a transaction.
A stream's encoded body may sit in another basis than the tokens appended (:class:`BodyBasis`: a
Hadamard rotation, a mean-centering bias subtracted); the residual never does.

This module knows nothing about positions, eviction policy or transformers (see :mod:`kvslim.cache.layer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import Codec, Encoded
from .hadamard import Hadamard


class TimeBuffer:
    """A tensor ``(B, H, T, ...)`` growing along dim 2, oldest entry first.

    Two storage modes:

    - growing (``capacity=None``, unbounded caches): a preallocated block with slack at the end;
      ``start`` moves on drops. When an append does not fit, the live part moves into a new block with
      25% headroom (at least ``min_slack`` entries) — amortized O(1) appends, a fresh allocation, so
      views handed out earlier are never overwritten.
    - capped (``capacity=N``, bounded caches): the block grows as above but never past ``N`` entries; once
      it holds ``N`` it is never reallocated again as long as at most ``N`` entries are live. A drop moves
      ``start`` (an index: nothing is copied, nothing re-encoded); when an append reaches the end of the
      block, the live entries move to its front, in place (a copy of the live entries once per ``N - live``
      appends, no allocation). Only a chunk that does not fit beside the live entries (a prefill chunk
      longer than the capacity, before its eviction) grows the block past ``N``, and the drop that follows
      gives the extra back. So a bounded cache's bytes are constant once it is full, and a short stream
      in a long window holds only what it stores (plus slack), not the window.

    Views (:meth:`view`) are valid until the next append or drop.
    """

    __slots__ = ("data", "start", "end", "min_slack", "capacity", "_view", "_view_of")

    def __init__(self, min_slack: int = 64, capacity: int | None = None):
        self.data: torch.Tensor | None = None
        self.start = 0
        self.end = 0
        # the last view and (data, start, end) it was cut from: an encoded body's parts change once a group,
        # and an eager decode step reads each of them every layer
        self._view: torch.Tensor | None = None
        self._view_of: tuple | None = None
        self.min_slack = min_slack
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
        ):
            raise ValueError(f"capacity must be a positive number of entries or None, got {capacity!r}")
        self.capacity = capacity

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[2]
        if n == 0 and self.data is not None:
            return
        if self.data is None or self.end + n > self.data.shape[2]:
            live = len(self)
            if self.capacity is not None and self.data is not None and live + n <= self.data.shape[2]:
                self._compact()
            else:
                self._realloc(live + n, x)
        self.data[:, :, self.end : self.end + n] = x
        self.end += n

    def _compact(self) -> None:
        """Move the live entries to the front of the block, in place (fixed mode)."""
        live = len(self)
        if self.start and live:
            src = self.data[:, :, self.start : self.end]
            # overlapping source and target: copy through a temporary when they overlap
            self.data[:, :, :live] = src.clone() if self.start < live else src
        self.start, self.end = 0, live

    def _realloc(self, need: int, like: torch.Tensor) -> None:
        """Move the live entries into a new block with room for ``need`` entries (plus slack when growing).

        Slack is a quarter of the live size (at least ``min_slack``): appends stay amortized O(1) (each
        entry is copied about four more times at most) and the block holds at most ~25% more than it
        stores; capped mode stops at ``capacity`` (or exactly ``need`` for a chunk past it). A fresh
        allocation: views handed out earlier are never overwritten.
        """
        live = len(self)
        cap = need + max(self.min_slack, live // 4)
        if self.capacity is not None:  # capped: never past the capacity unless one chunk needs more
            cap = need if need > self.capacity else min(cap, self.capacity)
        new = like.new_empty((*like.shape[:2], cap, *like.shape[3:]))
        if live:
            new[:, :, :live] = self.data[:, :, self.start : self.end]
        self.data, self.start, self.end = new, 0, live
        self._view = self._view_of = None  # the old block is not kept alive by a cached view

    def drop_front(self, k: int) -> None:
        if not 0 <= k <= len(self):
            raise ValueError(f"cannot drop {k} of {len(self)} entries")
        self.start += k
        if self.start == self.end:
            self.start = self.end = 0  # reuse the block from its beginning
        cap = self.data.shape[2] if self.data is not None else 0
        if self.capacity is not None:
            if cap > self.capacity and len(self) <= self.capacity:
                self._realloc(
                    len(self), self.data[:, :, :0]
                )  # a long chunk grew the block: back under capacity
        elif cap > 2 * len(self) + 2 * self.min_slack:
            # A big drop (a prefill leaving the residual, a window evicting a long prompt): give the memory back.
            self._realloc(len(self), self.data[:, :, :0])

    def drop_back(self, k: int) -> None:
        if not 0 <= k <= len(self):
            raise ValueError(f"cannot drop {k} of {len(self)} entries")
        self.end -= k

    def view(self) -> torch.Tensor | None:
        if self.data is None:
            return None
        of = self._view_of
        if of is None or of[0] is not self.data or of[1] != self.start or of[2] != self.end:
            self._view = self.data[:, :, self.start : self.end]
            self._view_of = (self.data, self.start, self.end)
        return self._view

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (a batch-dim index/repeat) to the stored block."""
        if self.data is not None:
            self.data = fn(self.data)
            self._view = self._view_of = None

    def nbytes(self) -> int:
        """Bytes allocated (live entries and slack): what the buffer really holds in memory."""
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def live_nbytes(self) -> int:
        if self.data is None:
            return 0
        per = self.data[:, :, :1].numel() * self.data.element_size()
        return per * len(self)


#: Name of the per-token part an adaptively centered body carries: 1 where the token was stored centered.
CENTERED = "centered"


@dataclass(frozen=True)
class BodyBasis:
    """The basis a stream's encoded body is stored in, relative to the tokens appended to the stream:
    ``encode(x) = H x - bias`` (``hadamard`` None: no rotation; ``bias`` (H_kv, D) float32 in the rotated
    basis, None: no centering). ``decode`` is its exact inverse, ``H (y + bias)`` (H is its own inverse),
    so a stored token decodes to the token appended up to the format's error: the bias acts as a fixed
    per-channel zero point (centering never relies on softmax invariance, whatever else the layer keeps
    at full precision).

    Centering is per token (:meth:`encode_adaptive`, for per-token formats): each token is stored centered
    only where that lowers its own round-trip error, and a ``centered`` token part (B, H, T, 1) uint8
    records the choice. A token far from the mean — the attention sink, whose key is short while the mean
    is long — is stored as it is, so centering never makes a token's key worse than not centering
    (docs/quality.md, "Centering and the attention sink")."""

    hadamard: Hadamard | None = None
    bias: torch.Tensor | None = None

    @property
    def identity(self) -> bool:
        return self.hadamard is None and self.bias is None

    def _bias(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias.to(device=x.device, dtype=torch.float32)
        if b.shape != (x.shape[1], x.shape[3]):
            raise ValueError(
                f"mean-center bias has shape {tuple(b.shape)} but the tokens have {x.shape[1]} KV heads x head_dim "
                f"{x.shape[3]}"
            )
        return b[None, :, None, :]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) appended tokens -> float32 in the stored basis (x itself when the basis is the identity)."""
        if self.identity:
            return x
        y = self.hadamard.apply(x) if self.hadamard is not None else x.float()
        return y - self._bias(y) if self.bias is not None else y

    def encode_adaptive(self, codec: Codec, x: torch.Tensor) -> Encoded:
        """Encode (B, H, T, D) tokens with a per-token codec, each centered or not, whichever round-trips
        closer (ties: centered); the choice is the ``centered`` token part (B, H, T, 1) uint8."""
        y = self.hadamard.apply(x) if self.hadamard is not None else x.float()
        b = self._bias(y)
        centered, plain = codec.encode(y - b), codec.encode(y)
        err_c = (codec.decode(centered, torch.float32) - (y - b)).pow(2).sum(-1)  # (B, H, T)
        err_p = (codec.decode(plain, torch.float32) - y).pow(2).sum(-1)
        flag = err_c <= err_p
        token = {}
        for name, tc in centered.token.items():
            f = flag.reshape(*flag.shape, *([1] * (tc.dim() - 3)))
            token[name] = torch.where(f, tc, plain.token[name])
        token[CENTERED] = flag.to(torch.uint8)[..., None]
        return Encoded(token=token, group=dict(centered.group))

    def decode(self, y: torch.Tensor, centered: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, T, D) decoded body tokens -> float32 in the basis the tokens were appended in.

        centered: the body's ``centered`` part (B, H, T, 1) (None: every token was centered)."""
        if self.identity:
            return y
        y = y.float()
        if self.bias is not None:
            y = y + (self._bias(y) if centered is None else self._bias(y) * centered.to(y.dtype))
        return self.hadamard.apply(y) if self.hadamard is not None else y

    def decode_sum(self, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``sum_i p_i decode(y_i)`` from ``out = sum_i p_i y_i`` (B, H, M, D) and ``weight = sum_i p_i``
        (B, H, M, 1): the inverse is affine, so the weighted sum is decoded once, not token by token."""
        if self.bias is not None:
            out = out + weight * self.bias.to(device=out.device, dtype=torch.float32)[None, :, None, :]
        return self.hadamard.apply(out) if self.hadamard is not None else out.float()


def encode_in_basis(codec: Codec, basis: BodyBasis | None, x: torch.Tensor) -> Encoded:
    """Tokens leaving a residual (B, H, n, D) -> their encoding, in the body's ``basis`` (None: as given;
    centered per token where the codec is per token, :meth:`BodyBasis.encode_adaptive`)."""
    if basis is None:
        return codec.encode(x)
    if basis.bias is not None and codec.token_group == 1:
        return basis.encode_adaptive(codec, x)
    return codec.encode(basis.encode(x))


@dataclass(frozen=True)
class _Plan:
    """A stream append, decided and encoded but not applied: ``encoded`` joins the body,
    ``drop_fp`` tokens leave the front of the residual, ``fp`` (B, H, n, D) joins its end."""

    encoded: Encoded | None
    drop_fp: int
    fp: torch.Tensor


class Stream:
    """The non-sink tokens of one tensor (K or V) of one layer: encoded body + fp residual."""

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

    def plan(self, x: torch.Tensor, cast: torch.Tensor | None = None) -> _Plan:
        """Everything appending x (B, H, C, D) will do, computed without changing the stream: the
        encoding of the tokens that leave the residual (the step that can fail) is done here.
        cast: ``x.to(float16)`` already made and checked finite by the caller (:meth:`half_residual`)."""
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
            return _Plan(self._encode(self.fp.view()[:, :, :ready]), ready, y)
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
        if self.basis is None:
            return self.codec.decode(self.body(), dtype, self.offset)
        body = self.body()
        decoded = self.codec.decode(body, torch.float32, self.offset)
        return self.basis.decode(decoded, body.token.get(CENTERED)).to(dtype)

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
        if body.token or body.group:
            self._append_encoded(body)
        self.offset = int(offset)
        if fp is not None:
            self.fp.append(fp)

    # -- batch ---------------------------------------------------------------------------
    def map_batch(self, fn) -> None:
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
