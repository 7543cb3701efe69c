"""The encoded-layout contract: what a stored body of each layout family holds, checked once.

Kernels (the C ones, :mod:`kvslim.kernels.cpu`; the Triton ones, :mod:`kvslim.kernels.gpu`) read an
:class:`~kvslim.formats.base.Encoded` body through raw pointers, where a wrong shape reads out of bounds
instead of raising. :func:`body_layout` checks every part against the codec (its ``family``, ``bits``,
GGML ``block``, groups) and hands the parts back with every dim after 2 contiguous (dims 0..2 keep the
strides of the views the cache hands out). Each backend then only maps the parts to its own arguments.

Families (``Codec.family``, from the format registry), for a body of ``T`` tokens, ``B`` x ``H`` heads
of ``D`` channels:

- ``affine_k`` (KIVI per-channel K): codes uint8 (B, H, T, D * bits / 8), each row a little-endian bit stream
  (``Format.pack``: int3 packs 8 codes in 3 bytes, D a multiple of 8; :mod:`.affine`); scale, zero fp16/bf16/fp32
  (B, H, n, D), one row per group of ``token_group`` tokens, ``n = ceil((offset + T) / token_group)``;
- ``affine_v`` (KIVI per-token V): codes as above; scale, zero (B, H, T, D / g), ``g`` channels each
  (the codec's ``group_size``, None: the whole head);
- ``ggml``: blocks uint8 (B, H, T, D / elements * bytes) of the format's ``block``;
- ``fp8``: codes float8_e4m3fn (B, H, T, D); scale float32 (B, H, T, 1);
- ``cast``: values fp16/bf16/fp32 (B, H, T, D).

An affine body whose codes index a Lloyd-Max level table (:mod:`.codebook`) has no kernel layout: the kernels
read uniform codes, so :func:`body_layout` refuses it and the kernels' ``supports`` decline it.

This module knows nothing about kernels, positions or caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int
from .base import Codec, Encoded

#: Dtypes a scale, a zero or a cast body may have.
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: The families :func:`body_layout` knows.
FAMILIES = ("affine_k", "affine_v", "ggml", "fp8", "cast")


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


@dataclass(frozen=True)
class BodyLayout:
    """An encoded body's parts, checked against its codec (see the module docstring for the shapes).

    d: channels per token (head dim). x: the codes, blocks or values. scale, zero: the affine scales and
    zeros, fp8's per-token scale (``zero`` None), None otherwise. group: tokens per K scale row
    (``affine_k``), channels per V scale (``affine_v``), 1 otherwise."""

    d: int
    x: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    group: int = 1


def body_layout(
    codec: Codec, enc: Encoded, b: int, h: int, t: int, d: int | None = None, offset: int = 0
) -> BodyLayout:
    """The checked parts of a body of ``t`` tokens (B = ``b``, H = ``h``) that starts ``offset`` tokens into
    its first group (``affine_k`` only; 0 <= offset < token_group). ``d`` None: read from the body.

    Raises ValueError naming the part, its shape and dtype and what the codec needs."""
    family = codec.family
    if getattr(codec, "levels", None):
        raise ValueError(
            f"{codec.name} {codec.role.upper()} decodes through a Lloyd-Max level table (kvslim.formats.codebook), "
            f"which the kernels do not read: its body goes to the torch reference"
        )
    if family in ("affine_k", "affine_v"):
        per, nbytes = codec.format.pack
        codes = rows_contiguous(enc.token["codes"])
        d = codes.shape[-1] // nbytes * per if d is None else d
        if d % per:
            raise ValueError(
                f"{codec.name} packs {per} codes in {nbytes} byte(s): head dim {d} is not a multiple of {per}"
            )
        expect(
            codes, (b, h, t, d // per * nbytes), (torch.uint8,), f"{codec.name} {codec.role.upper()} codes"
        )
        if family == "affine_k":
            g = codec.token_group
            check_int("offset", offset, minimum=0, below=g)
            rows = (b, h, -(-(offset + t) // g), d)
            parts = (rows_contiguous(enc.group[k]) for k in ("scale", "zero"))
        else:
            g = d if codec.group_size is None else codec.group_size
            if d % g:
                raise ValueError(
                    f"{codec.name} V has channel groups of {g}, which do not divide head dim {d}"
                )
            rows = (b, h, t, d // g)
            parts = (rows_contiguous(enc.token[k]) for k in ("scale", "zero"))
        scale, zero = parts
        for name, s in (("scale", scale), ("zero", zero)):
            expect(s, rows, FLOATS, f"{codec.name} {codec.role.upper()} {name}")
        return BodyLayout(d, codes, scale, zero, g)
    if family == "ggml":
        size, nb = codec.format.block
        blocks = rows_contiguous(enc.token["blocks"])
        d = blocks.shape[-1] // nb * size if d is None else d
        if d % size:
            raise ValueError(f"{codec.name} needs a head dim that is a multiple of {size}, got {d}")
        expect(blocks, (b, h, t, d // size * nb), (torch.uint8,), f"{codec.name} blocks")
        return BodyLayout(d, blocks)
    if family == "fp8":
        codes = rows_contiguous(enc.token["codes"])
        d = codes.shape[-1] if d is None else d
        expect(codes, (b, h, t, d), (torch.float8_e4m3fn,), "fp8 codes")
        scale = enc.token["scale"]
        expect(scale, (b, h, t, 1), (torch.float32,), "fp8 scale")
        return BodyLayout(d, codes, scale)
    if family == "cast":
        x = rows_contiguous(enc.token["x"])
        d = x.shape[-1] if d is None else d
        expect(x, (b, h, t, d), FLOATS, f"{codec.name} tokens")
        return BodyLayout(d, x)
    raise ValueError(
        f"codec {codec.name!r} (family {family}) has no kernel layout; known: {', '.join(FAMILIES)}"
    )
