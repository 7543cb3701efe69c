"""The Triton program behind :mod:`kvslim.vllm.attend_triton`: attention on kvslim pages over block tables, the
contract of the C kernel ``kvp_attend`` (csrc/kvslim_paged.c) for CUDA tensors.

Imported only by :func:`kvslim.kernels.gpu.programs` (``programs("triton_pages")``), one copy per mode like
:mod:`.triton_kernels`, whose tile decoder (:func:`~.triton_kernels.tile`) it calls for the GGML blocks and the
per-token affine and fp8 rows: the copy of that module of the same mode.

:func:`pages_kernel`: one program per (query token, KV head), grid ``(N, H_kv)``. A program holds its head's M query
heads (the GQA group folded into M, padded to a ``tl.dot`` tile) and reads its row's keys a page at a time (a page
is 32 tokens of one KV head; a token's row holds K then V, each in its part's format), in one pass of online softmax
(flash attention's running maximum and sum: Dao et al., 2022): K and V are both per token in a page, so a page's
keys and values are decoded together. What it reads, for a query at position ``qpos`` of its row:

- the row's cached keys ``0 .. cached - 1`` from its pages (``cached`` already cut at ``qpos + 1`` for a causal
  query where the step's own tokens are in the pages); with a window, only keys ``>= qpos - window + 1`` and the
  sinks ``< sink``, and the pages between the sink pages and the window's first page are never read (a pool may
  have freed them);
- a page with a staging slot (:mod:`kvslim.vllm.staging`) from the slot's full-precision copy instead of its codes;
- the row's new keys, raw, from the step's K/V (``nnew`` of them: those up to the query, for a causal one).

Page parts (``FAM``): the GGML blocks, per-token affine codes with an fp16 scale and zero (one group a head), fp8
codes with an fp32 scale (all three through :func:`~.triton_kernels.tile`, the same decode as every other Triton
program of kvslim), symmetric int8 (an fp16 scale, then int8 codes) and plain values (fp32, fp16, bf16: ``CAST``
0, 1, 2). The host (:mod:`kvslim.vllm.attend_triton`) checks that a part's typed loads are aligned.

Not split over the tokens (flash-decoding's split, for few long rows on a big GPU, is the next step). Unmeasured: no
GPU was available when this was written; the interpreter tests (tests/test_triton_pages.py) check the values
against the torch reference and the C kernel.
"""

import triton
import triton.language as tl

from . import gpu as _gpu

_k = _gpu.programs()  # this mode's copy of triton_kernels
tile = _k.tile
_half = _k._half
_e4m3 = _k._e4m3
_maximum, _add = _k._maximum, _k._add  # tl.reduce's combiners
#: GGML kind name -> the tile decoder's layout code
GGML_CODES = _k.GGML

#: page part families (the FAM argument)
P_GGML, P_AFFINE, P_SYM, P_FP8, P_CAST = (tl.constexpr(i) for i in range(5))
#: int64 fields of a query token's record: row, qpos, cached, new0, nnew
TOKEN_FIELDS = tl.constexpr(5)


@triton.jit
def _f32(ptr, mask):
    """The little-endian fp32 numbers at uint8 addresses ``ptr`` (any alignment); 0 outside ``mask``."""
    b0 = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    b1 = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint32)
    b2 = tl.load(ptr + 2, mask=mask, other=0).to(tl.uint32)
    b3 = tl.load(ptr + 3, mask=mask, other=0).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _part(
    base, st, t, d, t_ok, d_ok, D,
    FAM: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, CAST: tl.constexpr,
    ALIGN4: tl.constexpr,
):  # fmt: skip
    """One role's values fp32 (BLOCK_T, BLOCK_D) of a page's tokens ``t`` (BLOCK_T, 1) int64 and channels ``d``
    (1, BLOCK_D): ``base`` the uint8 address of the part in the page's first token row of this head, ``st`` the
    token stride in bytes; 0 outside ``t_ok & d_ok``."""
    mask = t_ok & d_ok
    if FAM == P_CAST:
        if CAST == 0:
            if ALIGN4:
                return tl.load(base.to(tl.pointer_type(tl.float32)) + t * (st // 4) + d, mask=mask, other=0.0)
            else:  # a row whose fp32 values sit off a 4-byte boundary (after an int8 K's 66 bytes): byte by byte
                return _f32(base + t * st + d * 4, mask)
        else:
            bits = tl.load(base.to(tl.pointer_type(tl.uint16)) + t * (st // 2) + d, mask=mask, other=0)
            if CAST == 1:
                return bits.to(tl.float16, bitcast=True).to(tl.float32)
            else:  # bfloat16: the top half of an fp32
                return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif FAM == P_SYM:  # an fp16 scale, then D int8 codes
        scale = _half(
            tl.load(base + t * st, mask=t_ok, other=0), tl.load(base + t * st + 1, mask=t_ok, other=0)
        )
        q = tl.load(base + t * st + 2 + d, mask=mask, other=0).to(tl.int8, bitcast=True)
        return scale * q.to(tl.float32)
    elif FAM == P_AFFINE:  # codes, then the fp16 scale and zero of the whole head (V's per-token codec)
        nbytes = (D * BITS + 7) // 8
        meta = (base + nbytes).to(tl.pointer_type(tl.float16))
        return tl.where(
            mask,
            tile(
                base,
                meta,
                meta + 1,
                base,
                st,
                st // 2,
                st // 2,
                0,
                t,
                d,
                t_ok,
                d_ok,
                0,
                D,
                1,
                1,
                BITS,
                0,
                False,
            ),
            0.0,
        )
    elif (
        FAM == P_FP8
    ):  # D e4m3 codes, then an fp32 scale (read byte by byte: it may sit off a 4-byte boundary)
        codes = tl.load(base + t * st + d, mask=mask, other=0)
        return tl.where(mask, _e4m3(codes) * _f32(base + t * st + D, t_ok), 0.0)
    else:  # GGML blocks of 32 along D
        return tile(base, base, base, base, st, 0, 0, 0, t, d, t_ok, d_ok, 0, 1, 1, FMT, BITS, NB, False)


@triton.jit
def _update(q, kt, vt, ok, mx, w, acc, scale):
    """One tile of keys ``kt`` and values ``vt`` (BLOCK_T, BLOCK_D) into the running (max, sum, acc) of queries q
    (BLOCK_M, BLOCK_D); ``ok`` (BLOCK_T,) the keys the queries see."""
    s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # (BLOCK_M, BLOCK_T)
    s = tl.where(ok[None, :], s, float("-inf"))
    new = tl.maximum(mx, tl.reduce(s, 1, _maximum))
    safe = tl.where(new == float("-inf"), 0.0, new)  # nothing seen yet: exp(-inf - 0) = 0, never NaN
    alpha = tl.exp(mx - safe)
    p = tl.exp(s - safe[:, None])
    w = w * alpha + tl.reduce(p, 1, _add)
    acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
    return new, w, acc


@triton.jit
def pages_kernel(
    q_ptr, out_ptr, tok_ptr, bt_ptr, kv_ptr, key_ptr, val_ptr, stage_ptr, smap_ptr,
    sqn, sqh, son, soh, sbt, sp, sh, st, skn, skh, svn, svh, ssp, ssh, sst, n_map,
    M, D, T, window, sink, k_off, v_off, s_voff, scale,
    KFAM: tl.constexpr, KFMT: tl.constexpr, KBITS: tl.constexpr, KNB: tl.constexpr, KCAST: tl.constexpr,
    KALIGN: tl.constexpr,
    VFAM: tl.constexpr, VFMT: tl.constexpr, VBITS: tl.constexpr, VNB: tl.constexpr, VCAST: tl.constexpr,
    VALIGN: tl.constexpr,
    SCAST: tl.constexpr, STAGED: tl.constexpr, HAS_NEW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[n, h * M .. h * M + M - 1] (M, D) fp32 = softmax(scale * q . keys) @ values for query token n and KV head
    h; grid (N, H_kv). q (N, H_q, D) fp32 in K's basis; tok_ptr: int64 (N, 5) records (row, qpos, cached, new0,
    nnew); bt_ptr: int32 block tables (R, sbt); kv_ptr: uint8 pages (strides sp, sh, st in bytes, page of T =
    BLOCK_T tokens); key_ptr / val_ptr: the step's raw K / V fp32 (token and head strides in elements; HAS_NEW);
    stage_ptr: uint8 staging slots in the model's dtype (``SCAST``; strides in bytes; V at ``s_voff``), smap_ptr:
    int32 page -> slot or -1 (``n_map`` entries; STAGED)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rec = tok_ptr + n * TOKEN_FIELDS
    r, qpos, cached = tl.load(rec + 0), tl.load(rec + 1), tl.load(rec + 2)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_ok, d_ok = m < M, d < D
    q = tl.load(
        q_ptr + n * sqn + (h * M + m[:, None]) * sqh + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    mx = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    w = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    t = tl.arange(0, BLOCK_T).to(tl.int64)
    tt, dd, dk = t[:, None], d[None, :], d_ok[None, :]
    # the keys seen: kpos >= lo, or a sink (kpos < sink) under a window
    lo = tl.where(window > 0, tl.maximum(qpos - window + 1, 0), 0)
    sinks = tl.where(window > 0, tl.minimum(sink, cached), 0)
    sink_pages = (sinks + T - 1) // T
    first = tl.maximum(lo // T, sink_pages)
    last = (cached + T - 1) // T
    for i in range(0, sink_pages + tl.maximum(last - first, 0)):
        p = tl.where(i < sink_pages, i, first + i - sink_pages)
        kpos = p * T + t
        ok = (kpos < cached) & ((kpos >= lo) | (kpos < sinks))
        page = tl.load(bt_ptr + r * sbt + p).to(tl.int64)
        slot = -1
        if STAGED:
            slot = tl.load(smap_ptr + page, mask=page < n_map, other=-1)
        if slot >= 0:  # the partly filled page's full-precision copy
            sb = stage_ptr + slot * ssp + h * ssh
            kt = _part(sb, sst, tt, dd, ok[:, None], dk, D, P_CAST, 0, 0, 0, SCAST, True)
            vt = _part(sb + s_voff, sst, tt, dd, ok[:, None], dk, D, P_CAST, 0, 0, 0, SCAST, True)
        else:
            pb = kv_ptr + page * sp + h * sh
            kt = _part(pb + k_off, st, tt, dd, ok[:, None], dk, D, KFAM, KFMT, KBITS, KNB, KCAST, KALIGN)
            vt = _part(pb + v_off, st, tt, dd, ok[:, None], dk, D, VFAM, VFMT, VBITS, VNB, VCAST, VALIGN)
        mx, w, acc = _update(q, kt, vt, ok, mx, w, acc, scale)
    if HAS_NEW:  # the row's own tokens of this step, raw
        new0, nnew = tl.load(rec + 3), tl.load(rec + 4)
        for t0 in range(0, nnew, BLOCK_T):
            j = t0 + t
            kpos = cached + j
            ok = (j < nnew) & ((kpos >= lo) | (kpos < sink))
            mask = ok[:, None] & d_ok[None, :]
            kt = tl.load(key_ptr + (new0 + j[:, None]) * skn + h * skh + d[None, :], mask=mask, other=0.0)
            vt = tl.load(val_ptr + (new0 + j[:, None]) * svn + h * svh + d[None, :], mask=mask, other=0.0)
            mx, w, acc = _update(q, kt, vt, ok, mx, w, acc, scale)
    w = tl.where(w > 0, w, 1.0)  # padded query heads (m >= M) have no weight
    tl.store(
        out_ptr + n * son + (h * M + m[:, None]) * soh + d[None, :],
        acc / w[:, None],
        mask=m_ok[:, None] & d_ok[None, :],
    )
