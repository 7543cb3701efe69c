"""One layer's KV store: a keep policy + a codec per stream + a full-precision residual.

Layout of one layer (per K and per V, same token order)::

    [ sinks (<= sink tokens, model dtype) ][ body (encoded, oldest) ][ residual (model dtype, newest) ]
                                            \\________________ the stream _________________________/

- Arriving tokens go to the sinks until ``sink`` tokens were seen (StreamingLLM's with a window; without one
  simply never quantized: ``sink=auto`` keeps 16 in a quantized cache), then to
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
- Per-step cost: an append writes the new tokens into preallocated buffers (amortized O(new tokens)); the
  materializing read (standard attention, prompt chunks) decodes the stored tokens (O(stored)) or a kept copy.
- The stored basis (docs/quality.md, "Low-bit levers"). The encoded body may be stored in another
  basis than the model's keys/values: Hadamard-rotated (``k_hadamard``/``v_hadamard``), K mean-centered
  (``k_bias``, in the rotated basis when K is rotated) — both applied when tokens are encoded and undone
  exactly on read (:class:`~kvslim.cache.basis.BodyBasis`) — and, with ``pre_rope``, the whole K stream
  (residual and body) holds keys *before* RoPE: un-rotated on append with the forward's own rotary
  (KVQuant's pre-RoPE keys), rotated again on read at the position the current forward sees them. Sinks
  always hold the keys as the model gave them.

Where each part lives: the streams (encoded body + residual) in :mod:`kvslim.cache.stream`, the RoPE-frame
bookkeeping (which rotation each key carries, where it is read) in :mod:`kvslim.cache.frames`, the view
attention reads in :mod:`kvslim.cache.segments`, the state a prompt-cache file holds in
:mod:`kvslim.cache.layerstate`. This module decides what goes where on an append, evicts, and crops.

This module knows nothing about transformers (:mod:`kvslim.cache.layer_adapter` adapts it), nor about files.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..formats import Codec
from ..kernels import cpu as cpu_kernels
from . import layerbytes, layercheck, layerstate
from .basis import BodyBasis
from .frames import Frames, fed_positions
from .hadamard import Hadamard
from .policy import KeepPolicy
from .rotary import Rotary
from .segments import Segments
from .stream import Stream


class SlimLayer:
    """The K and V store of one attention layer.

    ``append`` adds new tokens and returns every stored token (for standard attention) or a
    :class:`Segments` view (for attention on the codes), then evicts. ``seen`` counts tokens ever
    appended — the one position counter (:mod:`kvslim.generate` reads it through the cache).

    Positions (docs/streaming.md; the bookkeeping is :class:`~kvslim.cache.frames.Frames`, ``self.frames``).
    Each key carries the RoPE rotation of the position id it was fed with. kvslim tracks, per stored key,
    that rotation relative to the token's *true* position (its index among the row's real tokens):
    ``rotation = true - base``, where ``base`` is what the caller subtracted to keep position ids bounded
    (0 under ``model.generate()``). Stream tokens share bases in a few runs (``runs``); sinks keep their
    rotation per row (``sink_rot``). At read time, in the frame of the current forward's base, every key
    is presented at the rotation its ``positions`` mode asks for:

    - ``original``: every key at its true position (distances grow with the stream for the sinks);
    - ``cache`` (StreamingLLM's in-cache positions): window keys at their true positions — the same
      distances as contiguous cache slots — and sink ``j`` right before the window's first key, as
      if the kept tokens were one contiguous sequence.

    Only the full-precision sinks are ever re-rotated; a stream run whose base differs from the
    current one (for ``window`` tokens after each re-base) is moved at read time — its keys in the
    materializing path, the query in the compressed path — never re-encoded. With ``pre_rope`` the
    stream's keys carry no rotation at all: each is rotated on read to its true position in the
    current frame (``Segments.k_pos``), so runs never need moving.

    The stored basis (module docstring): ``k_hadamard``/``v_hadamard`` rotate the encoded bodies,
    ``k_bias`` (H_kv, D) centers the encoded K body (in the basis it is stored in: rotated and/or
    pre-RoPE), ``pre_rope`` keeps the K stream before RoPE, un-rotated with the ``rope`` each
    :meth:`append` is given (default ``rotary``: a model whose frequencies change with the sequence
    length, dynamic NTK, hands each forward's own).
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
        positions: str = "original",
        rotary: Rotary | None = None,
        fp_dtype: torch.dtype | None = None,
        k_hadamard: Hadamard | None = None,
        v_hadamard: Hadamard | None = None,
        pre_rope: bool = False,
    ):
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
        if not isinstance(pre_rope, bool):
            raise ValueError(f"pre_rope must be True or False, got {pre_rope!r}")
        self.policy = policy
        self.positions = positions
        self.rotary = rotary  # None: keys are never moved (positions='original', base always 0)
        self.pre_rope = pre_rope  # the K stream holds keys before RoPE (needs a rope at every append)
        self.k_hadamard, self.v_hadamard = k_hadamard, v_hadamard
        # fp_dtype: storage of a lossy stream's full-precision tokens (residual and sinks); None: the model's
        bound = policy.window  # a bounded stream's buffers are allocated once, at their capacity
        self.k = Stream(
            k_codec, residual, group_size, min_slack, fp_dtype, BodyBasis(k_hadamard, k_bias), bound
        )
        self.v = Stream(v_codec, residual, group_size, min_slack, fp_dtype, BodyBasis(v_hadamard), bound)
        self._k_bias = k_bias  # (H_kv, D) float32, subtracted from every encoded key (in the body's basis)
        self.sink_k: torch.Tensor | None = None  # (B, H, <=sink, D), as the model gave them
        self.sink_v: torch.Tensor | None = None
        #: the rotation of every stored key, the base and rotary of the forward being served
        self.frames = Frames(positions, rotary, pre_rope)
        self.seen = 0
        self.pads: torch.Tensor | None = None  # (B,) left-padding count per row
        self._no_pads: torch.Tensor | None = None  # the zeros append hands out when nothing is padded
        self.sink_start: torch.Tensor | None = None  # (B,) first slot of each row's sinks
        self._zero_start: torch.Tensor | None = None  # the zeros append made for sink_start (never written to)
        self.dtype: torch.dtype | None = None
        self.kv_shape: tuple[int, int, int] | None = None  # (B, H_kv, D) of the stored tokens
        self._v_dim = 0  # V's head_dim (fixed by the first append)

    @property
    def k_bias(self) -> torch.Tensor | None:
        """The mean-centering bias (H_kv, D) of the encoded K body, in its stored basis (None: none)."""
        return self._k_bias

    @k_bias.setter
    def k_bias(self, bias: torch.Tensor | None) -> None:
        if self.k.n_body:
            raise ValueError("the mean-centering bias cannot change once keys were encoded with another one")
        self._k_bias = bias
        self.k.basis = BodyBasis(self.k_hadamard, bias) if self.k.codec.lossy else None
        if self.k.basis is not None and self.k.basis.identity:
            self.k.basis = None

    # -- sizes ---------------------------------------------------------------------------
    @property
    def sink_len(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def stored(self) -> int:
        return self.sink_len + len(self.k)

    @property
    def base(self) -> int:
        """The position base of the forward being served (what the caller subtracted from the ids; set by
        :meth:`append`, 0 under ``model.generate()``). Read-only."""
        return self.frames.base

    @property
    def runs(self) -> list[list[int]]:
        """``[[tokens, base], ...]`` over the stream's keys, oldest first (:class:`~kvslim.cache.frames.Frames`)."""
        return self.frames.runs

    @property
    def sink_rot(self) -> torch.Tensor | None:
        """(B, <=sink) int64: the rotation position of each sink key (None: no sinks)."""
        return self.frames.sink_rot

    @sink_rot.setter
    def sink_rot(self, rot: torch.Tensor | None) -> None:
        self.frames.sink_rot = rot

    @property
    def v_dim(self) -> int:
        """V's head_dim (fixed by the first append; 0 before it). Read-only."""
        return self._v_dim

    # -- the update ------------------------------------------------------------------------
    def basis_keys(self, keys: torch.Tensor, *, base: int = 0, rope: Rotary | None = None) -> torch.Tensor:
        """New keys (B, H, C, D), about to be appended, in the basis the K body stores them — un-rotated
        (``pre_rope``) and Hadamard-rotated (``k_hadamard``), never centered: what a mean-centering bias
        for this basis is the mean of (:mod:`kvslim.calibration.calibrate` observes them). float32."""
        x = keys.float()
        if self.pre_rope:
            rope = self.rotary if rope is None else rope
            pads = self.pads if self.pads is not None and self.pads.shape[0] == keys.shape[0] else None
            rot = fed_positions(self.seen, keys.shape[2], pads, base, keys.device)  # (B or 1, C)
            x = rope.move(x, -rot.expand(keys.shape[0], -1))
        return x if self.k_hadamard is None else self.k_hadamard.apply(x)

    def set_pads(self, pads: torch.Tensor | None) -> None:
        """Left padding per row (B,) int64, as decided by the cache (None: no padding)."""
        self.pads = None if pads is None else pads.to(dtype=torch.long)

    def check(self, keys: torch.Tensor, values: torch.Tensor, *, finite_checked: bool = False) -> None:
        """Raise ValueError (changing nothing) unless keys/values (B, H, T, D) can be appended
        (:func:`kvslim.cache.layercheck.check`). finite_checked: the caller already checked that every value is
        finite (a ragged step checks its whole batch at once)."""
        layercheck.check(self, keys, values, finite_checked=finite_checked)

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        segments: bool = False,
        defer_sinks: bool = False,
        base: int = 0,
        rope: Rotary | None = None,
        finite_checked: bool = False,
        encoded: tuple | None = None,
        halves: tuple | None = None,
    ):
        """Append keys/values (B, H, C, D); return every stored token before eviction, then evict down to the
        policy's capacity.

        base: what the caller subtracted from the true positions of these tokens' position ids (0 unless position
        ids are kept bounded). rope: the rotary these keys were rotated with (for ``pre_rope``; default the layer's
        ``rotary``). Returns ``(K, V)`` materialized, (B, H, stored + C, D) in the first update's dtype, or with
        ``segments=True`` a :class:`Segments` view of the stored parts (no fp copy of the history is written).

        A transaction: everything is validated and encoded first; a call that raises changes nothing.
        finite_checked: the caller already checked that every value is finite (:meth:`check`).
        defer_sinks: with ``segments=True``, ``(Segments, delta)`` (:meth:`segments`).
        encoded: (K, V) encodings of the tokens each stream flushes from its residual (:meth:`Stream.flush`), or
        None in either place: made by a ragged step for many rows at once (:meth:`Stream.plan`). halves: ``(keys,
        values)`` cast to float16, every value finite (a ragged step casts its whole layer in one call), or None.
        """
        if halves is not None and segments and layercheck.one_token(self, keys, values):
            # a decode token of a ragged step (cast and checked by the caller) into both residuals, nothing leaving
            # them, no sink to fill: what the steps below do for it, without asking again what the caller and
            # layercheck.one_token know (~10 us a row and layer at 16 rows x 30 layers)
            self.k.fp.append(halves[0])
            self.v.fp.append(halves[1])
            self.frames.add_run(1, base)
            self.seen += 1
            self.frames.serve(base, self.rotary if rope is None else rope)
            out = self.segments(defer_sinks=defer_sinks, shared=True)
            self._evict()
            return out
        batch, n_new = keys.shape[0], keys.shape[2]
        # A decode step whose token goes into float16 residuals: one finiteness check of the cast values covers
        # the input's (a NaN/inf stays one) and the residual's range (a finite value beyond float16's becomes
        # inf), one host sync where there were three. On failure the full checks raise their own errors.
        given, halves = halves, None  # given: cast by the caller, and finite
        if (
            n_new == 1
            and not self.pre_rope
            and self.policy.n_to_sinks(self.sink_len, n_new) == 0
            and self.k.half_residual(keys)
            and self.v.half_residual(values)
        ):
            self.check(keys, values, finite_checked=True)  # shapes and dtypes
            fast = (given, True) if given is not None else cpu_kernels.to_half_finite(keys, values)
            if fast is None:  # the C library cannot here: cast with torch
                halves = (keys.to(torch.float16), values.to(torch.float16))
                fast = halves, bool(torch.isfinite(halves[0]).all() & torch.isfinite(halves[1]).all())
            halves, finite = fast
            if not finite:
                self.check(keys, values)  # a non-finite input: raises
                self.k.cast(keys), self.v.cast(values)  # a value beyond float16's range: raises
                raise AssertionError("unreachable: a float16 cast of finite, in-range values is finite")
        else:
            self.check(keys, values, finite_checked=finite_checked)
        device = keys.device
        pads = self.pads if self.pads is not None and self.pads.shape[0] == batch else None
        if pads is None:  # no padding: one zeros tensor per batch size and device, never written to
            zeros = self._no_pads
            if zeros is None or zeros.shape[0] != batch or zeros.device != device:
                zeros = self._no_pads = torch.zeros(batch, dtype=torch.long, device=device)
            pads = zeros
        sink_start = self.sink_start
        if sink_start is None or sink_start.shape[0] != batch:
            sink_start = self._zero_start = torch.zeros(batch, dtype=torch.long, device=device)
        rope = self.rotary if rope is None else rope
        if self.pre_rope and rope is None:
            raise ValueError("pre_rope keeps keys before RoPE, which needs the model's rotary (rope=)")

        # -- plan: what goes where, encoded (may raise) ----------------------------------
        n_sink = self.policy.n_to_sinks(self.sink_len, n_new)
        sink_k, sink_v, sink_rot = self.sink_k, self.sink_v, self.sink_rot
        if n_sink:
            ks, vs = keys[:, :, :n_sink], values[:, :, :n_sink]
            ks, vs = self.k.cast(ks), self.v.cast(vs)
            rot = fed_positions(self.seen, n_sink, pads, base, device)  # (B, n): the ids these keys were fed
            sink_k = ks.clone() if sink_k is None else torch.cat([sink_k, ks], dim=2)
            sink_v = vs.clone() if sink_v is None else torch.cat([sink_v, vs], dim=2)
            sink_rot = rot if sink_rot is None else torch.cat([sink_rot, rot], dim=1)
        rest_k, rest_v = keys[:, :, n_sink:], values[:, :, n_sink:]
        plans = None
        if rest_k.shape[2]:
            if self.pre_rope:  # un-rotate: R(-p) k, p the position id each key was fed with
                rot = fed_positions(self.seen + n_sink, n_new - n_sink, pads, base, device)  # (B, n)
                rest_k = rope.move(rest_k, -rot)
            ek, ev = (None, None) if encoded is None else encoded
            if halves is not None:
                plans = (self.k.plan(rest_k, halves[0], ek), self.v.plan(rest_v, halves[1], ev))
            else:
                plans = (self.k.plan(rest_k, encoded=ek), self.v.plan(rest_v, encoded=ev))

        # -- commit (nothing below raises) -----------------------------------------------
        if self.dtype is None:
            self.dtype = keys.dtype
            self._v_dim = values.shape[3]
        self.kv_shape = (batch, keys.shape[1], keys.shape[3])
        self.pads, self.sink_start = pads, sink_start
        self.sink_k, self.sink_v, self.sink_rot = sink_k, sink_v, sink_rot
        if plans is not None:
            self.k.commit(plans[0])
            self.v.commit(plans[1])
            self.frames.add_run(rest_k.shape[2], base)
        self.seen += n_new
        self.frames.serve(base, rope)

        out = self.segments(defer_sinks=defer_sinks, shared=True) if segments else self.read(self.dtype, kept=True)
        self._evict()
        return out

    # -- reads -----------------------------------------------------------------------------
    def segments(self, *, defer_sinks: bool = False, shared: bool = False):
        """A frozen view of what is stored now (valid until the next update). defer_sinks: ``(view, delta)``,
        the sinks as stored and the move they are due (:meth:`Frames.sink_delta`; a tuple of per-row tuples for rows
        without padding, else a (B, S) tensor), for the caller to apply. shared: called within a forward (an
        append), whose layers share the sinks' move angles (:meth:`Rotary.rows_angles`, dropped after its last
        layer); a read from outside computes its own and leaves nothing behind."""
        pads, starts = (None, None) if self._unpadded() else (self.pads, self.sink_start)
        first = self.seen - len(self.k)
        host = defer_sinks or shared
        delta = self.frames.sink_delta(self.sink_k, first_stream_slot=first, pads=pads, sink_start=starts, host=host)
        if defer_sinks:
            return self._view(self.sink_k), delta
        if delta is None:
            return self._view(self.sink_k)
        if isinstance(delta, tuple):  # unpadded rows within a forward: the angles its layers share
            angles = self.rotary.rows_angles(delta, self.sink_k.device)
            return self._view(self.rotary.move(self.sink_k, None, angles=angles))
        return self._view(self.rotary.move(self.sink_k, delta))

    def _view(self, k_sink: torch.Tensor | None) -> Segments:
        return Segments.of(
            k_sink=k_sink,
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
            k_runs=self.frames.run_deltas(),
            rotary=self.rotary,
            k_basis=self.k.basis,
            v_basis=self.v.basis,
            k_pos=self.frames.read_positions(self.seen - len(self.k), len(self.k), self.pads),
            rope=self.frames.rope if self.pre_rope else None,
            k_stream=None,
            v_stream=None,
        )

    def read(self, dtype: torch.dtype, kept: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token, oldest first, materialized: (B, H, stored, D), new tensors; ``kept``: a stream that keeps
        its body decoded (:meth:`~kvslim.cache.stream.Stream.keep_decoded`) hands its kept copy (valid until the next update)."""
        streams = {f"{n}_stream": s.kept_stream(dtype) for n, s in (("k", self.k), ("v", self.v)) if kept and s.keeps_decoded}
        return replace(self.segments(), **streams).materialize(dtype)

    def _unpadded(self) -> bool:
        """Whether no row is padded and every row's sinks start at slot 0, known without reading a tensor: the
        pads and sink starts are the zeros :meth:`append` made (a ragged step's rows, a batch without padding)."""
        return self.pads is not None and self.pads is self._no_pads and self.sink_start is self._zero_start

    def _evict(self) -> None:
        k = self.policy.n_to_evict(self.stored)
        if k == 0:
            return
        if self._unpadded():  # policy.sink_starts of zero pads is 0: the sinks stay where they are
            self.k.drop_front(k)
            self.v.drop_front(k)
            self.frames.drop_runs(k)
            return
        new_start = self.policy.sink_starts(self.seen, self.pads)
        shift = new_start - self.sink_start  # (B,) >= 0: rows whose sinks still slide over pads
        if self.policy.sink and bool((shift > 0).any()):
            n = self.policy.sink
            first = self.seen - len(self.k)  # slot of the stream's oldest key
            idx = (shift[:, None] + torch.arange(n, device=shift.device))[:, None, :, None]  # (B, 1, n, 1)
            for name in ("k", "v"):
                stream = getattr(self, name)
                sinks = getattr(self, f"sink_{name}")
                front = stream.front(k, sinks.dtype)  # (B, H, k, D) in the stream's basis
                if name == "k" and self.pre_rope:  # back to the rotation they were fed with, as sinks hold
                    front = self.frames.rope.move(front, self.frames.stream_rot(k, first, self.pads))
                pool = torch.cat([sinks, front], dim=2)  # (B, H, n + k, D)
                idx_full = idx.expand(-1, pool.shape[1], -1, pool.shape[3])
                setattr(self, f"sink_{name}", torch.gather(pool, 2, idx_full))
            pool_rot = torch.cat([self.sink_rot, self.frames.stream_rot(k, first, self.pads)], dim=1)  # (B, n + k)
            self.sink_rot = torch.gather(pool_rot, 1, idx[:, 0, :, 0])
        self.sink_start = new_start
        # zero pads: the new starts are zeros, and the fast path holds from here (else no zeros are kept for it)
        self._zero_start = new_start if self.pads is self._no_pads else None
        self.k.drop_front(k)
        self.v.drop_front(k)
        self.frames.drop_runs(k)

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
        for stream in (self.k, self.v):  # check both before cropping either
            if from_stream > len(stream.fp):
                stream.crop_back(from_stream)  # raises the stream's error; nothing was cropped
        self.k.crop_back(from_stream)
        self.v.crop_back(from_stream)
        self.frames.drop_runs(from_stream, from_back=True)
        rest = n - from_stream
        if rest:
            keep = self.sink_len - rest
            self.sink_k, self.sink_v = self.sink_k[:, :, :keep], self.sink_v[:, :, :keep]
            self.sink_rot = self.sink_rot[:, :keep]
        self.seen -= n

    def map_batch(self, fn) -> None:
        """Apply a batch-dim transform (beam reorder, select, repeat) to every stored tensor."""
        self.k.map_batch(fn)
        self.v.map_batch(fn)
        for name in ("sink_k", "sink_v", "sink_rot", "pads", "sink_start"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        if self.kv_shape is not None and self.pads is not None:
            self.kv_shape = (self.pads.shape[0], *self.kv_shape[1:])

    # -- save / restore --------------------------------------------------------------------
    def state(self) -> dict:
        """Everything this layer holds, as tensors (views, valid until the next update) and plain values
        (what :mod:`kvslim.promptcache` saves; nothing is decoded or re-encoded): the schema is
        :func:`kvslim.cache.layerstate.layer_state`'s."""
        return layerstate.layer_state(self)

    def restore(self, state: dict) -> None:
        """Fill this fresh layer (built with the same settings as the one saved) from a :meth:`state`.
        The shapes are checked against each other first (:func:`kvslim.cache.layerstate.check_state`:
        ValueError naming the part; nothing changed)."""
        if self.seen or self.stored:
            raise ValueError(f"restore() fills a fresh layer; this one has seen {self.seen} tokens")
        if not state["seen"]:
            return
        kv_shape, v_dim, runs = layerstate.check_state(state, max_sinks=self.policy.sink)
        # commit (the appends below only write into fresh buffers)
        self.k.restore(*state["k"])
        self.v.restore(*state["v"])
        self.sink_k, self.sink_v, self.sink_rot = state["sink_k"], state["sink_v"], state["sink_rot"]
        self.pads, self.sink_start = state["pads"], state["sink_start"]
        if self.pads is not None and not bool(self.pads.any()):  # unpadded rows keep the fast paths (_unpadded)
            zero = self.sink_start is not None and not bool(self.sink_start.any())
            self._no_pads, self._zero_start = self.pads, self.sink_start if zero else None
        self.frames.runs, self.seen, self.frames.base = runs, int(state["seen"]), int(state["base"])
        self.dtype, self.kv_shape, self._v_dim = state["dtype"], kv_shape, v_dim

    # -- accounting (kvslim.cache.layerbytes) -----------------------------------------------
    def components(self) -> dict[str, int]:
        return layerbytes.components(self)

    def nbytes(self) -> int:
        return sum(self.components().values())

    def projected_nbytes(self, tokens: int, kv: tuple[int, int, int], v_dim: int, dtype: torch.dtype) -> int:
        """The most bytes this layer holds while fed ``tokens`` tokens of rows ``kv = (B, H_kv, D)`` in ``dtype``
        (:func:`kvslim.cache.layerbytes.projected_nbytes`): an upper bound a memory budget can reserve up front."""
        return layerbytes.projected_nbytes(self, tokens, kv, v_dim, dtype)

    def live_nbytes(self) -> int:
        """Bytes of the stored tokens alone (no buffer slack)."""
        return layerbytes.live_nbytes(self)


POSITIONS = ("original", "cache")

