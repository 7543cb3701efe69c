"""The torch reference of :func:`kvslim.vllm.attend.attend`: every row's cached keys decoded from its pages to fp32,
a masked softmax. Correct and slow: the oracle the C kernel is tested against, and what :func:`~.attend.attend`
runs where the C library cannot be built or ``$KVSLIM_VLLM_KERNEL`` is ``reference``.

This module imports nothing of vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..cache.hadamard import Hadamard
from .pages import PageLayout, gather
from .staging import overlay

if TYPE_CHECKING:
    from .attend import Rows, Staged


def attend_reference(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    out: torch.Tensor,
    rows: Rows,
    scale: float,
    window: int = 0,
    causal: bool = True,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    staged: Staged | None = None,
    sink: int = 0,
    rotate: tuple[int, int] = (0, 0),
) -> None:
    """:func:`attend` in torch: each row's cached keys decoded from its pages to fp32 (with ``key``/``value``,
    its new keys taken from them), a masked softmax. The oracle of the C kernel."""
    h_q = query.shape[1]
    staged_kv = None
    if staged is not None:
        staged_kv = staged.layout.decode(staged.pool)  # (K, V) fp32 (slots, H, T, D)
    for r, kv_len in enumerate(rows.kv_lens):
        q0, q1 = rows.starts[r], rows.starts[r + 1]
        n = q1 - q0
        if n == 0:
            continue
        cached = kv_len if key is None else kv_len - n  # keys read from the pages' codes
        if cached:
            kv = gather(layout, kv_cache, rows.block_table[r], cached)  # K, V: (H_kv, cached, D) fp32
            if staged_kv is not None:
                kv = overlay(kv, staged_kv, staged.map, rows.block_table[r], cached)
        else:
            kv = (torch.empty(kv_cache.shape[1], 0, layout.head_dim),) * 2
        if key is not None:  # the row's new keys, raw
            kv = [torch.cat([x, raw[q0:q1].float().transpose(0, 1)], 1) for x, raw in zip(kv, (key, value))]
        g = h_q // kv[0].shape[0]
        k, v = (x.repeat_interleave(g, 0) for x in kv)  # (H_q, L, D)
        q = query[q0:q1].float()
        if rotate[0]:  # into K's basis
            q = Hadamard(layout.head_dim, rotate[0]).apply(q)
        q = q.transpose(0, 1)  # (H_q, n, D)
        s = (q @ k.transpose(1, 2)) * scale  # (H_q, n, L)
        qpos = torch.arange(kv_len - n, kv_len)[:, None]  # (n, 1)
        kpos = torch.arange(kv_len)[None, :]  # (1, L)
        keep = kpos <= qpos if causal else torch.ones(n, kv_len, dtype=torch.bool)
        if window > 0:
            keep = keep & ((kpos > qpos - window) | (kpos < sink))
        s = s.masked_fill(~keep, float("-inf"))
        o = (torch.softmax(s, -1) @ v).transpose(0, 1)  # (n, H_q, D)
        if rotate[1]:  # back from V's basis
            o = Hadamard(layout.head_dim, rotate[1]).apply(o)
        out[q0:q1] = o.to(out.dtype)
