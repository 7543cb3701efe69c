"""A decode step's attention in one kernel call: one cache's rows (:func:`fused_decode`) or every row of a ragged
step's layer (:func:`ragged_fused`), each row computed as it would be alone.

Two backends, one contract (a table of rows, each with its own sinks, encoded body as a list of pieces, residual
and bases; :class:`kvslim.kernels.cpu.AttendRow`), picked by device (:func:`rows_backend`):

- CPU tensors: the C kernels, ``kernels.cpu.attend`` (a cache alone, ``kv_attend``) and ``kernels.cpu.attend_rows``
  (many rows, ``kv_attend_rows``): the same instructions per row, so a row's output is bit for bit the same alone
  and in a batch.
- CUDA tensors (CPU tensors under Triton's interpreter, asked for by name): the Triton rows program
  (``kernels.gpu_rows.attend_rows``), for a cache alone too, so that here also a row gets the same bits alone and
  in a batch (its program depends on the row alone).

A stream whose keys sit in several RoPE frames (runs after a re-base of the position ids: a windowed cache, for up
to a window's worth of steps after each re-base) is one K piece per run in the C rows call, each scored with the
row's queries moved into its frame (:func:`fused_row`); the Triton program does not take a piece's own queries yet.
A body in a fitted basis (``rotate='fitted'``, :class:`kvslim.calibration.rotation.FittedRotation`: one ``D x D``
matrix ``R`` per KV head, ``y = R x``) is read by the C rows call as a Hadamard body is: its keys scored with the
row's queries taken to the basis once (``R q``, ``(R q) . (R k) = q . k``), its values' weighted sum taken back
once (``R^T``) before the full-precision sinks and residual are added; a cache alone goes through the rows call
too (one row), so a row gets the same bits alone and in a batch. A K body stored mean-centered (a bias in the
body's basis, Hadamard or fitted, subtracted from the tokens flagged ``centered``) is read there too: each centered
token scores ``qb . bias`` more, ``qb`` the query in the body's basis, as :func:`kvslim.attention._body_scores`
adds it. Keys stored before RoPE (``pre_rope``) go there too: the K body as one piece with a key transform
(:class:`kvslim.kernels.KeyTransform`: the bias added back where flagged, the basis taken back, RoPE at each
key's position, what the transformed score kernels of the op-by-op path apply), scored with the row's own
queries, and the residual's keys rotated to their positions (:func:`_pre_rope_piece`). What neither reads
(:func:`fusable`: re-based key runs on CUDA or in a batched cache, a fitted rotation, a centering bias or pre-RoPE
keys on CUDA, MLA's narrower V, nothing encoded yet, a backend other than these) runs op by op in
:func:`kvslim.attention.compressed_attention`.

This module knows the cache's :class:`~kvslim.cache.segments.Segments` view and the kernels' row contract; it
knows nothing about transformers.
"""

from __future__ import annotations

import torch

from . import kernels
from .cache.basis import CENTERED
from .cache.hadamard import Hadamard
from .cache.rotary import by_rotation
from .formats import Encoded, make_codec

#: the codec of full-precision keys read as a piece (the residual's keys of a run off the frame, :func:`_run_pieces`)
_FP_ROWS = make_codec("none", "k")


def rows_backend(qf: torch.Tensor):
    """The kernels module whose ``attend_rows`` serves queries ``qf`` (B, Hkv, M, D) fp32: ``kernels.cpu``,
    ``kernels.gpu_rows``, or None (op by op)."""
    if kernels.cpu_serves_query(qf):
        return kernels.cpu
    if kernels.triton_serves_query(qf):
        return kernels.gpu_rows
    return None


def fusable(qf: torch.Tensor, kv, backend=None) -> bool:
    """Whether the fused call reads ``kv`` for queries like ``qf`` (B, Hkv, M, D): both bodies present and read by
    the backend's kernels, key runs (a re-based stream) only on the CPU, in a cache of one row, with the residual's
    keys in the frame after those off it (:func:`_runs_fit`), bases of Hadamard blocks or (on the CPU only)
    fitted matrices, a K centering bias (none on V) and pre-RoPE keys, V as wide as K. The one test for a row alone
    (:func:`fused_decode`) and for a row of a ragged step (:func:`ragged_fused`): the same answer for both is what
    keeps a row's output the same in and out of a batch. backend: :func:`rows_backend`'s answer when the caller
    asked it once for many rows (None: asked here)."""
    if kv.k_body is None or kv.v_body is None:
        return False
    if kv.v_basis is not None and kv.v_basis.bias is not None:
        return False  # V is never centered (kvslim.cache.layer); the calls take a K bias only
    # V as wide as K (not MLA): read off the residual, which every lossy stream has (possibly empty)
    if kv.v_res is None or kv.v_res.shape[-1] != qf.shape[-1]:
        return False
    backend = rows_backend(qf) if backend is None else backend
    if (fitted(kv) or k_bias(kv) is not None or kv.k_pos is not None) and backend is not kernels.cpu:
        return False  # a fitted matrix, a bias, a key transform: the Triton program takes Hadamard blocks only
    if kv.k_runs and (backend is not kernels.cpu or kv.kv_shape[0] != 1 or not _runs_fit(kv)):
        return False
    if backend is kernels.cpu:
        if not kernels.on_cpu(kv.k_body, kv.v_body):
            return False
        return kernels.cpu.attend_supported(kv.k_codec, kv.k_body, kv.v_codec, kv.v_body)
    if backend is kernels.gpu_rows:
        return kernels.gpu_rows.attend_supported(qf, kv.k_codec, kv.k_body, kv.v_codec, kv.v_body)
    return False


def hblocks(kv) -> tuple[int, int]:
    """The Hadamard blocks of the K and V bodies' bases (0: none)."""
    kb, vb = kv.k_basis, kv.v_basis
    return (
        0 if kb is None or kb.hadamard is None else kb.hadamard.block,
        0 if vb is None or vb.hadamard is None else vb.hadamard.block,
    )


def fitted(kv) -> bool:
    """Whether either body of ``kv`` is stored in a fitted rotation's basis (a matrix, Hadamard block 0)."""
    return any(b is not None and b.hadamard is not None and not b.hadamard.block for b in (kv.k_basis, kv.v_basis))


def rotations(kv) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The fitted rotations' matrices ``(H_kv, D, D)`` float32 of the K and V bodies' bases (None: none, or a
    Hadamard basis), as the C rows call takes them (:class:`kvslim.kernels.cpu.AttendRow`'s ``k_rot``, ``v_rot``)."""

    def mat(b):
        if b is None or b.hadamard is None or b.hadamard.block:
            return None
        return b.hadamard.matrix

    return mat(kv.k_basis), mat(kv.v_basis)


def k_bias(kv) -> torch.Tensor | None:
    """The K body's mean-centering bias (H_kv, D) float32 in its stored basis, as the C rows call takes it
    (:class:`kvslim.kernels.cpu.AttendRow`'s ``k_bias``); None: none."""
    b = kv.k_basis
    if b is None or b.bias is None:
        return None
    return b.bias.to(dtype=torch.float32).contiguous()


def fused_row(kv, qrow: int, b: int | None = None, qf: torch.Tensor | None = None, moved_q: dict | None = None):
    """``kv`` (batch row ``b`` of it; None: a batch of one) as one row of the fused call
    (:class:`kvslim.kernels.cpu.AttendRow`), its query at ``qrow`` (of ``qf`` (N, Hkv, M, D), needed only for
    a cache with key runs): the bodies as one piece each, or K as one piece per key run (:func:`_run_pieces`;
    moved_q: its queries already moved per run distance, :func:`_moved_queries`)."""
    if kv.k_runs:
        if qf is None:
            raise ValueError("a row with key runs needs its queries (qf) for the runs' pieces")
        k_body, moved = _run_pieces(kv, qf[qrow : qrow + 1], moved_q)
        return kernels.cpu.AttendRow(
            qrow, kv.k_sink, kv.v_sink, kv.k_res[:, :, moved:], kv.v_res, k_body,
            ((kv.v_codec, kv.v_body, kv.v_offset),), *hblocks(kv), *rotations(kv), k_bias(kv),
        )  # fmt: skip

    def cut(t):
        return t if b is None or t is None else t[b : b + 1]

    def body(enc: Encoded) -> Encoded:
        if b is None:
            return enc
        return Encoded(
            token={n: cut(t) for n, t in enc.token.items()}, group={n: cut(t) for n, t in enc.group.items()}
        )

    (k_hblock, v_hblock), (k_rot, v_rot), bias = hblocks(kv), rotations(kv), k_bias(kv)
    k_piece, k_res = (kv.k_codec, body(kv.k_body), kv.k_offset), cut(kv.k_res)
    if kv.k_pos is not None:  # keys before RoPE: the body through a key transform, the residual rotated here
        k_piece, k_res = _pre_rope_piece(kv, k_piece, k_res, cut(kv.k_pos))
        k_hblock, k_rot, bias = 0, None, None  # the basis and the bias are the transform's
    return kernels.cpu.AttendRow(
        qrow,
        cut(kv.k_sink),
        cut(kv.v_sink),
        k_res,
        cut(kv.v_res),
        (k_piece,),
        ((kv.v_codec, body(kv.v_body), kv.v_offset),),
        k_hblock,
        v_hblock,
        k_rot,
        v_rot,
        bias,
    )


def pre_rope_transform(kv, pos: torch.Tensor, enc: Encoded, device) -> kernels.KeyTransform:
    """The :class:`kvslim.kernels.KeyTransform` that takes pre-RoPE body keys ``enc`` of ``kv`` to the scores'
    frame: the centering bias added back where flagged, the basis taken back, RoPE at ``pos`` (B, n_body). The one
    builder of the op-by-op path (:func:`kvslim.attention._stream_scores`) and the fused pieces."""
    cos, sin = kv.rope.table(pos, device)  # (B, n_body, R/2)
    basis = kv.k_basis
    return kernels.KeyTransform(
        bias=None if basis is None else basis.bias,
        hadamard=None if basis is None else basis.hadamard,
        cos=cos,
        sin=sin,
        rope_offset=kv.rope.offset,
        centered=enc.token.get(CENTERED),
    )


def _pre_rope_piece(kv, piece: tuple, k_res: torch.Tensor, pos: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """A row's K body piece and residual keys when the stream holds keys before RoPE (``kv.k_pos``, the row's
    positions ``pos`` (1, n_body + n_res)): the piece with a :class:`kvslim.kernels.KeyTransform` (the centering
    bias added back where flagged, the basis taken back, RoPE at each key's position: what
    :func:`kvslim.attention._stream_scores` hands the transformed score kernels), the residual keys rotated to their
    positions (fp32), as that function rotates them. Elementwise on the row's own slice: the same bits alone and in
    a batch."""
    codec, enc, offset = piece
    n_body = kv.n_body("k")
    tr = pre_rope_transform(kv, pos[:, :n_body], enc, k_res.device)
    if k_res is not None and k_res.shape[2]:
        k_res = kv.rope.move(k_res.float(), pos[:, n_body:])
    return (codec, enc, offset, None, tr), k_res


def fused_decode(qf: torch.Tensor, kv) -> torch.Tensor | None:
    """A decode step's attention (B, Hkv, M, D) fp32 over ``kv`` in one kernel call, or None where that call does
    not apply (:func:`fusable`) and :func:`kvslim.attention.compressed_attention` computes it op by op. The same
    scores, softmax and sums, in one call instead of a dozen dispatched ops and two kernel calls a layer: what an
    eager step's time at short contexts was made of. On CUDA it is the rows program with this cache's rows, the
    call a ragged step makes for all its rows."""
    backend = rows_backend(qf)
    if backend is None or not fusable(qf, kv, backend):
        return None
    if kv.k_runs:  # keys in other RoPE frames (CPU, one row): the rows call scores each run with its own queries
        out = torch.zeros_like(qf)
        return None if kernels.cpu.attend_rows(qf, [fused_row(kv, 0, qf=qf)], out) else out
    if backend is kernels.cpu and (fitted(kv) or k_bias(kv) is not None or kv.k_pos is not None):
        # a fitted basis, a centered K, keys before RoPE: kv_attend_rows takes the matrices, the bias and the key
        # transform (one row per batch row)
        out = torch.zeros_like(qf)
        rows = [fused_row(kv, b, None if qf.shape[0] == 1 else b) for b in range(qf.shape[0])]
        return None if kernels.cpu.attend_rows(qf, rows, out) else out
    if backend is kernels.gpu_rows:
        out = torch.zeros_like(qf)
        rows = [fused_row(kv, b, None if qf.shape[0] == 1 else b) for b in range(qf.shape[0])]
        try:
            left = kernels.gpu_rows.attend_rows(qf, rows, out)
        except Exception:  # noqa: BLE001 - as a ragged step does with a failed call: the op-by-op path instead
            return None
        return None if left else out
    k_hblock, v_hblock = hblocks(kv)
    return kernels.cpu.attend(
        qf,
        kv.k_sink,
        kv.v_sink,
        kv.k_res,
        kv.v_res,
        kv.k_codec,
        kv.k_body,
        kv.k_offset,
        kv.v_codec,
        kv.v_body,
        k_hblock=k_hblock,
        v_hblock=v_hblock,
        v_offset=kv.v_offset,
    )


def ragged_fused(query, key, scaling, real: list[int]):
    """The fusable rows of a ragged step's layer in one call (``attend_rows`` of :func:`rows_backend`).

    Returns (out (B, 1, Hq, D) in query's dtype, with the fused rows' outputs and 0 elsewhere, rows left to the
    caller), or (None, real) where no row is fused. Each fused row's output is bit for bit what
    :func:`kvslim.attention.compressed_attention` gives that row alone: the same query arithmetic (elementwise,
    whatever the batch), the same kernel arithmetic per row (``kv_attend_rows`` is ``kv_attend`` per row; the
    Triton rows program is the one a row alone runs), the same casts."""
    b_all, hq, q_len, d = query.shape
    first = key.rows[real[0]]
    h_kv = first.kv_shape[1]
    if hq % h_kv:
        return None, real
    scaling = d**-0.5 if scaling is None else scaling
    # GQA folded into the query axis as compressed_attention folds it: (B, Hkv, rep * q, D)
    qf = (query.float() * scaling).reshape(b_all, h_kv, hq // h_kv * q_len, d)
    backend = rows_backend(qf)
    if backend is None:
        return None, real
    rows, rest = [], []
    moved_q = _moved_queries(qf, key, real) if backend is kernels.cpu else {}
    for b in real:
        seg = key.rows[b]
        if seg.kv_shape[1:] == (h_kv, d) and fusable(qf, seg, backend):
            rows.append(fused_row(seg, b, qf=qf, moved_q=moved_q.get(b)))
        else:
            rest.append(b)
    if not rows:
        return None, real
    # rows the call does not write (fillers, rows left to the caller) are 0; where it writes every row, nothing is
    # left unwritten but the rows it refuses, which the caller writes over
    flat = torch.empty_like(qf) if len(rows) == b_all else torch.zeros_like(qf)
    try:
        left = backend.attend_rows(qf, rows, flat)
    except Exception:  # noqa: BLE001 - every row runs alone instead, where a failure stays with its row
        left = range(len(rows))
    rest = sorted(rest + [rows[i].qrow for i in left])
    if q_len == 1 and query.dtype == flat.dtype:  # (B, Hq, 1, D) is (B, 1, Hq, D) in memory: a view
        return flat.view(b_all, 1, hq, d), rest
    out = flat.reshape(b_all, hq, q_len, d).to(query.dtype).transpose(1, 2).contiguous()  # (B, q, Hq, D)
    return out, rest


def _runs_fit(kv) -> bool:
    """Whether the residual's keys off the current RoPE frame all come before its keys in the frame (the fused
    call scores the residual's tail with the row's own queries; the keys before it become pieces)."""
    n_body, start, framed = kv.n_body("k"), 0, False
    for n, delta in kv.k_runs:
        if start + n > n_body:  # the run reaches into the residual
            if delta and framed:
                return False
            framed = framed or delta == 0
        start += n
    return True


def _moved_queries(qf: torch.Tensor, key, real: list[int]) -> dict:
    """``{row: {delta: (queries, based)}}``: each ragged row's queries ``qf[row]`` moved by ``-delta`` for every key
    run ``delta`` positions off its frame, in one :meth:`~kvslim.cache.rotary.Rotary.move` per rotation instead of
    one per row and run (:func:`_run_pieces` moves a row's own when it is not here: the move is elementwise, so the
    bits are the same either way), and ``based``, those queries in the row's Hadamard K basis where
    :func:`_in_bases` could rotate them together (None: the row rotates its own). The angles of a set of distances
    are computed once a step, not once a layer, where the step shares a dict (``key.shared``): a run's distance is
    the same in every layer."""
    items = []
    for b in real:
        seg = key.rows[b]
        if seg is not None and seg.k_runs and seg.rotary is not None:
            items += [(seg.rotary, (b, delta)) for _, delta in seg.k_runs if delta]
    out: dict = {}
    shared = getattr(key, "shared", None)
    for rotary, pairs in by_rotation(items, shared):
        if len(pairs) < 2:
            continue
        idx = torch.tensor([b for b, _ in pairs])
        x = qf[idx]  # (G, Hkv, M, D)
        memo = ("queries", id(rotary), x.shape[2], str(x.device), tuple(-d for _, d in pairs))
        angles = None if shared is None else shared.get(memo)
        if angles is None:
            delta = torch.tensor([-d for _, d in pairs])[:, None].expand(len(pairs), x.shape[2])  # (G, M)
            angles = rotary.move_angles(delta, x.device)
            if shared is not None:
                shared[memo] = angles
        moved = rotary.move(x, None, angles=angles).float()
        based = _in_bases(moved, [key.rows[b].k_basis for b, _ in pairs])
        for i, (b, delta) in enumerate(pairs):
            out.setdefault(b, {})[delta] = (moved[i : i + 1], based[i])
    return out


def _in_bases(moved: torch.Tensor, bases: list) -> list:
    """Each row of ``moved`` (G, Hkv, M, D) taken to its basis ``bases[i]``'s Hadamard basis, the rows of one basis
    in one product, where that product rounds each row as it rounds it alone (:meth:`Hadamard.row_invariant`):
    a list of G (1, Hkv, M, D) tensors (None: :func:`_run_pieces` rotates that row alone, as it always could)."""
    out: list = [None] * len(bases)
    if not Hadamard.row_invariant(moved):
        return out
    groups: dict = {}
    for i, basis in enumerate(bases):
        if basis is not None and basis.hadamard is not None and basis.hadamard.block:
            groups.setdefault(basis.hadamard, []).append(i)
    for had, idx in groups.items():
        rotated = had.apply(moved if len(idx) == len(bases) else moved[torch.tensor(idx)])
        for j, i in enumerate(idx):
            out[i] = rotated[j : j + 1]
    return out


def _run_pieces(kv, q: torch.Tensor, moved_q: dict | None = None) -> tuple[tuple, int]:
    """The K stream's keys as pieces ``(codec, Encoded, offset[, queries])``, one per key run, and how many of
    the residual's first keys they took. A run ``delta`` positions off the current frame is scored with the
    row's queries ``q`` (1, Hkv, M, D) moved by ``-delta`` (``R(-d)q . k = q . R(d)k``, the arithmetic of
    :func:`kvslim.attention._stream_scores`): its body keys as a piece of the body's codec with those queries
    taken to the body's basis, its residual keys (a run still at full precision right after a re-base) as a
    piece of the residual's own dtype (the ``none`` cast, read by the C row decoders) with the moved queries as
    they are. A run in the frame is scored with the row's own queries: its body keys a plain piece, its residual
    keys left to the row's residual. Computed on the row's (1, ...) slice alone, so a row gets the same bits in a
    ragged step and alone."""
    n_body, start, pieces, moved = kv.n_body("k"), 0, [], 0
    basis = kv.k_basis
    for n, delta in kv.k_runs:
        lo, hi = start, start + n
        start = hi
        qb = None
        if delta == 0:
            qd = None
        elif moved_q is not None and delta in moved_q:
            qd, qb = moved_q[delta]
        else:
            qd = kv.rotary.move(q, -delta).float()
        if lo < n_body:  # the run's body keys
            enc, offset = kv.k_body.narrow(lo, min(hi, n_body), kv.k_offset, kv.k_codec.token_group)
            if qd is None:
                pieces.append((kv.k_codec, enc, offset))
            else:
                if qb is None:
                    qb = basis.hadamard.apply(qd) if basis is not None and basis.hadamard is not None else qd
                pieces.append((kv.k_codec, enc, offset, qb.contiguous()))
        if hi > n_body and qd is not None:  # the run's residual keys, off the frame
            res = kv.k_res[:, :, max(lo, n_body) - n_body : hi - n_body]
            pieces.append((_FP_ROWS, Encoded(token={"x": res}), 0, qd.contiguous()))
            moved = hi - n_body
    return tuple(pieces), moved
