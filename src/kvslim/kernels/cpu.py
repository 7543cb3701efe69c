"""The C kernels (``csrc/*.c``, built and loaded by :mod:`kvslim.kernels.clib`) called through ctypes.

The wrappers validate every shape against the codec (the encoded-layout contract,
:func:`kvslim.formats.layout.body_layout`) before handing raw pointers to C (a wrong shape there would
read out of bounds, not raise). Tensors are passed as (pointer, element strides of dims 0..2); a last dim
that is not contiguous is copied first. Nothing here raises at import; an unusable library leaves
:func:`status` False and the dispatcher in :mod:`kvslim.kernels` uses the PyTorch reference.
"""

from __future__ import annotations

import array
from typing import NamedTuple

import torch

from ..formats import Codec, Encoded
from ..formats.layout import body_layout, rows_contiguous
from ..formats.varnorm import factor_part
from . import records
from .clib import NAMED_ROWS, ROWS_LAYOUT, library, row_code, status  # noqa: F401 - the dispatcher reads cpu.status
from .cpu_parts import CENTERED
from .cpu_parts import DT as _DT
from .cpu_parts import bias_part as _bias_part
from .cpu_parts import flags_part as _flags_part
from .cpu_parts import fp_part as _fp_part
from .cpu_parts import part as _part
from .cpu_parts import piece_queries as _piece_queries
from .cpu_parts import piece_transform as _piece_transform
from .cpu_parts import rot_part as _rot_part
from .cpu_parts import transform_parts as _transform_parts

#: Longest query axis (GQA group x new tokens) the C kernels take. They redo the dot products per
#: query, where decode + GEMM amortizes the decode: measured (1 thread, T=4096, 3 KV heads, D=64) the
#: C kernels take 0.2-0.3x the reference's time at M=32..48 and draw level around M=96.
MAX_M = 64

#: kv_run's operations and its argument layout (see the end of csrc/kvslim_kernels.c)
_OP_K_ROWS, _OP_V_ROWS, _OP_K_AFFINE, _OP_V_AFFINE, _OP_K_ROWS_T, _OP_K_AFFINE_T = range(6)
_NPARAM = 8


# --------------------------------------------------------------------------- argument marshalling


def _run(op: int, what: str, dims: tuple, params: tuple, parts: tuple) -> None:
    """Call kv_run: dims (B, H, M, T, D), up to 8 int params, tensors (B, H, N, ...) whose dims after 2
    are contiguous, passed as (pointer, element strides of dims 0..2, dtype code)."""
    vals = [*dims, torch.get_num_threads(), *params, *(0,) * (_NPARAM - len(params))]
    _call(lambda a: library().kv_run(op, a), what, vals, parts)


def _call(entry, what: str, vals: list, parts, tail: tuple = ()) -> None:
    """``entry(args)`` on one int64 array: ``vals``, then (pointer, element strides of dims 0..2, dtype code)
    per tensor of ``parts``; its return code as Python's error (1: out of memory, other nonzero: rejected)."""
    for t in parts:
        if t is None:  # an absent optional part (C reads data 0 as none)
            vals += (0, 0, 0, 0, _DT[torch.uint8])
            continue
        s = t.stride()
        vals += (t.data_ptr(), s[0], s[1], s[2], _DT[t.dtype])
    vals += tail
    args = array.array("q", vals)  # one int64 array, far cheaper to marshal than ctypes structs; held until the call returns
    rc = entry(args.buffer_info()[0])
    if rc == 1:
        raise MemoryError(f"kvslim C kernel {what}: out of memory for its scratch buffers")
    if rc:
        raise ValueError(f"kvslim C kernel {what} rejected its arguments (code {rc})")


# --------------------------------------------------------------------------- KIVI per-channel K


def _affine_k_parts(codec: Codec, enc: Encoded, b: int, h: int, t: int, d: int, offset: int):
    lay = body_layout(codec, enc, b, h, t, d, offset)
    return lay.x, lay.scale, lay.zero


def k_affine(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """Per-channel affine K scores: q (B, H, M, D) fp32 -> (B, H, M, T)."""
    b, h, m, d = q.shape
    t = enc.token["codes"].shape[2]
    codes, scale, zero = _affine_k_parts(codec, enc, b, h, t, d, offset)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    _run(
        _OP_K_AFFINE,
        "k_affine",
        (b, h, m, t, d),
        (codec.bits, codec.token_group, offset),
        (q, codes, scale, zero, out, _vn_part(codec, enc, b, h, t, d, offset)),
    )
    return out


def k_affine_transformed(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int, tr) -> torch.Tensor:
    """Per-channel affine K scores against transformed keys (kvslim.kernels.KeyTransform): (B, H, M, T)."""
    b, h, m, d = q.shape
    t = enc.token["codes"].shape[2]
    codes, scale, zero = _affine_k_parts(codec, enc, b, h, t, d, offset)
    params, extra = _transform_parts(q, tr, t)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    _run(
        _OP_K_AFFINE_T,
        "k_affine_transformed",
        (b, h, m, t, d),
        (codec.bits, codec.token_group, offset, *params),
        (q, codes, scale, zero, out, *extra, _vn_part(codec, enc, b, h, t, d, offset)),
    )
    return out


# --------------------------------------------------------------------------- KIVI per-token V


def _v_group(codec: Codec, d: int) -> int:
    return d if codec.group_size is None else codec.group_size


def affine_k_supported(codec: Codec, enc: Encoded) -> bool:
    """Whether the C kernels read this per-channel K body (every one, variance-normalized ones too, but one whose
    codes index a Lloyd-Max level table, :mod:`kvslim.formats.codebook`: the torch reference decodes those)."""
    return not getattr(codec, "levels", None)


#: The checked factor part of a variance-normalized affine body (K token factors, V channel factors; None for a
#: plain body): one contract with the Triton kernels.
_vn_part = factor_part


def affine_v_supported(codec: Codec, enc: Encoded) -> bool:
    """The C kernel needs each channel group to be whole packing units of codes (g a multiple of the unit's
    codes, ``Format.pack``: 1, 2, 4, or 8 for int3), and uniform codes (no Lloyd-Max level table)."""
    if getattr(codec, "levels", None):
        return False
    per, nbytes = codec.format.pack
    d = enc.token["codes"].shape[-1] // nbytes * per
    g = _v_group(codec, d)
    return d % g == 0 and g % per == 0


def v_affine(p: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """Per-token affine V weighted sum: p (B, H, M, T) fp32 -> (B, H, M, D)."""
    b, h, m, t = p.shape
    lay = body_layout(codec, enc, b, h, t)
    d = lay.d
    out = torch.empty((b, h, m, d), dtype=torch.float32)
    _run(
        _OP_V_AFFINE,
        "v_affine",
        (b, h, m, t, d),
        (codec.bits, lay.group, codec.token_group, offset),
        (p, lay.x, lay.scale, lay.zero, out, _vn_part(codec, enc, b, h, t, d, offset)),
    )
    return out


# --------------------------------------------------------------------------- per-token rows


def _row_parts(codec: Codec, enc: Encoded, b: int, h: int, t: int, d: int | None):
    """(format code, row tensor, fp8 scale or a dummy, D) of a GGML / fp8 / cast body."""
    family = codec.family
    if family not in (*NAMED_ROWS, "cast"):
        raise ValueError(f"the row kernels do not decode codec {codec.name!r} (family {family})")
    lay = body_layout(codec, enc, b, h, t, d)
    code = row_code(codec.name if family in NAMED_ROWS else lay.x.dtype)
    return code, lay.x, lay.x if lay.scale is None else lay.scale, lay.d


def rows_supported(codec: Codec, enc: Encoded) -> bool:
    """Whether the C library has a row decoder for this body (by format name, or the cast's dtype)."""
    if codec.family in NAMED_ROWS:
        return row_code(codec.name) is not None
    x = enc.token.get("x")
    return codec.family == "cast" and x is not None and row_code(x.dtype) is not None


def k_rows(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """Per-token formats (GGML, fp8, fp16/bf16/fp32): q (B, H, M, D) fp32 -> (B, H, M, T)."""
    b, h, m, d = q.shape
    t = next(iter(enc.token.values())).shape[2]
    fmt, x, xs, d = _row_parts(codec, enc, b, h, t, d)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    _run(_OP_K_ROWS, "k_rows", (b, h, m, t, d), (fmt,), (q, x, xs, out))
    return out


def k_rows_transformed(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int, tr) -> torch.Tensor:
    """Per-token formats against transformed keys (kvslim.kernels.KeyTransform): (B, H, M, T)."""
    b, h, m, d = q.shape
    t = next(iter(enc.token.values())).shape[2]
    fmt, x, xs, d = _row_parts(codec, enc, b, h, t, d)
    params, extra = _transform_parts(q, tr, t)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    _run(_OP_K_ROWS_T, "k_rows_transformed", (b, h, m, t, d), (fmt, 0, 0, *params), (q, x, xs, out, *extra))
    return out


def v_rows(p: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """Per-token formats: p (B, H, M, T) fp32 -> (B, H, M, D)."""
    b, h, m, t = p.shape
    fmt, x, xs, d = _row_parts(codec, enc, b, h, t, None)
    out = torch.empty((b, h, m, d), dtype=torch.float32)
    _run(_OP_V_ROWS, "v_rows", (b, h, m, t, d), (fmt,), (p, x, xs, out))
    return out


def half_to_float(bits: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """The C side's fp16 -> fp32 conversion (F16C when built for it, else bit arithmetic; ``portable``
    forces the latter) of uint16/int16 bit patterns, for the tests."""
    src = bits.to(torch.int16).contiguous()
    dst = torch.empty(src.shape, dtype=torch.float32)
    library().kv_test_half_to_float(src.data_ptr(), dst.data_ptr(), src.numel(), int(portable))
    return dst


# --------------------------------------------------------------------------- fused decode attention


def _body_args(codec: Codec, enc: Encoded, b: int, h: int, d: int, offset: int, role: str):
    """(kind, code, group, offset, tokens) and the three parts of a K or V body for kv_attend."""
    n = next(iter(enc.token.values())).shape[2]
    if codec.family in ("affine_k", "affine_v"):
        lay = body_layout(codec, enc, b, h, n, d, offset if role == "k" else 0)
        group = codec.token_group if role == "k" else lay.group
        vn = _vn_part(codec, enc, b, h, n, lay.d, offset)
        return (1, codec.bits, group, offset if role == "k" else 0, n), (lay.x, lay.scale, lay.zero), vn
    fmt, x, xs, _ = _row_parts(codec, enc, b, h, n, d)
    return (0, fmt, 1, 0, n), (x, xs, x), None


def attend_supported(codec_k: Codec, enc_k: Encoded, codec_v: Codec, enc_v: Encoded) -> bool:
    """Whether :func:`attend` reads both bodies: per-channel K or rows, per-token V or rows, in C."""
    k_ok = (codec_k.family == "affine_k" and affine_k_supported(codec_k, enc_k)) or rows_supported(codec_k, enc_k)
    v_ok = (codec_v.family == "affine_v" and affine_v_supported(codec_v, enc_v)) or rows_supported(codec_v, enc_v)
    return k_ok and v_ok


def attend(
    q: torch.Tensor,
    k_sink: torch.Tensor | None,
    v_sink: torch.Tensor | None,
    k_res: torch.Tensor | None,
    v_res: torch.Tensor | None,
    k_codec: Codec,
    k_body: Encoded,
    k_offset: int,
    v_codec: Codec,
    v_body: Encoded,
    k_hblock: int = 0,
    v_hblock: int = 0,
    v_offset: int = 0,
) -> torch.Tensor:
    """One layer's decode attention in one C call: q (B, H, M, D) fp32, already scaled, against the sinks, the
    encoded bodies and the residual (full-precision parts (B, H, n, D) fp32/fp16/bf16 or None), softmax over
    all of them, the weighted values summed: (B, H, M, D) fp32. The bodies are stored in a normalized
    Hadamard basis of block ``k_hblock`` / ``v_hblock`` (0: none): the body's keys are scored with the
    rotated query, the body's value sum is rotated back. ``v_offset``: where the V body's first token sits in its
    group (a variance-normalized V's channel factors are per group of ``token_group`` tokens; 0 otherwise)."""
    if q.dim() != 4 or q.dtype != torch.float32:
        raise ValueError(f"fused attention: q must be (B, H, M, D) float32, got {tuple(q.shape)} {q.dtype}")
    q = rows_contiguous(q)
    b, h, m, d = q.shape
    dummy = q
    fp = []
    for t in (k_sink, v_sink, k_res, v_res):
        if t is None or t.shape[2] == 0:
            fp.append((0, dummy))
            continue
        if tuple(t.shape[:2]) != (b, h) or t.shape[3] != d or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"fused attention: a full-precision part {tuple(t.shape)} {t.dtype} does not fit q {tuple(q.shape)}"
            )
        fp.append((t.shape[2], rows_contiguous(t)))
    (s_k, ks), (s_v, vs), (rk, kr), (rv, vr) = fp
    if s_k != s_v:
        raise ValueError(f"fused attention: {s_k} sink keys but {s_v} sink values")
    kp, kparts, kvn = _body_args(k_codec, k_body, b, h, d, k_offset, "k")
    vp, vparts, vvn = _body_args(v_codec, v_body, b, h, d, v_offset, "v")
    if s_k + kp[4] + rk != s_k + vp[4] + rv:
        raise ValueError(
            f"fused attention: K holds {kp[4]} + {rk} tokens after the sinks, V {vp[4]} + {rv}"
        )
    out = torch.empty((b, h, m, d), dtype=torch.float32)
    vals = [b, h, m, d, torch.get_num_threads(), s_k, rk, rv, *kp, vp[0], vp[1], vp[2], vp[4], k_hblock, v_hblock]
    parts = (q, ks, vs, kr, vr, *kparts, *vparts, out, kvn, vvn)
    _call(library().kv_attend, "attend", vals, parts, (v_codec.token_group, v_offset))
    return out


# --------------------------------------------------------------------------- many rows in one call


class AttendRow(NamedTuple):
    """One row of :func:`attend_rows`: what :func:`attend` takes for a batch of 1, plus where its query is.

    qrow: the row's index in the call's q and out. k_sink, v_sink, k_res, v_res: (1, H, n, D) fp32/fp16/bf16 or
    None. k_body, v_body: the encoded body as pieces ``(codec, Encoded, offset)``, oldest first, concatenated
    (one piece: a cache's body; many: blocks anywhere in memory, as a paged pool keeps them); ``offset``: where
    a per-channel K piece's first token sits in its group, a variance-normalized V piece's in its factors' group
    of ``token_group`` tokens (0 for the others). A K piece may carry a fourth element, its own queries
    ``(1, H, M, D)`` fp32, contiguous, already scaled and in the piece's basis (the call scores that piece with
    them instead of the row's; kvslim's key runs in other RoPE frames use it; None: the row's), and a fifth, a
    :class:`kvslim.kernels.KeyTransform` of its ``n`` tokens (``cos``/``sin`` (1, n, R/2): keys stored before
    RoPE): each decoded key is transformed as ``kv_run``'s transformed K ops do and scored with the row's own
    queries, neither rotated by the row's K basis nor given the row's ``k_bias``. A row's V pieces share one
    format. k_hblock, v_hblock: the bodies' Hadamard blocks (0: none), as :func:`attend`'s. k_rot, v_rot: the
    bodies' fitted rotations instead (:class:`kvslim.calibration.rotation.FittedRotation`'s ``matrix``, (H, D, D)
    float32, ``y = R x``; None: none): the call scores the K body with ``R_k q`` and takes the V body's sum back
    with ``R_v^T``, as the Hadamard blocks are used (a stream has one or the other, never both). k_bias: the K
    body's mean-centering bias (H, D) float32 in the body's basis (None: none): a K body token stored centered (its
    piece's ``centered`` token part (1, H, n, 1) uint8 is 1; every token when the part is absent) scores
    ``qb . bias`` more, ``qb`` the query it is scored with (:func:`kvslim.attention._body_scores`'s arithmetic)."""

    qrow: int
    k_sink: torch.Tensor | None
    v_sink: torch.Tensor | None
    k_res: torch.Tensor | None
    v_res: torch.Tensor | None
    k_body: tuple
    v_body: tuple
    k_hblock: int = 0
    v_hblock: int = 0
    k_rot: torch.Tensor | None = None
    v_rot: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None


_HEAD, _ROW, _PIECE, _STATUS = (ROWS_LAYOUT[k] for k in ("head", "row", "piece", "status"))


def _row_pieces(pieces, h: int, m: int, d: int, role: str, vals: list, held: list) -> tuple[int, int]:
    """A row's K or V body pieces appended to ``vals`` as piece records; returns (pieces, tokens). A
    variance-normalized affine piece carries its factors (and, for V, their token group, ``offset`` being where
    the piece's first token sits in it), read in place as :func:`attend` reads them; a K piece may carry its own
    queries (a fourth element, :class:`AttendRow`) and a key transform (a fifth; tensors made for it go to ``held``,
    which the caller keeps until the call returns). A record is found again where it can be
    (:mod:`kvslim.kernels.records`: kept on an unchanged body, or a template of the same signature) and built
    and checked otherwise."""
    tokens, first = 0, None
    for piece in pieces:
        codec, enc, offset = piece[:3]
        qk = piece[3] if len(piece) > 3 else None
        tr = piece[4] if len(piece) > 4 else None
        rec = key = sig = None
        if tr is None:
            if qk is None:
                rec = records.kept(codec, enc, offset, h, m, d, role)
            if rec is None:
                parts = records.direct_parts(enc)  # once for both keys
                key = None if qk is not None else records.kept_key(codec, enc, offset, h, m, d, role, parts)
                sig = records.template_key(codec, enc, offset, h, m, d, role, qk, parts)
                rec = None if sig is None else records.from_template(sig, enc, qk)
        if rec is None:
            rec, pointers = _piece_record(codec, enc, offset, h, m, d, role, qk, tr, held)
            records.put_template(sig, rec, pointers, enc, qk)
        records.keep(key, rec)
        if role == "v":
            first = first or rec[:2]
            if rec[:2] != first:
                raise ValueError(f"attention rows: a row's V pieces must share one format, got {first} and {rec[:2]}")
        vals += rec
        tokens += rec[4]
    return len(pieces), tokens


def _piece_record(codec: Codec, enc: Encoded, offset: int, h: int, m: int, d: int, role: str, qk, tr, held: list):
    """A piece's record, checked and built (:func:`_row_pieces`), and ``(field index, tensor)`` of each of its
    pointer fields but a transform's."""
    p, parts, vn = _body_args(codec, enc, 1, h, d, offset, role)
    held += (*parts, vn)  # a part copied to make its rows contiguous lives until the call returns
    if role == "v" and vn is not None:  # the V factors' offset in their group (a plain V piece's stays 0)
        p = (*p[:3], offset, p[4])
    rec = [*p, codec.token_group if role == "v" and vn is not None else 0]
    pointers = []
    for t in (*parts, vn):
        if t is not None:
            pointers.append((len(rec), t))
        rec += (0, 0, 0, 0, _DT[torch.uint8]) if t is None else _part(t)
    if qk is not None:
        pointers.append((len(rec), qk))
    rec += _piece_queries(qk, h, m, d, role)
    flags = _flags_part(enc, h, p[4], role)
    if flags[0]:
        pointers.append((len(rec), enc.token[CENTERED]))
    rec += flags
    rec += _piece_transform(tr, h, d, p[4], role, held)
    return tuple(rec), pointers


def attend_rows(q: torch.Tensor, rows, out: torch.Tensor, lib=None) -> list[int]:
    """The decode attention of many rows in one C call (``kv_attend_rows``, one OpenMP region): row ``r`` of
    ``rows`` (:class:`AttendRow`) writes ``out[r.qrow]`` exactly as :func:`attend` would compute it for that row
    alone (bit for bit, at the same thread count), each row with its own length, formats, sinks, residual and
    bases. q (N, H, M, D) fp32, already scaled; out (N, H, M, D) fp32 with a contiguous last dim (written in
    place; the rows no row names are left as they are).

    Returns the indices (into ``rows``) of the rows not computed, their ``out`` rows not to be trusted: a row
    whose arguments do not fit (the reason is what :func:`attend` raises for it), a row the C side refused, or
    every row when the call failed (out of memory). The caller computes them its own way, one by one, so that a
    failure stays with its row. ``lib``: the library to call (None: :func:`library`'s; the kernel bench passes a
    build of older sources, :func:`kvslim.kernels.bench.baseline_library`)."""
    if q.dim() != 4 or q.dtype != torch.float32 or not q.is_cpu:
        raise ValueError(
            f"attention rows: q must be a CPU (N, H, M, D) float32 tensor, got {tuple(q.shape)} {q.dtype}"
        )
    fits = out.shape == q.shape and out.dtype == torch.float32 and out.is_cpu
    if not fits or (q.shape[3] > 1 and out.stride(3) != 1):
        raise ValueError(
            f"attention rows: out must be a CPU float32 {tuple(q.shape)} tensor with a contiguous last dim, got "
            f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}"
        )
    q = rows_contiguous(q)
    nq, h, m, d = q.shape
    dummy = _part(q)
    recs, pieces, sent, left, taken = [], [], [], [], set()
    held: list = []  # tensors made for the table (a transform's tables), alive until the call returns
    for i, row in enumerate(rows):
        try:
            qrow = int(row.qrow)
            if not 0 <= qrow < nq or qrow in taken:
                raise ValueError(
                    f"attention rows: row {i}'s query row {qrow} is outside 0..{nq - 1} or taken"
                )
            (s_k, ks), (s_v, vs), (rk, kr), (rv, vr) = (
                _fp_part(t, h, d, dummy) for t in (row.k_sink, row.v_sink, row.k_res, row.v_res)
            )
            if s_k != s_v:
                raise ValueError(f"attention rows: {s_k} sink keys but {s_v} sink values")
            mine: list = []
            first = len(pieces) // _PIECE
            kn, nk = _row_pieces(row.k_body, h, m, d, "k", mine, held)
            vn, nv = _row_pieces(row.v_body, h, m, d, "v", mine, held)
            if nk + rk != nv + rv or s_k + nk + rk < 1:
                raise ValueError(f"attention rows: K holds {nk} + {rk} tokens after the sinks, V {nv} + {rv}")
            hbs = (int(row.k_hblock), int(row.v_hblock))
            bases = (*_rot_part(row.k_rot, hbs[0], h, d, "k"), *_rot_part(row.v_rot, hbs[1], h, d, "v"))
            bases += _bias_part(row.k_bias, h, d)
        except Exception:  # noqa: BLE001 - the caller's own path for this row says what is wrong with it
            left.append(i)
            continue
        taken.add(qrow)
        pieces += mine
        # the status field starts at "refused" (2): a row is done only where C says so
        recs += (qrow, s_k, rk, rv, *hbs, first, kn, first + kn, vn, *ks, *vs, *kr, *vr, *bases, 2, 0)
        sent.append(i)
    if not sent:
        return left
    head = [len(sent), nq, h, m, d, torch.get_num_threads(), len(pieces) // _PIECE, 0, *dummy, *_part(out)]
    args = array.array("q", head + recs + pieces)  # held until the call returns; C writes each row's status
    rc = (lib or library()).kv_attend_rows(args.buffer_info()[0])
    if rc == 0:
        return left
    if rc == 2:  # some rows refused: their status says which
        left += [i for j, i in enumerate(sent) if args[_HEAD + j * _ROW + _STATUS]]
        return sorted(left)
    return sorted(left + sent)  # out of memory: nothing written is reliable


def to_half_finite(*xs: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], bool] | None:
    """``xs`` (CPU float32, contiguous) cast to float16 in one C call, and whether every result is finite (an
    inf or NaN input, or a finite value beyond float16's range, is not); None where the C library cannot
    (not built, built without F16C, another dtype, device or layout): the caller casts with torch. Rounds
    to nearest even, as ``x.to(torch.float16)`` does (tested equal)."""
    for x in xs:
        if x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():
            return None
    if not status()[0]:
        return None
    outs = tuple(torch.empty(x.shape, dtype=torch.float16) for x in xs)
    vals = [len(xs)]
    for x, y in zip(xs, outs, strict=True):
        vals += (x.data_ptr(), y.data_ptr(), x.numel())
    args = array.array("q", vals)  # held until the call returns
    rc = library().kv_to_half_finite(args.buffer_info()[0])
    if rc < 0:
        return None
    return outs, bool(rc)
