"""Float formats: ``none`` (the model's dtype, as given), ``fp16``, ``bf16`` and ``fp8`` (e4m3).

fp8 stores each token's vector as float8_e4m3fn after dividing by a per-token scale
``absmax / 448`` (448 is e4m3's largest finite value), kept as fp32; with the scale, tokens of any
magnitude use the format's full range instead of saturating or flushing to zero.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from .base import Codec, Encoded, Format, check_finite, tracing

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class _CastCodec(Codec):
    """Store as a plain dtype cast (fp16 / bf16), or unchanged (``none``: the format's dtype is None)."""

    def __init__(self, fmt: _CastFormat, role: str):
        super().__init__(fmt, role)
        self.dtype = fmt.dtype

    def encode(self, x: torch.Tensor) -> Encoded:
        if self.dtype is None:
            return Encoded(token={"x": x})
        if tracing():  # no host sync in a compiled step
            return Encoded(token={"x": x.to(self.dtype)})
        check_finite(x)
        if self.dtype == torch.float16 and bool((x.abs() > torch.finfo(torch.float16).max).any()):
            raise ValueError(
                f"values up to {x.abs().max().item():.4g} overflow fp16 (max 65504); use bf16 or an 8/4-bit format"
            )
        return Encoded(token={"x": x.to(self.dtype)})

    def decode(self, enc: Encoded, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return enc.token["x"].to(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        # ``none`` depends on the model's dtype; report it for fp32 here, layers count real bytes.
        return 32.0 if self.dtype is None else float(torch.finfo(self.dtype).bits)

    def nbytes(self, batch: int, heads: int, tokens: int, head_dim: int) -> int:
        return batch * heads * tokens * head_dim * int(self.bits_per_element(head_dim)) // 8


class _Fp8Codec(Codec):
    def encode(self, x: torch.Tensor) -> Encoded:
        if not tracing():
            check_finite(x)
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)  # (B, H, T, 1)
        scale = torch.clamp(amax / FP8_MAX, min=1e-12)
        codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Encoded(token={"codes": codes, "scale": scale})

    def decode(self, enc: Encoded, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return (enc.token["codes"].float() * enc.token["scale"]).to(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        return 8.0 + 32.0 / head_dim

    def nbytes(self, batch: int, heads: int, tokens: int, head_dim: int) -> int:
        return batch * heads * tokens * (head_dim + 4)


class _CastFormat(Format):
    """Floats stored as a dtype cast: no zero point, no scale (symmetric, no mean-centering)."""

    symmetric = True
    family = MappingProxyType({"k": "cast", "v": "cast"})
    #: the storage dtype; None = the model's own, as given
    dtype: torch.dtype | None = None

    def codec(self, role, *, group_size=32, v_group_size=None):
        return _CastCodec(self, role)


class NoneFormat(_CastFormat, name="none"):
    summary = "no compression: the model's own dtype"
    bits = None
    lossy = False


class Fp16Format(_CastFormat, name="fp16"):
    summary = "IEEE half precision"
    bits = 16
    dtype = torch.float16


class Bf16Format(_CastFormat, name="bf16"):
    summary = "bfloat16"
    bits = 16
    dtype = torch.bfloat16


class Fp8Format(Format, name="fp8"):
    summary = "float8 e4m3 with a per-token fp32 scale"
    bits = 8
    symmetric = True
    family = MappingProxyType({"k": "fp8", "v": "fp8"})

    def codec(self, role, *, group_size=32, v_group_size=None):
        return _Fp8Codec(self, role)
