"""Range clipping for the affine formats: the quantization range of a slice chosen to minimize its squared error.

KIVI's affine codes span each slice's ``[min, max]`` (:mod:`.affine`). At 2 bits that spends the four levels on
the extremes: a token's 64 rotated V channels are close to Gaussian, and a grid stretched to their most extreme
value rounds the many values near the middle coarsely. Clipping the range (shrinking it, the values outside
clamped to its ends) trades a large error on a few outliers for a smaller one on the rest; the ratio that
minimizes the slice's mean squared error is the classic choice for uniform quantizers (Banner et al., 2019,
"Post-training 4-bit quantization of convolution networks for rapid-deployment", ACIQ; OmniQuant's learnable
clipping and OSCAR's calibrated thresholds fit it offline; llama.cpp's k-quants search it per block at encode
time, as here).

kvslim searches per slice, at encode time, with no calibration: ``[min, max]`` shrunk symmetrically about its
middle by each of :data:`RATIOS` (1.0, the min-max range itself, first), the codes computed against each, and the
range whose reconstruction has the least squared error kept (the first on a tie, so a slice min-max already fits
best keeps exactly min-max). Only encoding changes: the stored scale and zero have the same layout and meaning,
so every decoder and kernel reads clipped codes as they are. Measured per format and role in docs/quality.md
("Range clipping"): it helps 2-bit V a lot and hurts K (a key's outlier channels carry its attention), so the
cache's ``clip=auto`` turns it on where it was measured to help (:data:`AUTO`).
"""

from __future__ import annotations

import torch

from . import codebook

#: the shrink ratios of a slice's ``[min, max]`` tried, widest first (1.0: min-max, KIVI's range)
RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
#: (role, bits) where ``clip=auto`` clips: the measured wins of docs/quality.md's "Range clipping"
AUTO: frozenset[tuple[str, int]] = frozenset({("v", 2)})
#: the spec's values: which streams clip (``auto``: :data:`AUTO`)
MODES = ("auto", "off", "v", "k", "kv")


def clipped_range(
    xf: torch.Tensor, dim: int, bits: int, mn: torch.Tensor, mx: torch.Tensor, eps: float, table=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The range ``(lo, hi)`` (shaped like ``mn``/``mx``, the slices' min and max along ``dim`` kept as size 1) of
    least squared error for ``bits``-bit affine codes of the fp32 slices of ``xf`` along ``dim``: one of
    :data:`RATIOS`' shrinks of ``[mn, mx]`` per slice (module docstring). ``eps``: the smallest scale. ``table``:
    the codes' levels (a Lloyd-Max codebook, :mod:`.codebook`: nearest-level codes, its own wider ratios; None:
    the uniform grid)."""
    levels = (1 << bits) - 1
    ratios = RATIOS if table is None else codebook.RATIOS
    r = torch.tensor(ratios, dtype=torch.float32, device=xf.device).reshape((-1,) + (1,) * xf.dim())
    cut = (1 - r) / 2 * (mx - mn)  # (R, ...)
    lo, hi = mn + cut, mx - cut
    scale = torch.clamp((hi - lo) / levels, min=eps)
    if table is None:
        q = torch.round((xf - lo) / scale).clamp_(0, levels)
    else:
        q = codebook.lookup(codebook.nearest((xf - lo) / scale, table), table)
    err = (q * scale + lo - xf).square_().sum(dim if dim < 0 else dim + 1, keepdim=True)  # (R, ...)
    best = err.argmin(0, keepdim=True)  # the first of equal errors: the widest range
    return lo.gather(0, best.expand_as(lo[:1]))[0], hi.gather(0, best.expand_as(hi[:1]))[0]


def applies(codec) -> bool:
    """Whether ``codec`` encodes with :func:`clipped_range` when asked (the plain affine K and V codecs)."""
    return hasattr(codec, "clip") and not getattr(codec, "varnorm", False)


def wanted(mode: str, role: str, bits: int) -> bool:
    """Whether a stream of ``role`` in a ``bits``-bit affine format clips under ``clip=mode``."""
    return role in mode if mode != "auto" else (role, bits) in AUTO
