"""The Triton rows program behind :mod:`.gpu_rows`: a decode step's attention for many rows in one launch.

Imported only by :func:`kvslim.kernels.gpu.programs` (``programs("triton_rows")``), one copy per mode like
:mod:`.triton_kernels`, whose tile decoder (:func:`~.triton_kernels.tile`) it calls: the copy of that module of
the same mode, asked for while this one loads.

:func:`rows_kernel` is ``kv_attend_rows`` (csrc/kvslim_kernels.c) on the GPU: one program per (row, KV head)
of a row table built once per step (:mod:`.gpu_rows`), grid ``(rows, H_kv)``. A program holds its head's M
query rows (the GQA group folded into M, as everywhere in kvslim) and reads its row's segments in order::

    [ sinks (fp) | K body: piece, piece, ... | K residual (fp) ]     scores -> the row's scratch (M, T)
    [ sinks (fp) | V body: piece, piece, ... | V residual (fp) ]     exp(score - max) @ V, summed

Phase 1 writes every score of the row to its scratch and keeps the running maximum per query row; phase 2
reads them back (a CTA barrier between: the same program wrote them, other threads of it read them), weights
the values by ``exp(score - max)`` and sums the weights; the output is the sum over the weights. K and V may
cut the token axis at different points (per-channel K keeps whole groups, per-token V does not), which is why
the scores go through memory rather than one online-softmax pass over (K, V) tiles. A body piece is a block
anywhere in memory (a cache's body view, or a paged pool's block): the table holds its element offsets from the
launch's template tensor of each part (:mod:`.gpu_rows`), its strides and its group facts. The body of a row
stored in a Hadamard basis is scored with the query rotated once (``q @ H_k``) and its value sum rotated back
once (``@ H_v``), both as a ``tl.dot`` with the normalized block-diagonal matrix.

Not split over the tokens: one program reads one row's head whole (flash-decoding's split, as the per-row
:func:`~.triton_kernels.v_partial_kernel` has, is the step after this one for few long rows on a big GPU).
Unmeasured: no GPU was available when this was written; the interpreter tests check the values.
"""

import triton
import triton.language as tl

from . import gpu as _gpu

tile = _gpu.programs().tile  # the decoder of this mode's copy of triton_kernels
_maximum, _add = _gpu.programs()._maximum, _gpu.programs()._add  # tl.reduce's combiners

#: int64 fields of a row record: qrow, S, RK, RV, NK, NV, K first piece, K pieces, V first piece, V pieces,
#: K Hadamard matrix, V Hadamard matrix, scratch offset, T, then (offset, head stride, token stride) of k_sink,
#: v_sink, k_res, v_res from their launch templates.
ROW_FIELDS = tl.constexpr(26)
#: int64 fields of a piece record: n, offset, group, ngroup, then the element offsets of x, s, z, f from their
#: launch templates, then the (head, token) strides of x, s, z, f.
PIECE_FIELDS = tl.constexpr(16)


@triton.jit
def _fp_scores(q, base, sh, st, n, col0, h, scr, T, m, d, m_ok, d_ok, mx, BLOCK_T: tl.constexpr):
    """Scores of q (BLOCK_M, BLOCK_D) against n full-precision keys (head stride sh, token stride st) into
    columns col0.. of scr (M, T); returns the running maximum mx (BLOCK_M,)."""
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        t_ok = t < n
        k = tl.load(
            base + h * sh + t[:, None] * st + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0
        )
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # (BLOCK_M, BLOCK_T)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        tl.store(scr + m[:, None] * T + col0 + t[None, :], s, mask=m_ok[:, None] & t_ok[None, :])
        mx = tl.maximum(mx, tl.reduce(s, 1, _maximum))
    return mx


@triton.jit
def _fp_sum(acc, w, base, sh, st, n, col0, h, scr, T, m, d, m_ok, d_ok, mx, BLOCK_T: tl.constexpr):
    """acc (BLOCK_M, BLOCK_D) += exp(scores - mx) @ V over n full-precision values, w (BLOCK_M,) += the weights."""
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        t_ok = t < n
        s = tl.load(
            scr + m[:, None] * T + col0 + t[None, :], mask=m_ok[:, None] & t_ok[None, :], other=float("-inf")
        )
        p = tl.exp(s - mx[:, None])
        w += tl.reduce(p, 1, _add)
        v = tl.load(
            base + h * sh + t[:, None] * st + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0
        )
        acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return acc, w


@triton.jit
def _body(
    q_or_acc, w, pt_ptr, first, count, x_ptr, s_ptr, z_ptr, f_ptr, col0, h, scr, T, m, d, m_ok, d_ok, mx,
    IS_V: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, VN: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    """A body's pieces ``first .. first + count`` in order, its tokens at columns col0.. of the scores; returns
    (q_or_acc, mx, w). K (IS_V False): q_or_acc is the body's queries, the scores are written and mx (BLOCK_M,)
    is the running maximum. V: q_or_acc is the body's sum, the weights are added to w (BLOCK_M,)."""
    col = col0
    for i in range(first, first + count):
        pc = pt_ptr + i * PIECE_FIELDS
        n = tl.load(pc + 0)
        offset = tl.load(pc + 1)
        group = tl.load(pc + 2)
        ngroup = tl.load(pc + 3)
        xb = x_ptr + tl.load(pc + 4) + h * tl.load(pc + 8)
        sb = s_ptr + tl.load(pc + 5) + h * tl.load(pc + 10)
        zb = z_ptr + tl.load(pc + 6) + h * tl.load(pc + 12)
        fb = f_ptr + tl.load(pc + 7) + h * tl.load(pc + 14)
        sxt, sst, szt, sft = tl.load(pc + 9), tl.load(pc + 11), tl.load(pc + 13), tl.load(pc + 15)
        for t0 in range(0, n, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            t_ok = t < n
            x = tile(
                xb, sb, zb, fb, sxt, sst, szt, sft, t[:, None], d[None, :], t_ok[:, None], d_ok[None, :],
                offset, group, ngroup, FMT, BITS, NB, VN,
            )  # fmt: skip
            if IS_V:
                s = tl.load(
                    scr + m[:, None] * T + col + t[None, :],
                    mask=m_ok[:, None] & t_ok[None, :],
                    other=float("-inf"),
                )
                p = tl.exp(s - mx[:, None])
                w += tl.reduce(p, 1, _add)
                q_or_acc += tl.dot(p, x, input_precision="ieee")
            else:
                s = tl.dot(q_or_acc, tl.trans(x), input_precision="ieee")
                s = tl.where(t_ok[None, :], s, float("-inf"))
                tl.store(scr + m[:, None] * T + col + t[None, :], s, mask=m_ok[:, None] & t_ok[None, :])
                mx = tl.maximum(mx, tl.reduce(s, 1, _maximum))
        col += n
    return q_or_acc, mx, w


@triton.jit
def rows_kernel(
    q_ptr, out_ptr, rt_ptr, pt_ptr, scr_ptr, had_ptr,
    ksk_ptr, vsk_ptr, kre_ptr, vre_ptr,
    kx_ptr, ks_ptr, kz_ptr, kf_ptr, vx_ptr, vs_ptr, vz_ptr, vf_ptr,
    M, D, sqn, sqh, sqm, son, soh, som,
    KFMT: tl.constexpr, KBITS: tl.constexpr, KNB: tl.constexpr, KVN: tl.constexpr,
    VFMT: tl.constexpr, VBITS: tl.constexpr, VNB: tl.constexpr, VVN: tl.constexpr,
    KHAD: tl.constexpr, VHAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[qrow, h] (M, D) = softmax(q[qrow, h] . keys) @ values of row r of the table, head h; grid (R, H_kv).
    q, out (N, H, M, D) fp32 (q already scaled); scr_ptr: the rows' scores (row r's (H, M, T) at its offset);
    had_ptr: (n, BLOCK_D, BLOCK_D) fp32 normalized Hadamard matrices (KHAD / VHAD: the rows' bodies are rotated)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    row = rt_ptr + r * ROW_FIELDS
    qrow, S, RK, RV = tl.load(row + 0), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    NK, NV, T = tl.load(row + 4), tl.load(row + 5), tl.load(row + 13)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = m < M, d < D
    q = tl.load(
        q_ptr + qrow * sqn + h * sqh + m[:, None] * sqm + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    hm = d[:, None] * BLOCK_D + d[None, :]  # a (BLOCK_D, BLOCK_D) matrix's elements
    qb = q
    if KHAD:  # the body's queries in its basis: (H q) . k = q . (H k), H symmetric
        qb = tl.dot(q, tl.load(had_ptr + tl.load(row + 10) * BLOCK_D * BLOCK_D + hm), input_precision="ieee")
    scr = scr_ptr + tl.load(row + 12) + h * M * T  # this head's (M, T) scores
    w = tl.full((BLOCK_M,), 0.0, tl.float32)
    mx = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    # 1. scores: sinks, body pieces, residual
    mx = _fp_scores(
        q,
        ksk_ptr + tl.load(row + 14),
        tl.load(row + 15),
        tl.load(row + 16),
        S,
        0,
        h,
        scr,
        T,
        m,
        d,
        m_ok,
        d_ok,
        mx,
        BLOCK_T,
    )
    _, mx, w = _body(
        qb, w, pt_ptr, tl.load(row + 6), tl.load(row + 7), kx_ptr, ks_ptr, kz_ptr, kf_ptr, S, h, scr, T, m, d,
        m_ok, d_ok, mx, False, KFMT, KBITS, KNB, KVN, BLOCK_T,
    )  # fmt: skip
    mx = _fp_scores(
        q,
        kre_ptr + tl.load(row + 20),
        tl.load(row + 21),
        tl.load(row + 22),
        RK,
        S + NK,
        h,
        scr,
        T,
        m,
        d,
        m_ok,
        d_ok,
        mx,
        BLOCK_T,
    )
    tl.debug_barrier()  # every score of the row is in scr before any is read back
    # 2. exp(score - max) times the values: sinks, body pieces (rotated back once), residual
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    acc, w = _fp_sum(
        acc,
        w,
        vsk_ptr + tl.load(row + 17),
        tl.load(row + 18),
        tl.load(row + 19),
        S,
        0,
        h,
        scr,
        T,
        m,
        d,
        m_ok,
        d_ok,
        mx,
        BLOCK_T,
    )
    body = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    body, _, w = _body(
        body, w, pt_ptr, tl.load(row + 8), tl.load(row + 9), vx_ptr, vs_ptr, vz_ptr, vf_ptr, S, h, scr, T, m, d,
        m_ok, d_ok, mx, True, VFMT, VBITS, VNB, VVN, BLOCK_T,
    )  # fmt: skip
    if VHAD:  # the body's sum back in the model's basis
        body = tl.dot(
            body, tl.load(had_ptr + tl.load(row + 11) * BLOCK_D * BLOCK_D + hm), input_precision="ieee"
        )
    acc += body
    acc, w = _fp_sum(
        acc,
        w,
        vre_ptr + tl.load(row + 23),
        tl.load(row + 24),
        tl.load(row + 25),
        RV,
        S + NV,
        h,
        scr,
        T,
        m,
        d,
        m_ok,
        d_ok,
        mx,
        BLOCK_T,
    )
    w = tl.where(w > 0, w, 1.0)  # padded query rows (m >= M) have no weight
    out = out_ptr + qrow * son + h * soh + m[:, None] * som + d[None, :]
    tl.store(out, acc / w[:, None], mask=m_ok[:, None] & d_ok[None, :])
