"""One layer's KV store: a keep policy + a codec per stream + a full-precision residual.

Layout of one layer (per K and per V, same token order)::

    [ sinks (<= sink tokens, model dtype) ][ body (encoded, oldest) ][ residual (model dtype, newest) ]
      \\_ only with a window               \\________________ the stream _________________________/

- Arriving tokens go to the sinks until ``sink`` tokens were seen (only with a window), then to
  the residual. The residual keeps the most recent ``residual`` tokens at full precision (KIVI);
  older ones leave it ``group_size`` at a time and are encoded together — once, and never again.
  So between ``min(n, residual)`` and ``residual + group_size - 1`` tokens of a stream are at full
  precision. (KIVI's per-channel K needs whole groups anyway; per-token formats go in the same
  units so that one encode call serves ``group_size`` tokens — the fixed cost of a call, not the
  tokens, dominates a single-token encode — and K and V bodies stay the same length.
  ``residual=0, group_size=1`` encodes every token on arrival, as llama.cpp does.)
- Eviction (StreamingLLM) drops the oldest tokens of the stream, one token at a time: encoded
  codes are sliced; a group's shared scales leave with the group's last token (the surviving
  tokens of a partly evicted group decode exactly as before).
- Per-step cost: an append writes the new tokens into preallocated buffers (amortized O(new
  tokens), history independent); the materializing read used by standard attention decodes the
  stored tokens once per step (O(stored)), which is what attention reads anyway.

This module knows nothing about transformers; :mod:`kvslim.cache` adapts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Codec, Encoded
from .policy import KeepPolicy


class TimeBuffer:
    """A tensor ``(B, H, T, ...)`` growing along dim 2: amortized O(1) append, O(1) drop of the oldest.

    Storage is a preallocated block with slack at the end; ``start`` moves on drops. When an append
    does not fit, the live part moves into a new block with 50% headroom (at least ``min_slack``
    entries) — a fresh allocation, so views handed out earlier are never overwritten.
    """

    __slots__ = ("data", "start", "end", "min_slack")

    def __init__(self, min_slack: int = 64):
        self.data: torch.Tensor | None = None
        self.start = 0
        self.end = 0
        self.min_slack = min_slack

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[2]
        if n == 0 and self.data is not None:
            return
        if self.data is None or self.end + n > self.data.shape[2]:
            self._realloc(len(self) + n, x)
        self.data[:, :, self.end : self.end + n] = x
        self.end += n

    def _realloc(self, need: int, like: torch.Tensor) -> None:
        """Move the live entries into a new block with room for ``need`` entries plus slack.

        Slack is a quarter of the live size (at least ``min_slack``): appends stay amortized O(1)
        (each entry is copied about four more times at most) and the block holds at most ~25% more
        than it stores. A fresh allocation: views handed out earlier are never overwritten.
        """
        live = len(self)
        cap = need + max(self.min_slack, live // 4)
        new = like.new_empty((*like.shape[:2], cap, *like.shape[3:]))
        if live:
            new[:, :, :live] = self.data[:, :, self.start : self.end]
        self.data, self.start, self.end = new, 0, live

    def drop_front(self, k: int) -> None:
        if not 0 <= k <= len(self):
            raise ValueError(f"cannot drop {k} of {len(self)} entries")
        self.start += k
        if self.start == self.end:
            self.start = self.end = 0  # reuse the block from its beginning
        cap = self.data.shape[2] if self.data is not None else 0
        if cap > 2 * len(self) + 2 * self.min_slack:
            # A big drop (a prefill leaving the residual, a window evicting a long prompt): give the memory back.
            self._realloc(len(self), self.data[:, :, :0])

    def drop_back(self, k: int) -> None:
        if not 0 <= k <= len(self):
            raise ValueError(f"cannot drop {k} of {len(self)} entries")
        self.end -= k

    def view(self) -> torch.Tensor | None:
        return None if self.data is None else self.data[:, :, self.start : self.end]

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (a batch-dim index/repeat) to the stored block."""
        if self.data is not None:
            self.data = fn(self.data)

    def nbytes(self) -> int:
        """Bytes allocated (live entries and slack): what the buffer really holds in memory."""
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def live_nbytes(self) -> int:
        if self.data is None:
            return 0
        per = self.data[:, :, :1].numel() * self.data.element_size()
        return per * len(self)


class Stream:
    """The non-sink tokens of one tensor (K or V) of one layer: encoded body + fp residual."""

    def __init__(self, codec: Codec, residual: int, unit: int = 1, min_slack: int = 64):
        self.codec = codec
        self.residual_cap = residual if codec.lossy else 0
        if unit % codec.token_group:
            raise ValueError(f"unit={unit} must be a multiple of the codec's token group {codec.token_group}")
        self.unit = unit  # tokens leave the residual this many at a time
        self.tokens: dict[str, TimeBuffer] = {}  # encoded per-token parts
        self.groups: dict[str, TimeBuffer] = {}  # encoded per-group parts
        self.offset = 0  # tokens already evicted from the first group
        self.fp = TimeBuffer(min_slack)  # residual (everything, for an identity codec)
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
        if not self.codec.lossy:
            self.fp.append(x)
            return
        g = self.unit
        n_fp = len(self.fp)
        ready = ((n_fp + x.shape[2] - self.residual_cap) // g) * g  # tokens that leave the residual now
        if ready <= n_fp:
            if ready > 0:
                self._encode(self.fp.view()[:, :, :ready])
                self.fp.drop_front(ready)
            self.fp.append(x)
            return
        # A long chunk (prefill): encode straight from it; only the newest tokens enter the residual.
        head = x[:, :, : ready - n_fp]
        self._encode(head if n_fp == 0 else torch.cat([self.fp.view(), head], dim=2))
        self.fp.drop_front(n_fp)
        self.fp.append(x[:, :, ready - n_fp :])

    def _encode(self, x: torch.Tensor) -> None:
        """Encode x (B, H, n, D), n a multiple of token_group, and append it to the body."""
        enc = self.codec.encode(x)
        for name, t in enc.token.items():
            self.tokens.setdefault(name, TimeBuffer(self.min_slack)).append(t)
        g_slack = max(1, self.min_slack // self.codec.token_group)
        for name, t in enc.group.items():
            self.groups.setdefault(name, TimeBuffer(g_slack)).append(t)

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
        if self.n_body == 0:
            return None
        return self.codec.decode(self.body(), dtype, self.offset)

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


@dataclass(frozen=True)
class Segments:
    """One layer's stored K and V as segments, oldest first: what attention on the codes reads.

    ``[ sinks (fp) | body (encoded) | residual (fp) ]`` per stream. K and V may split at different
    points (per-channel K leaves the residual a group at a time). Tensors are views into the layer's
    buffers, valid until that layer's next update; nothing here may be written.

    k_sink, v_sink: (B, H, S, D) or None; k_body, v_body: :class:`~kvslim.formats.Encoded` or None,
    decoded with ``k_codec``/``v_codec`` and ``k_offset``/``v_offset`` (tokens already evicted from the
    first per-channel group); k_res, v_res: (B, H, R, D) or None; length: stored tokens;
    kv_shape: (B, H_kv, D); dtype: the dtype the standard path would return.
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

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full (B, H, T, D) tensors, as the standard path would have returned them."""
        out = []
        for sink, codec, body, offset, res in (
            (self.k_sink, self.k_codec, self.k_body, self.k_offset, self.k_res),
            (self.v_sink, self.v_codec, self.v_body, self.v_offset, self.v_res),
        ):
            parts = [sink, None if body is None else codec.decode(body, self.dtype, offset), res]
            out.append(torch.cat([t.to(self.dtype) for t in parts if t is not None and t.shape[2]], dim=2))
        return out[0], out[1]


class SlimLayer:
    """The K and V store of one attention layer.

    ``update`` appends new tokens and returns every stored token (for standard attention), then
    evicts; positions are owned here: ``seen`` counts tokens ever appended.
    """

    def __init__(
        self,
        policy: KeepPolicy,
        k_codec: Codec,
        v_codec: Codec,
        residual: int,
        group_size: int = 1,
        k_bias: torch.Tensor | None = None,
        min_slack: int = 64,
    ):
        self.policy = policy
        self.k = Stream(k_codec, residual, group_size, min_slack)
        self.v = Stream(v_codec, residual, group_size, min_slack)
        self.k_bias = k_bias  # (H_kv, D) float32, subtracted from every key before storage
        self.sink_k: torch.Tensor | None = None  # (B, H, <=sink, D)
        self.sink_v: torch.Tensor | None = None
        self.seen = 0
        self.pads: torch.Tensor | None = None  # (B,) left-padding count per row
        self.sink_start: torch.Tensor | None = None  # (B,) first position of each row's sinks
        self.dtype: torch.dtype | None = None
        self.kv_shape: tuple[int, int, int] | None = None  # (B, H_kv, D) of the stored tokens

    # -- sizes ---------------------------------------------------------------------------
    @property
    def sink_len(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def stored(self) -> int:
        return self.sink_len + len(self.k)

    # -- the update ------------------------------------------------------------------------
    def center(self, keys: torch.Tensor) -> torch.Tensor:
        """Subtract the mean-centering bias (in fp32) from keys (B, H, T, D)."""
        if self.k_bias is None:
            return keys
        bias = self.k_bias.to(device=keys.device)
        if bias.shape != (keys.shape[1], keys.shape[3]):
            raise ValueError(
                f"mean-center bias has shape {tuple(bias.shape)} but keys have {keys.shape[1]} KV heads "
                f"x head_dim {keys.shape[3]}"
            )
        return (keys.float() - bias[None, :, None, :]).to(keys.dtype)

    def set_pads(self, pads: torch.Tensor | None) -> None:
        """Left padding per row (B,) int64, as decided by the cache (None: no padding)."""
        self.pads = None if pads is None else pads.to(dtype=torch.long)

    def append(self, keys: torch.Tensor, values: torch.Tensor, *, segments: bool = False):
        """Append keys/values (B, H, C, D); return every stored token before eviction, then evict
        down to the policy's capacity.

        Returns ``(K, V)`` materialized, (B, H, stored + C, D) in the first update's dtype, or with
        ``segments=True`` a :class:`Segments` view of the stored parts (what the compressed attention
        reads: no fp copy of the history is written).
        """
        if (
            keys.ndim != 4
            or keys.shape != values.shape[:3] + keys.shape[3:]
            or keys.shape[:3] != values.shape[:3]
        ):
            raise ValueError(
                f"keys and values must be (B, H, T, D) with equal B, H, T; got {tuple(keys.shape)} and "
                f"{tuple(values.shape)}"
            )
        if self.dtype is None:
            self.dtype = keys.dtype
        batch, n_new = keys.shape[0], keys.shape[2]
        self.kv_shape = (batch, keys.shape[1], keys.shape[3])
        self.seen += n_new
        if self.pads is None or self.pads.shape[0] != batch:
            self.pads = torch.zeros(batch, dtype=torch.long, device=keys.device)
        if self.sink_start is None or self.sink_start.shape[0] != batch:
            self.sink_start = torch.zeros(batch, dtype=torch.long, device=keys.device)
        keys = self.center(keys)

        n_sink = self.policy.n_to_sinks(self.sink_len, n_new)
        if n_sink:
            ks, vs = keys[:, :, :n_sink], values[:, :, :n_sink]
            self.sink_k = ks.clone() if self.sink_k is None else torch.cat([self.sink_k, ks], dim=2)
            self.sink_v = vs.clone() if self.sink_v is None else torch.cat([self.sink_v, vs], dim=2)
            keys, values = keys[:, :, n_sink:], values[:, :, n_sink:]
        if keys.shape[2]:
            self.k.append(keys)
            self.v.append(values)

        out = self.segments() if segments else self.read(self.dtype)
        self._evict()
        return out

    def segments(self) -> Segments:
        """A frozen view of what is stored now (valid until the next update)."""
        return Segments(
            k_sink=self.sink_k,
            v_sink=self.sink_v,
            k_codec=self.k.codec,
            v_codec=self.v.codec,
            k_body=self.k.body() if self.k.n_body else None,
            v_body=self.v.body() if self.v.n_body else None,
            k_offset=self.k.offset,
            v_offset=self.v.offset,
            k_res=self.k.fp.view(),
            v_res=self.v.fp.view(),
            length=self.stored,
            kv_shape=self.kv_shape,
            dtype=self.dtype,
        )

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token, oldest first, materialized: (B, H, stored, D)."""
        k, v = self.k.materialize(dtype), self.v.materialize(dtype)
        if self.sink_k is not None:
            sk, sv = self.sink_k.to(dtype), self.sink_v.to(dtype)
            k = sk if k is None else torch.cat([sk, k], dim=2)
            v = sv if v is None else torch.cat([sv, v], dim=2)
        return k, v

    def _evict(self) -> None:
        k = self.policy.n_to_evict(self.stored)
        if k == 0:
            return
        new_start = self.policy.sink_starts(self.seen, self.pads)
        shift = new_start - self.sink_start  # (B,) >= 0: rows whose sinks still slide over pads
        if self.policy.sink and bool((shift > 0).any()):
            n = self.policy.sink
            idx = (shift[:, None] + torch.arange(n, device=shift.device))[:, None, :, None]  # (B, 1, n, 1)
            for name in ("k", "v"):
                stream = getattr(self, name)
                sinks = getattr(self, f"sink_{name}")
                pool = torch.cat([sinks, stream.front(k, sinks.dtype)], dim=2)  # (B, H, n + k, D)
                idx_full = idx.expand(-1, pool.shape[1], -1, pool.shape[3])
                setattr(self, f"sink_{name}", torch.gather(pool, 2, idx_full))
        self.sink_start = new_start
        self.k.drop_front(k)
        self.v.drop_front(k)

    # -- edits ---------------------------------------------------------------------------
    def crop(self, n: int) -> None:
        """Remove the ``n`` newest tokens (possible while nothing was evicted and they are in fp)."""
        if n <= 0:
            return
        if self.stored < self.seen:
            raise ValueError(
                f"cannot crop {n} tokens after StreamingLLM evicted {self.seen - self.stored}: the cache no longer "
                f"holds what came before them"
            )
        if n > self.stored:
            raise ValueError(f"cannot crop {n} tokens from a layer holding {self.stored}")
        from_stream = min(n, len(self.k))
        self.k.crop_back(from_stream)
        self.v.crop_back(from_stream)
        rest = n - from_stream
        if rest:
            self.sink_k = self.sink_k[:, :, : self.sink_len - rest]
            self.sink_v = self.sink_v[:, :, : self.sink_v.shape[2] - rest]
        self.seen -= n

    def map_batch(self, fn) -> None:
        """Apply a batch-dim transform (beam reorder, select, repeat) to every stored tensor."""
        self.k.map_batch(fn)
        self.v.map_batch(fn)
        for name in ("sink_k", "sink_v", "pads", "sink_start"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        if self.kv_shape is not None and self.pads is not None:
            self.kv_shape = (self.pads.shape[0], *self.kv_shape[1:])

    # -- accounting ------------------------------------------------------------------------
    def components(self) -> dict[str, int]:
        out = {**self.k.components("k"), **self.v.components("v")}
        out["k_sinks"] = _bytes(self.sink_k)
        out["v_sinks"] = _bytes(self.sink_v)
        out["mean_center_bias"] = _bytes(self.k_bias)
        # per-row bookkeeping of left-padded batches: padding and sink start, (B,) int64 each
        out["row_state"] = _bytes(self.pads) + _bytes(self.sink_start)
        return out

    def nbytes(self) -> int:
        return sum(self.components().values())

    def live_nbytes(self) -> int:
        """Bytes of the stored tokens alone (no buffer slack)."""
        c = self.components()
        return (
            self.k.live_nbytes() + self.v.live_nbytes() + c["k_sinks"] + c["v_sinks"] + c["mean_center_bias"]
        )


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
