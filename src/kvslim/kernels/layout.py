"""Argument checks every kernel backend shares: the layout a kernel may read without a copy."""

from __future__ import annotations

import torch


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Make everything after dim 2 contiguous (dims 0..2 may keep any strides: the cache hands out
    narrowed views)."""
    if t.dim() == 4 and (t.shape[3] <= 1 or t.stride(3) == 1):
        return t
    return t.contiguous()


def expect(t: torch.Tensor, shape: tuple, dtypes, what: str) -> None:
    """Raise ValueError unless ``t`` has ``shape`` and a dtype in ``dtypes``."""
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        raise ValueError(
            f"{what} has shape {tuple(t.shape)} and dtype {t.dtype}; expected shape {shape} "
            f"and dtype in {[str(d) for d in dtypes]}"
        )
