"""The affine encoders in C (``csrc/kvslim_encode.c``): KIVI's int8/int4/int3/int2 codes with fp16 scales and
zeros, the very bytes :func:`kvslim.formats.affine.quantize_per_channel` (K) and
:func:`~kvslim.formats.affine.quantize_per_token` (V) give, without torch's per-op dispatch: a decode step's rows
leave their residuals a group at a time, a few thousand values a stream and layer, where torch's encoder spends
~0.2 ms of dispatch (a row's flush ~13 ms over the embedded model's 30 layers; a 16-row flush step ~95 ms).

:func:`affine` returns None wherever it does not apply (another codec or setting, no C library or no F16C, an
input the C side refuses) and the caller encodes with the codec itself; a non-finite input or a range fp16 cannot
hold also returns None there, and the codec's own encoder raises its error. This module knows the affine codecs'
settings and their encoded layout; nothing about caches.
"""

from __future__ import annotations

import array

import torch

from ..formats import Codec, Encoded
from ..formats.affine import _AffineKCodec, _AffineVCodec
from .clib import library, status

#: the bit widths the C encoder packs (int3: eight codes in three bytes, as formats.affine packs them)
BITS = (8, 4, 3, 2)


def applies(codec: Codec) -> bool:
    """Whether :func:`affine` can encode for ``codec``: a plain affine K or V codec (not variance-normalized,
    no clipping, no level table) of 8, 4, 3 or 2 bits with fp16 scales."""
    return (
        type(codec) in (_AffineKCodec, _AffineVCodec)
        and codec.bits in BITS
        and codec.scale_dtype == torch.float16
        and not codec.clip
        and codec.levels is None
    )


def affine(codec: Codec, x: torch.Tensor) -> Encoded | None:
    """``codec.encode(x)`` for x (B, H, T, D) floating point on the CPU, in C: the same parts, names and bytes;
    None where it does not apply (module docstring)."""
    if not applies(codec) or x.dim() != 4 or not x.is_cpu or not x.is_floating_point() or not status()[0]:
        return None
    lib = library()
    if not hasattr(lib, "kv_encode_affine"):
        return None
    b, h, t, d = x.shape
    k = codec.role == "k"
    group = codec.token_group if k else (d if codec.group_size is None else codec.group_size)
    bits = codec.bits
    if t == 0 or d == 0 or (t % group if k else d % group) or (d * bits) % 8:
        return None  # the codec's own checks say what is wrong
    xf = x.float().contiguous()  # (B, H, T, D): a float16 residual's tokens widened exactly, as the codec does
    codes = torch.empty(b, h, t, d * bits // 8, dtype=torch.uint8)
    rows = (b, h, t // group, d) if k else (b, h, t, d // group)
    scale, zero = torch.empty(rows, dtype=torch.float16), torch.empty(rows, dtype=torch.float16)
    args = array.array(
        "q", [0 if k else 1, bits, b * h, t, d, group, xf.data_ptr(), codes.data_ptr(), scale.data_ptr(), zero.data_ptr()]
    )  # held until the call returns
    if lib.kv_encode_affine(args.buffer_info()[0]) != 0:
        return None
    if k:
        return Encoded(token={"codes": codes}, group={"scale": scale, "zero": zero})
    return Encoded(token={"codes": codes, "scale": scale, "zero": zero})
