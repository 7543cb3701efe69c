"""The decode attention of many rows in one Triton launch: :func:`attend_rows`, the contract of
:func:`kvslim.kernels.cpu.attend_rows` (C's ``kv_attend_rows``) for CUDA tensors.

Same rows (:class:`~kvslim.kernels.cpu.AttendRow`: a query row, fp sinks and residual, K and V bodies as lists of
pieces anywhere in memory, Hadamard blocks), same formats as the per-row Triton kernels (:mod:`.gpu`: affine K/V
at 8/4/3/2 bits with any scale dtype and V channel group, variance-normalized or not; GGML q8_0/q4_0/q4_1/q5_0/
q5_1; fp8; fp16/bf16/fp32), same answer: the rows it computed are written to ``out``, the indices of the others
are returned for the caller's per-row path.

The row table is built once per call (a decode step's layer) and read by one program per (row, KV head)
(:mod:`.triton_rows`, which says what a program does). A launch takes the rows whose formats and part dtypes
agree (Triton compiles a program per format: the format is a constant of it); a step whose rows share one cache
configuration, the engine's usual case, is one launch per layer. Each row's program depends on that row alone
(its own constants, table entries and data), so a row's output is the same bits whatever else is in the call:
the property that keeps a row's greedy continuation the same in and out of a batch (tested under the
interpreter).

Pointers: Triton takes tensors, not lists of them, so each part (K codes, K scales, ..., V residual) is passed
as one template tensor (the part's lowest address among the launch's pieces) and every piece's part as its
element offset from it; pieces are views into the cache's own buffers (or a pool's blocks), never copied.
"""

from __future__ import annotations

import functools

import torch

from ..formats.layout import rows_contiguous
from . import gpu

_FP = (torch.float32, torch.float16, torch.bfloat16)
#: Tokens a program decodes per tile (both phases): a (BLOCK_T, BLOCK_D) fp32 tile in registers. Unmeasured.
BLOCK_T = 32


def programs():
    """The rows programs of the current mode (:mod:`.triton_rows`)."""
    return gpu.programs("triton_rows")


def attend_supported(x: torch.Tensor, codec_k, enc_k, codec_v, enc_v) -> bool:
    """Whether :func:`attend_rows` reads both bodies for queries ``x``: every part on x's device and a layout the
    Triton programs read (:func:`kvslim.kernels.gpu.supported`)."""
    for enc in (enc_k, enc_v):
        if not all(t.device == x.device for t in (*enc.token.values(), *enc.group.values())):
            return False
    return gpu.supported(codec_k, enc_k) and gpu.supported(codec_v, enc_v)


@functools.cache
def _hadamard(block: int, d: int, size: int, device: str) -> torch.Tensor:
    """The normalized block-diagonal Hadamard matrix of ``d`` channels (kvslim.cache.hadamard's, built here: kernels do
    not import the cache), zero-padded to (size, size) fp32."""
    i = torch.arange(block)
    both = i[:, None] & i[None, :]
    parity = torch.zeros_like(both)
    for bit in range(max(1, block.bit_length())):
        parity ^= (both >> bit) & 1
    hb = (1 - 2 * parity).double() / block**0.5  # Sylvester order: (-1)^popcount(i & j) / sqrt(block)
    m = torch.zeros(size, size, dtype=torch.float64)
    m[:d, :d] = torch.block_diag(*[hb] * (d // block))
    return m.float().to(device)


def _fp(t, h: int, d: int, device) -> tuple[int, torch.Tensor | None]:
    """(tokens, part) of a row's sinks or residual (1, H, n, D) fp32/fp16/bf16; None or empty: (0, None)."""
    if t is None or (t.dim() == 4 and t.shape[2] == 0 and t.dtype in _FP):
        return 0, None
    if (
        t.dim() != 4
        or tuple(t.shape[:2]) != (1, h)
        or t.shape[3] != d
        or t.dtype not in _FP
        or t.device != device
    ):
        raise ValueError(
            f"attention rows: a full-precision part {tuple(t.shape)} {t.dtype} on {t.device} does not fit a row of "
            f"(1, {h}, n, {d}) on {device}"
        )
    return t.shape[2], rows_contiguous(t)


def _pieces(pieces, h: int, d: int, role: str) -> tuple[list, tuple]:
    """A row's K or V pieces as (tokens, offset, _Layout) and their shared launch key (format and part dtypes)."""
    out, key = [], None
    for codec, enc, offset in pieces:
        n = next(iter(enc.token.values())).shape[2]
        if role == "v" and not getattr(codec, "varnorm", False):
            offset = 0  # only a normalized V's factors have a place in a group
        lay, width = gpu._layout(codec, enc, 1, h, n, d if role == "k" else None, offset)
        if width != d:
            raise ValueError(f"attention rows: a {role.upper()} piece of head dim {width}, the queries' {d}")
        k = (lay.fmt, lay.bits, lay.nb, lay.vn, lay.x.dtype, lay.s.dtype, lay.z.dtype, lay.factors.dtype)
        if key is not None and k != key:
            raise ValueError(f"attention rows: a row's {role.upper()} pieces must share one layout")
        key = k
        out.append((n, offset, lay))
    if key is None:
        raise ValueError(f"attention rows: a row without {role.upper()} body pieces")
    return out, key


def _prepare(row, nq: int, h: int, d: int, device) -> tuple[tuple, dict]:
    """(launch key, the row's checked parts) or ValueError (the row is left to the caller)."""
    qrow = int(row.qrow)
    if not 0 <= qrow < nq:
        raise ValueError(f"attention rows: query row {qrow} is outside 0..{nq - 1}")
    fp = [_fp(t, h, d, device) for t in (row.k_sink, row.v_sink, row.k_res, row.v_res)]
    (s_k, _), (s_v, _), (rk, _), (rv, _) = fp
    if s_k != s_v:
        raise ValueError(f"attention rows: {s_k} sink keys but {s_v} sink values")
    kp, kkey = _pieces(row.k_body, h, d, "k")
    vp, vkey = _pieces(row.v_body, h, d, "v")
    nk, nv = sum(n for n, _, _ in kp), sum(n for n, _, _ in vp)
    if nk + rk != nv + rv or s_k + nk + rk < 1:
        raise ValueError(f"attention rows: K holds {nk} + {rk} tokens after the sinks, V {nv} + {rv}")
    if any(getattr(row, name, None) is not None for name in ("k_rot", "v_rot", "k_bias")):
        raise ValueError(
            "attention rows: the Triton rows program takes Hadamard blocks only, not a fitted rotation or a K bias"
        )
    hbs = (int(row.k_hblock), int(row.v_hblock))
    for hb in hbs:
        if hb < 0 or (hb and (hb & (hb - 1) or d % hb)):
            raise ValueError(f"attention rows: a Hadamard block of {hb} does not tile head dim {d}")
    fp_dtypes = tuple(None if t is None else t.dtype for t in (row.k_sink, row.v_sink, row.k_res, row.v_res))
    key = (kkey, vkey, fp_dtypes, bool(hbs[0]), bool(hbs[1]))
    return key, dict(qrow=qrow, fp=fp, kp=kp, vp=vp, nk=nk, nv=nv, hbs=hbs, t=s_k + nk + rk)


def attend_rows(q: torch.Tensor, rows, out: torch.Tensor) -> list[int]:
    """The decode attention of many rows in one launch per layout: row ``r`` of ``rows`` writes ``out[r.qrow]``.
    q (N, H, M, D) fp32, already scaled, on a CUDA device (or the CPU under Triton's interpreter); out (N, H, M, D)
    fp32 on the same device with a contiguous last dim (rows no row names are left as they are). Returns the
    indices (into ``rows``) of the rows not computed (arguments that do not fit, a query row named twice)."""
    if q.dim() != 4 or q.dtype != torch.float32:
        raise ValueError(
            f"attention rows: q must be an (N, H, M, D) float32 tensor, got {tuple(q.shape)} {q.dtype}"
        )
    if (
        out.shape != q.shape
        or out.dtype != torch.float32
        or out.device != q.device
        or (q.shape[3] > 1 and out.stride(3) != 1)
    ):
        raise ValueError(
            f"attention rows: out must be a float32 {tuple(q.shape)} tensor on {q.device} with a contiguous last "
            f"dim, got {tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
    nq, h, m, d = q.shape
    if not 0 < m <= gpu.MAX_M:
        raise ValueError(
            f"attention rows: {m} query rows a head, the Triton rows program takes 1..{gpu.MAX_M}"
        )
    q = rows_contiguous(q)
    groups: dict[tuple, list] = {}
    left, taken = [], set()
    for i, row in enumerate(rows):
        try:
            key, prep = _prepare(row, nq, h, d, q.device)
            if prep["qrow"] in taken:
                raise ValueError(f"attention rows: query row {prep['qrow']} is taken")
        except Exception:  # noqa: BLE001 - the caller's own path for this row says what is wrong with it
            left.append(i)
            continue
        taken.add(prep["qrow"])
        groups.setdefault(key, []).append(prep)
    for key, preps in groups.items():
        _launch(q, out, key, preps)
    return left


class _Parts:
    """One launch's template of a part and each user's element offset from it (all of one dtype)."""

    def __init__(self, tensors, dummy: torch.Tensor):
        present = [t for t in tensors if t is not None]
        self.base = min(present, key=lambda t: t.data_ptr()) if present else dummy
        self.size = self.base.element_size()

    def offset(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        diff = t.data_ptr() - self.base.data_ptr()
        if diff % self.size:
            raise ValueError("attention rows: a part is not aligned to its element size")
        return diff // self.size


def _launch(q: torch.Tensor, out: torch.Tensor, key: tuple, preps: list) -> None:
    """One launch of :func:`~.triton_rows.rows_kernel` over the rows ``preps`` that share ``key``."""
    (kkey, vkey, _, khad, vhad) = key
    nq, h, m, d = q.shape
    block_m, block_d = gpu._blocks(m, d)
    fps = [_Parts([p["fp"][j][1] for p in preps], q) for j in range(4)]
    lays = {role: [lay for p in preps for _, _, lay in p[role + "p"]] for role in ("k", "v")}
    body = {
        role: [_Parts([getattr(lay, part) for lay in lays[role]], q) for part in ("x", "s", "z", "factors")]
        for role in ("k", "v")
    }
    blocks = sorted({hb for p in preps for hb in p["hbs"] if hb})
    had = (
        torch.stack([_hadamard(hb, d, block_d, str(q.device)) for hb in blocks]) if blocks else q.new_zeros(1)
    )
    row_tab, piece_tab, scratch = [], [], 0
    for p in preps:
        firsts = {}
        for role in ("k", "v"):
            firsts[role] = len(piece_tab)
            parts = body[role]
            for n, offset, lay in p[role + "p"]:
                f = lay.factors
                offs = [parts[i].offset(t) for i, t in enumerate((lay.x, lay.s, lay.z, f))]
                strides = [lay.x.stride(1), lay.x.stride(2), lay.s.stride(1), lay.s.stride(2)]
                strides += [lay.z.stride(1), lay.z.stride(2), f.stride(1), f.stride(2)]
                piece_tab.append([n, offset, lay.group, lay.ngroup, *offs, *strides])
        fp = []
        for j, (_, t) in enumerate(p["fp"]):
            fp += [0, 0, 0] if t is None else [fps[j].offset(t), t.stride(1), t.stride(2)]
        kh, vh = (blocks.index(hb) if hb else 0 for hb in p["hbs"])
        (s, _), _, (rk, _), (rv, _) = p["fp"]
        row_tab.append(
            [
                p["qrow"],
                s,
                rk,
                rv,
                p["nk"],
                p["nv"],
                firsts["k"],
                len(p["kp"]),
                firsts["v"],
                len(p["vp"]),
                kh,
                vh,
                scratch,
                p["t"],
                *fp,
            ]  # fmt: skip
        )
        scratch += h * m * p["t"]
    prog = programs()
    if len(row_tab[0]) != prog.ROW_FIELDS.value or len(piece_tab[0]) != prog.PIECE_FIELDS.value:
        raise RuntimeError("the rows table widths differ from the rows program's (kernels/triton_rows.py)")
    rt = torch.tensor(row_tab, dtype=torch.int64).to(q.device)
    pt = torch.tensor(piece_tab, dtype=torch.int64).to(q.device)
    scores = torch.empty(scratch, dtype=torch.float32, device=q.device)
    kparts, vparts = ([part.base for part in body[role]] for role in ("k", "v"))
    with gpu._device(q):
        prog.rows_kernel[(len(preps), h)](
            q, out, rt, pt, scores, had, *(part.base for part in fps), *kparts, *vparts,
            m, d, *q.stride()[:3], *out.stride()[:3],
            KFMT=kkey[0], KBITS=kkey[1], KNB=kkey[2], KVN=kkey[3],
            VFMT=vkey[0], VBITS=vkey[1], VNB=vkey[2], VVN=vkey[3], KHAD=khad, VHAD=vhad,
            BLOCK_M=block_m, BLOCK_T=BLOCK_T, BLOCK_D=block_d, **gpu.COMPILE_OPTIONS,
        )  # fmt: skip
