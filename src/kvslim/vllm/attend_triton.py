"""Attention on kvslim pages in Triton: :func:`attend_triton`, the contract of :func:`kvslim.vllm.attend.attend` (the
C kernel ``kvp_attend`` and its torch reference) for CUDA tensors.

The same pages (:class:`~kvslim.vllm.pages.PageLayout`: every format a page holds: the GGML blocks, per-token
affine int4/int3/int2, symmetric int8, fp8, plain fp32/fp16/bf16), the same rows (:class:`~kvslim.vllm.attend.Rows`:
decode, prefill, prefill over a cached prefix, mixed in one call), the step's raw K/V for a row's own tokens, staging
slots, a window with sinks, GQA, the Hadamard bases: one launch a layer, one program per (query token, KV head)
(:mod:`kvslim.kernels.triton_pages` says what a program does). The query is rotated into K's basis before the launch
and the output back from V's after it, in torch (the C kernel does both inside its call).

:func:`~kvslim.vllm.attend.attend` sends CUDA tensors here where :func:`why_not` is None (else to the torch reference),
and CPU tensors only where ``$KVSLIM_VLLM_KERNEL=triton`` asks for it under Triton's interpreter
(``TRITON_INTERPRET=1``): how the tests run it (tests/test_triton_pages.py, against the reference and the C kernel).

The page writes need no kernel of their own on CUDA: :func:`kvslim.vllm.pages.write`'s torch encoders run on any
device and give the same bytes.

Not measured: no GPU was available when this was written; the tile sizes are the other Triton programs' reasoned
defaults. The CUDA side of the vLLM plugin (an attention backend registered as vLLM's CUSTOM one) is not built yet
(docs/vllm.md, "Not built yet").

This module imports nothing of vLLM.
"""

from __future__ import annotations

import torch

from ..cache.hadamard import Hadamard
from ..kernels import gpu
from .pages import PageLayout, Part

#: Tokens of a page the program reads (vLLM's kernel block size for this backend).
PAGE = 32
#: The program's ``FAM`` codes (kvslim/kernels/triton_pages.py)
FAMILY = {"ggml": 0, "affine": 1, "sym": 2, "fp8": 3, "cast": 4}
#: The program's ``CAST`` codes: the dtype of a plain part, its size
CAST = {torch.float32: (0, 4), torch.float16: (1, 2), torch.bfloat16: (2, 2)}
#: GGML block bytes as the program reads them (kvslim.kernels.gpu's)
GGML = gpu.GGML_LAYOUT


def programs():
    """The pages program of the current mode (:mod:`kvslim.kernels.triton_pages`)."""
    return gpu.programs("triton_pages")


def _constants(part: Part) -> tuple[int, int, int, int, int] | None:
    """(FAM, FMT, BITS, NB, CAST) of a part for the program, or None where it cannot read it."""
    fam = FAMILY[part.family]
    if part.family == "cast":
        return (fam, 0, 0, 0, CAST[part.dtype][0]) if part.dtype in CAST else None
    if part.family == "ggml":
        if part.name not in GGML:
            return None
        return fam, programs().GGML_CODES[part.name].value, 0, GGML[part.name], 0
    return fam, 0, int(part.bits or 0), 0, 0


def _alignment(part: Part) -> int:
    """The bytes a part's typed loads need its offset and the token stride to be a multiple of (an fp32 part off a
    4-byte boundary is read byte by byte instead: :func:`_aligned4`)."""
    if part.family == "cast":
        return min(2, CAST[part.dtype][1])
    return 2 if part.family == "affine" else 1


def _aligned4(part: Part, kv_cache: torch.Tensor) -> bool:
    """Whether a part's fp32 values can be loaded as fp32 (else byte by byte)."""
    return not (part.offset % 4 or kv_cache.stride(2) % 4 or kv_cache.data_ptr() % 4)


def why_not(layout: PageLayout, kv_cache: torch.Tensor, staged=None) -> str | None:
    """Why :func:`attend_triton` does not take these pages, or None where it does."""
    if not gpu.installed():
        return "Triton is not installed (pip install 'kvslim[gpu]')"
    if kv_cache.device.type not in ("cpu", "cuda"):
        return f"Triton does not run on {kv_cache.device.type} tensors"
    if kv_cache.device.type == "cpu" and not gpu.interpreting():
        return "CPU tensors run in Triton only under its interpreter (TRITON_INTERPRET=1)"
    if kv_cache.dim() != 4 or kv_cache.dtype != torch.uint8 or kv_cache.shape[2] != PAGE:
        return f"pages of shape {tuple(kv_cache.shape)} {kv_cache.dtype}: expected uint8 (pages, H_kv, {PAGE}, bytes)"
    if kv_cache.stride(3) != 1 or layout.head_dim > 256:
        return "a token row's bytes must be contiguous, and the head size at most 256"
    for part in (layout.k, layout.v):
        if _constants(part) is None:
            return f"the program does not read {part.name} pages"
        a = _alignment(part)
        if part.offset % a or kv_cache.stride(2) % a or kv_cache.data_ptr() % a:
            return f"{part.name} pages are not aligned for the program's {a}-byte loads"
    if staged is not None:
        s = staged.layout.k
        if s.family != "cast" or s.dtype not in CAST or staged.pool.stride(3) != 1:
            return "the staging pool is not a plain fp32/fp16/bf16 layout"
        a = CAST[s.dtype][1]
        if staged.pool.stride(2) % a or staged.pool.data_ptr() % a or staged.layout.v.offset % a:
            return "the staging pool is not aligned for its dtype"
    return None


def take(layout: PageLayout, kv_cache: torch.Tensor, staged=None) -> bool:
    """Whether :func:`kvslim.vllm.attend.attend` runs these pages here (:func:`why_not` None; CUDA tensors it does not
    take go to the torch reference); for CPU tensors (``$KVSLIM_VLLM_KERNEL=triton``) a reason is a ValueError in one
    line, never another kernel in its place."""
    reason = why_not(layout, kv_cache, staged)
    if reason is not None and kv_cache.device.type == "cpu":
        raise ValueError(f"kvslim paged attention: $KVSLIM_VLLM_KERNEL=triton, but {reason}")
    return reason is None


def _tokens(rows, n: int, causal: bool, has_new: bool, device) -> torch.Tensor:
    """The program's records, int64 (N, 5): each query token's row, position, cached keys it reads from the pages,
    first new key's index in the step's K/V and the number of new keys it sees."""
    starts = torch.tensor(rows.starts, dtype=torch.int64)
    kv = torch.tensor(rows.kv_lens, dtype=torch.int64)
    r = kv.shape[0]
    q_len = starts[1 : r + 1] - starts[:r]
    row = torch.repeat_interleave(torch.arange(r), q_len)  # (N',) rows of the packed tokens
    tok = torch.zeros(n, 5, dtype=torch.int64)
    if row.numel() == 0:
        return tok.to(device)
    idx = torch.arange(starts[0], starts[0] + row.numel())
    i = idx - starts[row]  # the token's place in its row
    qpos = kv[row] - q_len[row] + i
    if has_new:
        cached = kv[row] - q_len[row]
        nnew = i + 1 if causal else q_len[row]
    else:
        cached = torch.minimum(kv[row], qpos + 1) if causal else kv[row]
        nnew = torch.zeros_like(i)
    rec = torch.stack([row, qpos, cached, starts[row], nnew], 1)
    tok[idx] = rec
    return tok.to(device)


def attend_triton(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    out: torch.Tensor,
    rows,
    scale: float,
    window: int = 0,
    causal: bool = True,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    staged=None,
    sink: int = 0,
    rotate: tuple[int, int] = (0, 0),
) -> None:
    """:func:`kvslim.vllm.attend.attend` in one Triton launch (the arguments checked by it; :func:`why_not` None)."""
    n, h_q, d = query.shape
    h_kv = kv_cache.shape[1]
    m = h_q // h_kv
    dev = kv_cache.device
    q = query.float()
    if rotate[0]:  # into K's basis
        q = Hadamard(d, rotate[0]).apply(q)
    q = q.contiguous()
    o = torch.zeros(n, h_q, d, dtype=torch.float32, device=dev)
    has_new = key is not None
    tok = _tokens(rows, n, causal, has_new, dev)
    bt = rows.block_table.to(device=dev, dtype=torch.int32)
    if bt.dim() != 2 or bt.shape[1] == 0:
        bt = torch.zeros(max(1, bt.shape[0] if bt.dim() else 1), 1, dtype=torch.int32, device=dev)
    if bt.stride(1) != 1:
        bt = bt.contiguous()
    if has_new:
        k, v = key.float(), value.float()
        if k.stride(2) != 1 or v.stride(2) != 1:
            k, v = k.contiguous(), v.contiguous()
    else:
        k = v = q  # unread
    kc, vc = _constants(layout.k), _constants(layout.v)
    if staged is not None:
        pool, smap = staged.pool, staged.map.to(device=dev, dtype=torch.int32).contiguous()
        scast, s_voff = CAST[staged.layout.k.dtype][0], staged.layout.v.offset
        ss = (pool.stride(0), pool.stride(1), pool.stride(2), smap.shape[0])
    else:
        pool, smap, scast, s_voff = kv_cache, tok, 0, 0
        ss = (0, 0, 0, 0)
    block_m = max(16, 1 << (m - 1).bit_length())
    block_d = max(16, 1 << (d - 1).bit_length())
    if n:
        programs().pages_kernel[(n, h_kv)](
            q, o, tok, bt, kv_cache, k, v, pool, smap,
            q.stride(0), q.stride(1), o.stride(0), o.stride(1), bt.stride(0),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *ss,
            m, d, PAGE, window, sink, layout.k.offset, layout.v.offset, s_voff, float(scale),
            *kc, _aligned4(layout.k, kv_cache), *vc, _aligned4(layout.v, kv_cache), scast, staged is not None, has_new,
            BLOCK_M=block_m, BLOCK_T=PAGE, BLOCK_D=block_d, **gpu.COMPILE_OPTIONS,
        )  # fmt: skip
    if rotate[1]:  # back from V's basis
        o = Hadamard(d, rotate[1]).apply(o)
    out.copy_(o)
