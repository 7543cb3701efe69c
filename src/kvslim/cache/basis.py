"""The basis a stream's encoded body is stored in: a Hadamard rotation and a mean-centering bias.

:class:`BodyBasis` maps the tokens appended to a stream to the basis its encoded body holds them in
(``H x - bias``) and back, exactly; :func:`encode_in_basis` encodes tokens leaving a residual in that basis
(centered per token where the codec is per token). Used by the growing stores (:mod:`kvslim.cache.stream`)
and the static ones (:mod:`kvslim.cache.static`) alike.

This module knows nothing about buffers, positions, eviction or transformers: it is pure tensor
functions over a codec (:mod:`kvslim.formats`) and a Hadamard matrix (:mod:`kvslim.cache.hadamard`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import Codec, Encoded
from ..formats.base import tracing
from ..kernels import encode as c_encode
from .hadamard import Hadamard

#: Name of the per-token part an adaptively centered body carries: 1 where the token was stored centered.
CENTERED = "centered"


@dataclass(frozen=True)
class BodyBasis:
    """The basis a stream's encoded body is stored in, relative to the tokens appended to the stream:
    ``encode(x) = H x - bias`` (``hadamard`` None: no rotation; ``bias`` (H_kv, D) float32 in the rotated
    basis, None: no centering). ``decode`` is its exact inverse, ``H (y + bias)`` (H is its own inverse; a fitted
    rotation :class:`kvslim.calibration.rotation.FittedRotation` in ``hadamard``'s place decodes with ``R^T``),
    so a stored token decodes to the token appended up to the format's error: the bias acts as a fixed
    per-channel zero point (centering never relies on softmax invariance, whatever else the layer keeps
    at full precision).

    Centering is per token (:meth:`encode_adaptive`, for per-token formats): each token is stored centered
    only where that lowers its own round-trip error, and a ``centered`` token part (B, H, T, 1) uint8
    records the choice. A token far from the mean — the attention sink, whose key is short while the mean
    is long — is stored as it is, so centering never makes a token's key worse than not centering
    (docs/quality.md, "Centering and the attention sink")."""

    hadamard: Hadamard | None = None
    bias: torch.Tensor | None = None

    @property
    def identity(self) -> bool:
        return self.hadamard is None and self.bias is None

    def _bias(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias.to(device=x.device, dtype=torch.float32)
        if b.shape != (x.shape[1], x.shape[3]):
            raise ValueError(
                f"mean-center bias has shape {tuple(b.shape)} but the tokens have {x.shape[1]} KV heads x head_dim "
                f"{x.shape[3]}"
            )
        return b[None, :, None, :]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) appended tokens -> float32 in the stored basis (x itself when the basis is the identity)."""
        if self.identity:
            return x
        y = self.hadamard.apply(x) if self.hadamard is not None else x.float()
        return y - self._bias(y) if self.bias is not None else y

    def encode_adaptive(self, codec: Codec, x: torch.Tensor) -> Encoded:
        """Encode (B, H, T, D) tokens with a per-token codec, each centered or not, whichever round-trips
        closer (ties: centered); the choice is the ``centered`` token part (B, H, T, 1) uint8."""
        y = self.hadamard.apply(x) if self.hadamard is not None else x.float()
        b = self._bias(y)
        centered, plain = encode(codec, y - b), encode(codec, y)
        err_c = (codec.decode(centered, torch.float32) - (y - b)).pow(2).sum(-1)  # (B, H, T)
        err_p = (codec.decode(plain, torch.float32) - y).pow(2).sum(-1)
        flag = err_c <= err_p
        token = {}
        for name, tc in centered.token.items():
            f = flag.reshape(*flag.shape, *([1] * (tc.dim() - 3)))
            token[name] = torch.where(f, tc, plain.token[name])
        token[CENTERED] = flag.to(torch.uint8)[..., None]
        return Encoded(token=token, group=dict(centered.group))

    def decode(self, y: torch.Tensor, centered: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, T, D) decoded body tokens -> float32 in the basis the tokens were appended in.

        centered: the body's ``centered`` part (B, H, T, 1) (None: every token was centered)."""
        if self.identity:
            return y
        y = y.float()
        if self.bias is not None:
            y = y + (self._bias(y) if centered is None else self._bias(y) * centered.to(y.dtype))
        return self.hadamard.inverse(y) if self.hadamard is not None else y

    def decode_sum(self, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``sum_i p_i decode(y_i)`` from ``out = sum_i p_i y_i`` (B, H, M, D) and ``weight = sum_i p_i``
        (B, H, M, 1): the inverse is affine, so the weighted sum is decoded once, not token by token."""
        if self.bias is not None:
            out = out + weight * self.bias.to(device=out.device, dtype=torch.float32)[None, :, None, :]
        return self.hadamard.inverse(out) if self.hadamard is not None else out.float()


def encode_in_basis(codec: Codec, basis: BodyBasis | None, x: torch.Tensor) -> Encoded:
    """Tokens leaving a residual (B, H, n, D) -> their encoding, in the body's ``basis`` (None: as given;
    centered per token where the codec is per token, :meth:`BodyBasis.encode_adaptive`)."""
    if basis is None:
        return encode(codec, x)
    if basis.bias is not None and codec.token_group == 1:
        return basis.encode_adaptive(codec, x)
    return encode(codec, basis.encode(x))


def encode(codec: Codec, x: torch.Tensor) -> Encoded:
    """``codec.encode(x)``: through the C affine encoder where it applies (:func:`kvslim.kernels.encode.affine`,
    the same bytes without torch's per-op dispatch: a decode step's flushes are a few thousand values each), the
    codec's own encoder elsewhere (and inside a compiled graph, which a ctypes call would break)."""
    if not tracing():
        enc = c_encode.affine(codec, x)
        if enc is not None:
            return enc
    return codec.encode(x)
