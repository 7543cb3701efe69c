"""Hadamard rotation of stored K / V: spread channel outliers before quantization (QuaRot, RotateKV).

QuaRot (Ashkboos et al., 2024) and RotateKV (Su et al., 2025) rotate keys and values by an
orthonormal Hadamard matrix before quantizing them: a channel with a large outlier is spread over
all channels of its block, so a per-block or per-token scale wastes less range on it. llama.cpp does
the same since PR #21038 (April 2026) whenever its K or V cache is quantized
(``LLAMA_ATTN_ROT_DISABLE=1`` turns it off). Attention is unchanged: ``H`` is orthonormal, so
``(H q) . (H k) = q . k`` and ``sum_i p_i H v_i = H (sum_i p_i v_i)`` — kvslim rotates the query once
and the attention output back once, never the history.

The matrix (the rule, documented in docs/quality.md):

- ``H_n`` is the normalized Sylvester Hadamard matrix of order ``n`` (a power of two), built by the
  recursion of llama.cpp's ``ggml_gen_hadamard``: ``H_1 = [1/sqrt(n)]``, ``H_2s = [[H_s, H_s],
  [H_s, -H_s]]``, i.e. ``H[i, j] = (-1)^popcount(i & j) / sqrt(n)``. It is symmetric and its own
  inverse (``H @ H = I``).
- A head of ``D`` channels is rotated block-diagonally by ``H_b`` with ``b`` the largest power of two
  that divides ``D`` (``D = 64 -> one H_64``, ``D = 96 -> three H_32``, ``D = 80 -> five H_16``).
  That is llama.cpp's rule for K (which rotates only when ``D % 64 == 0``); llama.cpp rotates V with
  64-blocks whatever ``D``, kvslim uses the K rule for both. Blocks smaller than :data:`MIN_BLOCK`
  are refused (an odd head_dim cannot be rotated at all).

This module knows nothing about caches, positions or transformers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

#: Smallest Hadamard block kvslim rotates with: a head_dim whose largest power-of-two divisor is smaller
#: is refused (a rotation over a handful of channels spreads an outlier over too few to matter).
MIN_BLOCK = 16


def block_size(head_dim: int) -> int:
    """The Hadamard block of a head of ``head_dim`` channels: the largest power of two dividing it.

    Raises ValueError when that is below :data:`MIN_BLOCK`."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    block = head_dim & -head_dim
    if block < MIN_BLOCK:
        raise ValueError(
            f"a Hadamard rotation needs a head_dim divisible by {MIN_BLOCK} (it rotates blocks of the largest power "
            f"of two dividing head_dim); head_dim {head_dim} gives blocks of {block}: use rotate='none'"
        )
    return block


@functools.lru_cache(maxsize=16)
def sylvester(n: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``(n, n)`` float64 (n a power of two), built exactly as
    llama.cpp's ``ggml_gen_hadamard`` builds it (in float64 here)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.zeros(n, n, dtype=torch.float64)
    h[0, 0] = 1.0 / n**0.5
    s = 1
    while s < n:
        top = h[:s, :s].clone()
        h[s : 2 * s, :s] = top
        h[:s, s : 2 * s] = top
        h[s : 2 * s, s : 2 * s] = -top
        s *= 2
    return h


@dataclass(frozen=True)
class Hadamard:
    """The block-diagonal rotation of ``dim`` channels by ``H_block`` (see the module docstring).

    ``apply(x)`` rotates the last dim of ``x``; the matrix is symmetric and its own inverse, so the same
    call rotates back. Rotation runs in float32 and returns float32.
    """

    dim: int
    block: int

    @classmethod
    def for_head_dim(cls, head_dim: int) -> Hadamard:
        return cls(head_dim, block_size(head_dim))

    def matrix(self, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full ``(dim, dim)`` block-diagonal matrix."""
        h = sylvester(self.block)
        full = torch.block_diag(*[h] * (self.dim // self.block))
        return full.to(device=device, dtype=dtype)

    def block_matrix(self, device=None) -> torch.Tensor:
        """``H_block`` in float32 on ``device`` (memoized per device; a constant of a compiled graph)."""
        if torch.compiler.is_compiling():
            where = str(torch.device(device) if device is not None else torch.device("cpu"))
            return _block_constant(self.block, where)
        device = torch.device("cpu") if device is None else device
        h = _BLOCKS.get((self.block, device))  # an eager decode step rotates twice a layer: one dict lookup
        if h is None:
            h = _BLOCKS[(self.block, device)] = _block_f32(self.block, str(torch.device(device)))
        return h

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``H x`` along the last dim of ``x`` (..., dim) -> float32 (..., dim)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"Hadamard rotation of {self.dim} channels got a last dim of {x.shape[-1]}")
        h = self.block_matrix(x.device)
        xf = x.float()
        # One 2-D matmul over the blocks (H symmetric: x @ H = (H x^T)^T): fewer dispatched ops than a batched
        # matmul of the (..., blocks, block) view, which matters in an eager decode step (twice a layer).
        flat = xf.reshape(-1, self.block)
        own = _rows_product(flat)
        if own is not None:
            return own(flat, h).view(xf.shape)
        return torch.mm(flat, h).view(xf.shape)

    @staticmethod
    def row_invariant(x: torch.Tensor) -> bool:
        """Whether :meth:`apply` rotates each row of ``x`` to the same bits whatever other rows share the call
        (kvslim's own kernel; torch's ``mm`` makes no such promise): only then may rows rotated one by one be
        rotated together instead."""
        return _rows_product(x) is not None

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Back from the rotated basis: ``H y`` again (H is its own inverse). A fitted rotation
        (:class:`kvslim.calibration.rotation.FittedRotation`) has the same interface with ``R^T``."""
        return self.apply(y)

    def for_layer(self, layer: int) -> Hadamard:
        """The rotation of model layer ``layer``: one Hadamard serves every layer (a fitted rotation is per layer)."""
        return self


_BLOCKS: dict = {}  # (block, torch.device) -> _block_f32's matrix, for the eager path's lookup
_OWN: list = []  # [the module kvslim.kernels.linear], imported on the first eager CPU product


def _rows_product(flat: torch.Tensor):
    """kvslim's own linear kernel (:mod:`kvslim.kernels.linear`) for an eager float32 CPU product outside autograd,
    where this build has it; else None (torch's ``mm``).

    Why: a decode step rotates a few rows at a time, hundreds of times a step (a re-based row's moved queries, a
    flushed group), and each of torch's small ``mm`` calls wakes its sleeping OpenMP thread under
    ``OMP_WAIT_POLICY=PASSIVE`` (~120 us a call, measured, against ~10 here); and the kernel gives each row the same
    bits whatever other rows share the call, so rows rotated together or alone are rotated alike (torch's BLAS does
    not promise that: docs/performance.md, "Rows and the BLAS"). Whether this build has the kernel is probed once
    per library load (:func:`kvslim.kernels.linear.ready`), so every eager CPU rotation of a process rounds alike;
    a compiled graph, a CUDA tensor, a tensor autograd tracks, a tensor subclass and a traced call take torch's
    ``mm`` (a compiled decode step's rotations may round otherwise than the eager step's by an ulp)."""
    if (
        flat.device.type != "cpu"
        or type(flat) is not torch.Tensor
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
    ):
        return None
    if flat.requires_grad and torch.is_grad_enabled():
        return None
    if not _OWN:
        from ..kernels import linear as own  # (kernels imports the formats; imported late, once)

        _OWN.append(own)
    return _OWN[0].linear if _OWN[0].ready() else None


@functools.lru_cache(maxsize=16)
def _block_f32(block: int, device: str) -> torch.Tensor:
    # a normal tensor even when first asked for inside inference_mode: an inference tensor kept here would make
    # every later rotation that autograd tracks fail ("Inference tensors cannot be saved for backward")
    with torch.inference_mode(False):
        return sylvester(block).to(device=device, dtype=torch.float32)


@torch.compiler.assume_constant_result
def _block_constant(block: int, device: str) -> torch.Tensor:
    """:func:`_block_f32` as ``torch.compile`` sees it: evaluated once while tracing, a constant of the graph."""
    return _block_f32(block, device)
