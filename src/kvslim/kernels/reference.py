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

#: Tokens decoded at a time by :func:`k_scores_transformed`: its fp32 scratch is at most this many tokens
#: per (batch, head), whatever the length of the history.
TRANSFORM_TILE = 256


def k_scores(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int = 0) -> torch.Tensor:
    """q: (B, H, M, D) fp32 -> scores (B, H, M, T) fp32 against the T encoded keys."""
    k = codec.decode(enc, torch.float32, offset)  # (B, H, T, D)
    return torch.matmul(q, k.transpose(-1, -2))


def v_weighted(p: torch.Tensor, codec: Codec, enc: Encoded, offset: int = 0) -> torch.Tensor:
    """p: (B, H, M, T) fp32 -> p @ V (B, H, M, D) fp32 over the T encoded values."""
    v = codec.decode(enc, torch.float32, offset)  # (B, H, T, D)
    return torch.matmul(p, v)


def apply_transform(rows: torch.Tensor, tr, start: int) -> torch.Tensor:
    """Stored keys (B, H, n, D) fp32 (tokens ``start .. start + n`` of the body) -> the keys attention
    scores against: ``tr.bias`` added, ``tr.hadamard`` applied, RoPE at ``tr.cos``/``tr.sin``'s angles.
    Returns a new fp32 tensor (rows is not written)."""
    x = rows.float()
    if tr.bias is not None:
        bias = tr.bias.to(device=x.device, dtype=torch.float32)[None, :, None, :]
        if tr.centered is not None:
            bias = bias * tr.centered[:, :, start : start + x.shape[2]].to(
                device=x.device, dtype=torch.float32
            )
        x = x + bias
    if tr.hadamard is not None:
        x = tr.hadamard.inverse(x)  # back from the stored basis (a Hadamard is its own inverse; a fitted R: R^T)
    if tr.cos is not None:
        n = x.shape[2]
        c = tr.cos[:, None, start : start + n].to(x.device)  # (B|1, 1, n, R/2)
        s = tr.sin[:, None, start : start + n].to(x.device)
        o, h = tr.rope_offset, tr.cos.shape[-1]
        a, b = x[..., o : o + h], x[..., o + h : o + 2 * h]
        x = x.clone() if x is rows else x
        x[..., o : o + h], x[..., o + h : o + 2 * h] = a * c - b * s, b * c + a * s
    return x


def k_scores_transformed(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int, tr) -> torch.Tensor:
    """q: (B, H, M, D) fp32 -> scores (B, H, M, T) against ``apply_transform`` of the decoded keys.

    Decodes :data:`TRANSFORM_TILE` tokens at a time: the scratch is bounded, never a copy of the history."""
    t = next(iter(enc.token.values())).shape[2]
    out = q.new_empty((*q.shape[:3], t))
    for lo in range(0, t, TRANSFORM_TILE):
        hi = min(t, lo + TRANSFORM_TILE)
        part, off = enc.narrow(lo, hi, offset, codec.token_group) if (lo, hi) != (0, t) else (enc, offset)
        rows = apply_transform(codec.decode(part, torch.float32, off), tr, lo)  # (B, H, n, D)
        out[..., lo:hi] = torch.matmul(q, rows.transpose(-1, -2))
    return out
