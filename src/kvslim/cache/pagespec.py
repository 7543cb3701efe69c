"""What a :class:`~kvslim.cache.pagepool.PagePool` stores of a cache spec: the checks, the residual and sinks in whole
pages, the staging dtype, and StreamingLLM's window over pages.

A window in pages (``sink=N,window=W,positions=original``): every key keeps the position it was written at (pages
store keys after RoPE, so they are not moved as the ``cache`` positions of a SlimCache would move them), a query sees
the first ``N`` tokens and its last ``W`` (the kernel's ``sink`` and ``window``), and a row's pages that hold no sink
and have left every later query's window go back to the pool (:func:`evictable`): a row holds at most
:func:`window_pages` pages. Positions are never re-based, so a windowed row still ends at the model's context.

This module knows nothing about pages' bytes, rows or steps (:mod:`kvslim.cache.pagepool` applies these rules).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import CacheConfig
from ..vllm.pages import PAGE_TOKENS
from ..vllm.spec import check_supported, sink_pages

#: formats a page stores as plain values (no staging, so no residual)
CAST_FORMATS = ("none", "fp16", "bf16")
#: the residual of ``residual=auto``: kvslim's own cache's default (:mod:`kvslim.config`)
DEFAULT_RESIDUAL = 128


def residual_pages(config: CacheConfig) -> int:
    """Whole pages of newest tokens a row keeps staged beside its partly filled one: ``residual / 32``."""
    residual = DEFAULT_RESIDUAL if config.residual == "auto" else config.residual
    return residual // PAGE_TOKENS


def stage_dtype(config: CacheConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype a row's full-precision tokens are staged in: ``residual_dtype`` as a SlimCache resolves it (``auto``:
    float16 for a float32 model, else the model's dtype)."""
    if config.residual_dtype == "auto":
        return torch.float16 if dtype == torch.float32 else dtype
    return {"model": dtype, "float16": torch.float16, "bfloat16": torch.bfloat16}[config.residual_dtype]


def sink_tokens(config: CacheConfig) -> int:
    """Tokens every query sees whatever the window (0 without a window)."""
    return config.sink if config.window is not None else 0


def window_pages(config: CacheConfig, chunk: int) -> int | None:
    """The most pages a windowed row holds after a step of at most ``chunk`` new tokens (its sink pages, the pages
    of its window and the chunk, and one a page boundary may add); None without a window."""
    if config.window is None:
        return None
    return sink_pages(config) + -(-(config.window + chunk) // PAGE_TOKENS) + 1


def evictable(config: CacheConfig, length: int) -> tuple[int, int]:
    """The page indices ``[first, last)`` of a row of ``length`` tokens that no later query sees: past its sink pages,
    and wholly before the window of the next query (position ``length``). ``(0, 0)`` without a window."""
    if config.window is None:
        return 0, 0
    first = sink_pages(config)  # a window names its sinks (check_config)
    return first, max(first, (length - config.window + 1) // PAGE_TOKENS)


def check_config(config: CacheConfig) -> None:
    """ValueError in one line unless pages can store ``config`` (:mod:`kvslim.cache.pagepool`'s list, and the
    window's rules in the module docstring)."""
    if config.window is not None:
        if config.positions != "original":
            raise ValueError(
                f"window={config.window} in kvslim pages keeps every key at its original position: add "
                f"positions=original (pages do not move the kept keys, as positions={config.positions} does)"
            )
        if config.sink == "auto":
            raise ValueError(
                f"window={config.window} in kvslim pages needs its sinks named: add sink=N (StreamingLLM's first "
                f"tokens every query sees, 0 for none)"
            )
        residual = DEFAULT_RESIDUAL if config.residual == "auto" else config.residual
        cast = {config.k_format, config.v_format} <= set(CAST_FORMATS)  # nothing staged: no residual to hold
        if residual and not cast and config.window < residual + PAGE_TOKENS:
            raise ValueError(
                f"window={config.window} in kvslim pages must hold the full-precision residual and a page more "
                f"({residual} + {PAGE_TOKENS} tokens): widen the window or lower residual"
            )
    elif config.positions != CacheConfig().positions:
        raise ValueError(
            f"positions={config.positions!r} is not supported in kvslim pages without a window: every key keeps its "
            f"own position"
        )
    if config.pre_rope is True:
        raise ValueError("pre_rope=1 is not supported in kvslim pages: their keys are stored after RoPE")
    if config.residual != "auto" and config.residual % PAGE_TOKENS:
        raise ValueError(
            f"residual={config.residual} in kvslim pages must be a multiple of {PAGE_TOKENS} (whole pages kept at "
            f"full precision)"
        )
    plugin = replace(
        config, residual="auto", residual_dtype="auto", window=None, positions=CacheConfig().positions
    )
    try:  # the vLLM plugin's rules, but for its residual of one page in the model's dtype and its window
        check_supported(plugin)
    except ValueError as e:
        text = str(e).removeprefix("kvslim: ").replace("in vLLM", "in kvslim pages")
        raise ValueError(text) from None


#: From this magnitude on a float32 rounds to an infinite float16 (its largest finite value is 65504).
HALF_LIMIT = 65520.0


def check_half(keys: torch.Tensor, values: torch.Tensor) -> None:
    """ValueError in one line where a K/V value staged in float16 would not be finite there (as a SlimCache's float16
    residual refuses it): never an inf in the staging pool."""
    for name, x in (("key", keys), ("value", values)):
        # finite in float16 <=> |x| < 65520 (from there it rounds to inf); NaN fails the comparison too: one op a tensor
        if x.numel() and not float(torch.linalg.vector_norm(x, float("inf"))) < HALF_LIMIT:
            raise ValueError(
                f"a {name} value is not finite in float16 (beyond its range, or NaN/inf): the pool stages its newest "
                f"tokens in float16; build it with residual_dtype=model"
            )


def check_staged(stage_dtype, dtype, plan, keys: torch.Tensor, values: torch.Tensor, largest: float | None) -> None:
    """:func:`check_half` on what a step stages of its K/V (``keys``, ``values``: every token's, in the pages' basis)
    where the staging pool is float16 for a model of another dtype: only the staged tokens (``plan.staged_index``,
    None: all of them), and none where ``largest`` (the largest ``|value|`` of both, NaN if any; None: not known) says
    every value fits."""
    if stage_dtype != torch.float16 or dtype == torch.float16 or not plan.staged_any:
        return
    at = plan.staged_index  # only what is staged is cast: a prompt's other tokens are encoded
    if at is not None or largest is None or not largest < HALF_LIMIT:  # (NaN: not <) says which is out
        check_half(keys if at is None else keys[at], values if at is None else values[at])
