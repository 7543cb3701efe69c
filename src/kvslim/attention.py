"""Attention on the compressed store: transformers attention implementation ``"kvslim"``.

A model using ``attn_implementation="kvslim"`` (``kvslim.enable(model)`` switches a loaded one;
:func:`register` makes the name known to transformers — building a SlimCache does it too) attends
on a :class:`~kvslim.SlimCache`'s encoded tokens directly during decode: K scores come from the
codes with scales and zeros folded in, the V sum weights the codes, and no fp copy of the history is
ever written (:mod:`kvslim.kernels` holds the per-format kernels). With any other cache, or for long
chunks (prefill), it behaves exactly like ``sdpa`` — it *is* sdpa then.

How the two meet: whether a SlimCache hands attention its segments is decided once, when the cache
is built (from ``config=model.config``) or by ``cache.use_compressed_attention(...)``; then a forward
carrying at most :data:`FAST_MAX_QUERY` new tokens gets a frozen :class:`~kvslim.cache.segments.Segments`
view (taken before eviction) from ``update`` instead of materialized tensors, and
:func:`kvslim_attention` consumes it. This module never reads a layer's private fields.

Stored tokens of a layer, oldest first, as attention sees them::

    [ sinks (fp) | body (encoded) | residual (fp, the new tokens at its end) ]

K and V are split at different points (per-channel K leaves the residual a group at a time, V a
token at a time), so scores are concatenated over positions and the probabilities are split
again along V's segments. Softmax runs in fp32 over the concatenated scores (the whole row).

Stored bases (:mod:`kvslim.cache.layer`): a Hadamard-rotated K body is scored with the query rotated once
(``(H q) . (H k) = q . k``) and a rotated V body's weighted sum is rotated back once — a cost per
query, never per stored token; a mean-centered body gets ``q . bias`` added back to its scores (one
dot product per query). Pre-RoPE keys are rotated on read: the residual's (full precision, at most
``residual + group_size`` tokens) directly, the body's inside the score kernel
(:class:`kvslim.kernels.KeyTransform`), which reads the codes as stored.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import kernels
from .cache.basis import CENTERED
from .cache.segments import FAST_MAX_QUERY as FAST_MAX_QUERY  # re-exported: the contract with the cache
from .cache.segments import Segments
from .cache.static import StaticSegments
from .fused import fusable as _fusable  # noqa: F401 - the tests' name for the one fusability test
from .fused import fused_decode as _fused_decode
from .fused import fused_row as _fused_row  # noqa: F401 - the tests' name
from .fused import hblocks as _hblocks  # noqa: F401 - the tests' name
from .fused import pre_rope_transform
from .fused import ragged_fused as _ragged_fused
from .kernels import ops

NAME = "kvslim"
#: FAST_MAX_QUERY (imported above, :mod:`kvslim.cache.segments`): forwards with more new tokens than this
#: (prefill chunks) are handed materialized K/V and run sdpa: their cost is the matmuls, not reading the cache.
#: A decode step (one new token a row, no mask) runs its attention as one kernel call where it can
#: (:mod:`kvslim.fused`: C on the CPU, the Triton rows program on CUDA); False computes it op by op (the
#: reference the fused call is tested against).
FUSED_DECODE = True


def compressed_attention(query: torch.Tensor, kv: Segments, attention_mask, scaling: float) -> torch.Tensor:
    """Attention of ``query`` (B, Hq, q, D) over a layer's :class:`~kvslim.cache.segments.Segments`; returns
    (B, Hq, q, D) in query's dtype.

    attention_mask: None (causal, aligned bottom-right) or bool (B or 1, 1, q, T): True = attend.
    """
    b, hq, q_len, d = query.shape
    h_kv = kv.kv_shape[1]
    rep = hq // h_kv
    # GQA without repeat_kv: each KV head serves `rep` query heads -> fold them into the query axis.
    qf = (query.float() * scaling).reshape(b, h_kv, rep * q_len, d)  # (B, Hkv, rep*q, D)
    if q_len == 1 and attention_mask is None and FUSED_DECODE:
        out = _fused_decode(qf, kv)
        if out is not None:
            return out.reshape(b, hq, q_len, -1).to(query.dtype)

    parts = []
    if kv.k_sink is not None and kv.k_sink.shape[2]:
        parts.append(qf @ kv.k_sink.float().transpose(-1, -2))
    parts += _stream_scores(qf, kv)
    scores = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # (B, Hkv, rep*q, T)
    t = scores.shape[-1]

    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"kvslim attention expects a boolean mask, got {attention_mask.dtype}")
        m = attention_mask[..., -t:]  # (B|1, 1, q, T)
        m = m.unsqueeze(2).expand(m.shape[0], 1, rep, q_len, t).reshape(m.shape[0], 1, rep * q_len, t)
        scores = scores.masked_fill(~m, float("-inf"))
    elif q_len > 1:
        causal = torch.ones(q_len, t, dtype=torch.bool, device=scores.device).tril(t - q_len)
        scores = scores.masked_fill(~causal.repeat(rep, 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if attention_mask is not None:
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with nothing to attend to (pad queries)

    n_sink = 0 if kv.v_sink is None else kv.v_sink.shape[2]
    n_body = kv.n_body("v")
    out = None
    if n_sink:
        out = probs[..., :n_sink] @ kv.v_sink.float()
    if n_body:
        pb = probs[..., n_sink : n_sink + n_body]
        o = _body_sum(pb, kv.v_basis, kernels.v_weighted(pb, kv.v_codec, kv.v_body, kv.v_offset))
        out = o if out is None else out + o
    if kv.v_res is not None and kv.v_res.shape[2]:
        o = probs[..., n_sink + n_body :] @ kv.v_res.float()
        out = o if out is None else out + o
    return out.reshape(b, hq, q_len, -1).to(query.dtype)  # V may be narrower than K (MLA)


def _stream_scores(qf: torch.Tensor, kv: Segments) -> list[torch.Tensor]:
    """Scores (B, Hkv, M, n) of qf (B, Hkv, M, D) against the K stream (body, then residual), in pieces.

    A run of keys ``delta`` positions off the current frame (``kv.k_runs``, after a re-base of the
    position ids) is scored with the query moved by ``-delta`` instead: ``R(-d)q . k = q . R(d)k``, so
    the codes are read as stored. A body in another basis (``kv.k_basis``) is scored with the query in
    that basis (``H q``) plus ``H q . bias``: exactly the scores of the decoded keys. A pre-RoPE stream
    (``kv.k_pos``) has no runs: the kernel rotates each decoded body key to its position, the residual
    is rotated directly.
    """
    n_body = kv.n_body("k")
    n_res = 0 if kv.k_res is None else kv.k_res.shape[2]
    parts = []
    if kv.k_pos is not None:
        if n_body:
            tr = pre_rope_transform(kv, kv.k_pos[:, :n_body], kv.k_body, qf.device)
            parts.append(kernels.k_scores(qf, kv.k_codec, kv.k_body, kv.k_offset, tr))
        if n_res:
            res = kv.rope.move(kv.k_res.float(), kv.k_pos[:, n_body:])
            parts.append(qf @ res.transpose(-1, -2))
        return parts
    runs = kv.k_runs or ((n_body + n_res, 0),)
    start = 0
    for n, delta in runs:
        q = qf if delta == 0 else kv.rotary.move(qf, -delta)
        lo, hi = start, start + n
        if lo < n_body:
            enc, offset = (kv.k_body, kv.k_offset)
            if (lo, min(hi, n_body)) != (0, n_body):
                enc, offset = kv.k_body.narrow(lo, min(hi, n_body), kv.k_offset, kv.k_codec.token_group)
            parts.append(
                _body_scores(
                    q, kv.k_basis, enc, lambda x, e=enc, o=offset: kernels.k_scores(x, kv.k_codec, e, o)
                )
            )
        if hi > n_body and n_res:
            res = kv.k_res[:, :, max(lo, n_body) - n_body : hi - n_body]
            parts.append(q @ res.float().transpose(-1, -2))
        start = hi
    return parts


def _body_scores(q: torch.Tensor, basis, enc, score) -> torch.Tensor:
    """q (B, Hkv, M, D) fp32 against encoded keys ``enc`` stored in ``basis`` (not pre-RoPE): (B, Hkv, M, n).
    ``score(x)``: x's scores against the codes as stored (a kernel call)."""
    if basis is None:
        return score(q)
    qb = basis.hadamard.apply(q) if basis.hadamard is not None else q  # H symmetric: (H q) . y = q . (H y)
    scores = score(qb)
    if basis.bias is not None:  # + (H q) . bias: the centered keys' zero point, added back
        b = basis.bias.to(device=q.device, dtype=torch.float32)  # (Hkv, D)
        qbias = torch.einsum("bhmd,hd->bhm", qb, b)[..., None]  # (B, Hkv, M, 1)
        flags = enc.token.get(CENTERED)  # (B, Hkv, n, 1): which tokens were stored centered
        scores = scores + (qbias if flags is None else qbias * flags[..., 0].to(torch.float32)[:, :, None, :])
    return scores


def _body_sum(p: torch.Tensor, basis, weighted: torch.Tensor) -> torch.Tensor:
    """``weighted`` (B, Hkv, M, Dv): the probabilities ``p`` (B, Hkv, M, n) times the encoded values as stored
    (a kernel call), back in the model's basis (once per query, never per token): the V twin of _body_scores."""
    return weighted if basis is None else basis.decode_sum(weighted, p.sum(-1, keepdim=True))


def static_attention(query: torch.Tensor, kv: StaticSegments, scaling: float) -> torch.Tensor:
    """Attention of ``query`` (B, Hq, q, D) over a static store's slots (:mod:`kvslim.cache.static`): every slot
    scored, the empty and evicted ones masked; the encoded ones through the custom ops
    (:mod:`kvslim.kernels.ops`), so ``torch.compile`` traces the whole step. Returns (B, Hq, q, Dv).

    One new token per row (the decode step): it sees every live slot (itself included), no mask needed.
    """
    b, hq, q_len, d = query.shape
    h_kv = kv.kv_shape[1]
    rep = hq // h_kv
    qf = (query.float() * scaling).reshape(b, h_kv, rep * q_len, d)  # (B, Hkv, rep*q, D)
    n_fp = kv.k_fp.shape[2]
    neg = float("-inf")
    parts = [
        (qf @ kv.keys_fp().transpose(-1, -2)).masked_fill(~kv.live(kv.fp_pos), neg)
    ]  # (B, Hkv, M, S+F)
    if kv.k_body is not None:
        token, group = ops.split(kv.k_body)
        body = _body_scores(qf, kv.k_basis, kv.k_body, lambda x: ops.k_scores(x, kv.k_key, token, group))
        parts.append(body.masked_fill(~kv.live(kv.body_pos), neg))  # (B, Hkv, M, C)
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out = probs[..., :n_fp] @ kv.v_fp.float()
    if kv.v_body is not None:
        pb = probs[..., n_fp:]
        token, group = ops.split(kv.v_body)
        out = out + _body_sum(pb, kv.v_basis, ops.v_weighted(pb, kv.v_key, token, group, kv.v_dim))
    return out.reshape(b, hq, q_len, -1).to(query.dtype)


def kvslim_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The registered attention function: compressed attention for Segments, row by row for a ragged step's
    :class:`~kvslim.cache.ragged.RaggedSegments`, the pool's calls for a paged step's
    :class:`~kvslim.cache.paged_adapter.PagedKV`, sdpa otherwise."""
    from .cache.paged_adapter import PagedKV
    from .cache.ragged import RaggedSegments

    if isinstance(key, (StaticSegments, PagedKV)):
        paged = isinstance(key, PagedKV)
        if (
            kwargs.get("softcap") is not None
            or kwargs.get("sinks") is not None
            or kwargs.get("position_bias") is not None
            or (paged and kwargs.get("sliding_window") is not None)
            or (dropout and module.training)
        ):
            raise ValueError(
                f"{'a paged step' if paged else 'a static SlimCache'} serves plain attention only (no softcap, "
                f"attention sinks, position bias{', sliding window' if paged else ''} or dropout)"
            )
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        if paged:
            return key.attend(query, scaling), None
        return static_attention(query, key, scaling).transpose(1, 2).contiguous(), None
    if isinstance(key, RaggedSegments):
        return _ragged_attention(module, query, key, dropout, scaling, kwargs)
    if not isinstance(key, Segments):
        return sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    return _segments_attention(module, query, key, attention_mask, dropout, scaling, kwargs)


def _ragged_attention(module, query, key, dropout, scaling, kwargs):
    """query (B, Hq, 1, D): row ``b`` attends to every token row ``b`` stores (no mask: a decode token sees its
    whole row), each on its own Segments; a filler row's output is 0. Returns (B, 1, Hq, Dv).

    The rows the fused call reads (:func:`kvslim.fused.fusable`, the test a row alone meets) go in one call for the
    whole layer (:func:`kvslim.fused.ragged_fused`: C's rows kernel on the CPU, the Triton rows program on CUDA);
    the others, and any the call leaves (arguments that do not fit, a failed call), run one by one as a row alone
    does. A row that raises there is dropped (``key.drop``) when the step asks for
    that, and its output is 0.

    A packed step (``key.spans`` set: decode tokens and prompt chunks in one sequence) goes to
    :func:`_packed_attention`."""
    if key.spans is not None:
        return _packed_attention(module, query, key, dropout, scaling, kwargs)
    real = [b for b, seg in enumerate(key.rows) if seg is not None]
    out, rest = None, real
    fusing = FUSED_DECODE and query.shape[2] == 1 and not (dropout and module.training)
    if fusing and not _unfused_kwargs(kwargs):
        out, rest = _ragged_fused(query, key, scaling, real)
    if out is None:
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], _ragged_v_dim(key))
    for b in rest:
        try:
            o, _ = _segments_attention(module, query[b : b + 1], key.rows[b], None, dropout, scaling, kwargs)
        except Exception as e:  # noqa: BLE001 - with the step's errors dict, this row alone leaves the step
            if key.drop is None:
                raise
            key.drop(b, e)
            out[b] = 0
            continue
        out[b] = o[0]
    return out, None


def _packed_attention(module, query, key, dropout, scaling, kwargs):
    """A packed step's attention (:mod:`kvslim.cache.ragged`, "Packed, not padded"): query (1, Hq, N, D), row
    ``b``'s queries at ``key.spans[b]``. Returns (1, N, Hq, Dv); a filler's or a dropped row's output is 0.

    The one-token rows (decode tokens) are gathered into a (R, Hq, 1, D) batch and go through
    :func:`_ragged_attention` as a decode step does (the rows kernel: each row bit for bit what it gets alone).
    A row of several tokens (a prompt chunk) attends on its own: its queries against what its cache handed
    (Segments, or its stored K/V materialized), causal within the chunk (:func:`_chunk_mask`) — the arithmetic
    of that chunk whatever else shares the step, so a prompt read in a mixed step gives the bits it gives in a
    step of its own. A row that raises is dropped (``key.drop``) when the step asks for that."""
    n_all = query.shape[2]
    out = None
    single = [b for b, (_, n) in enumerate(key.spans) if n == 1 and key.rows[b] is not None]
    if len(single) == n_all:  # every token a real row's decode token, in order: views, no gather or scatter
        q1 = query[0].transpose(0, 1).unsqueeze(2)  # (N, Hq, 1, D)
        o, _ = _ragged_attention(module, q1, type(key)(key.rows, key.drop, shared=key.shared), dropout, scaling, kwargs)
        return o.reshape(1, n_all, o.shape[2], o.shape[3]), None
    if single:
        idx = torch.tensor([key.spans[b][0] for b in single], device=query.device)
        q1 = query[0].index_select(1, idx).transpose(0, 1).unsqueeze(2)  # (R, Hq, 1, D)
        drop = None if key.drop is None else (lambda i, e: key.drop(single[i], e))
        sub = type(key)(tuple(key.rows[b] for b in single), drop, shared=key.shared)
        o, _ = _ragged_attention(module, q1, sub, dropout, scaling, kwargs)  # (R, 1, Hq, Dv)
        out = o.new_zeros(1, n_all, o.shape[2], o.shape[3])
        out[0, idx] = o[:, 0]
    for b, (start, n) in enumerate(key.spans):
        view = key.rows[b]
        if n == 1 or view is None:
            continue
        try:
            o = _chunk_attention(module, query[:, :, start : start + n], view, dropout, scaling, kwargs)
        except Exception as e:  # noqa: BLE001 - with the step's errors dict, this row alone leaves the step
            if key.drop is None:
                raise
            key.drop(b, e)
            continue
        if out is None:
            out = o.new_zeros(1, n_all, o.shape[2], o.shape[3])
        out[:, start : start + n] = o
    if out is None:  # every row was dropped (the owner raises before this) or none was real
        out = query.new_zeros(1, n_all, query.shape[1], query.shape[3])
    return out, None


def _chunk_attention(module, query, view, dropout, scaling, kwargs) -> torch.Tensor:
    """A prompt chunk's attention: query (1, Hq, n, D) over ``view`` — its cache's :class:`Segments` or its
    stored ``(keys, values)`` (1, H_kv, T, D), the chunk's own n tokens last — with the mask transformers builds
    for that chunk fed alone (:func:`_chunk_mask`). Returns (1, n, Hq, Dv)."""
    query = query.contiguous()  # laid out as a batch-1 forward of the chunk lays it out
    n = query.shape[2]
    window = kwargs.get("sliding_window")
    if isinstance(view, Segments):
        mask = _chunk_mask(n, view.length, window, query.device)
        return _segments_attention(module, query, view, mask, dropout, scaling, kwargs)[0]
    keys, values = view
    mask = _chunk_mask(n, keys.shape[2], window, query.device)
    return sdpa(module, query, keys, values, mask, dropout, scaling, kwargs)[0]


def sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except that a masked forward of several queries over grouped KV heads asks sdpa
    for GQA (``enable_gqa``) instead of copying each KV head ``rep`` times (``repeat_kv``): what transformers does
    without a mask. The same bits (each query head reads its KV head; checked over dtypes, masks and shapes in
    tests/test_attention.py), and a long prompt chunk no longer writes and reads ``rep`` copies of every stored
    token (docs/performance.md, "A joining prompt's chunks")."""
    rep = getattr(module, "num_key_value_groups", 1)
    if (
        rep > 1
        and attention_mask is not None
        and query.shape[2] > 1
        and key.shape[-1] == value.shape[-1] <= 256
        and query.device.type == "cpu"
        and not any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "sinks"))
        and not kwargs.get("output_attentions", False)
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _chunk_mask(n: int, t: int, window: int | None, device) -> torch.Tensor | None:
    """The mask of ``n`` new tokens over ``t`` stored ones (the new ones last), as transformers' ``sdpa_mask``
    builds it for a batch-1 forward of those tokens: None where it skips the mask (as many keys as queries, and
    no sliding window reached: sdpa's own causal flag), else bool (1, 1, n, t), True = attend: key ``j`` is
    visible to query ``i`` when ``j <= t - n + i`` and, with a sliding window, ``j > t - n + i - window``."""
    if n == t and not (window is not None and t >= window):
        return None
    i = torch.arange(n, device=device)[:, None]  # (n, 1)
    j = torch.arange(t, device=device)[None]  # (1, t)
    mask = j <= t - n + i
    if window is not None:
        mask &= j > t - n + i - window
    return mask[None, None]  # (1, 1, n, t)


def _unfused_kwargs(kwargs) -> bool:
    """Features :func:`_segments_attention` hands to the materializing path, never to the compressed one."""
    return any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "sinks"))


def _ragged_v_dim(key, real=None) -> int:
    """V's width in a ragged step (the first real row's, or ``real``'s)."""
    real = real if real is not None else next(s for s in key.rows if s is not None)
    return real.v_res.shape[-1] if real.v_res is not None else real.v_sink.shape[-1]


def _segments_attention(module, query, key: Segments, attention_mask, dropout, scaling, kwargs):
    """Attention of ``query`` (B, Hq, q, D) over one cache's Segments; returns ((B, q, Hq, Dv), None)."""
    if dropout and module.training:
        raise ValueError("kvslim attention is an inference path: dropout is not supported")
    if (
        kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("sinks") is not None
        or (key.k_body is None and key.v_body is None)
    ):
        # Features the compressed path does not implement: same result through the materializing path.
        # And nothing encoded (a lossless cache, or a lossy one whose tokens are all still at full precision):
        # no codes to read, so sdpa on the stored tokens -- bit for bit what the plain cache computes.
        k, v = key.materialize()
        return sdpa(module, query, k, v, attention_mask, dropout, scaling, kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = compressed_attention(query, key, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register() -> None:
    """Register ``"kvslim"`` with transformers' attention and mask interfaces (idempotent).

    Called by :class:`~kvslim.SlimCache`, :func:`kvslim.enable` and the CLI; ``import kvslim`` alone
    does not (it imports neither torch nor transformers). Call ``kvslim.register()`` before
    ``from_pretrained(..., attn_implementation="kvslim")`` if no SlimCache was built yet.
    """
    global _registered
    if _registered:
        return
    AttentionInterface.register(NAME, kvslim_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


def uses_kvslim_attention(model_config) -> bool:
    """Whether a model config selects the ``"kvslim"`` attention (transformers keeps the choice on the
    config: ``_attn_implementation`` is where ``set_attn_implementation`` and ``from_pretrained`` put it)."""
    return model_config is not None and getattr(model_config, "_attn_implementation", None) == NAME
