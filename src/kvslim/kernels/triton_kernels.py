"""The Triton programs behind :mod:`.gpu`: K scores and V weighted sums read from the packed codes.

Imported only by :func:`kvslim.kernels.gpu.programs` (importing it imports Triton). Whether the
``@triton.jit`` functions below compile for the GPU or run in Triton's interpreter is fixed when the
module is executed (Triton reads ``$TRITON_INTERPRET`` at decoration time), so :mod:`.gpu` executes
one copy of it per mode.

One decoder, :func:`tile`, turns a (BLOCK_T tokens, BLOCK_D channels) tile of any stored layout into
fp32 values in registers; the two programs share it:

- :func:`k_scores_kernel`: one program per (b * H + h, token tile, query-row tile) decodes its K
  tile once and multiplies it with every query row of its head (the GQA group is folded into M,
  so K is never repeated), writing scores (B, H, M, T).
- :func:`v_partial_kernel`: one program per (b * H + h, split of the tokens, query-row tile) loops
  over the token tiles of its split and accumulates ``p @ V`` in registers, writing a partial
  (B * H, S, M, D) that the caller sums over S. The probabilities are already normalized, so the
  partials add without the max/log-sum-exp rescaling of flash-decoding's online softmax.

The layouts (formats/affine.py, formats/ggml.py, formats/floats.py), decoded exactly as the torch
reference does; element ``d`` of token ``t``:

======  ============================================================================================
FMT     value
======  ============================================================================================
0  K    per-channel affine: code ``(bytes16[p // 8] >> p % 8) & mask`` at bit ``p = d * bits`` of the
        row's little-endian bit stream (``bytes16``: the byte and the next one, read only where an int3
        code straddles the byte boundary, ``p % 8 > 5``);
        ``code * scale[g, d] + zero[g, d]`` with ``g = (offset + t) // group`` (KIVI K); variance-normalized
        (``VN``, formats/varnorm.py): ``zero[g, d] + r_t * ((code - L / 2) * scale[g, d])``, ``r_t`` the token's
        factor byte ``e`` read as ``2^((e - 128) / 4)`` (:func:`_factor`), ``L = 2^bits - 1``
1  V    per-token affine: same code; ``code * scale[t, d // group] + zero[t, d // group]`` (KIVI V);
        variance-normalized: that times ``c[(offset + t) // ngroup, d]``, the channel's factor of its token group
2-6     GGML q8_0, q4_0, q4_1, q5_0, q5_1: block ``j = d // 32`` of ``NB`` bytes, ``i = d % 32``;
        fp16 ``d`` (and ``m``) from two little-endian bytes; q5's fifth bit is bit ``i % 8`` of
        ``qh`` byte ``i // 8`` (= bit ``i`` of the little-endian uint32)
7       fp8 e4m3fn codes (loaded as bytes, decoded by bit arithmetic: no fp8 hardware needed) times
        the token's fp32 scale
8       a plain fp16 / bf16 / fp32 tensor
======  ============================================================================================

Only ``triton.language`` builtins are used (``tl.full``, not ``tl.zeros``): the standard library's
own ``@triton.jit`` helpers are decorated when Triton is imported, so under an interpreter switched
on after that import they would stay compiled functions and fail on CPU tensors.

The matmuls are ``tl.dot`` with ``input_precision="ieee"``: fp32 products, as the reference (TF32
would trade ~1e-3 relative error for tensor-core throughput that a memory-bound decode step does
not need).
"""

import triton
import triton.language as tl

from ..formats.varnorm import FACTOR_TABLE

#: Layout codes (the FMT argument); constexpr globals, the only kind a Triton program may read.
AFFINE_K, AFFINE_V, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, FP8, CAST = (tl.constexpr(i) for i in range(9))
#: GGML kind name -> layout code
GGML = {"q8_0": Q8_0, "q4_0": Q4_0, "q4_1": Q4_1, "q5_0": Q5_0, "q5_1": Q5_1}


@triton.jit
def _maximum(a, b):  # tl.max / tl.sum are the standard library's jit helpers (module docstring): tl.reduce with these
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _half(lo, hi):
    """Two uint8 tiles, the little-endian bytes of fp16 numbers -> fp32."""
    bits = lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(b):
    """uint8 tile of float8_e4m3fn bit patterns -> fp32, exactly (e4m3fn: bias 7, no inf, NaN = S.1111.111)."""
    b = b.to(tl.uint32)
    e = (b >> 3) & 15
    m = b & 7
    sign = (b >> 7) << 31
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # (1 + m/8) 2^(e-7)
    sub = m.to(tl.float32) * 0.001953125  # e == 0: m * 2^-9
    sub = tl.where(sign != 0, -sub, sub)
    nan = tl.full(b.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
    return tl.where((b & 127) == 127, nan, tl.where(e == 0, sub, normal))


#: ``2^(i / 4)`` in fp32, i = 1..3 (varnorm.FACTOR_TABLE; entry 0 is 1)
VN_F1, VN_F2, VN_F3 = (tl.constexpr(f) for f in FACTOR_TABLE[1:])


@triton.jit
def _factor(e):
    """int32 tile of variance-normalization factor bytes -> fp32 ``2^((e - 128) / 4)``, exactly as
    varnorm.factor_of: the table entry of ``e % 4`` times the power of two ``2^(e // 4 - 32)`` from its bits."""
    i = e & 3
    frac = tl.where(i == 0, 1.0, tl.where(i == 1, VN_F1, tl.where(i == 2, VN_F2, VN_F3)))
    pow2 = (((e >> 2) + 95) << 23).to(tl.float32, bitcast=True)  # 2^(e // 4 - 32), always normal
    return frac * pow2


@triton.jit
def tile(
    x_ptr,
    s_ptr,
    z_ptr,
    n_ptr,
    sxt,
    sst,
    szt,
    snt,
    t,
    d,
    t_ok,
    d_ok,
    offset,
    group,
    ngroup,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    NB: tl.constexpr,
    VN: tl.constexpr,
):
    """fp32 values (BLOCK_T, BLOCK_D) of tokens ``t`` (BLOCK_T, 1) int64 and channels ``d``
    (1, BLOCK_D); 0 outside ``t_ok`` (BLOCK_T, 1) and ``d_ok`` (1, BLOCK_D). The pointers are at
    this (b, h)'s first token; ``group``: tokens per K scale row (FMT 0), channels per V scale (FMT 1).
    ``VN``: an affine body with variance-normalization factors at ``n_ptr`` (row stride ``snt``): K one
    byte per token, V one per channel per ``ngroup`` tokens (unused otherwise)."""
    mask = t_ok & d_ok
    if FMT == AFFINE_K or FMT == AFFINE_V:  # noqa: SIM109 (Triton's frontend has no `in`)
        p = d * BITS  # the code's first bit in the row's little-endian bit stream
        byte = tl.load(x_ptr + t * sxt + p // 8, mask=mask, other=0).to(tl.int32)
        if BITS == 3:  # int3: codes 2 and 5 of each 3-byte unit straddle a byte boundary
            nxt = tl.load(x_ptr + t * sxt + p // 8 + 1, mask=mask & (p % 8 > 5), other=0).to(tl.int32)
            byte = byte | (nxt << 8)
        code = ((byte >> (p % 8)) & ((1 << BITS) - 1)).to(tl.float32)
        if FMT == AFFINE_K:
            g = (offset + t) // group  # the token's scale row; the first group is partly evicted
            s = tl.load(s_ptr + g * sst + d, mask=mask, other=0).to(tl.float32)
            z = tl.load(z_ptr + g * szt + d, mask=mask, other=0).to(tl.float32)
            if VN:  # the grid centered on the zero, times the token's factor (a masked token reads byte 0)
                r = _factor(tl.load(n_ptr + t * snt, mask=t_ok, other=0).to(tl.int32))  # (BLOCK_T, 1)
                return tl.where(mask, z + r * ((code - ((1 << BITS) - 1) / 2) * s), 0.0)
        else:
            s = tl.load(s_ptr + t * sst + d // group, mask=mask, other=0).to(tl.float32)
            z = tl.load(z_ptr + t * szt + d // group, mask=mask, other=0).to(tl.float32)
            if VN:  # times the channel's factor of the token's group
                c = _factor(
                    tl.load(n_ptr + ((offset + t) // ngroup) * snt + d, mask=mask, other=0).to(tl.int32)
                )
                return tl.where(mask, (code * s + z) * c, 0.0)
        return code * s + z
    elif FMT == FP8:
        b = tl.load(x_ptr + t * sxt + d, mask=mask, other=0)
        s = tl.load(s_ptr + t * sst, mask=t_ok, other=0)  # (BLOCK_T, 1)
        return tl.where(mask, _e4m3(b) * s, 0.0)
    elif FMT == CAST:
        return tl.load(x_ptr + t * sxt + d, mask=mask, other=0).to(tl.float32)
    else:  # GGML: blocks of 32 along D
        blk = x_ptr + t * sxt + (d // 32) * NB
        i = d % 32
        scale = _half(tl.load(blk, mask=mask, other=0), tl.load(blk + 1, mask=mask, other=0))
        if FMT == Q8_0:
            q = tl.load(blk + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
            return scale * q.to(tl.float32)
        else:
            # the nibbles qs[16] end every block, q5's qh[4] just before them
            qs = tl.load(blk + (NB - 16) + i % 16, mask=mask, other=0).to(tl.int32)
            q = tl.where(i < 16, qs & 15, qs >> 4)
            if FMT == Q5_0 or FMT == Q5_1:  # noqa: SIM109
                qh = tl.load(blk + (NB - 20) + i // 8, mask=mask, other=0).to(tl.int32)
                q = q | (((qh >> (i % 8)) & 1) << 4)
            if FMT == Q4_0:
                return scale * (q - 8).to(tl.float32)
            elif FMT == Q5_0:
                return scale * (q - 16).to(tl.float32)
            else:  # q4_1, q5_1: d * q + m
                mn = _half(tl.load(blk + 2, mask=mask, other=0), tl.load(blk + 3, mask=mask, other=0))
                return scale * q.to(tl.float32) + mn


@triton.jit
def k_scores_kernel(
    q_ptr,
    x_ptr,
    s_ptr,
    z_ptr,
    n_ptr,
    out_ptr,
    H,
    M,
    T,
    D,
    offset,
    group,
    ngroup,
    sqb,
    sqh,
    sqm,
    sxb,
    sxh,
    sxt,
    ssb,
    ssh,
    sst,
    szb,
    szh,
    szt,
    snb,
    snh,
    snt,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    NB: tl.constexpr,
    VN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out (B, H, M, T) contiguous = q (B, H, M, D) @ K^T; grid (B * H, cdiv(T, BLOCK_T), cdiv(M, BLOCK_M))."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    d = tl.arange(0, BLOCK_D)
    q_mask = (m < M)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * sqb + h * sqh + m[:, None] * sqm + d[None, :], mask=q_mask, other=0.0)
    k = tile(
        x_ptr + b * sxb + h * sxh,
        s_ptr + b * ssb + h * ssh,
        z_ptr + b * szb + h * szh,
        n_ptr + b * snb + h * snh,
        sxt,
        sst,
        szt,
        snt,
        t[:, None],
        d[None, :],
        (t < T)[:, None],
        (d < D)[None, :],
        offset,
        group,
        ngroup,
        FMT,
        BITS,
        NB,
        VN,
    )  # (BLOCK_T, BLOCK_D)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # (BLOCK_M, BLOCK_T)
    out = out_ptr + (bh * M + m[:, None]) * T + t[None, :]
    tl.store(out, scores, mask=(m < M)[:, None] & (t < T)[None, :])


@triton.jit
def v_partial_kernel(
    p_ptr,
    x_ptr,
    s_ptr,
    z_ptr,
    n_ptr,
    out_ptr,
    H,
    M,
    T,
    D,
    offset,
    group,
    ngroup,
    TILES,
    spb,
    sph,
    spm,
    sxb,
    sxh,
    sxt,
    ssb,
    ssh,
    sst,
    szb,
    szh,
    szt,
    snb,
    snh,
    snt,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    NB: tl.constexpr,
    VN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out (B * H, S, M, D) contiguous: split s's share of p (B, H, M, T) @ V, over its TILES token tiles;
    grid (B * H, S, cdiv(M, BLOCK_M))."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    p_row = p_ptr + b * spb + h * sph + m[:, None] * spm  # (BLOCK_M, 1)
    x_base, s_base, z_base = x_ptr + b * sxb + h * sxh, s_ptr + b * ssb + h * ssh, z_ptr + b * szb + h * szh
    n_base = n_ptr + b * snb + h * snh
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    for i in range(0, TILES):
        t = (split * TILES + i) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) int64
        p = tl.load(p_row + t[None, :], mask=(m < M)[:, None] & (t < T)[None, :], other=0.0)
        v = tile(
            x_base,
            s_base,
            z_base,
            n_base,
            sxt,
            sst,
            szt,
            snt,
            t[:, None],
            d[None, :],
            (t < T)[:, None],
            (d < D)[None, :],
            offset,
            group,
            ngroup,
            FMT,
            BITS,
            NB,
            VN,
        )  # (BLOCK_T, BLOCK_D), 0 outside the body
        acc += tl.dot(p, v, input_precision="ieee")
    n_split = tl.num_programs(1)
    out = out_ptr + ((bh * n_split + split) * M + m[:, None]) * D + d[None, :]
    tl.store(out, acc, mask=(m < M)[:, None] & (d < D)[None, :])
