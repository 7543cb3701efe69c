"""The parts of the C kernels' calls that are tensors checked and passed as (pointer, element strides of dims
0..2, dtype code): a row's full-precision parts, its fitted rotations and K centering bias, a piece's own queries
and centering flags (``kv_attend_rows``), a key transform's (``kv_run``'s transformed K ops). Split from
:mod:`kvslim.kernels.cpu`, which builds the calls; this module knows no codec and calls no C.
"""

from __future__ import annotations

import torch

from ..formats import Encoded
from ..formats.layout import expect, rows_contiguous

#: dtype codes of the C side (``DT_*`` in csrc/kvslim_kernels.c)
DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.uint8: 4}

#: the token part of an encoded K body that says which tokens were stored centered (kvslim.cache.basis.CENTERED;
#: named here, not imported, so the kernels know nothing of the cache)
CENTERED = "centered"


def part(t: torch.Tensor) -> tuple:
    s = t.stride()
    return t.data_ptr(), s[0], s[1], s[2], DT[t.dtype]


FP = (torch.float32, torch.float16, torch.bfloat16)


def fp_part(t: torch.Tensor | None, h: int, d: int, dummy: tuple) -> tuple[int, tuple]:
    """(tokens, part) of a row's full-precision sinks or residual (1, H, n, D); None or empty: (0, dummy)."""
    if t is None or t.shape[2] == 0:
        return 0, dummy
    if t.dim() != 4 or tuple(t.shape[:2]) != (1, h) or t.shape[3] != d or t.dtype not in FP:
        raise ValueError(
            f"attention rows: a full-precision part {tuple(t.shape)} {t.dtype} does not fit a row of (1, {h}, n, {d})"
        )
    return t.shape[2], part(rows_contiguous(t))


def rot_part(mat: torch.Tensor | None, hblock: int, h: int, d: int, role: str) -> tuple:
    """The part of a row's fitted rotation (None: none, an all-zero part): (H, D, D) float32 on the CPU, rows
    contiguous, seen as (1, H, D, D) (row e of head h at ``at(part, 0, h, e)``)."""
    if mat is None:
        return (0, 0, 0, 0, 0)
    fits = mat.dtype == torch.float32 and tuple(mat.shape) == (h, d, d) and mat.is_cpu and mat.is_contiguous()
    if not fits or hblock:
        raise ValueError(
            f"attention rows: a {role.upper()} rotation must be a contiguous CPU float32 ({h}, {d}, {d}) tensor "
            f"and the stream's only basis (Hadamard block 0), got {tuple(mat.shape)} {mat.dtype}, block {hblock}"
        )
    return part(mat[None])  # a view of the caller's tensor, alive until the call returns


def bias_part(bias: torch.Tensor | None, h: int, d: int) -> tuple:
    """The part of a row's K centering bias (None: none, an all-zero part): (H, D) float32 on the CPU, contiguous,
    seen as (1, H, 1, D)."""
    if bias is None:
        return (0, 0, 0, 0, 0)
    if bias.dtype != torch.float32 or tuple(bias.shape) != (h, d) or not bias.is_cpu or not bias.is_contiguous():
        raise ValueError(
            f"attention rows: a K bias must be a contiguous CPU float32 ({h}, {d}) tensor, got {tuple(bias.shape)} "
            f"{bias.dtype}"
        )
    return part(bias[None, :, None, :])


def flags_part(enc: Encoded, h: int, n: int, role: str) -> tuple:
    """The part of a K piece's centering flags (its ``centered`` token part, (1, H, n, 1) uint8; absent or a V
    piece: an all-zero part)."""
    flags = enc.token.get(CENTERED) if role == "k" else None
    if flags is None:
        return (0, 0, 0, 0, 0)
    expect(flags, (1, h, n, 1), (torch.uint8,), "K centering flags")
    return part(flags)


def piece_queries(qk: torch.Tensor | None, h: int, m: int, d: int, role: str) -> tuple:
    """The part of a K piece's own queries (None: the row's, an all-zero part)."""
    if qk is None:
        return (0, 0, 0, 0, 0)
    fits = qk.dtype == torch.float32 and tuple(qk.shape) == (1, h, m, d) and qk.is_cpu and qk.is_contiguous()
    if role != "k" or not fits:
        raise ValueError(
            f"attention rows: a {role.upper()} piece's own queries must be K's, a contiguous CPU float32 "
            f"(1, {h}, {m}, {d}) tensor, got {tuple(qk.shape)} {qk.dtype}"
        )
    return part(qk)  # contiguous: the caller's tensor itself, alive until the call returns


def transform_parts(q: torch.Tensor, tr, t: int) -> tuple[tuple, tuple]:
    """The C side's (hblock, rhalf, roff, has_bias, has_flags) and (bias, cos, sin, flags, mat) parts of a
    KeyTransform.

    bias: (1, H, 1, D) fp32; cos/sin: (B, 1, T, R/2) fp32, batch stride 0 when shared by every row;
    flags: the ``centered`` part (B, H, T, 1) uint8; mat: a fitted rotation's matrix (1, H, D, D) fp32
    (:class:`kvslim.calibration.rotation.FittedRotation`, block 0: the kernel takes each key back with
    ``R^T``), None for a Hadamard basis or none. Other absent parts repeat q (never read)."""
    b, h, _, d = q.shape
    bias = q
    if tr.bias is not None:
        bias = tr.bias.to(dtype=torch.float32, device=q.device).contiguous()
        expect(bias, (h, d), (torch.float32,), "transform bias")
        bias = bias[None, :, None, :]
    hblock = 0 if tr.hadamard is None else int(tr.hadamard.block)
    mat = None
    if tr.hadamard is not None and not hblock:  # a fitted rotation: its (H, D, D) matrix
        mat = tr.hadamard.matrix.to(dtype=torch.float32, device=q.device).contiguous()
        expect(mat, (h, d, d), (torch.float32,), "transform rotation matrix")
        mat = mat[None]  # (1, H, D, D): row e of head h at at(mat, 0, h, e)
    if hblock and (hblock & (hblock - 1) or d % hblock):
        raise ValueError(f"a Hadamard block of {hblock} does not tile head_dim {d}")
    cos = sin = q
    rhalf = roff = 0
    if tr.cos is not None:
        rhalf, roff = int(tr.cos.shape[-1]), int(tr.rope_offset)
        if roff < 0 or roff + 2 * rhalf > d:
            raise ValueError(f"rotary channels {roff}..{roff + 2 * rhalf} exceed head_dim {d}")
        parts = []
        for name, a in (("cos", tr.cos), ("sin", tr.sin)):
            a = a.to(dtype=torch.float32, device=q.device).contiguous()
            if a.dim() != 3 or a.shape[0] not in (1, b) or tuple(a.shape[1:]) != (t, rhalf):
                raise ValueError(
                    f"transform {name} has shape {tuple(a.shape)}, expected ({b} or 1, {t}, {rhalf})"
                )
            parts.append(a[:, None].expand(b, 1, t, rhalf))  # stride 0 over a shared batch
        cos, sin = parts
    flags = q
    if tr.centered is not None:
        flags = rows_contiguous(tr.centered)
        expect(flags, (b, h, t, 1), (torch.uint8,), "transform centered flags")
    has = (int(tr.bias is not None), int(tr.centered is not None))
    return (hblock, rhalf, roff, *has), (bias, cos, sin, flags, mat)


def piece_transform(tr, h: int, d: int, n: int, role: str, held: list) -> tuple:
    """A K piece's key transform (:class:`kvslim.kernels.KeyTransform` of its ``n`` tokens, None: none) as the row
    table's fields: hblock, rhalf, roff, has_bias, has_flags, then the parts bias (1, H, 1, D), cos, sin
    (1, 1, n, R/2), mat (1, H, D, D) (absent ones all zero; the flags are the piece's ``centered`` part). The
    tensors whose pointers the fields hold are appended to ``held``: the caller keeps them until the call."""
    zero = (0, 0, 0, 0, 0)
    if tr is None:
        return (0, 0, 0, 0, 0, *zero * 4)
    if role != "k":
        raise ValueError("attention rows: a key transform belongs to a K piece")
    dummy = torch.zeros(1, h, 1, d)
    params, (bias, cos, sin, _flags, mat) = transform_parts(dummy, tr, n)
    vals = list(params)
    for t in (bias, cos, sin):
        vals += zero if t is dummy else part(t)
    vals += zero if mat is None else part(mat)
    held += [t for t in (bias, cos, sin, mat) if t is not None and t is not dummy]
    return tuple(vals)
