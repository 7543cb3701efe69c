"""The pure-PyTorch kernels: decode the encoded tokens to fp32, then matmul (any device, any codec).

These define the semantics every other backend is tested against::

    k_scores(q, codec, enc, offset)   = q @ codec.decode(enc, fp32, offset)^T     (B, H, M, T)
    v_weighted(p, codec, enc, offset) = p @ codec.decode(enc, fp32, offset)       (B, H, M, D)

Unlike the C kernels they do write a fp32 copy of the body (one layer's worth, dropped right after):
on CUDA, and for long query chunks on CPU (prefill), the matmul dominates and this is the fast path.

A folded variant for per-channel K (``(q * scale_g) @ codes_g^T + q . zero_g``, one batched matmul
per token group) was measured against this one and left out: the unpacked codes still have to be
turned into fp32 for the matmul, so it saves only the multiply-add of the decode, and the per-group
matmuls cost more than that. CPU, 1 thread, T=4096, 3 KV heads, D=64, per layer: at M=3 it was
-16% (int8), +6% (int4), -13% (int2), within this shared machine's noise; at M=96 (the only CPU
case that reaches the reference) it took twice as long.
"""

from __future__ import annotations

import torch

from ..formats import Codec, Encoded


def k_scores(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int = 0) -> torch.Tensor:
    """q: (B, H, M, D) fp32 -> scores (B, H, M, T) fp32 against the T encoded keys."""
    k = codec.decode(enc, torch.float32, offset)  # (B, H, T, D)
    return torch.matmul(q, k.transpose(-1, -2))


def v_weighted(p: torch.Tensor, codec: Codec, enc: Encoded, offset: int = 0) -> torch.Tensor:
    """p: (B, H, M, T) fp32 -> p @ V (B, H, M, D) fp32 over the T encoded values."""
    v = codec.decode(enc, torch.float32, offset)  # (B, H, T, D)
    return torch.matmul(p, v)
