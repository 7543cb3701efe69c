"""Affine (asymmetric) integer formats of KIVI: int8, int4, int3 and int2 with real bit-packing.

KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache") quantizes
K *per channel* (statistics over a group of ``G`` tokens, one scale/zero per channel and group:
keys have a few outlier channels, and a per-channel range isolates them) and V *per token*
(statistics over a group of channels of one token). For each slice::

    scale = max(eps, (max - min) / (2^bits - 1)),  zero = min,  eps = 1e-5
    code  = clamp(round((x - zero) / scale), 0, 2^bits - 1)
    x'    = code * scale + zero

Every piece of arithmetic runs in fp32 (fp16/bf16 inputs and stored fp16 scales are cast first);
the dequantized output is returned in the caller's dtype. A Lloyd-Max codebook (:mod:`.codebook`, the
cache's ``codebook``) decodes ``T[code]`` in place of ``code``, ``T`` its level table; nothing else changes.

Deviation from KIVI's reference code, on purpose: scale and zero are *stored* in ``scale_dtype``
(fp16 by default), and the codes are computed against the stored values. Rounding them to nearest
could move ``zero`` above the slice's min (the min then clamps, with an error of up to half an fp16
ulp of min, far above ``scale / 2`` for a channel with a large mean and a small spread). So zero is
rounded toward -inf and scale toward +inf (from ``(max - zero) / levels``): the stored grid
``[zero, zero + levels * scale]`` still covers ``[min, max]``, and for every element
``|x - x'| <= scale / 2`` (+ fp32 rounding) holds against the stored scale. A constant slice whose
value the storage dtype represents (every fp16 input; bf16 in fp16's normal range) reconstructs
exactly, and ``scale >= eps`` means no division by zero. A slice whose min or range does not fit
fp16 (``|min| > 65504`` or ``(max - min) / levels > 65504``) raises ValueError; pass
``scale_dtype=torch.float32`` for such data.

Packing: the codes of one slice row (a token's ``D`` channels) are one little-endian bit stream, low
bits first: element ``d`` sits in bits ``bits * d .. bits * d + bits - 1`` of the row's bytes, so a row of
``D`` codes takes exactly ``D * bits / 8`` bytes. Byte by byte, per packing unit (``Format.pack``: codes and
bytes of one unit; ``D`` must be a multiple of its codes):

=====  ======  =====================================================================================
bits   unit    layout of unit ``j`` (codes ``c0..c7`` = elements ``per * j + 0 ..``)
=====  ======  =====================================================================================
8      1 / 1   byte ``j`` = ``c0`` (the codes as they are)
4      2 / 1   byte ``j`` = ``c0 | c1 << 4``
3      8 / 3   24-bit word ``w = c0 | c1 << 3 | ... | c7 << 21``; bytes ``3j, 3j+1, 3j+2`` =
               ``w & 0xff, (w >> 8) & 0xff, w >> 16`` (c2 and c5 straddle a byte boundary)
2      4 / 1   byte ``j`` = ``c0 | c1 << 2 | c2 << 4 | c3 << 6``
=====  ======  =====================================================================================

int3 is the one format whose codes straddle bytes; 8 codes in 3 bytes is the smallest unit that wastes
no bit (10 codes in a 32-bit word would waste 2 and tie the head dim to multiples of 10).

This module knows nothing about positions or caches: the codecs at the bottom only map
``(B, H, T, D)`` blocks to stored tensors and back (see :mod:`.base`).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch

from ..checks import check_int
from . import codebook
from .base import FORMATS, Block, Codec, Encoded, Format, check_finite, tracing
from .clip import clipped_range

EPS = 1e-5
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_bits(bits: int) -> Block:
    """The packing unit (codes, bytes) of ``bits``-bit codes (the registered affine formats')."""
    unit = PACKING.get(bits) if isinstance(bits, int) and not isinstance(bits, bool) else None
    if unit is None:
        raise ValueError(f"bits must be one of {tuple(PACKING)}, got {bits!r}")
    return unit


def _check_group(group_size, what: str) -> int:
    return check_int(what, group_size, minimum=1, expected="a positive integer")


def _unit_text(unit: Block) -> str:
    if unit.nbytes == 1:
        return f"{unit.elements} code{'s' if unit.elements > 1 else ''} per byte"
    return f"{unit.elements} codes in {unit.nbytes} bytes"


def _check_packing(bits: int, dim: int) -> None:
    unit = _check_bits(bits)
    if dim < 1 or dim % unit.elements:
        raise ValueError(
            f"int{bits} packs {_unit_text(unit)}: head dim must be a multiple of {unit.elements}, got {dim}"
        )


def packed_dim(bits: int, dim: int) -> int:
    """Bytes of one packed row of ``dim`` codes (``dim`` a multiple of the unit's codes)."""
    unit = _check_bits(bits)
    return dim // unit.elements * unit.nbytes


def _check_scale_dtype(scale_dtype: torch.dtype) -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")


def _check_float(x: torch.Tensor, what: str = "x") -> None:
    if not x.is_floating_point():
        raise ValueError(f"{what} must be a floating point tensor, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{what} must have shape (..., T, D), got shape {tuple(x.shape)}")


# --------------------------------------------------------------------------- bit packing


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: uint8 (..., D) with values < 2^bits -> uint8 (..., D * bits // 8), low bits first (the
    module docstring's table).

    D must be a multiple of the packing unit's codes (int4: 2, int3: 8, int2: 4). int8 returns the codes
    unchanged.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    _check_packing(bits, codes.shape[-1])
    return _pack(codes, bits)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bits` without validation, for codes of any integer dtype (..., D) -> uint8."""
    per, nbytes = PACKING[bits]
    if per == 1:
        return codes.to(torch.uint8)
    # Strided slices and scalar shifts: several times faster on CPU than a broadcast shift tensor.
    if nbytes == 1:
        packed = codes[..., 0::per].clone()  # (..., D/per)
        for i in range(1, per):
            packed |= codes[..., i::per] << (bits * i)
        return packed.to(torch.uint8)
    # int3: each unit of 8 codes as one 24-bit word, written as its 3 little-endian bytes
    *lead, d = codes.shape
    word = codes[..., 0::per].to(torch.int32)  # (..., D/8)
    for i in range(1, per):
        word |= codes[..., i::per].to(torch.int32) << (bits * i)
    packed = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1)  # (..., D/8, 3)
    return packed.reshape(*lead, d // per * nbytes).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """packed: uint8 (..., dim * bits // 8) -> codes uint8 (..., dim). Inverse of :func:`pack_bits`."""
    per, nbytes = _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if dim % per or packed.shape[-1] * per != dim * nbytes:
        raise ValueError(
            f"int{bits} packed codes of last dim {packed.shape[-1]} cannot hold {dim} codes "
            f"(need dim = {per} * last dim" + (f" / {nbytes})" if nbytes > 1 else ")")
        )
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    if nbytes == 1:
        codes = torch.stack([(packed >> (bits * i)) & mask for i in range(per)], dim=-1)  # (..., D/per, per)
        return codes.reshape(*packed.shape[:-1], dim)
    # int3: 3 bytes -> one 24-bit word -> 8 codes
    lead = packed.shape[:-1]
    units = packed.reshape(*lead, dim // per, nbytes).to(torch.int32)  # (..., D/8, 3)
    word = units[..., 0] | (units[..., 1] << 8) | (units[..., 2] << 16)  # (..., D/8)
    codes = torch.stack([(word >> (bits * i)) & mask for i in range(per)], dim=-1)  # (..., D/8, 8)
    return codes.reshape(*lead, dim).to(torch.uint8)


# --------------------------------------------------------------------------- scale / zero / codes


def _round_to(t: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """Cast fp32 ``t`` to ``dtype``, rounding toward ``direction`` (-inf: down, +inf: up).

    Nearest rounding is off by at most half an ulp, so one ``nextafter`` step fixes it.
    """
    r = t.to(dtype)
    if dtype == torch.float32:
        return r
    wrong = r.float() < t if direction > 0 else r.float() > t
    if (
        tracing()
    ):  # Inductor computes a half's nextafter in float32 (a float32 step, lost again): step the bits
        bits = r.view(torch.int16)  # sign-magnitude: away from zero is +1 on either side
        away = (bits >= 0) == (direction > 0)
        return torch.where(wrong, (bits + torch.where(away, 1, -1).to(torch.int16)).view(dtype), r)
    return torch.where(wrong, torch.nextafter(r, torch.full_like(r, direction)), r)


def _affine_params(
    xf: torch.Tensor, dim: int, bits: int, scale_dtype: torch.dtype, what: str, clip: bool = False, table=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored (scale, zero) in ``scale_dtype`` of the fp32 slices of ``xf`` along ``dim`` (kept as a
    size-1 dim); raises on non-finite input or on a range the storage dtype cannot hold. clip: span the range
    of least squared error (:mod:`.clip`) instead of each slice's min-max; table: the codes' levels (a Lloyd-Max
    table, :mod:`.codebook`; the range is min-max, or searched with the table's levels under clip)."""
    levels = (1 << bits) - 1
    # amin + amax: on CPU each is an order of magnitude faster than aminmax. Both propagate NaN,
    # and +-inf lands in one of them: checking the (small) scale and zero covers the input too,
    # without a full isfinite pass over it.
    mn, mx = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    lo, hi = clipped_range(xf, dim, bits, mn, mx, EPS, table) if clip else (mn, mx)
    zero = _round_to(lo + 0.0, scale_dtype, -math.inf)  # a zero min stored +0 whatever amin's sign (as kernels.encode)
    scale = _round_to(torch.clamp((hi - zero.float()) / levels, min=EPS), scale_dtype, math.inf)
    # One host sync for both checks; diagnose only on failure.
    if not tracing() and not bool(
        torch.isfinite(scale).all() & torch.isfinite(zero).all() & torch.isfinite(mx).all()
    ):
        check_finite(xf, what)
        lo, hi = float(xf.min()), float(xf.max())
        top = torch.finfo(scale_dtype).max
        raise ValueError(
            f"{what}: int{bits} {scale_dtype} scale/zero cannot store values spanning [{lo:g}, {hi:g}]: "
            f"a slice min must satisfy |min| <= {top:g} and (max - min) / {levels} <= {top:g}; "
            f"pass scale_dtype=torch.float32 for data of this range"
        )
    return scale, zero


def _codes(xf: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, levels=None) -> torch.Tensor:
    """fp32 x and broadcastable stored scale/zero -> int32 codes in [0, 2^bits - 1] (levels: the nearest of a
    level table's, :mod:`.codebook`)."""
    if levels:
        return codebook.nearest((xf - zero.float()) / scale.float(), levels)
    q = torch.round((xf - zero.float()) / scale.float())
    return q.clamp_(0, (1 << bits) - 1).to(torch.int32)  # float -> int32 is far cheaper than -> uint8 on CPU


def quantize_per_channel(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    scale_dtype: torch.dtype = torch.float16,
    clip: bool = False,
    levels: tuple[float, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI's K quantization: one scale/zero per channel for each group of ``group_size`` tokens (clip: each
    range of least squared error, :mod:`.clip`; levels: a code level table, :mod:`.codebook`).

    x: (..., T, D) floating point, T a multiple of ``group_size`` G.
    Returns (packed codes uint8 (..., T, D * bits // 8), scale (..., T // G, D), zero (..., T // G, D)),
    scale and zero in ``scale_dtype``.
    """
    _check_float(x)
    _check_bits(bits)
    _check_scale_dtype(scale_dtype)
    g = _check_group(group_size, "group_size")
    *lead, t, d = x.shape
    if t % g:
        raise ValueError(f"per-channel quantization needs T a multiple of group_size={g}, got T={t}")
    _check_packing(bits, d)
    xg = x.float().reshape(*lead, t // g, g, d)  # (..., T/G, G, D)
    scale, zero = _affine_params(
        xg, -2, bits, scale_dtype, "per-channel quantization input", clip, levels
    )  # (..., T/G, 1, D)
    codes = _codes(xg, scale, zero, bits, levels).reshape(*lead, t, d)
    return _pack(codes, bits), scale.squeeze(-2), zero.squeeze(-2)


def quantize_per_token(
    x: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    scale_dtype: torch.dtype = torch.float16,
    clip: bool = False,
    levels: tuple[float, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI's V quantization: one scale/zero per token for each group of ``group_size`` channels (clip: each
    range of least squared error, :mod:`.clip`; levels: as per channel).

    x: (..., T, D) floating point; ``group_size`` g divides D (None: g = D).
    Returns (packed codes uint8 (..., T, D * bits // 8), scale (..., T, D // g), zero (..., T, D // g)).
    """
    _check_float(x)
    _check_bits(bits)
    _check_scale_dtype(scale_dtype)
    *lead, t, d = x.shape
    g = d if group_size is None else _check_group(group_size, "group_size")
    if d % g:
        raise ValueError(f"per-token quantization needs head dim a multiple of group_size={g}, got {d}")
    _check_packing(bits, d)
    xg = x.float().reshape(*lead, t, d // g, g)  # (..., T, D/g, g)
    scale, zero = _affine_params(
        xg, -1, bits, scale_dtype, "per-token quantization input", clip, levels
    )  # (..., T, D/g, 1)
    codes = _codes(xg, scale, zero, bits, levels).reshape(*lead, t, d)
    return _pack(codes, bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_per_channel(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
    offset: int = 0,
    levels: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_per_channel` (the same ``levels``), in fp32, returned as ``dtype``.

    packed: (..., T, D * bits // 8); scale, zero: (..., n_groups, D). The T tokens start ``offset``
    tokens into the first group (0 <= offset < G, the leading tokens of that group were evicted), so
    n_groups must be ceil((offset + T) / G). Returns (..., T, D).
    """
    per, nbytes = _check_bits(bits)
    g = _check_group(group_size, "group_size")
    check_int("offset", offset, minimum=0, below=g)
    t, d = packed.shape[-2], packed.shape[-1] // nbytes * per
    n_groups = scale.shape[-2]
    if scale.shape != zero.shape or scale.shape[-1] != d or n_groups != -(-(offset + t) // g):
        raise ValueError(
            f"per-channel scale/zero of shapes {tuple(scale.shape)}/{tuple(zero.shape)} do not match "
            f"{t} tokens of dim {d} at offset {offset} with group_size {g} "
            f"(expected (..., {-(-(offset + t) // g)}, {d}) for both)"
        )
    codes = codebook.lookup(unpack_bits(packed, bits, d), levels)  # (..., T, D)
    s, z = scale.float(), zero.float()
    lead = codes.shape[:-2]
    if offset == 0 and t == n_groups * g:
        # Whole groups: broadcast the scales over each group's tokens without materializing them.
        out = codes.reshape(*lead, n_groups, g, d) * s.unsqueeze(-2) + z.unsqueeze(-2)  # (..., n, G, D)
        return out.reshape(*lead, t, d).to(dtype)
    # Partly evicted first group: spread the scales to one row per token, then cut the window out.
    rows = (*lead, n_groups * g, d)
    s = s.unsqueeze(-2).expand(*s.shape[:-1], g, d).reshape(rows)[..., offset : offset + t, :]  # (..., T, D)
    z = z.unsqueeze(-2).expand(*z.shape[:-1], g, d).reshape(rows)[..., offset : offset + t, :]
    return (codes * s + z).to(dtype)


def dequantize_per_token(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    levels: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token` (the same ``levels``), in fp32, returned as ``dtype``.

    packed: (..., T, D * bits // 8); scale, zero: (..., T, D // g) with g = ``group_size``
    (None: inferred from the scale's shape). Returns (..., T, D).
    """
    per, unit_bytes = _check_bits(bits)
    *lead, t, nbytes = packed.shape
    d = nbytes // unit_bytes * per
    n = scale.shape[-1]
    g = (d // n if n and d % n == 0 else 0) if group_size is None else _check_group(group_size, "group_size")
    if scale.shape != zero.shape or g == 0 or d % g or tuple(scale.shape[-2:]) != (t, d // g):
        raise ValueError(
            f"per-token scale/zero of shapes {tuple(scale.shape)}/{tuple(zero.shape)} do not match "
            f"{t} tokens of dim {d} with group_size {group_size}"
        )
    codes = codebook.lookup(unpack_bits(packed, bits, d), levels).reshape(*lead, t, d // g, g)  # (..., T, D/g, g)
    out = codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return out.reshape(*lead, t, d).to(dtype)


# --------------------------------------------------------------------------- codecs


class _AffineKCodec(Codec):
    """Per-channel K: ``token`` = {"codes"}, ``group`` = {"scale", "zero"} per ``group_size`` tokens. ``clip``:
    encode each range of least squared error (:mod:`.clip`; set by the cache's ``clip``)."""

    def __init__(self, fmt: Format, group_size: int, scale_dtype: torch.dtype = torch.float16):
        super().__init__(fmt, "k")
        self.token_group = _check_group(group_size, "group_size")
        self.scale_dtype = scale_dtype
        self.clip = False
        self.levels: tuple[float, ...] | None = None  # a code level table (:mod:`.codebook`), set by the cache

    def encode(self, x: torch.Tensor) -> Encoded:
        codes, scale, zero = quantize_per_channel(
            x, self.bits, self.token_group, self.scale_dtype, self.clip, self.levels
        )
        return Encoded(token={"codes": codes}, group={"scale": scale, "zero": zero})

    def decode(self, enc: Encoded, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return dequantize_per_channel(
            enc.token["codes"],
            enc.group["scale"],
            enc.group["zero"],
            self.bits,
            self.token_group,
            dtype,
            offset,
            self.levels,
        )

    def _meta_bits(self) -> int:
        return 2 * torch.finfo(self.scale_dtype).bits  # scale + zero

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + self._meta_bits() / self.token_group

    def nbytes(self, batch: int, heads: int, tokens: int, head_dim: int) -> int:
        if tokens % self.token_group:
            raise ValueError(
                f"{self.name} K stores whole groups of {self.token_group} tokens, got {tokens} tokens"
            )
        codes = tokens * head_dim * self.bits // 8
        meta = (tokens // self.token_group) * head_dim * self._meta_bits() // 8
        return batch * heads * (codes + meta)

    def check_head_dim(self, head_dim: int) -> None:
        _check_packing(self.bits, head_dim)


class _AffineVCodec(Codec):
    """Per-token V: ``token`` = {"codes", "scale", "zero"}, one scale/zero per ``group_size`` channels. ``clip``:
    as the K codec's."""

    def __init__(self, fmt: Format, group_size: int | None, scale_dtype: torch.dtype = torch.float16):
        super().__init__(fmt, "v")
        self.group_size = None if group_size is None else _check_group(group_size, "v_group_size")
        self.scale_dtype = scale_dtype
        self.clip = False
        self.levels: tuple[float, ...] | None = None  # as the K codec's

    def _group(self, head_dim: int) -> int:
        return head_dim if self.group_size is None else self.group_size

    def encode(self, x: torch.Tensor) -> Encoded:
        codes, scale, zero = quantize_per_token(
            x, self.bits, self.group_size, self.scale_dtype, self.clip, self.levels
        )
        return Encoded(token={"codes": codes, "scale": scale, "zero": zero})

    def decode(self, enc: Encoded, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        t = enc.token
        return dequantize_per_token(
            t["codes"], t["scale"], t["zero"], self.bits, self.group_size, dtype, self.levels
        )

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + 2 * torch.finfo(self.scale_dtype).bits / self._group(head_dim)

    def nbytes(self, batch: int, heads: int, tokens: int, head_dim: int) -> int:
        meta = (head_dim // self._group(head_dim)) * 2 * torch.finfo(self.scale_dtype).bits // 8
        return batch * heads * tokens * (head_dim * self.bits // 8 + meta)

    def check_head_dim(self, head_dim: int) -> None:
        _check_packing(self.bits, head_dim)
        if head_dim % self._group(head_dim):
            raise ValueError(
                f"{self.name} V group size {self.group_size} must divide head_dim, got head_dim {head_dim}"
            )


class _AffineFormat(Format):
    """KIVI: K per channel over token groups, V per token; a zero point per slice (not symmetric)."""

    symmetric = False
    family = MappingProxyType({"k": "affine_k", "v": "affine_v"})

    def codec(self, role: str, *, group_size: int = 32, v_group_size: int | None = None) -> Codec:
        if role == "k":
            return _AffineKCodec(self, group_size)
        if role == "v":
            return _AffineVCodec(self, v_group_size)
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")


class Int8Format(_AffineFormat, name="int8"):
    summary = "KIVI affine 8-bit: K per channel over token groups, V per token; fp16 scale+zero"
    bits = 8
    pack = Block(1, 1)


class Int4Format(_AffineFormat, name="int4"):
    summary = "KIVI affine 4-bit, 2 codes per byte: K per channel over token groups, V per token"
    bits = 4
    pack = Block(2, 1)


class Int3Format(_AffineFormat, name="int3"):
    summary = "KIVI affine 3-bit, 8 codes in 3 bytes: K per channel over token groups, V per token"
    bits = 3
    pack = Block(8, 3)


class Int2Format(_AffineFormat, name="int2"):
    summary = "KIVI affine 2-bit, 4 codes per byte: K per channel over token groups, V per token"
    bits = 2
    pack = Block(4, 1)


#: bits -> packing unit (codes, bytes) of the registered affine formats, widest first: read from the
#: registry (``Format.pack``), the one place the facts are written.
PACKING: dict[int, Block] = {
    f.bits: f.pack
    for f in sorted((f for f in FORMATS.values() if isinstance(f, _AffineFormat)), key=lambda f: -f.bits)
}
#: the code widths of the affine formats, widest first
BITS = tuple(PACKING)
