"""Variance normalization for the affine formats: balance a group's variance along both axes, then round.

KVarN (a vLLM fork, ported to llama.cpp and mlx-swift-lm) normalizes each 128-token tile along both axes
(per-channel and per-token scale factors, no calibration) after a Hadamard rotation and before
round-to-nearest. This module derives its own scheme for KIVI's layout (:mod:`.affine`), per encoded group of
``G`` tokens (the cache's token group, 32 by default, not KVarN's 128):

1. **Balance** (:func:`balance`): a few Sinkhorn-style alternating passes find a per-token factor ``r_t`` and
   a per-channel factor ``c_d`` with ``u[t, d] / (r_t c_d)`` of unit RMS along both axes (``u`` the group,
   for K centered per channel first). :data:`PASSES` passes, channels first.
2. **Keep only the factor the quantizer cannot absorb.** An affine slice's own scale absorbs a factor
   constant along the slice, exactly (range quantization is scale-equivariant). K slices run over the tokens of
   one channel, so ``c_d`` is absorbed and only ``r_t`` is stored; V slices run over the channels of one token,
   so ``r_t`` is absorbed and only ``c_d`` is stored. The Sinkhorn passes still matter: they decide the stored
   factor with the other axis balanced (a K token's factor is not dominated by an outlier channel).
3. **Round** with the stored factor, so the bound below holds against what is stored:

   - K (per channel, group ``g`` of ``G`` tokens): ``x[t, d] = zero[g, d] + r_t * scale[g, d] * (code - L/2)``,
     ``L = 2^bits - 1``. The zero is *outside* the token factor: a channel's mean is not multiplied by
     ``1 / r_t`` (a constant channel stays exact), and the grid is symmetric around ``zero`` =
     the channel's mid-range, so with every ``r_t = 1`` it is exactly KIVI's grid ``[min, max]``.
     ``scale = max_t |x - zero| / r_t / (L/2)``, rounded up to ``scale_dtype`` (every code in range).
   - V (per token, channel groups of ``g``): ``x[t, d] = c_d * (code * scale[t] + zero[t])``, KIVI's
     per-token quantization of ``x / c_d``. V keeps its channel factors per group of ``G`` tokens, so a
     variance-normalized V codec has ``token_group = G`` (its factors are a ``group`` part).

   Error bound, per element: ``|x - x'| <= r_t * scale / 2`` (K), ``<= c_d * scale / 2`` (V), plus fp32
   rounding.

Deviations from KVarN, on purpose: groups of ``G`` tokens (the unit tokens leave the residual in) rather than
128-token tiles; one factor per axis stored, not two (the other is absorbed, above); the factors are stored
as one byte each, a quarter-octave exponent (:func:`factor_of`: ``2^((e - 128) / 4)``, exact in every
backend: a 4-entry fp32 table times a power of two), since their precision only moves the balance, never
the bound; K keeps a per-channel zero outside the token factor (KVarN's K is rotated and centered).

Stored parts (:class:`~kvslim.formats.base.Encoded`), on top of the affine ones: K ``token["rnorm"]`` uint8
(B, H, T, 1); V ``group["cnorm"]`` uint8 (B, H, T / G, D). Cost: 8 / D bits per element for K (0.125 at
D = 64), 8 / G for V (0.25 at G = 32). Both are counted by ``nbytes`` and ``bits_per_element``.

This module knows nothing about positions or caches.
"""

from __future__ import annotations

import math

import torch

from ..checks import check_int
from . import clip, codebook
from .affine import (
    EPS,
    _affine_params,
    _AffineKCodec,
    _AffineVCodec,
    _check_packing,
    _check_scale_dtype,
    _codes,
    _pack,
    _round_to,
    unpack_bits,
)
from .base import Codec, Encoded, check_finite, make_codec, tracing
from .layout import expect, rows_contiguous

#: Sinkhorn-style passes (one pass: channel factors, then token factors).
PASSES = 3
#: A stored factor is ``2^((e - FACTOR_BIAS) / FACTOR_STEPS)`` for its byte ``e``.
FACTOR_BIAS = 128
FACTOR_STEPS = 4
#: ``2^(i / 4)``, i = 0..3, in fp32 (the C and Triton kernels hold the same four floats).
FACTOR_TABLE = tuple(
    float(torch.tensor(2.0 ** (i / FACTOR_STEPS), dtype=torch.float32)) for i in range(FACTOR_STEPS)
)
#: The balance never spreads the factors of one group over more than this ratio (a token or channel of zero
#: variance would otherwise get an unbounded factor).
MAX_SPREAD = 2.0**8
#: Candidate strengths: each group stores the factors ``f ** alpha`` of the alpha whose reconstruction has the least
#: squared error (alpha 0 is the plain affine grid, so a group is never worse than without normalization).
STRENGTHS = (0.0, 0.5, 1.0)


def factor_of(e: torch.Tensor) -> torch.Tensor:
    """uint8 exponent codes -> fp32 factors ``2^((e - 128) / 4)`` (in 2^-32 .. 2^31.75), exactly: the fp32
    table entry of ``(e - 128) mod 4`` times the power of two ``2^floor((e - 128) / 4)`` built from its bits."""
    k = e.to(torch.int32) - FACTOR_BIAS
    q = torch.div(k, FACTOR_STEPS, rounding_mode="floor")
    frac = torch.tensor(FACTOR_TABLE, dtype=torch.float32, device=e.device)[k - q * FACTOR_STEPS]
    pow2 = ((q + 127) << 23).view(torch.float32)
    return frac * pow2


def factor_code(f: torch.Tensor) -> torch.Tensor:
    """Positive fp32 factors -> the nearest uint8 exponent code (clamped to the storable range)."""
    e = torch.round(torch.log2(f.clamp_min(2.0**-40)) * FACTOR_STEPS) + FACTOR_BIAS
    return e.clamp_(0, 255).to(torch.uint8)


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.square().mean(dim, keepdim=True).sqrt()


def _bounded(f: torch.Tensor, dim: int) -> torch.Tensor:
    """Factors along ``dim`` normalized to geometric mean 1, clamped to within MAX_SPREAD of the largest."""
    top = f.amax(dim, keepdim=True)
    f = torch.maximum(f, top / MAX_SPREAD).clamp_min(1e-30)
    return f / f.log().mean(dim, keepdim=True).exp()


def balance(u: torch.Tensor, passes: int = PASSES) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-axis variance balance of groups ``u`` (..., G, D) fp32: token factors r (..., G, 1) and channel
    factors c (..., 1, D), each normalized to geometric mean 1 along its axis, with ``u / (r c)`` of roughly unit
    RMS along both axes (Sinkhorn-style: channels, then tokens, ``passes`` times)."""
    r = torch.ones_like(u[..., :1])  # (..., G, 1)
    c = torch.ones_like(u[..., :1, :])  # (..., 1, D)
    for _ in range(passes):
        c = _bounded(_rms(u / r, -2), -1)
        r = _bounded(_rms(u / c, -1), -2)
    return r, c


# --------------------------------------------------------------------------- K: per channel, token factors


def _select(errs: list[torch.Tensor], cands: list[tuple]) -> tuple:
    """Per group (dim -3 of (..., n, G, D)), the candidate of least squared error: its parts, picked elementwise."""
    err = torch.stack(errs)  # (A, ..., n, 1, 1)
    best = err.argmin(0)  # (..., n, 1, 1)
    out = []
    for i in range(len(cands[0])):
        parts = torch.stack([c[i] for c in cands])  # (A, ..., n, x, y)
        idx = best.expand(*best.shape[:-2], *parts.shape[-2:]).unsqueeze(0)
        out.append(parts.gather(0, idx).squeeze(0))
    return tuple(out)


def _k_candidate(xg, rcode, bits, scale_dtype, mn, mx):
    """Codes (int32), scale, zero and the squared error per group of one K candidate (token factor codes)."""
    half = ((1 << bits) - 1) / 2
    rf = factor_of(rcode)
    zero = ((mn + mx) / 2).to(scale_dtype)
    y = (xg - zero.float()) / rf  # (..., n, G, D)
    scale = _round_to(torch.clamp(y.abs().amax(-2, keepdim=True) / half, min=EPS), scale_dtype, math.inf)
    q = torch.round(y / scale.float() + half).clamp_(0, 2 * half)
    err = (zero.float() + rf * ((q - half) * scale.float()) - xg).square().sum((-2, -1), keepdim=True)
    return (q, rcode, scale, zero), err


def quantize_k(
    x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Variance-normalized per-channel K (module docstring). x: (..., T, D), T a multiple of G.

    Returns (packed codes uint8 (..., T, D * bits / 8), token factor codes uint8 (..., T, 1),
    scale (..., T / G, D), zero (..., T / G, D)) in ``scale_dtype``."""
    _check_scale_dtype(scale_dtype)
    g = check_int("group_size", group_size, minimum=1, expected="a positive integer")
    *lead, t, d = x.shape
    if t % g:
        raise ValueError(f"per-channel quantization needs T a multiple of group_size={g}, got T={t}")
    _check_packing(bits, d)
    xg = x.float().reshape(*lead, t // g, g, d)  # (..., T/G, G, D)
    mn, mx = xg.amin(-2, keepdim=True), xg.amax(-2, keepdim=True)  # (..., T/G, 1, D)
    if not tracing() and not bool(torch.isfinite(mn).all() & torch.isfinite(mx).all()):
        check_finite(xg, "per-channel quantization input")
    r, _ = balance(xg - xg.mean(-2, keepdim=True))
    cands, errs = [], []
    for alpha in STRENGTHS:
        cand, err = _k_candidate(xg, factor_code(r**alpha), bits, scale_dtype, mn, mx)
        cands.append(cand)
        errs.append(err)
    q, rcode, scale, zero = _select(errs, cands) if len(cands) > 1 else cands[0]
    if not tracing() and not bool(torch.isfinite(scale).all() & torch.isfinite(zero).all()):
        top = torch.finfo(scale_dtype).max
        raise ValueError(
            f"per-channel quantization input: int{bits} {scale_dtype} scale/zero cannot store values spanning "
            f"[{float(mn.min()):g}, {float(mx.max()):g}] with variance normalization (|mid-range| and the "
            f"normalized half-range / {((1 << bits) - 1) / 2:g} must be <= {top:g}); pass scale_dtype=torch.float32"
        )
    codes = _pack(q.to(torch.int32).reshape(*lead, t, d), bits)
    return codes, rcode.reshape(*lead, t, 1), scale.squeeze(-2), zero.squeeze(-2)


def dequantize_k(
    packed: torch.Tensor,
    rnorm: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
    offset: int = 0,
) -> torch.Tensor:
    """Inverse of :func:`quantize_k`: packed (..., T, D * bits / 8), rnorm (..., T, 1), scale/zero
    (..., n_groups, D) with the T tokens starting ``offset`` tokens into the first group. Returns (..., T, D)."""
    g = check_int("group_size", group_size, minimum=1, expected="a positive integer")
    check_int("offset", offset, minimum=0, below=g)
    t = packed.shape[-2]
    d = scale.shape[-1]
    n = scale.shape[-2]
    if scale.shape != zero.shape or n != -(-(offset + t) // g) or tuple(rnorm.shape[-2:]) != (t, 1):
        raise ValueError(
            f"variance-normalized K parts rnorm {tuple(rnorm.shape)}, scale {tuple(scale.shape)}, zero "
            f"{tuple(zero.shape)} do not match {t} tokens at offset {offset} with group_size {g}"
        )
    half = ((1 << bits) - 1) / 2
    codes = unpack_bits(packed, bits, d).float() - half  # (..., T, D)
    rows = (*scale.shape[:-2], n * g, d)
    s = scale.float().unsqueeze(-2).expand(*scale.shape[:-1], g, d).reshape(rows)[..., offset : offset + t, :]
    z = zero.float().unsqueeze(-2).expand(*zero.shape[:-1], g, d).reshape(rows)[..., offset : offset + t, :]
    return (z + factor_of(rnorm) * (codes * s)).to(dtype)


# --------------------------------------------------------------------------- V: per token, channel factors


def quantize_v(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    v_group: int | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Variance-normalized per-token V (module docstring). x: (..., T, D), T a multiple of ``group_size`` G
    (the token group of the channel factors); ``v_group`` channels per scale (None: the whole head).

    Returns (packed codes (..., T, D * bits / 8), scale (..., T, D / v_group), zero (..., T, D / v_group),
    channel factor codes uint8 (..., T / G, D))."""
    _check_scale_dtype(scale_dtype)
    g = check_int("group_size", group_size, minimum=1, expected="a positive integer")
    *lead, t, d = x.shape
    vg = d if v_group is None else v_group
    if t % g:
        raise ValueError(f"variance-normalized V needs T a multiple of group_size={g}, got T={t}")
    if d % vg:
        raise ValueError(f"per-token quantization needs head dim a multiple of group_size={vg}, got {d}")
    _check_packing(bits, d)
    xg = x.float().reshape(*lead, t // g, g, d)  # (..., T/G, G, D)
    if not tracing() and not bool(torch.isfinite(xg.amax()) & torch.isfinite(xg.amin())):
        check_finite(xg, "per-token quantization input")
    _, c = balance(xg)  # uncentered: a per-token zero removes one offset per token, not one per channel
    cands, errs = [], []
    for alpha in STRENGTHS:
        ccode = factor_code(c**alpha).expand(*lead, t // g, g, d)  # (..., T/G, G, D)
        cf = factor_of(ccode[..., :1, :])
        y = (xg / cf).reshape(*lead, t // g, g, d // vg, vg)  # (..., T/G, G, D/vg, vg)
        scale, zero = _affine_params(y, -1, bits, scale_dtype, "per-token quantization input")
        q = _codes(y, scale, zero, bits)
        err = (((q * scale.float() + zero.float()).reshape(xg.shape) * cf - xg).square()).sum(
            (-2, -1), keepdim=True
        )
        cands.append(
            (
                q.reshape(xg.shape).float(),
                scale.reshape(*lead, t // g, g, d // vg),
                zero.reshape(*lead, t // g, g, d // vg),
                ccode,
            )
        )
        errs.append(err)
    q, scale, zero, ccode = _select(errs, cands) if len(cands) > 1 else cands[0]
    codes = q.to(torch.int32).reshape(*lead, t, d)
    scale, zero = scale.reshape(*lead, t, d // vg), zero.reshape(*lead, t, d // vg)
    ccode = ccode[..., 0, :]
    return _pack(codes, bits), scale, zero, ccode


def dequantize_v(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    cnorm: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
    offset: int = 0,
) -> torch.Tensor:
    """Inverse of :func:`quantize_v`: packed (..., T, D * bits / 8), scale/zero (..., T, D / v_group), cnorm
    (..., n_groups, D), the T tokens starting ``offset`` tokens into the first group. Returns (..., T, D)."""
    g = check_int("group_size", group_size, minimum=1, expected="a positive integer")
    check_int("offset", offset, minimum=0, below=g)
    *lead, t, _ = packed.shape
    d, n = cnorm.shape[-1], cnorm.shape[-2]
    ns = scale.shape[-1]
    if scale.shape != zero.shape or not ns or d % ns or n != -(-(offset + t) // g) or scale.shape[-2] != t:
        raise ValueError(
            f"variance-normalized V parts scale {tuple(scale.shape)}, zero {tuple(zero.shape)}, cnorm "
            f"{tuple(cnorm.shape)} do not match {t} tokens at offset {offset} with group_size {g}"
        )
    vg = d // ns
    codes = unpack_bits(packed, bits, d).float().reshape(*lead, t, ns, vg)
    y = (codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).reshape(*lead, t, d)
    c = factor_of(cnorm)  # (..., n, D)
    c = (
        c.unsqueeze(-2)
        .expand(*c.shape[:-1], g, d)
        .reshape(*c.shape[:-2], n * g, d)[..., offset : offset + t, :]
    )
    return (y * c).to(dtype)


# --------------------------------------------------------------------------- codecs


class VarNormKCodec(_AffineKCodec):
    """Variance-normalized per-channel K: ``token`` = {"codes", "rnorm"}, ``group`` = {"scale", "zero"}."""

    varnorm = True

    def encode(self, x: torch.Tensor) -> Encoded:
        codes, rnorm, scale, zero = quantize_k(x, self.bits, self.token_group, self.scale_dtype)
        return Encoded(token={"codes": codes, "rnorm": rnorm}, group={"scale": scale, "zero": zero})

    def decode(self, enc: Encoded, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        g = enc.group
        return dequantize_k(
            enc.token["codes"],
            enc.token["rnorm"],
            g["scale"],
            g["zero"],
            self.bits,
            self.token_group,
            dtype,
            offset,
        )

    def bits_per_element(self, head_dim: int) -> float:
        return super().bits_per_element(head_dim) + 8 / head_dim

    def nbytes(self, batch: int, heads: int, tokens: int, head_dim: int) -> int:
        return super().nbytes(batch, heads, tokens, head_dim) + batch * heads * tokens


class VarNormVCodec(_AffineVCodec):
    """Variance-normalized per-token V: ``token`` = {"codes", "scale", "zero"}, ``group`` = {"cnorm"} per
    ``token_group`` tokens."""

    varnorm = True

    def __init__(
        self, fmt, group_size: int | None, token_group: int, scale_dtype: torch.dtype = torch.float16
    ):
        super().__init__(fmt, group_size, scale_dtype)
        self.token_group = check_int("group_size", token_group, minimum=1, expected="a positive integer")

    def encode(self, x: torch.Tensor) -> Encoded:
        codes, scale, zero, cnorm = quantize_v(
            x, self.bits, self.token_group, self.group_size, self.scale_dtype
        )
        return Encoded(token={"codes": codes, "scale": scale, "zero": zero}, group={"cnorm": cnorm})

    def decode(self, enc: Encoded, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        t = enc.token
        return dequantize_v(
            t["codes"], t["scale"], t["zero"], enc.group["cnorm"], self.bits, self.token_group, dtype, offset
        )

    def bits_per_element(self, head_dim: int) -> float:
        return super().bits_per_element(head_dim) + 8 / self.token_group

    def nbytes(self, batch: int, heads: int, tokens: int, head_dim: int) -> int:
        if tokens % self.token_group:
            raise ValueError(
                f"{self.name} V with variance normalization stores whole groups of {self.token_group} tokens, "
                f"got {tokens} tokens"
            )
        extra = (tokens // self.token_group) * head_dim
        return super().nbytes(batch, heads, tokens, head_dim) + batch * heads * extra


def factor_part(
    codec: Codec, enc: Encoded, b: int, h: int, t: int, d: int, offset: int
) -> torch.Tensor | None:
    """The checked factor part of a body of ``t`` tokens the kernels read (the encoded-layout contract of
    :mod:`.layout`, for the part it adds): K token factors uint8 (B, H, T, 1), V channel factors uint8
    (B, H, ceil((offset + T) / G), D) with everything after dim 2 contiguous; None for a plain body.
    ValueError naming the part, its shape and what the codec needs."""
    if not getattr(codec, "varnorm", False):
        return None
    if codec.role == "k":
        part, shape = enc.token["rnorm"], (b, h, t, 1)
    else:
        check_int("offset", offset, minimum=0, below=codec.token_group)
        part, shape = rows_contiguous(enc.group["cnorm"]), (b, h, -(-(offset + t) // codec.token_group), d)
    expect(part, shape, (torch.uint8,), f"{codec.name} {codec.role.upper()} variance-normalization factors")
    return part


def applies(codec: Codec) -> bool:
    """Whether variance normalization can wrap this codec (an affine K or V codec not already wrapped)."""
    return isinstance(codec, (_AffineKCodec, _AffineVCodec)) and not getattr(codec, "varnorm", False)


def varnorm_codec(codec: Codec, token_group: int) -> Codec:
    """The variance-normalized codec of an affine codec (same format, role, groups and scale dtype), V's channel
    factors per ``token_group`` tokens (the cache's group size); ValueError for any other codec."""
    if not applies(codec):
        raise ValueError(
            f"variance normalization applies to the affine formats (int8, int4, int3, int2), "
            f"got {codec.name!r} ({getattr(codec, 'family', 'generic')})"
        )
    if codec.role == "k":
        return VarNormKCodec(codec.format, codec.token_group, codec.scale_dtype)
    return VarNormVCodec(codec.format, codec.group_size, token_group, codec.scale_dtype)


#: ``varnorm="auto"``: the (role, bits) of the affine streams it normalizes (docs/quality.md, "Variance
#: normalization": where the measurements show it helps; nowhere else). Empty: over 512 decode steps it made
#: int2 worse (KLD x1.49) and int4 no better, though shorter and chunked runs showed int2 gains.
AUTO: frozenset[tuple[str, int]] = frozenset()


def resolve(mode: str, codec: Codec, token_group: int) -> Codec:
    """The codec a cache stores a stream with under ``varnorm=mode`` (``on``, ``off``, ``auto``): the
    variance-normalized codec of an affine one where ``mode`` asks for it, else ``codec`` itself."""
    if mode == "off" or not applies(codec) or (mode == "auto" and (codec.role, codec.bits) not in AUTO):
        return codec
    return varnorm_codec(codec, token_group)


def cache_codec(cfg, fmt: str, role: str) -> Codec:
    """The codec a cache of config ``cfg`` (a :class:`~kvslim.config.CacheConfig`) stores ``role`` with in format
    ``fmt``: :func:`~kvslim.formats.base.make_codec` with its groups, ``cfg.varnorm`` resolved (:func:`resolve`),
    then ``cfg.clip`` (:mod:`.clip`) and ``cfg.codebook`` (:mod:`.codebook`)."""
    codec = resolve(cfg.varnorm, make_codec(fmt, role, group_size=cfg.group_size, v_group_size=cfg.v_group_size),
                    cfg.group_size)
    if clip.applies(codec):
        codec.clip = clip.wanted(getattr(cfg, "clip", "off"), role, codec.bits)
    if codebook.applies(codec):
        codec.levels = codebook.wanted(getattr(cfg, "codebook", "off"), role, codec.bits)
    return codec
