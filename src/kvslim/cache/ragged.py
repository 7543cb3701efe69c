"""Many SlimCaches as one batch: the transformers adapter for a ragged step (decode rows and prompt chunks).

A step of the batch engine (:mod:`kvslim.engine`) feeds new tokens to each of several rows whose caches
have different lengths, different evicted ranges and different settings (each row is its own
:class:`~kvslim.SlimCache`, built for batch 1): one token to every decoding row, and a chunk of its prompt
to each joining row (chunked prefill mixed into the decode step, as Sarathi-Serve and vLLM schedule it). Padding every row to the longest would cost what the
longest row costs, for every row, and would need one storage layout for all of them. Instead
:class:`RaggedCache` hands each attention layer a :class:`RaggedSegments`: one
:class:`~kvslim.cache.layer.Segments` view per row (None for a filler row, see below), and the ``kvslim``
attention (:mod:`kvslim.attention`) attends on each row's own codes: one kernel call a layer for every row
the rows kernels read (:mod:`kvslim.fused`: C's :func:`kvslim.kernels.cpu.attend_rows` on the CPU, the Triton
:func:`kvslim.kernels.gpu_rows.attend_rows` on CUDA; each row computed as it would be alone), row by row for
the others. The linear layers, the norms and RoPE run once over the whole batch — that is what a
batch is for: the weights are read once per step for every row.

A row that fails (its K/V not finite, or its store refuses them) in a step run with an ``errors`` dict is
dropped from the rest of that step: it is recorded in ``errors[b]`` and becomes a filler row (below) from
that layer on, so the other rows' logits are exactly those they would have had with it (every row's work
is its own: the linear layers are row-wise, attention computes each row on its own, even in one call). Its own cache has taken the token in
the layers before the failure and is not to be fed again: the caller ends that row. Without ``errors`` the
first failure raises, as a batch-1 cache would.

Packed, not padded. Every new token of the step sits in ONE sequence (batch 1, ``N`` tokens): row ``b``'s
tokens are the span ``spans[b] = (start, n)`` of it, with their own position ids, so the linear layers see
no padding at all (a 4,096-token chunk beside 15 decode tokens is a 4,111-row matrix product, not 16 rows
padded to 4,096). Attention is per row: a one-token row (a decode token) reads its cache through the rows
kernel with every other one-token row; a row of several tokens (a prompt chunk) gets what its own cache
hands a batch-1 forward of that chunk (a :class:`~kvslim.cache.segments.Segments` view up to
``FAST_MAX_QUERY`` tokens, else its stored tokens materialized) and attends causally within its span:
exactly the computation the chunk gets when its step carries nothing else (:mod:`kvslim.attention`,
``_packed_attention``).

Positions are not decided here: the loop (:func:`kvslim.generate.forward_step`) computes each row's first
position id and hands the base it subtracted (``bases``); this module passes them to each row's layers as
they are.

Filler rows. The CPU BLAS rounds a row of a matrix product differently depending on how many rows the
product has (MKL: the same for 4, 8 and 12 or more rows, differently for 1-3, 5-7, 9-11 on AVX-512; on
AVX2 the same for every count from 4 up, measured to 4,400 rows at 1 and 2 threads), so one token's
results would depend on how many tokens share its step. The loop pads a step to a multiple of 4 tokens
with filler rows (``None`` caches, one token each: token 0, position 0, attention output 0, nothing
stored), which makes every row's logits bit-identical whatever else is in the step
(tests/test_engine.py, tests/test_mixed_step.py check it). Where every weight product of the step is kvslim's own
(:mod:`kvslim.kernels.linear`: each output one dot product in a fixed order, a row's bits its own at any row
count), no filler is needed: the engine then pads to 1 (:meth:`kvslim.engine.linears.Linears.row_multiple`,
tests/test_rows_alike.py), and the Hadamard basis' products run on the same kernel
(:meth:`kvslim.cache.hadamard.Hadamard.row_invariant`).

This module knows nothing about scheduling, sampling or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..formats import Encoded
from ..kernels import cpu as cpu_kernels
from .hadamard import Hadamard
from .rotary import by_rotation
from .segments import Segments


@dataclass(frozen=True)
class RaggedSegments:
    """One layer's stored tokens for every row of a ragged step: ``rows[b]`` is row ``b``'s
    :class:`~kvslim.cache.layer.Segments` (batch 1, taken after this step's token was appended, before
    eviction), or None for a filler row. Valid until the next step."""

    rows: tuple[Segments | None, ...]
    drop: object = None  # drop(b, exc): the owner's hook that ends row b's part in this step (or None: raise)
    #: None: row b's one query is batch row b (query (B, Hq, 1, D)). Else the packed layout (module docstring):
    #: query (1, Hq, N, D), row b's queries at spans[b] = (start, n); a row of n > 1 tokens holds its cache's
    #: batch-1 answer for those n tokens: a Segments view, or the (keys, values) tensors materialized.
    spans: tuple[tuple[int, int], ...] | None = None
    #: what the step's layers share (the owner's ``angles``: rotary comparisons, move angles), or None
    shared: dict | None = None

    @property
    def shape(self) -> torch.Size:
        """(B, H_kv, longest row, D): what transformers' shape checks read."""
        real = [s for s in self.rows if s is not None]
        if not real:
            return torch.Size((len(self.rows), 0, 0, 0))
        lengths = [s.length if isinstance(s, Segments) else s[0].shape[2] for s in real]
        first = real[0]
        h, d = (first.kv_shape[1], first.kv_shape[2]) if isinstance(first, Segments) else first[0].shape[1::2]
        return torch.Size((len(self.rows), h, max(lengths), d))


def _move_sinks(rows: list, moves: list, angles: dict | None = None) -> None:
    """Move the sink keys of the rows in ``moves`` (``(b, delta)``, delta from
    :meth:`~kvslim.cache.frames.Frames.sink_delta`: a tuple of per-row tuples, or a (1, S) tensor) and put them in
    their views, one :meth:`~kvslim.cache.rotary.Rotary.move` per group of rows with the same rotary and sink shape
    instead of one per row (a step of many windowed rows spent most of its Python time there). The move is
    elementwise, so each row's keys are bit for bit what its own :meth:`~kvslim.cache.layer.SlimLayer.segments`
    gives. angles: ``{key: (cos, sin)}`` kept by the caller for the step: a row's sinks move by the same distances
    in every layer, so a group's angles are computed once a step, not once a layer (the same values)."""
    items = []
    for b, delta in moves:
        k = rows[b].k_sink
        items.append((rows[b].rotary, (tuple(k.shape), k.dtype, k.device, b, delta)))
    for rotary, members in by_rotation(items, angles):
        shapes: dict = {}
        for shape, dtype, device, b, delta in members:  # one move per sink shape, dtype and device
            shapes.setdefault((shape, dtype, device), []).append((b, delta))
        for (shape, _, device), group in shapes.items():
            if len(group) == 1 and angles is None:
                b, delta = group[0]
                rows[b] = replace(rows[b], k_sink=rotary.move(rows[b].k_sink, _delta_tensor(delta, device)))
                continue
            deltas = [d for _, d in group]
            key = None
            if angles is not None and all(isinstance(d, tuple) for d in deltas):
                key = (id(rotary), shape, str(device), tuple(deltas))  # rotaries live while the step does
            got = None if key is None else angles.get(key)
            if got is None:
                delta = torch.cat([_delta_tensor(d, device) for d in deltas])  # (G, S)
                got = rotary.move_angles(delta, device)
                if key is not None:
                    angles[key] = got
            keys = rows[group[0][0]].k_sink if len(group) == 1 else torch.cat([rows[b].k_sink for b, _ in group])
            moved = rotary.move(keys, None, angles=got)  # keys (G, H, S, D)
            for i, (b, _) in enumerate(group):
                rows[b] = _with_sinks(rows[b], moved[i : i + 1])


def _delta_tensor(delta, device) -> torch.Tensor:
    """A sink delta (a tuple of per-row tuples, or a tensor) as a (B, S) int64 tensor."""
    return delta if isinstance(delta, torch.Tensor) else torch.tensor(delta, dtype=torch.long, device=device)


def _with_sinks(view: Segments, k_sink: torch.Tensor) -> Segments:
    """``view`` with its sink keys moved: a fresh view nobody else holds yet (made by this step's
    :meth:`~kvslim.cache.layer.SlimLayer.segments`), so its field is set in place rather than through
    ``dataclasses.replace``'s full constructor (480 a step at 16 rows x 30 layers)."""
    object.__setattr__(view, "k_sink", k_sink)
    return view


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """A ragged step's keys or values (1, H_kv, N, D) as (N, H_kv, 1, D), contiguous: ``split(1)`` gives token ``i``
    laid out as a one-token row alone holds it (one copy and one split for the layer, where a slice and a copy a
    row cost ~10 us each of Python and dispatch at 16 rows x 30 layers)."""
    # (contiguous(): a model's fused projection can hand keys whose reshape is a strided view of its output)
    return x.transpose(1, 2).reshape(x.shape[2], x.shape[1], 1, x.shape[3]).contiguous()


def _halves(keys: torch.Tensor, values: torch.Tensor) -> tuple | None:
    """A ragged step's token rows (:func:`_token_rows`) cast to float16 in one C call, each split into its
    tokens: ``(keys, values)``, tuples of (1, H_kv, 1, D) float16, or None where that cannot be done or some cast
    value is not finite (a value beyond float16's range: each row then casts and checks its own tokens, and the one
    that holds it raises as a batch-1 cache would). A token's cast is the bits of casting it alone (the cast is per
    element; ``to_half_finite`` rounds as ``x.to(float16)``)."""
    if keys.dtype != torch.float32 or not keys.is_cpu:
        return None
    fast = cpu_kernels.to_half_finite(keys, values)
    if fast is None or not fast[1]:
        return None
    return tuple(h.split(1) for h in fast[0])


def _batched_flushes(stores: dict) -> dict:
    """``{b: [K encoded, V encoded]}``: the residual groups the decode rows ``stores`` (``{b: SlimLayer}``) flush in
    this step, encoded in one call per stream and codec configuration instead of one per row (a step whose rows
    all fill their residual at once, as copies of one prompt do, encoded 2 x rows x layers groups one by one), each
    row's part cut back out (None where the row encodes its own). The encoders work per token or per channel within
    a row, and the Hadamard basis is a matrix product that rounds a row alike at any row count (kvslim's kernel,
    :meth:`Hadamard.row_invariant`) or whose row count is a multiple of 4 alone and in the batch (else the row
    encodes alone; the module docstring's "Filler rows"), so a row's codes are its own encode's."""
    out: dict = {}
    for i, role in enumerate(("k", "v")):
        groups: dict = {}
        for b, store in stores.items():
            st = getattr(store, role)
            n = st.flush(1)
            key = _encode_key(st, n) if n else None
            if key is not None:
                groups.setdefault(key, []).append((b, st, n))
        for members in groups.values():
            if len(members) < 2:
                continue
            st = members[0][1]
            try:
                enc = st._encode(torch.cat([m[1].fp.view()[:, :, : m[2]] for m in members]))
            except Exception:  # noqa: BLE001 - each row encodes its own, where a failure stays with its row
                continue
            for j, (b, _, _) in enumerate(members):
                part = Encoded(
                    token={n: t[j : j + 1] for n, t in enc.token.items()},
                    group={n: t[j : j + 1] for n, t in enc.group.items()},
                )
                out.setdefault(b, [None, None])[i] = part
    return out


def _encode_key(stream, n: int):
    """What must agree for two rows' flushed tokens to be encoded in one call: the codec's class and settings
    (plain values only), the basis (a Hadamard block; no centering bias) and the tokens' shape; None: alone."""
    basis = stream.basis
    if basis is not None and (basis.bias is not None or (basis.hadamard is not None and not basis.hadamard.block)):
        return None  # a centering bias (per-row choices) or a fitted rotation (a matrix per layer): row by row
    settings = []
    for name, value in sorted(vars(stream.codec).items()):
        if name == "format":
            value = value.name
        elif not isinstance(value, (int, float, str, bool, type(None), torch.dtype)):
            return None
        settings.append((name, value))
    x = stream.fp.view()
    hadamard = None if basis is None or basis.hadamard is None else (basis.hadamard.dim, basis.hadamard.block)
    if hadamard is not None and (x.shape[1] * n * hadamard[0] // hadamard[1]) % 4 and not Hadamard.row_invariant(x):
        return None  # a row's product of 1-3, 5-7 or 9-11 rows may round otherwise than the batch's (MKL)
    return (type(stream.codec), tuple(settings), hadamard, n, tuple(x.shape), x.dtype, str(x.device))


class StepLayer(CacheLayerMixin):
    """What every layer of a many-row step (ragged rows, or a pool's pages) answers transformers alike: no mask
    (each row's attention builds its own), the longest row's length, and no reset, reorder or crop (the rows' own
    stores are the caller's). ``_what``: how its errors name it; ``_reset``: what to do instead of a reset."""

    is_compileable = False
    is_sliding = False
    _what = "a ragged step's cache"
    _reset = "reset the rows' own caches"

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # The kvslim attention ignores the mask of a many-row step (each row builds its own, kvslim.attention);
        # as many keys as queries lets transformers' builder skip it (no (N, N + longest) mask is ever built).
        from ..compat import mask_query_length

        return mask_query_length(query_length), 0

    def get_seq_length(self) -> int:
        return self._owner.longest

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        raise ValueError(f"{self._what} cannot be reset: {self._reset}")

    def reorder_cache(self, beam_idx) -> None:
        raise ValueError(f"{self._what} cannot be reordered (no beam search in the batch engine)")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(f"{self._what} cannot be cropped")


class RaggedLayer(StepLayer):
    """Layer ``layer_idx`` of every row: transformers' per-layer contract for one ragged step."""

    def __init__(self, owner: RaggedCache, layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        rows = [c for c in owner.caches if c is not None]
        self.is_sliding = rows[0].layers[layer_idx].is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """key_states, value_states: (1, H_kv, N, D), the step's tokens packed (module docstring). Appends row
        ``b``'s span to row ``b``'s cache (filler rows: nothing) and returns ``(view, view)``, a
        :class:`RaggedSegments` in the packed layout."""
        from .segments import FAST_MAX_QUERY

        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self._owner
        if key_states.shape[0] != 1 or key_states.shape[2] != owner.n_tokens:
            raise ValueError(
                f"a ragged step feeds {owner.n_tokens} tokens packed in one sequence; got keys {tuple(key_states.shape)}"
            )
        # One finiteness check for the whole step (a sync per layer, not per row); where it fails, each row
        # checks its own tokens: a bad row raises as a batch-1 cache would, or is dropped (module docstring).
        finite = bool(torch.isfinite(key_states).all() & torch.isfinite(value_states).all())
        # a step of one-token rows only (a decode step): every row's K and V laid out as alone in one copy a layer
        tokens = halves = None
        if owner.n_tokens == len(owner.spans):
            whole = (_token_rows(key_states), _token_rows(value_states))
            tokens = (whole[0].split(1), whole[1].split(1))
            # the float16 residual tokens, cast once for the layer (a row that does not keep float16 ignores its
            # own; casting the step's few tokens costs less than asking every row whether it does)
            halves = _halves(*whole) if finite else None
        flushed = _batched_flushes(
            {
                b: cache.layers[self.layer_idx].store
                for b, cache in enumerate(owner.caches)
                if cache is not None and owner.spans[b][1] == 1
            }
        )
        rows, moves = [], []
        for b, cache in enumerate(owner.caches):
            if cache is None:
                rows.append(None)
                continue
            start, n = owner.spans[b]
            store = cache.layers[self.layer_idx].store
            try:
                # the rotary of the span's last position, as a batch-1 forward of these tokens has it
                rope = cache._rope_source.at(owner.positions[b] + n - 1) if store.pre_rope else None
                # a one-token row reads its Segments (the rows kernel); a chunk gets what a batch-1 forward of it
                # gets: Segments up to FAST_MAX_QUERY tokens (if its cache attends on codes), else (K, V)
                view = n == 1 or (cache.compressed_attention and n <= FAST_MAX_QUERY)
                k_row, v_row = (
                    (key_states[:, :, start : start + n].contiguous(), value_states[:, :, start : start + n].contiguous())
                    if tokens is None
                    else (tokens[0][start], tokens[1][start])
                )  # (1, H_kv, n, D), laid out as alone
                got = store.append(  # a transaction: a row it refuses stores nothing in this layer
                    k_row,
                    v_row,
                    segments=view,
                    defer_sinks=view,
                    base=owner.bases[b],
                    rope=rope,
                    finite_checked=finite,
                    encoded=flushed.get(b),
                    halves=None if halves is None else (halves[0][start], halves[1][start]),
                )
            except Exception as e:  # noqa: BLE001 - one row's failure, kept to that row when the caller asks
                owner.drop(b, e)
                rows.append(None)
                continue
            if view:
                got, delta = got
                if delta is not None:
                    moves.append((b, delta))
            rows.append(got)
        if moves:
            _move_sinks(rows, moves, owner.angles)
        drop = owner.drop if owner.errors is not None else None
        view = RaggedSegments(tuple(rows), drop, tuple(owner.spans), owner.angles)
        return view, view


class RaggedCache(Cache):
    """The caches of the rows of one step, as one transformers ``Cache``.

    caches: one :class:`~kvslim.SlimCache` (built for batch 1, with ``config=``) or None (a filler row) per row.
    positions: each row's first position id in this step; bases: what was subtracted from each row's true
    positions to get them (:func:`kvslim.generate.position_ids`). lengths: each row's new tokens (None: one
    each; a filler row has one), packed in row order into one sequence (module docstring). errors: None (a
    row's failure raises) or a dict that receives ``{row: exception}`` for each row dropped from the step.
    """

    def __init__(
        self,
        caches,
        positions: list[int],
        bases: list[int],
        errors: dict | None = None,
        lengths: list[int] | None = None,
    ):
        from .layer_adapter import SlimCacheLayer

        real = [c for c in caches if c is not None]
        if not real:
            raise ValueError("a ragged step needs at least one row with a cache")
        n_layers = len(real[0].layers)
        for c in real:
            if len(c.layers) != n_layers or not all(isinstance(layer, SlimCacheLayer) for layer in c.layers):
                raise ValueError(
                    "every row of a ragged step must be a SlimCache of the same model whose layers all store K/V"
                )
            if c.padding_explicit and c.pads is not None:
                raise ValueError("a ragged step's rows are batch-1 caches without padding")
        self.caches = list(caches)
        self.positions = list(positions)
        self.bases = list(bases)
        lengths = [1] * len(self.caches) if lengths is None else list(lengths)
        if len(lengths) != len(self.caches) or any(not isinstance(n, int) or n < 1 for n in lengths):
            raise ValueError(f"lengths must give every row at least one new token, got {lengths}")
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        self.spans = list(zip(starts, lengths, strict=True))  # row b's tokens: [start, start + n) of the step
        self.n_tokens = sum(lengths)
        self.errors = errors
        #: what this step's layers share: the sinks' move angles and rotary comparisons (:func:`_move_sinks`)
        self.angles: dict = {}
        self.longest = max(c.get_seq_length() for c in real)
        super().__init__(layers=[RaggedLayer(self, i) for i in range(n_layers)])

    def drop(self, row: int, exc: BaseException) -> None:
        """Row ``row`` failed in this step: raise ``exc`` (no ``errors`` dict), or record it and feed the row
        as a filler row from here on. When no real row is left, the step has nothing to compute: raise."""
        if self.errors is None:
            raise exc
        self.errors.setdefault(row, exc)
        self.caches[row] = None
        if all(c is None for c in self.caches):
            raise exc
