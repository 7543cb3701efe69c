"""One layer's K/V in fixed-capacity buffers, addressed by slot: the store a compiled decode step runs on.

:class:`StaticStore` keeps the tokens a :class:`~kvslim.cache.layer.SlimLayer` of the same options keeps —
the same sinks, the same groups encoded at the same steps, the same window — but in buffers that are
allocated once (at the first write) and never change shape, never move and are never re-sliced, so a
decode step is one fixed graph: ``torch.compile`` traces it once per shape (docs/compile.md).

Layout, per K and per V (``S`` sinks, ``R`` residual, ``G`` group, ``F = R + G``)::

    fp    (B, H, S + F, D)  residual dtype: S sink slots, then a ring of F full-precision slots
    body  Encoded, token parts (B, H, C, ...), group parts (B, H, C / G, ...): a ring of C encoded slots
    fp_pos (S + F,), body_pos (C,) int64: the index of the token each slot holds (-1: none)

Token ``t`` (counted over every token this layer has seen; ``i = t - S`` its index in the stream):

- ``t < S``: fp slot ``t``, for good (StreamingLLM's sinks; without a window RotateKV's fp sinks);
- else fp slot ``S + i % F``. When token ``i`` completes a group that makes the fp ring full (``(i + 1) % G
  == 0`` and ``i + 1 >= F``), the oldest ``G`` fp tokens ``[i + 1 - F, i + 1 - F + G)`` are encoded together
  into body slots ``(i + 1 - F) % C`` onward and their fp slots freed: between ``R`` and ``R + G - 1``
  stream tokens stay at full precision, exactly as in :mod:`kvslim.cache.layer`. A lossless store (``none``) has
  no body: its ring holds the whole window (or the capacity).

Attention reads every slot and masks those that are empty or evicted (``t < seen - window`` for a stream
token): softmax does not depend on the order of the keys, and every key keeps the RoPE rotation it was fed
with (with StreamingLLM's in-cache positions the few sink keys are moved, on read, to sit right before the
window's oldest key: :meth:`StaticSegments.keys_fp`). Ring sizes: ``C = roundup(window - R + 1, G) + G`` with a window (a slot is
reused only after its token left the window; the extra group is a spare, so that a prefill chunk's
write, which starts at a group boundary below the window, never lands on a live group: proving the bound
tight is left for later), ``roundup(capacity - S - R, G)`` without one.

Two write paths, the same result: :meth:`StaticStore.write` (eager, any number of tokens; prefill) decides
with host integers; :meth:`StaticStore.write_one` (one token per row: the decode step) reads the position from
a tensor and, compiled, decides whether a group is due with ``torch.cond`` (both branches in the graph, one
run: the group encoded, or the slots' contents kept), so the same graph serves every step with no host sync
and no recompile. Eagerly it asks the host (``bool(due)``): the same writes.

This module knows nothing about transformers; :mod:`kvslim.cache.static_adapter` adapts it (``StaticSlimCache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import Codec, Encoded
from ..kernels.ops import codec_key
from .basis import CENTERED, BodyBasis, encode_in_basis
from .rotary import Rotary


def _roundup(n: int, g: int) -> int:
    return -(-n // g) * g


@dataclass(frozen=True)
class StaticSegments:
    """One layer's stored K/V as attention on the codes reads it in a static store: every slot, with the
    positions that say which are live. Views into the store's buffers, valid until its next write.

    k_fp, v_fp: (B, H, S + F, D) fp slots (sinks, then the ring); k_body, v_body: the encoded slots
    (:class:`~kvslim.formats.Encoded`, C tokens; None for a lossless store); fp_pos (S + F,), body_pos (C,)
    int64: the token in each slot (-1: none); visible_from: 0-dim int64, the first stream token attention
    sees (None: no window); sink: S.
    """

    k_fp: torch.Tensor
    v_fp: torch.Tensor
    fp_pos: torch.Tensor
    k_body: Encoded | None
    v_body: Encoded | None
    body_pos: torch.Tensor | None
    visible_from: torch.Tensor | None
    sink: int
    k_codec: Codec
    v_codec: Codec
    k_basis: BodyBasis | None
    v_basis: BodyBasis | None
    kv_shape: tuple[int, int, int]
    v_dim: int
    dtype: torch.dtype
    k_key: str = ""  # the codecs' custom-op keys (kvslim.kernels.ops)
    v_key: str = ""
    sink_shift: torch.Tensor | None = None  # 0-dim: positions the sink keys are moved by (positions='cache')
    rotary: Rotary | None = None  # what moves them

    def keys_fp(self) -> torch.Tensor:
        """The fp slots' keys (B, H, S + F, D) float32 as attention scores them: with in-cache positions the
        sinks moved to sit right before the window's oldest key (a rotation of S keys, branch-free)."""
        k = self.k_fp.float()
        if self.sink_shift is None or not self.sink:
            return k
        # moved in float32 and stored back in the fp slots' dtype, as a SlimLayer's moved sinks are
        moved = move_keys(self.rotary, k[:, :, : self.sink], self.sink_shift).to(self.k_fp.dtype).float()
        return torch.cat([moved, k[:, :, self.sink :]], dim=2)

    def live(self, pos: torch.Tensor) -> torch.Tensor:
        """pos (N,) int64 -> (N,) bool: the slots attention reads."""
        ok = pos >= 0
        if self.visible_from is not None:
            ok = ok & ((pos < self.sink) | (pos >= self.visible_from))
        return ok


class StaticStore:
    """The K and V of one attention layer in fixed buffers (module docstring).

    sink, window (None: no eviction, ``capacity`` tokens at most), residual and group as in
    :class:`~kvslim.cache.layer.SlimLayer`; k_basis / v_basis: the stored basis of each encoded body (None: the
    tokens as given); fp_dtype: storage of the full-precision slots (None: the model's).
    """

    def __init__(
        self,
        k_codec: Codec,
        v_codec: Codec,
        *,
        sink: int,
        window: int | None,
        residual: int,
        group_size: int,
        capacity: int | None,
        k_basis: BodyBasis | None = None,
        v_basis: BodyBasis | None = None,
        fp_dtype: torch.dtype | None = None,
        positions: str = "original",
        rotary: Rotary | None = None,
    ):
        if positions not in ("original", "cache"):
            raise ValueError(f"positions must be 'original' or 'cache', got {positions!r}")
        if positions == "cache" and window is not None and sink and rotary is None:
            raise ValueError("positions='cache' moves the sink keys, which needs the model's RoPE (rotary=)")
        if k_codec.lossy != v_codec.lossy:
            raise ValueError(
                f"a static cache stores K and V alike: both quantized or both 'none', got k={k_codec.name!r}, "
                f"v={v_codec.name!r}"
            )
        if window is None and capacity is None:
            raise ValueError(
                "a static cache without a window needs max_cache_len (the most tokens it will hold)"
            )
        if window is None and capacity <= sink:
            raise ValueError(f"max_cache_len must exceed sink ({sink}), got {capacity}")
        self.k_codec, self.v_codec = k_codec, v_codec
        self.lossy = k_codec.lossy
        self.sink, self.window, self.capacity = sink, window, capacity
        self.residual, self.group = (residual, group_size) if self.lossy else (0, 1)
        g = self.group
        if self.lossy:
            if residual % g:
                raise ValueError(f"residual ({residual}) must be a multiple of group_size ({g})")
            self.ring = residual + g  # F
            span = window - residual + 1 if window is not None else capacity - sink - residual
            self.body_slots = max(g, _roundup(max(span, 0), g) + (g if window is not None else 0))  # C
        else:
            self.ring = window + 1 if window is not None else capacity - sink
            self.body_slots = 0
        self.k_basis = k_basis if self.lossy and k_basis is not None and not k_basis.identity else None
        self.v_basis = v_basis if self.lossy and v_basis is not None and not v_basis.identity else None
        self.fp_dtype = fp_dtype if self.lossy else None  # a lossless store keeps the model's dtype
        # In-cache positions (StreamingLLM's): only with a window and sinks does a key ever need moving.
        self.moves_sinks = positions == "cache" and window is not None and sink > 0
        self.rotary = rotary
        self.k_fp = self.v_fp = self.fp_pos = self.body_pos = None
        self.k_key = self.v_key = ""  # custom-op codec keys (kvslim.kernels.ops), set at allocation
        self.k_body: Encoded | None = None
        self.v_body: Encoded | None = None
        self.seen = torch.zeros((), dtype=torch.long)  # tokens written (the one position counter); a tensor
        self.kv_shape: tuple[int, int, int] | None = None
        self.v_dim = 0
        self.dtype: torch.dtype | None = None

    # -- allocation -------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Slots attention reads per step: S + F full-precision ones and C encoded ones."""
        return self.sink + self.ring + self.body_slots

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Allocate every buffer for keys (B, H, T, D) / values (B, H, T, Dv): once, before the first write."""
        b, h, _, d = keys.shape
        dv = values.shape[3]
        dev = keys.device
        fp = self.fp_dtype
        if fp == "auto":  # as a Stream: float16 for float32 K/V, else the model's dtype
            fp = torch.float16 if keys.dtype == torch.float32 else None
        fp = keys.dtype if fp is None else fp
        n_fp = self.sink + self.ring
        self.k_fp = torch.zeros(b, h, n_fp, d, dtype=fp, device=dev)
        self.v_fp = torch.zeros(b, h, n_fp, dv, dtype=fp, device=dev)
        self.fp_pos = torch.full((n_fp,), -1, dtype=torch.long, device=dev)
        if self.lossy:
            c = self.body_slots
            self.k_body = _zeroed(encode_in_basis(self.k_codec, self.k_basis, keys.new_zeros(b, h, c, d)))
            self.v_body = _zeroed(encode_in_basis(self.v_codec, self.v_basis, values.new_zeros(b, h, c, dv)))
            self.body_pos = torch.full((c,), -1, dtype=torch.long, device=dev)
            # the custom ops' codec keys, registered here (eagerly), read inside compiled steps
            self.k_key, self.v_key = (
                codec_key(self.k_codec, self.k_body),
                codec_key(self.v_codec, self.v_body),
            )
        self.seen = self.seen.to(dev)
        self.kv_shape, self.v_dim, self.dtype = (b, h, d), dv, keys.dtype

    def nbytes(self) -> int:
        """Every byte the store holds (its capacity, whatever is live): buffers, position slots, counter."""
        return sum(self.components().values())

    def components(self) -> dict[str, int]:
        """Bytes per kind of tensor (fixed from the first write on)."""
        size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        return {
            "fp_slots": size(self.k_fp) + size(self.v_fp),
            "encoded": sum(e.nbytes() for e in (self.k_body, self.v_body) if e is not None),
            "slot_positions": size(self.fp_pos) + size(self.body_pos) + size(self.seen),
        }

    live_nbytes = nbytes  # a static store holds its capacity from the first write on

    # -- writes -----------------------------------------------------------------------------
    def write(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``T`` new tokens (B, H, T, D), deciding on the host (eager; a prefill chunk). Returns what a
        :class:`~kvslim.cache.layer.SlimLayer` hands standard attention for the chunk: every token stored before it
        (none evicted yet) and the new ones, each as stored (encoded tokens decoded, fp ones in the fp dtype),
        in the model's dtype: (B, H, stored + T, D) K and V."""
        t0, q = int(self.seen), keys.shape[2]
        if self.window is None and t0 + q > self.capacity:
            raise ValueError(
                f"this static cache holds at most max_cache_len={self.capacity} tokens; {t0} are stored and "
                f"{q} more were fed (build it with a larger max_cache_len, or a window)"
            )
        s, f, g, dev, dtype = self.sink, self.ring, self.group, keys.device, keys.dtype
        ns = max(0, min(q, s - t0))  # tokens that become sinks
        if ns:
            idx = torch.arange(t0, t0 + ns, device=dev)
            self._put_fp(idx, keys[:, :, :ns], values[:, :, :ns], idx)
        ks, vs = keys[:, :, ns:], values[:, :, ns:]
        n = max(0, t0 - s)  # stream tokens before
        n2 = n + q - ns
        first = 0 if self.window is None else max(0, n - self.window)  # the oldest stream token still stored
        sink_k = self.k_fp[:, :, : min(t0 + ns, s)]
        shift = self._sink_shift(s + first)
        if shift is not None and first:  # in-cache positions: the sinks right before the oldest stored key
            sink_k = move_keys(self.rotary, sink_k.float(), torch.tensor(shift, device=dev)).to(sink_k.dtype)
        views = [[sink_k], [self.v_fp[:, :, : min(t0 + ns, s)]]]  # the sinks
        live_fp = (self.fp_pos >= s + first) & (self.fp_pos < s + n)
        if self.lossy:
            e, e2 = self._encoded(n), self._encoded(n2)
            if e > first:  # body tokens [first, e), decoded
                live = (self.body_pos >= s + first) & (self.body_pos >= 0)
                for view, body, codec, basis in (
                    (views[0], self.k_body, self.k_codec, self.k_basis),
                    (views[1], self.v_body, self.v_codec, self.v_basis),
                ):
                    view.append(_ordered(_decode(body, codec, basis), self.body_pos, live))
            if e2 > e:  # tokens [e, e2) leave the fp ring now: encoded once, as one block of whole groups
                parts = []
                if e < n:
                    ring = s + torch.arange(e, min(n, e2), device=dev) % f
                    parts.append((self.k_fp.index_select(2, ring), self.v_fp.index_select(2, ring)))
                if e2 > n:
                    parts.append((ks[:, :, : e2 - n], vs[:, :, : e2 - n]))
                xk = torch.cat([p[0].to(dtype) for p in parts], dim=2)
                xv = torch.cat([p[1].to(values.dtype) for p in parts], dim=2)
                enc_k = encode_in_basis(self.k_codec, self.k_basis, xk)
                enc_v = encode_in_basis(self.v_codec, self.v_basis, xv)
                shown = max(e, first) - e  # the encoded tokens attention sees now (the rest were evicted)
                views[0].append(_decode(enc_k, self.k_codec, self.k_basis)[:, :, shown:])
                views[1].append(_decode(enc_v, self.v_codec, self.v_basis)[:, :, shown:])
                lo = e if self.window is None else max(e, ((n2 - self.window) // g) * g)  # still stored after
                if e2 > lo:
                    tokens = torch.arange(lo, e2, device=dev)
                    slots = tokens % self.body_slots
                    _put_body(self.k_body, enc_k.narrow(lo - e, e2 - e, 0, g)[0], slots, self.k_codec)
                    _put_body(self.v_body, enc_v.narrow(lo - e, e2 - e, 0, g)[0], slots, self.v_codec)
                    self.body_pos.index_copy_(0, slots, tokens + s)
            live_fp = live_fp & (self.fp_pos >= s + e2)
            self.fp_pos.masked_fill_((self.fp_pos >= s) & (self.fp_pos < s + e2), -1)
        else:
            e2 = n2 - f  # the ring keeps the newest f stream tokens
        views[0].append(_ordered(self.k_fp, self.fp_pos, live_fp))  # old fp tokens still at full precision
        views[1].append(_ordered(self.v_fp, self.fp_pos, live_fp))
        kept = max(n, e2)  # the new tokens that stay at full precision
        if n2 > kept:
            tokens = torch.arange(kept, n2, device=dev)
            self._put_fp(s + tokens % f, ks[:, :, kept - n :], vs[:, :, kept - n :], tokens + s)
        views[0].append(ks[:, :, max(0, kept - n) if self.lossy else 0 :].to(self.k_fp.dtype))
        views[1].append(vs[:, :, max(0, kept - n) if self.lossy else 0 :].to(self.v_fp.dtype))
        self.seen.add_(q)
        return tuple(torch.cat([p.to(dtype) for p in view], dim=2) for view in views)

    def write_one(self, keys: torch.Tensor, values: torch.Tensor) -> StaticSegments:
        """Store one new token per row (B, H, 1, D) and return what this step's attention reads. Compiled, no
        host integer is read (module docstring), so ``torch.compile`` traces it once."""
        s, f, g = self.sink, self.ring, self.group
        t = self.seen  # 0-dim: the new token's index
        if not torch.compiler.is_compiling() and self.window is None and int(t) >= self.capacity:
            # (a compiled step is checked by kvslim.compiled, on the host, before the graph runs)
            raise ValueError(
                f"this static cache holds at most max_cache_len={self.capacity} tokens and is full (build it "
                f"with a larger max_cache_len, or a window)"
            )
        i = (t - s).clamp(min=0)  # its stream index (0 while it is a sink)
        slot = torch.where(t < s, t, s + i % f).reshape(1)
        self._put_fp(slot, keys, values, t.reshape(1))
        if self.lossy:
            n2 = i + 1
            due = (t >= s) & (n2 % g == 0) & (n2 >= f)  # a group leaves the full ring now
            start = (
                (n2 - f).clamp(min=0) // g * g
            )  # its first stream token (group-aligned, whether due or not)
            src = s + (start % f) + torch.arange(g, device=t.device)  # its fp slots
            dst = start % self.body_slots + torch.arange(g, device=t.device)  # its body slots
            xk = self.k_fp.index_select(2, src).to(keys.dtype)
            xv = self.v_fp.index_select(2, src).to(values.dtype)
            if self.residual == 0:  # the group ends with the new token: encoded as given, never rounded to the
                # fp dtype first (as in kvslim.cache.stream)
                xk = torch.cat([xk[:, :, :-1], keys], dim=2)
                xv = torch.cat([xv[:, :, :-1], values], dim=2)
            # Encoded only when due (torch.cond: one branch runs; a compiled step keeps both in one graph), else
            # the slots' current contents, so the write below is unconditional.
            # each body's group slots, by its own codec's token group (a variance-normalized V has groups next to
            # a per-token K)
            kg, vg = (dst[:: c.token_group] // c.token_group for c in (self.k_codec, self.v_codec))
            if torch.compiler.is_compiling():
                parts = torch.cond(due, self._encode_group, self._body_at, (xk, xv, dst, kg, vg))
                _write_parts(self.k_body, self.v_body, parts, dst, kg, vg)
            elif bool(due):  # eager: the host decides (torch.cond would trace its branches each call)
                _write_parts(self.k_body, self.v_body, self._encode_group(xk, xv, dst, kg, vg), dst, kg, vg)
            self.body_pos.index_copy_(0, dst, torch.where(due, self.fp_pos[src], self.body_pos[dst]))
            self.fp_pos.index_copy_(0, src, torch.where(due, -1, self.fp_pos[src]))
        view = self.segments(t)
        self.seen.add_(1)
        return view

    def _encode_group(self, xk, xv, dst, kg, vg) -> tuple[torch.Tensor, ...]:
        """torch.cond's branch when a group is due: xk / xv (B, H, G, D) encoded, as the flat parts of
        :func:`_flat` (K token, K group, V token, V group parts, in the buffers' order and dtypes)."""
        ek = encode_in_basis(self.k_codec, self.k_basis, xk)
        ev = encode_in_basis(self.v_codec, self.v_basis, xv)
        return _flat(ek, ev, self.k_body, self.v_body)

    def _body_at(self, xk, xv, dst, kg, vg) -> tuple[torch.Tensor, ...]:
        """torch.cond's other branch: the body's current contents at token slots ``dst`` (group slots ``kg`` /
        ``vg``)."""
        out = []
        for body, gdst in ((self.k_body, kg), (self.v_body, vg)):
            out += [_bytes(t).index_select(2, dst).contiguous() for t in body.token.values()]
            out += [_bytes(t).index_select(2, gdst).contiguous() for t in body.group.values()]
        return tuple(out)

    def _sink_shift(self, first):
        """How far the sink keys move when the oldest stored stream token is ``first`` (its index): they sit
        right before it (positions 'cache'; None otherwise)."""
        if not self.moves_sinks:
            return None
        return first - self.sink

    def segments(self, t: torch.Tensor) -> StaticSegments:
        """The slots attention reads when the newest stored token is ``t`` (0-dim)."""
        visible = None if self.window is None else t - self.window
        shift = None if visible is None else self._sink_shift(visible.clamp(min=self.sink))
        return StaticSegments(
            self.k_fp,
            self.v_fp,
            self.fp_pos,
            self.k_body,
            self.v_body,
            self.body_pos,
            visible,
            self.sink,
            self.k_codec,
            self.v_codec,
            self.k_basis,
            self.v_basis,
            self.kv_shape,
            self.v_dim,
            self.dtype,
            self.k_key,
            self.v_key,
            shift,
            self.rotary,
        )

    def _encoded(self, n: int) -> int:
        """Stream tokens encoded once ``n`` were written: every whole group beyond the newest R."""
        return max(0, (n - self.residual) // self.group) * self.group

    def _put_fp(self, slots, keys, values, tokens) -> None:
        self.k_fp.index_copy_(2, slots, keys.to(self.k_fp.dtype))
        self.v_fp.index_copy_(2, slots, values.to(self.v_fp.dtype))
        self.fp_pos.index_copy_(0, slots, tokens)

    # -- reads ------------------------------------------------------------------------------
    @property
    def stored(self) -> int:
        """Tokens stored now (host integer: reads the counter)."""
        t = int(self.seen)
        n = max(0, t - self.sink)
        return min(t, self.sink) + (n if self.window is None else min(n, self.window))

    def materialize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every stored token, oldest first, decoded: (B, H, stored, D) K and V in ``dtype`` (default the
        model's); None before the first write."""
        if self.k_fp is None:
            return None
        dtype = self.dtype if dtype is None else dtype
        view = self.segments(self.seen)
        k_fp = self.k_fp
        if self.moves_sinks:  # after the last write: the oldest stored stream token is seen - window
            shift = torch.tensor(self._sink_shift(max(self.sink, int(self.seen) - self.window)))
            sinks = move_keys(self.rotary, k_fp[:, :, : self.sink].float(), shift).to(k_fp.dtype)
            k_fp = torch.cat([sinks, k_fp[:, :, self.sink :]], dim=2)
        out = []
        for fp, body, codec, basis in (
            (k_fp, self.k_body, self.k_codec, self.k_basis),
            (self.v_fp, self.v_body, self.v_codec, self.v_basis),
        ):
            pieces = []
            if body is not None:
                pieces.append(_ordered(_decode(body, codec, basis), self.body_pos, view.live(self.body_pos)))
            pieces.append(
                _ordered(fp, self.fp_pos, view.live(self.fp_pos))
            )  # sinks first: the smallest positions
            if body is not None:  # sinks before the body
                sinks = pieces[1][:, :, : min(int(self.seen), self.sink)]
                pieces = [sinks, pieces[0], pieces[1][:, :, sinks.shape[2] :]]
            out.append(torch.cat([p.to(dtype) for p in pieces], dim=2))
        return out[0], out[1]


def move_keys(rotary: Rotary, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``R(delta) k`` for keys k (B, H, S, D) float32 and one 0-dim ``delta``: :meth:`Rotary.move` without its
    host-side shortcut (a zero delta is a rotation by 0), so a compiled step traces it."""
    cos, sin = rotary.cos_sin(delta.reshape(1, 1), k.device)  # (1, 1, R)
    o, r = rotary.offset, rotary.rotary_dim
    rot = k[..., o : o + r]
    half = r // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)  # rotate_half
    return torch.cat([k[..., :o], rot * cos[:, None] + turned * sin[:, None], k[..., o + r :]], dim=-1)


def _ordered(x: torch.Tensor, pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The live slots of x (B, H, N, D), in token order."""
    idx = torch.nonzero(live).flatten()
    idx = idx[torch.argsort(pos[idx])]
    return x.index_select(2, idx)


def _decode(body: Encoded, codec: Codec, basis: BodyBasis | None) -> torch.Tensor:
    """Every body slot decoded to float32 in the tokens' own basis: (B, H, C, D)."""
    y = codec.decode(body, torch.float32)
    return y if basis is None else basis.decode(y, body.token.get(CENTERED))


def _zeroed(enc: Encoded) -> Encoded:
    for t in (*enc.token.values(), *enc.group.values()):
        t.zero_()
    return enc


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 as its bytes (CPU has no fp8 index_copy / index_select); any other tensor as it is."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _flat(ek: Encoded, ev: Encoded, k_body: Encoded, v_body: Encoded) -> tuple[torch.Tensor, ...]:
    """New encodings as flat tensors in the order and dtypes of the body buffers (see _write_parts)."""
    out = []
    for enc, body in ((ek, k_body), (ev, v_body)):
        out += [_bytes(enc.token[n].to(b.dtype)).contiguous() for n, b in body.token.items()]
        out += [_bytes(enc.group[n].to(b.dtype)).contiguous() for n, b in body.group.items()]
    return tuple(out)


def _write_parts(
    k_body: Encoded, v_body: Encoded, parts, dst: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor
) -> None:
    """Write the flat parts of :func:`_flat` at token slots ``dst`` / group slots ``kg`` (K) and ``vg`` (V)."""
    it = iter(parts)
    for body, gdst in ((k_body, kg), (v_body, vg)):
        for t in body.token.values():
            _bytes(t).index_copy_(2, dst, next(it))
        for t in body.group.values():
            _bytes(t).index_copy_(2, gdst, next(it))


def _put_body(body: Encoded, enc: Encoded, slots: torch.Tensor, codec: Codec) -> None:
    """Write encoded tokens into body token slots ``slots`` (whole groups, group-aligned) and their groups'
    parts (eager: a prefill chunk)."""
    gslots = slots[:: codec.token_group] // codec.token_group
    for parts, new, idx in ((body.token, enc.token, slots), (body.group, enc.group, gslots)):
        for name, buf in parts.items():
            _bytes(buf).index_copy_(2, idx, _bytes(new[name].to(buf.dtype)))
