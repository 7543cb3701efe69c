"""kvslim's paged attention and page writes as torch custom ops, for code that traces (``torch.compile``) or
dispatches through torch (vLLM's own kernels are such ops):

- ``torch.ops.kvslim.paged_attention(query, out, kv_cache, query_start_loc, seq_lens, block_table, k_format,
  v_format, model_dtype, scale, window=0, causal=True, key=None, value=None, stage_pool=None, stage_map=None)``:
  :func:`kvslim.vllm.attend.attend` (the C kernel ``kvp_attend``, or its torch reference) on the pages of a
  :class:`~kvslim.vllm.pages.PageLayout` named by its formats, written into ``out``; the rows are vLLM's own
  metadata (``query_start_loc`` (R + 1,), ``seq_lens`` (R,), ``block_table`` (R', max_blocks) int32); a staging
  pool (uint8, the model's dtype in the ``none`` layout) and its page-to-slot map (int32) are given together or
  not at all.
- ``torch.ops.kvslim.paged_write(kv_cache, key, value, slot_mapping, k_format, v_format, model_dtype)``:
  :func:`kvslim.vllm.attend.store` (``kvp_write``, or the torch encoders).

Both mutate an argument and return nothing (their schemas say which: ``out``, ``kv_cache``), so a compiled graph
keeps them in order and a fake tensor run has nothing to infer. No gradient: inference only. Registered once, on
the first import of this module, in the ``kvslim`` namespace (:mod:`kvslim.kernels.ops` defines it). The formats
and head size come as plain values, so the op is the same call from any caller: the vLLM backend keeps calling
:func:`~kvslim.vllm.attend.attend` directly (its layout object is already at hand), and a traced or foreign caller
uses these. CPU only (the C kernel and its reference read CPU tensors).

This module imports nothing of vLLM.
"""

from __future__ import annotations

import functools

import torch

from ..kernels import ops as _kernel_ops  # noqa: F401  (defines the kvslim namespace)
from . import attend as paged
from .pages import PageLayout

_LIB = torch.library.Library("kvslim", "FRAGMENT")
_LIB.define(
    "paged_attention(Tensor query, Tensor(a!) out, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, str k_format, str v_format, ScalarType model_dtype, float scale, int window=0, "
    "bool causal=True, Tensor? key=None, Tensor? value=None, Tensor? stage_pool=None, Tensor? stage_map=None) -> ()"
)
_LIB.define(
    "paged_write(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping, str k_format, str v_format, "
    "ScalarType model_dtype) -> ()"
)


@functools.lru_cache(maxsize=64)
def layout(k_format: str, v_format: str, head_dim: int, model_dtype: torch.dtype) -> PageLayout:
    """The :class:`PageLayout` of these formats (kept: the ops name it every call)."""
    return PageLayout.of(k_format, v_format, head_dim, model_dtype)


def _page_layout(kv_cache: torch.Tensor, k_format: str, v_format: str, model_dtype: torch.dtype, x, name: str):
    """The :class:`PageLayout` of these formats at the head size of ``x`` (the queries, or the keys written), checked
    against the pages' row bytes (one line where not). The shapes of the K/V and queries are checked where they are
    used (:func:`~kvslim.vllm.attend.attend`, :func:`~kvslim.vllm.pages.write`)."""
    if x.dim() != 3:
        raise ValueError(f"kvslim paged ops: {name} must be (N, heads, head size), got {tuple(x.shape)}")
    d = int(x.shape[-1])
    if kv_cache.dim() != 4 or kv_cache.dtype != torch.uint8:
        raise ValueError(
            f"kvslim paged ops: kv_cache must be uint8 (pages, H_kv, T, row bytes), got {tuple(kv_cache.shape)} "
            f"{kv_cache.dtype}"
        )
    pages = layout(k_format, v_format, d, model_dtype)
    if kv_cache.shape[3] != pages.row_bytes:
        raise ValueError(
            f"kvslim paged ops: pages of K {k_format} / V {v_format} at head size {d} have {pages.row_bytes} bytes "
            f"a token, kv_cache has {kv_cache.shape[3]}"
        )
    return pages


def _paged_attention(
    query, out, kv_cache, query_start_loc, seq_lens, block_table, k_format, v_format, model_dtype, scale,
    window=0, causal=True, key=None, value=None, stage_pool=None, stage_map=None,
) -> None:  # fmt: skip
    if (stage_pool is None) != (stage_map is None):
        raise ValueError("kvslim paged ops: give the staging pool and its map together, or neither")
    pages = _page_layout(kv_cache, k_format, v_format, model_dtype, query, "queries")
    staged = None
    if stage_pool is not None:
        staged = paged.Staged(stage_pool, layout("none", "none", pages.head_dim, model_dtype), stage_map)
    rows = paged.Rows.of(query_start_loc, seq_lens, block_table)
    paged.attend(pages, kv_cache, query, out, rows, scale, window, causal, key, value, staged)


def _paged_write(kv_cache, key, value, slot_mapping, k_format, v_format, model_dtype) -> None:
    pages = _page_layout(kv_cache, k_format, v_format, model_dtype, key, "key")
    paged.store(pages, kv_cache, key, value, slot_mapping)


_LIB.impl("paged_attention", _paged_attention, "CPU")
_LIB.impl("paged_write", _paged_write, "CPU")


@torch.library.register_fake("kvslim::paged_attention", lib=_LIB)
def _(query, out, kv_cache, *args, **kwargs) -> None:
    return None


@torch.library.register_fake("kvslim::paged_write", lib=_LIB)
def _(kv_cache, *args, **kwargs) -> None:
    return None


paged_attention = torch.ops.kvslim.paged_attention.default
paged_write = torch.ops.kvslim.paged_write.default
