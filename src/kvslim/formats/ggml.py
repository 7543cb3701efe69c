"""llama.cpp's GGML block formats q8_0, q4_0, q4_1, q5_0 and q5_1, in torch (CPU and CUDA).

Blocks of 32 consecutive elements along the last dimension, each stored as a few fp16 constants
followed by the packed codes, in llama.cpp's byte layout (``block_q4_0`` etc. in ``ggml-common.h``):

=====  =====  =================================  ============================================
kind   bytes  layout                             value
=====  =====  =================================  ============================================
q8_0   34     d, qs[32] (int8)                   d * q
q4_0   18     d, qs[16]                          d * (q - 8)
q4_1   20     d, m, qs[16]                       d * q + m
q5_0   22     d, qh[4], qs[16]                   d * (q - 16)
q5_1   24     d, m, qh[4], qs[16]                d * q + m
=====  =====  =================================  ============================================

``d`` and ``m`` are little-endian fp16. ``qs[j]`` holds element ``j`` in its low nibble and
element ``j + 16`` in its high nibble; q5's ``qh`` is a little-endian uint32 whose bit ``i`` is the
fifth bit of element ``i``.

The bytes are identical to ``gguf.quants.quantize`` (gguf-py, itself bit-exact with ggml's
``quantize_row_*_ref``) on float32 input, so the quirks below are copied on purpose:

- the inverse scale ``id`` is ``1 / d`` computed in fp32 from the *unrounded* fp32 ``d`` (``0``
  when ``d == 0``), while the block stores ``d`` rounded to fp16 (nearest-even);
- q8_0 rounds half away from zero (C's ``roundf``; gguf-py's ``np_roundf``), not half to even;
- q4_0/q5_0 pick the element of largest magnitude *with its sign* (the first one on ties) and set
  ``d = max / -8`` (``-16``), so that element maps to code 0; codes are ``trunc(x * id + 8.5)``
  (``16.5``) clamped to the range, i.e. rounding half up after the offset;
- q4_1/q5_1 use ``trunc((x - min) * id + 0.5)``; the stored ``min`` of a block whose minimum is
  zero carries the sign gguf-py gives it: numpy's ``min``/``max`` keep the later of equal values,
  so a zero extreme is the block's *last* zero, ``-0.0`` or ``0.0`` (a block of mixed-sign zeros,
  e.g. tiny values rounded, stores ``m`` as ``0x8000`` or ``0x0000`` accordingly). torch's reductions
  pick either. That is numpy's x86 behaviour (SSE/AVX ``minps`` return the second operand on ties);
  ggml's C reference keeps the *first* zero instead, and ARM's ``fmin`` prefers ``-0.0``: the sign of a
  zero ``m`` is the one place the three can differ, and it never changes a decoded value.

Divisions by 15, 31 and 127 divide by a device tensor, not a Python scalar: CUDA turns division
by a CPU scalar into a multiplication by its reciprocal, which is not bit-exact.

Like gguf, a block whose ``d`` or ``m`` overflows fp16 would store inf; here it raises ValueError
(as does non-finite input). Blocks whose maximum is below fp32's normal range (~1e-38) follow
ggml's own undefined path (``1 / d`` overflows) and are not guaranteed identical.

This module knows nothing about positions or caches.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import torch

from .base import FORMATS, Block, Codec, Encoded, Format, check_finite, tracing

#: Largest finite fp16, the bound on every stored ``d`` and ``m``.
FP16_MAX = 65504.0
#: Elements per block of every legacy GGML kind (ggml's QK4_0 = QK8_0 = ... = 32). Each format's
#: block (elements, bytes) is a fact of its registered class below; the C kernels check theirs
#: against it when they load.
BLOCK = 32


# --------------------------------------------------------------------------- helpers


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp32 (..., 1) -> its fp16 bytes uint8 (..., 2), little-endian (x86, ARM and CUDA hosts)."""
    return v.to(torch.float16).view(torch.uint8)


def _bytes_fp32(b: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 2) holding a little-endian fp16 -> fp32 (..., 1)."""
    return b.contiguous().view(torch.float16).float()


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """gguf's ``id = np.where(d == 0, 0, 1 / d)`` in fp32."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _divide(v: torch.Tensor, by: float) -> torch.Tensor:
    """Exact IEEE fp32 ``v / by`` on every device (a 0-dim device tensor, see the module docstring)."""
    return v / torch.full((), by, dtype=v.dtype, device=v.device)


def _abs_max_signed(blocks: torch.Tensor) -> torch.Tensor:
    """(..., 32) -> (..., 1): the element of largest magnitude, sign kept, first one on ties.

    From amax and amin (two vectorized reductions, ~3x faster on CPU than abs + argmax + gather);
    only blocks whose max and -min tie need the first one's sign, found the slow way."""
    mx, mn = blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)
    out = torch.where(-mn > mx, mn, mx)
    tie = -mn == mx  # also every all-zero block: the sign of its first zero is d's
    if tracing():  # a compiled step: the slow way for every block, kept where they tie (no host sync)
        return torch.where(tie, blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)), out)
    if bool(tie.any()):  # a host sync; NaN blocks never tie (quantize_ggml refuses them after)
        rows = tie[..., 0].nonzero(as_tuple=True)
        b = blocks[rows]
        out = out.clone()
        out[rows] = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    return out


def _nibbles_of_floats(f: torch.Tensor) -> torch.Tensor:
    """Codes as whole floats in [0, 15] (..., 32) -> uint8 (..., 16), as :func:`_nibbles`: packed while
    still float (exact below 256), then one conversion."""
    return (f[..., :16] + 16 * f[..., 16:]).to(torch.int32).to(torch.uint8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes (..., 32) integer -> uint8 (..., 16): low nibble element j, high nibble element j + 16."""
    lo, hi = q[..., :16] & 0x0F, q[..., 16:] & 0x0F
    return (lo | (hi << 4)).to(torch.uint8)


def _unnibble(qs: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 16) -> codes uint8 (..., 32)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """5-bit codes (..., 32) -> qh uint8 (..., 4): bit i of the little-endian uint32 is q[i] >> 4.

    Same as gguf's ``np.packbits(q >> 4, bitorder="little")``.
    """
    bits = ((q >> 4) & 1).reshape(*q.shape[:-1], 4, 8)  # (..., byte, bit)
    qh = bits[..., 0].clone()  # (..., 4); scalar shifts beat a broadcast shift tensor on CPU
    for j in range(1, 8):
        qh |= bits[..., j] << j
    return qh.to(torch.uint8)


def _unhigh_bits(qh: torch.Tensor) -> torch.Tensor:
    """qh uint8 (..., 4) -> fifth bits uint8 (..., 32), element i = bit i."""
    bits = torch.stack([(qh >> j) & 1 for j in range(8)], dim=-1)  # (..., byte, bit)
    return bits.reshape(*qh.shape[:-1], BLOCK)


def _trunc_codes(v: torch.Tensor, top: int) -> torch.Tensor:
    """gguf's ``np.trunc(v).astype(np.uint8).clip(0, top)``, as int32.

    Every caller has v > 0 (v >= 0.5 up to fp32 rounding), where trunc equals floor, and torch's
    floor is vectorized on CPU while trunc is not (~15x slower).
    """
    return torch.floor(v).clamp_(0, top).to(torch.int32)


# --------------------------------------------------------------------------- per-kind block codecs
# quantizers: fp32 blocks (..., 32) -> (uint8 bytes (..., block_bytes), fp16-bound metadata (..., k))
# dequantizers: uint8 (..., block_bytes) -> fp32 (..., 32)


def _q8_0(b):
    d = _divide(b.abs().amax(-1, keepdim=True), 127.0)
    v = b * _inverse(d)
    # np_roundf: half away from zero, as floor(a) + floor(2 * (a - floor(a))) (exact in fp32, unlike
    # floor(a + 0.5), which rounds 0.49999997 up).
    a = v.abs()
    fl = torch.floor(a)
    q = (torch.sign(v) * (fl + torch.floor(2 * (a - fl)))).to(torch.int8)
    return torch.cat([_fp16_bytes(d), q.view(torch.uint8)], -1), d


def _q8_0_dq(blk):
    return _bytes_fp32(blk[..., :2]) * blk[..., 2:].view(torch.int8).float()


def _q4_0(b):
    d = _abs_max_signed(b) / -8  # power of two: exact everywhere
    q = torch.floor(b * _inverse(d) + 8.5).clamp_(0, 15)  # = _trunc_codes, kept float
    return torch.cat([_fp16_bytes(d), _nibbles_of_floats(q)], -1), d


def _q4_0_dq(blk):
    return _bytes_fp32(blk[..., :2]) * (_unnibble(blk[..., 2:]).float() - 8)


def _zero_min_signs(blocks: torch.Tensor, data: torch.Tensor, mn: torch.Tensor, offset: int) -> torch.Tensor:
    """Give every stored ``m`` that is zero the sign gguf-py stores: that of the block's last zero.

    blocks: fp32 (..., 32); data: uint8 (..., block_bytes) with ``m`` (fp16, little-endian) at
    ``offset``; mn: (...,) the blocks' minima. Only the sign bit of a zero ``m`` changes (its codes
    and ``d`` do not depend on it), so this runs after the fact on the few blocks concerned.
    """
    rows = (mn == 0).nonzero(as_tuple=True)  # a sync, only reached when some block's min is zero
    b = blocks[rows]  # (n, 32)
    lanes = torch.arange(1, BLOCK + 1, device=b.device, dtype=b.dtype)  # 1..32, exact in fp32
    last_zero = b.gather(-1, ((b == 0) * lanes).argmax(-1, keepdim=True))[:, 0]  # (n,) +-0.0
    data = data.clone()
    data[(*rows, torch.full_like(rows[0], offset + 1))] = torch.signbit(last_zero).to(torch.uint8) << 7
    return data


def _zero_min_signs_dense(
    blocks: torch.Tensor, data: torch.Tensor, mn: torch.Tensor, offset: int
) -> torch.Tensor:
    """:func:`_zero_min_signs` for every block at once, without a host sync (a compiled step): the same bytes."""
    lanes = torch.arange(1, BLOCK + 1, device=blocks.device, dtype=blocks.dtype)
    last_zero = blocks.gather(-1, ((blocks == 0) * lanes).argmax(-1, keepdim=True))[..., 0]  # (...,) +-0.0
    hi = torch.where(mn == 0, torch.signbit(last_zero).to(torch.uint8) << 7, data[..., offset + 1])
    return torch.cat([data[..., : offset + 1], hi[..., None], data[..., offset + 2 :]], dim=-1)


def _q4_1(b):
    mn, mx = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)  # faster than aminmax on CPU
    # + 0.0: a block of zeros gets d = +0 as in gguf-py (max - min = +0 there; torch's amin/amax may
    # pick zeros of opposite signs and give -0). Zero minima are signed in quantize_ggml.
    d = _divide(mx - mn, 15.0) + 0.0
    q = torch.floor((b - mn) * _inverse(d) + 0.5).clamp_(0, 15)  # = _trunc_codes, kept float
    return torch.cat([_fp16_bytes(d), _fp16_bytes(mn), _nibbles_of_floats(q)], -1), torch.cat([d, mn], -1)


def _q4_1_dq(blk):
    d, m = _bytes_fp32(blk[..., :2]), _bytes_fp32(blk[..., 2:4])
    return d * _unnibble(blk[..., 4:]).float() + m


def _q5_0(b):
    d = _abs_max_signed(b) / -16
    q = _trunc_codes(b * _inverse(d) + 16.5, 31)
    return torch.cat([_fp16_bytes(d), _high_bits(q), _nibbles(q)], -1), d


def _q5_0_dq(blk):
    q = _unnibble(blk[..., 6:]) | (_unhigh_bits(blk[..., 2:6]) << 4)
    return _bytes_fp32(blk[..., :2]) * (q.float() - 16)


def _q5_1(b):
    mn, mx = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = _divide(mx - mn, 31.0) + 0.0  # see _q4_1
    q = _trunc_codes((b - mn) * _inverse(d) + 0.5, 31)
    data = torch.cat([_fp16_bytes(d), _fp16_bytes(mn), _high_bits(q), _nibbles(q)], -1)
    return data, torch.cat([d, mn], -1)


def _q5_1_dq(blk):
    d, m = _bytes_fp32(blk[..., :2]), _bytes_fp32(blk[..., 2:4])
    q = _unnibble(blk[..., 8:]) | (_unhigh_bits(blk[..., 4:8]) << 4)
    return d * q.float() + m


def _kind(kind: str) -> _GGMLFormat:
    fmt = FORMATS.get(kind)
    if not isinstance(fmt, _GGMLFormat):
        raise ValueError(f"unknown GGML kind {kind!r}; expected one of: {', '.join(GGML_KINDS)}")
    return fmt


# --------------------------------------------------------------------------- public functions


def quantize_ggml(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x: (..., K) floating point, K a multiple of 32 -> uint8 (..., K // 32 * block_bytes).

    Bytes equal ``gguf.quants.quantize(x.float().numpy(), GGMLQuantizationType[kind.upper()])``.
    """
    fmt = _kind(kind)
    size, nbytes = fmt.block
    if not x.is_floating_point():
        raise ValueError(f"{kind} quantizes floating point tensors, got dtype {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % size:
        raise ValueError(f"{kind} needs the last dim to be a multiple of {size}, got shape {tuple(x.shape)}")
    *lead, k = x.shape
    blocks = x.float().reshape(*lead, k // size, size)  # (..., n_blocks, 32)
    data, meta = fmt.quantize_block(blocks)  # (..., n_blocks, block_bytes), (..., n_blocks, 1 or 2)
    # One host sync on the small fp16 metadata: it is non-finite for non-finite input (the block
    # reductions behind d and m propagate NaN and inf; argmax picks a NaN) and on fp16 overflow of d
    # or m (where gguf would store inf) -- no full isfinite pass over the input. The same sync says
    # whether a block's stored minimum m is zero (its sign is then fixed, see the module docstring).
    if tracing():  # a compiled step: no host sync; every zero minimum signed (branch-free), nothing checked
        if fmt.min_offset is not None:
            data = _zero_min_signs_dense(blocks, data, meta[..., 1], fmt.min_offset)
        return data.reshape(*lead, k // size * nbytes)
    checks = [~torch.isfinite(meta.to(torch.float16)).all()]
    if fmt.min_offset is not None:
        checks.append((meta[..., 1] == 0).any())
    bad, *zero_min = torch.stack(checks).tolist()
    if zero_min and zero_min[0] and not bad:
        data = _zero_min_signs(blocks, data, meta[..., 1], fmt.min_offset)
    if bad:
        check_finite(x, f"{kind} input")
        raise ValueError(
            f"{kind} cannot store values spanning [{float(x.min()):g}, {float(x.max()):g}]: a block's fp16 "
            f"scale (or min) would overflow 65504"
        )
    return data.reshape(*lead, k // size * nbytes)


def dequantize_ggml(data: torch.Tensor, kind: str) -> torch.Tensor:
    """data: uint8 (..., n_blocks * block_bytes) -> float32 (..., n_blocks * 32).

    Values equal ``gguf.quants.dequantize`` (to fp32 rounding).
    """
    fmt = _kind(kind)
    size, nbytes = fmt.block
    if data.dtype != torch.uint8:
        raise ValueError(f"{kind} data must be uint8, got {data.dtype}")
    if data.dim() < 1 or data.shape[-1] % nbytes:
        raise ValueError(
            f"{kind} data needs the last dim to be a multiple of {nbytes} bytes, got {tuple(data.shape)}"
        )
    *lead, n = data.shape
    out = fmt.dequantize_block(data.reshape(*lead, n // nbytes, nbytes))  # (..., n_blocks, 32)
    return out.reshape(*lead, n // nbytes * size)


# --------------------------------------------------------------------------- codecs


class _GGMLCodec(Codec):
    """``token`` = {"blocks": uint8 (B, H, T, D // 32 * block_bytes)}: per-token, blocks along D."""

    def __init__(self, fmt: _GGMLFormat, role: str):
        super().__init__(fmt, role)
        self.block = fmt.block

    def encode(self, x: torch.Tensor) -> Encoded:
        return Encoded(token={"blocks": quantize_ggml(x, self.name)})

    def decode(self, enc: Encoded, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return dequantize_ggml(enc.token["blocks"], self.name).to(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        return self.block.nbytes * 8 / self.block.elements

    def nbytes(self, batch: int, heads: int, tokens: int, head_dim: int) -> int:
        self.check_head_dim(head_dim)
        return batch * heads * tokens * (head_dim // self.block.elements) * self.block.nbytes

    def check_head_dim(self, head_dim: int) -> None:
        size = self.block.elements
        if head_dim < 1 or head_dim % size:
            raise ValueError(
                f"{self.name} quantizes blocks: head_dim must be a multiple of {size}, got {head_dim}"
            )


class _GGMLFormat(Format):
    """A GGML block format: per token, blocks of ``block.elements`` along D in ``block.nbytes`` bytes.

    ``quantize_block``: fp32 blocks (..., 32) -> (uint8 bytes (..., block_bytes), fp16-bound metadata
    (..., 1 or 2)); ``dequantize_block``: uint8 (..., block_bytes) -> fp32 (..., 32).
    ``max_abs``: the largest magnitude a block can hold, set by its fp16 ``d`` (and ``m``) staying
    below 65504: ``65504 * 127`` for q8_0 (``d = amax / 127``), ``65504 * 8`` / ``* 16`` for q4_0 /
    q5_0 (``d = max / -8``, ``/ -16``), 65504 for q4_1 / q5_1 (the block minimum is stored as ``m``).
    """

    symmetric = True
    max_abs: float = FP16_MAX
    #: byte offset of the fp16 block minimum ``m`` (q4_1, q5_1); None for the symmetric kinds.
    min_offset: int | None = None
    family = MappingProxyType({"k": "ggml", "v": "ggml"})
    quantize_block: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    dequantize_block: Callable[[torch.Tensor], torch.Tensor]

    def codec(self, role: str, *, group_size: int = 32, v_group_size: int | None = None) -> Codec:
        return _GGMLCodec(self, role)


class Q8_0Format(_GGMLFormat, name="q8_0"):
    summary = "llama.cpp q8_0: blocks of 32, int8 codes + fp16 scale (8.5 bits)"
    bits = 8
    mean_center = True
    max_abs = FP16_MAX * 127
    block = Block(BLOCK, 34)
    quantize_block = staticmethod(_q8_0)
    dequantize_block = staticmethod(_q8_0_dq)


class Q4_0Format(_GGMLFormat, name="q4_0"):
    summary = "llama.cpp q4_0: blocks of 32, 4-bit codes + fp16 scale (4.5 bits)"
    bits = 4
    mean_center = True
    max_abs = FP16_MAX * 8
    block = Block(BLOCK, 18)
    quantize_block = staticmethod(_q4_0)
    dequantize_block = staticmethod(_q4_0_dq)


class Q4_1Format(_GGMLFormat, name="q4_1"):
    summary = "llama.cpp q4_1: blocks of 32, 4-bit codes + fp16 scale and min (5 bits)"
    bits = 4
    symmetric = False
    min_offset = 2
    block = Block(BLOCK, 20)
    quantize_block = staticmethod(_q4_1)
    dequantize_block = staticmethod(_q4_1_dq)


class Q5_0Format(_GGMLFormat, name="q5_0"):
    summary = "llama.cpp q5_0: blocks of 32, 5-bit codes + fp16 scale (5.5 bits)"
    bits = 5
    mean_center = True
    max_abs = FP16_MAX * 16
    block = Block(BLOCK, 22)
    quantize_block = staticmethod(_q5_0)
    dequantize_block = staticmethod(_q5_0_dq)


class Q5_1Format(_GGMLFormat, name="q5_1"):
    summary = "llama.cpp q5_1: blocks of 32, 5-bit codes + fp16 scale and min (6 bits)"
    bits = 5
    symmetric = False
    min_offset = 2
    block = Block(BLOCK, 24)
    quantize_block = staticmethod(_q5_1)
    dequantize_block = staticmethod(_q5_1_dq)


def ggml_max_abs(kind: str) -> float:
    """The largest magnitude a block of ``kind`` can store (see ``_GGMLFormat.max_abs``)."""
    return _kind(kind).max_abs


#: name -> (elements per block, bytes per block), read from the registered formats above.
GGML_KINDS: dict[str, tuple[int, int]] = {
    f.name: tuple(f.block) for f in FORMATS.values() if isinstance(f, _GGMLFormat)
}
