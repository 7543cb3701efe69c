"""Attention on the compressed store: transformers attention implementation ``"kvslim"``.

``import kvslim`` registers it. A model loaded with ``attn_implementation="kvslim"`` (or switched with
``model.set_attn_implementation("kvslim")``) then attends on a :class:`~kvslim.SlimCache`'s encoded
tokens directly during decode: K scores come from the codes with scales and zeros folded in, the
V sum weights the codes, and no fp copy of the history is ever written
(:mod:`kvslim.kernels` holds the per-format kernels). With any other cache, or for long chunks
(prefill), it behaves exactly like ``sdpa`` — it *is* sdpa then.

How the two meet: a SlimCache built with ``config=model.config`` sees the model's live attention
implementation; when it is ``"kvslim"`` and a forward carries at most :data:`FAST_MAX_QUERY` new
tokens, ``update`` returns a :class:`CompressedKV` (views of the stored segments, taken before
eviction) instead of materialized tensors, and :func:`kvslim_attention` consumes it.

Stored tokens of a layer, oldest first, as attention sees them::

    [ sinks (fp) | body (encoded) | residual (fp, the new tokens at its end) ]

K and V are split at different points (per-channel K leaves the residual a group at a time, V a
token at a time), so scores are concatenated over positions and the probabilities are split
again along V's segments. Softmax runs in fp32 over the concatenated scores (the whole row).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import kernels

NAME = "kvslim"
#: Forwards with more new tokens than this (prefill chunks) materialize and run sdpa: their cost is
#: the matmuls, not reading the cache.
FAST_MAX_QUERY = 16


class CompressedKV:
    """One layer's stored K and V as segments, handed from ``SlimCacheLayer.update`` to the attention.

    The tensors are views into the layer's buffers, valid until that layer's next update.
    """

    __slots__ = (
        "k_sink",
        "v_sink",
        "k_codec",
        "v_codec",
        "k_body",
        "v_body",
        "k_offset",
        "v_offset",
        "k_res",
        "v_res",
        "length",
        "dtype",
    )

    def __init__(self, store, dtype: torch.dtype):
        self.k_sink, self.v_sink = store.sink_k, store.sink_v
        self.k_codec, self.v_codec = store.k.codec, store.v.codec
        self.k_body = store.k.body() if store.k.n_body else None
        self.v_body = store.v.body() if store.v.n_body else None
        self.k_offset, self.v_offset = store.k.offset, store.v.offset
        self.k_res, self.v_res = store.k.fp.view(), store.v.fp.view()
        self.length = store.stored
        self.dtype = dtype

    @property
    def shape(self):
        ref = self.k_sink if self.k_sink is not None else self.k_res
        if ref is None:
            ref = next(iter(self.k_body.token.values()))
        return torch.Size((ref.shape[0], ref.shape[1], self.length, self.head_dim))

    @property
    def head_dim(self) -> int:
        for t in (self.v_sink, self.v_res):
            if t is not None:
                return t.shape[-1]
        return self.v_codec.decode(_slice_encoded(self.v_body, 0, 1), torch.float32, self.v_offset).shape[-1]

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full (B, H, T, D) tensors, as the standard path would have returned them."""
        k = [
            self.k_sink,
            None if self.k_body is None else self.k_codec.decode(self.k_body, self.dtype, self.k_offset),
            self.k_res,
        ]
        v = [
            self.v_sink,
            None if self.v_body is None else self.v_codec.decode(self.v_body, self.dtype, self.v_offset),
            self.v_res,
        ]
        return (
            torch.cat([t.to(self.dtype) for t in k if t is not None and t.shape[2]], dim=2),
            torch.cat([t.to(self.dtype) for t in v if t is not None and t.shape[2]], dim=2),
        )


def _slice_encoded(enc, start, stop):
    from .formats import Encoded

    return Encoded(token={n: t[:, :, start:stop] for n, t in enc.token.items()}, group=dict(enc.group))


def compressed_attention(
    query: torch.Tensor, kv: CompressedKV, attention_mask, scaling: float
) -> torch.Tensor:
    """Attention of ``query`` (B, Hq, q, D) over a CompressedKV; returns (B, Hq, q, D) in query's dtype.

    attention_mask: None (causal, aligned bottom-right) or bool (B or 1, 1, q, T): True = attend.
    """
    b, hq, q_len, d = query.shape
    ref = kv.k_sink if kv.k_sink is not None else kv.k_res
    h_kv = ref.shape[1] if ref is not None else next(iter(kv.k_body.token.values())).shape[1]
    rep = hq // h_kv
    # GQA without repeat_kv: each KV head serves `rep` query heads -> fold them into the query axis.
    qf = (query.float() * scaling).reshape(b, h_kv, rep * q_len, d)  # (B, Hkv, rep*q, D)

    parts = []
    if kv.k_sink is not None and kv.k_sink.shape[2]:
        parts.append(qf @ kv.k_sink.float().transpose(-1, -2))
    if kv.k_body is not None:
        parts.append(kernels.k_scores(qf, kv.k_codec, kv.k_body, kv.k_offset))
    if kv.k_res is not None and kv.k_res.shape[2]:
        parts.append(qf @ kv.k_res.float().transpose(-1, -2))
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
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with nothing to attend to (pad queries)

    n_sink = 0 if kv.v_sink is None else kv.v_sink.shape[2]
    n_body = 0 if kv.v_body is None else next(iter(kv.v_body.token.values())).shape[2]
    out = None
    if n_sink:
        out = probs[..., :n_sink] @ kv.v_sink.float()
    if n_body:
        o = kernels.v_weighted(
            probs[..., n_sink : n_sink + n_body], kv.v_codec, kv.v_body, kv.v_offset
        )
        out = o if out is None else out + o
    if kv.v_res is not None and kv.v_res.shape[2]:
        o = probs[..., n_sink + n_body :] @ kv.v_res.float()
        out = o if out is None else out + o
    return out.reshape(b, hq, q_len, d).to(query.dtype)


def kvslim_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The registered attention function: compressed attention for a CompressedKV, sdpa otherwise."""
    if not isinstance(key, CompressedKV):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout and module.training:
        raise ValueError("kvslim attention is an inference path: dropout is not supported")
    if (
        kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("sinks") is not None
    ):
        # Features the compressed path does not implement: same result through the materializing path.
        k, v = key.materialize()
        return sdpa_attention_forward(
            module, query, k, v, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = compressed_attention(query, key, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"kvslim"`` with transformers (idempotent; done by ``import kvslim``)."""
    AttentionInterface.register(NAME, kvslim_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def wants_compressed(model_config, query_len: int) -> bool:
    """Whether a layer update should hand attention a CompressedKV."""
    return (
        model_config is not None
        and getattr(model_config, "_attn_implementation", None) == NAME
        and query_len <= FAST_MAX_QUERY
    )


register()
