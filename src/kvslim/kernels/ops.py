"""kvslim's attention kernels as torch custom ops: what ``torch.compile`` traces through without a graph break.

Two ops, one per matmul of attention on the codes (:func:`kvslim.kernels.k_scores` / ``v_weighted``)::

    torch.ops.kvslim.k_scores(q, codec, token_parts, group_parts)       -> (B, H, M, T) fp32
    torch.ops.kvslim.v_weighted(p, codec, token_parts, group_parts, d)  -> (B, H, M, d) fp32

A custom op takes tensors, ints and strings only, so a codec travels as its key (:func:`codec_key`: the
format, role and group sizes, with the names of its encoded parts) and an :class:`~kvslim.formats.Encoded`
as two lists of tensors in the key's order. Inside, the call goes to the kernel registry exactly as an
eager call does (C kernels on CPU, Triton on CUDA, the torch reference otherwise): compiled and eager steps
run the same kernels on the same codes. The fake (meta) implementations only say the output's shape, which
is all the compiler needs: Inductor calls the op as an opaque kernel, once per layer per step.

Keys are deterministic (equal options, equal key), so every cache of one configuration shares one compiled
graph; the codec behind a key is the first one registered with it (they behave identically).
"""

from __future__ import annotations

import torch

from ..formats import Codec, Encoded

_CODECS: dict[str, tuple[Codec, tuple[str, ...], tuple[str, ...]]] = {}


def codec_key(codec: Codec, enc: Encoded) -> str:
    """A string naming ``codec`` and the part layout of ``enc`` (registered, for the ops to find both)."""
    options = (
        codec.name,
        codec.role,
        codec.token_group,
        getattr(codec, "group_size", None),
        str(getattr(codec, "scale_dtype", "")),
        "lloyd" if getattr(codec, "levels", None) else "",  # a level table changes what the codes mean
    )
    key = "|".join(map(str, options)) + "|" + ",".join(enc.token) + "|" + ",".join(enc.group)
    _CODECS.setdefault(key, (codec, tuple(enc.token), tuple(enc.group)))
    return key


def split(enc: Encoded) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """An Encoded as the two tensor lists the ops take (the key's order)."""
    return list(enc.token.values()), list(enc.group.values())


def _join(key: str, token_parts, group_parts) -> tuple[Codec, Encoded]:
    try:
        codec, token_names, group_names = _CODECS[key]
    except KeyError:
        raise ValueError(
            f"kvslim custom op: unknown codec key {key!r} (build it with codec_key first)"
        ) from None
    enc = Encoded(
        token=dict(zip(token_names, token_parts, strict=True)),
        group=dict(zip(group_names, group_parts, strict=True)),
    )
    return codec, enc


# Registered through torch.library.Library rather than torch.library.custom_op: one dispatch, no autograd or
# dynamo-disable wrapper around the Python kernel -- ~15 us less per call, and a compiled step makes two calls
# per layer (60 per step of a 30-layer model). Neither op has a gradient (attention on stored codes is
# inference only); CompositeExplicitAutograd serves every device (the kernel registry picks C, Triton or torch).
_LIB = torch.library.Library("kvslim", "DEF")
_LIB.define("k_scores(Tensor q, str codec, Tensor[] token_parts, Tensor[] group_parts) -> Tensor")
_LIB.define("v_weighted(Tensor p, str codec, Tensor[] token_parts, Tensor[] group_parts, int d) -> Tensor")


def _k_scores(q: torch.Tensor, codec: str, token_parts, group_parts) -> torch.Tensor:
    """q (B, H, M, D) fp32 against every encoded key: (B, H, M, T) fp32."""
    from . import k_scores as eager

    c, enc = _join(codec, token_parts, group_parts)
    return eager(q, c, enc, 0)


def _v_weighted(p: torch.Tensor, codec: str, token_parts, group_parts, d: int) -> torch.Tensor:
    """p (B, H, M, T) fp32 weights of every encoded value: (B, H, M, d) fp32."""
    from . import v_weighted as eager

    c, enc = _join(codec, token_parts, group_parts)
    return eager(p, c, enc, 0)


_LIB.impl("k_scores", _k_scores, "CompositeExplicitAutograd")
_LIB.impl("v_weighted", _v_weighted, "CompositeExplicitAutograd")


@torch.library.register_fake("kvslim::k_scores", lib=_LIB)
def _(q, codec, token_parts, group_parts):
    return q.new_empty((*q.shape[:3], token_parts[0].shape[2]), dtype=torch.float32)


@torch.library.register_fake("kvslim::v_weighted", lib=_LIB)
def _(p, codec, token_parts, group_parts, d):
    return p.new_empty((*p.shape[:3], d), dtype=torch.float32)


#: The ops (what attention calls): ``k_scores(q, key, token_parts, group_parts)``,
#: ``v_weighted(p, key, token_parts, group_parts, d)``.
k_scores = torch.ops.kvslim.k_scores.default
v_weighted = torch.ops.kvslim.v_weighted.default
