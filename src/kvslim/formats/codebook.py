"""Non-uniform (Lloyd-Max) levels for the 2- and 3-bit affine formats.

KIVI's affine codes (:mod:`.affine`) place ``2^b`` *evenly spaced* levels over a slice's range. After a Hadamard
or fitted rotation the values of a slice are close to Gaussian, and for a Gaussian the levels of least squared
error are not evenly spaced: they crowd towards the middle, where most values are. Lloyd (1957/1982) and Max
(1960) give them as the fixed point of two conditions, each level the mean of the values nearest to it and each
threshold the midpoint between two levels; TurboQuant (merged in vLLM) quantizes rotated KV with such scalar
codebooks. For N(0, 1) the levels are ±0.4528, ±1.5104 (4 levels) and ±0.2451, ±0.7560, ±1.3439, ±2.1519
(8 levels; Max 1960, Table I). :func:`gaussian_levels` computes them here by the Lloyd iteration, in float64,
and a test checks them against those published values.

**The scheme (kvslim's).** The stored parts and their bytes are the affine ones, unchanged: a scale and a zero
per slice (bits per element identical). Only what a code *means* changes: code ``c`` decodes to
``zero + scale * T[c]`` instead of ``zero + scale * c``, where ``T`` (:func:`code_levels`) is the Gaussian
Lloyd-Max levels mapped affinely onto the code range ``[0, 2^b - 1]`` (``T[0] = 0``, ``T[-1] = 2^b - 1``;
int2: 0, 1.0503, 1.9497, 3; int3: 0, 1.3142, 2.2704, 3.1014, 3.8986, 4.7296, 5.6858, 7). A uniform grid is
``T[c] = c``, so a decoder changes in one place: the code's table entry instead of the code. Encoding takes each
value's *nearest* level (thresholds at the midpoints of ``T``).

The range is the slice's, chosen by the ``clip`` lever as for the even grid (the two levers are independent: the
codebook decides where the levels sit inside a slice's range, clipping decides the range): a stream that does not
clip keeps its outermost levels on the slice's min and max; a clipped one searches the range of least squared
error with the table's levels (:func:`kvslim.formats.clip.clipped_range` with the table and :data:`RATIOS`, which
reach lower than clipping's own: the Lloyd-Max outer levels sit at ±1.51 sigma at 2 bits, about 0.63 of a
64-value Gaussian slice's half-range, where clipping's search stops at 0.6). The two behave differently, as
clipping alone did (docs/quality.md, "Lloyd-Max codebooks"): a K channel's extremes carry its attention, so K
wants them kept. Deviation from a per-slice Lloyd fit (levels fitted to each slice's own values): that would
store ``2^b`` levels per slice; one fixed table costs nothing and fits the rotated, near-Gaussian slices it is for.

Where it is decoded: the torch decoders of :mod:`.affine` read the table. The C and Triton kernels read uniform
codes only (their fold of a K group's scale into the query and their codes-in-registers paths assume
``T[c] = c``), so they decline a codebook body and the kernel registry hands it to the torch reference
(:mod:`kvslim.kernels.reference`): correct, slower, never a different result (the layout contract,
:func:`kvslim.formats.layout.body_layout`, refuses a codebook body outright).

This module knows nothing about caches or kernels.
"""

from __future__ import annotations

import math
from functools import cache

import torch

#: the code widths a codebook is defined for (the 2- and 3-bit affine formats)
BITS = (2, 3)
#: the spec's values: which streams use the Lloyd-Max levels (``auto``: :data:`AUTO`)
MODES = ("auto", "off", "v", "k", "kv")
#: (role, bits) where ``codebook=auto`` uses the levels: where docs/quality.md ("Lloyd-Max codebooks") measured
#: them to help; empty until a measurement shows a gain.
AUTO: frozenset[tuple[str, int]] = frozenset()
#: the shrinks of a slice's ``[min, max]`` a clipped codebook stream tries for its outermost levels, widest first
RATIOS = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0 .. 0.5


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def _cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2)))


@cache
def gaussian_levels(n: int, iters: int = 10_000, tol: float = 1e-14) -> tuple[float, ...]:
    """The ``n`` Lloyd-Max levels of N(0, 1), ascending, by the Lloyd iteration in float64: thresholds at the
    midpoints of the levels, each level the mean of N(0, 1) between its thresholds
    (``(phi(a) - phi(b)) / (Phi(b) - Phi(a))``), until no level moves by more than ``tol``."""
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"a codebook needs at least 2 levels, got {n!r}")
    y = [-2.0 + 4.0 * (i + 0.5) / n for i in range(n)]  # evenly spaced start
    for _ in range(iters):
        t = [-math.inf, *((a + b) / 2 for a, b in zip(y, y[1:])), math.inf]
        new = [(_phi(a) - _phi(b)) / (_cdf(b) - _cdf(a)) for a, b in zip(t, t[1:])]
        moved = max(abs(a - b) for a, b in zip(new, y))
        y = new
        if moved < tol:
            break
    return tuple(y)


@cache
def code_levels(bits: int) -> tuple[float, ...]:
    """The table ``T`` of ``bits``-bit codes: :func:`gaussian_levels` mapped affinely onto ``[0, 2^bits - 1]``,
    rounded to fp32 (``T[0] = 0`` and ``T[-1] = 2^bits - 1`` exactly)."""
    if bits not in BITS:
        raise ValueError(f"Lloyd-Max codebooks are defined for {BITS}-bit codes, got {bits!r}")
    g = gaussian_levels(1 << bits)
    top = (1 << bits) - 1
    return tuple(float(torch.tensor(top * (v - g[0]) / (g[-1] - g[0]), dtype=torch.float32)) for v in g)


def table(levels: tuple[float, ...], device) -> torch.Tensor:
    """``levels`` as a float32 tensor on ``device``."""
    return torch.tensor(levels, dtype=torch.float32, device=device)


def nearest(y: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    """Codes (int32, shaped like ``y``) of the level of ``levels`` nearest to each fp32 ``y`` (in code units:
    ``(x - zero) / scale``); a value on a midpoint takes the lower level."""
    codes = torch.zeros(y.shape, dtype=torch.int32, device=y.device)
    for a, b in zip(levels, levels[1:]):
        codes += y > (a + b) / 2
    return codes


def lookup(codes: torch.Tensor, levels: tuple[float, ...] | None) -> torch.Tensor:
    """Integer codes -> their levels, float32 (``levels`` None: the uniform grid, the codes themselves)."""
    return table(levels, codes.device)[codes.long()] if levels else codes.float()


def applies(codec) -> bool:
    """Whether ``codec`` decodes through a level table when given one (the plain affine K and V codecs)."""
    return hasattr(codec, "levels") and not getattr(codec, "varnorm", False)


def wanted(mode: str, role: str, bits: int | None) -> tuple[float, ...] | None:
    """The level table a stream of ``role`` in a ``bits``-bit affine format uses under ``codebook=mode``
    (None: the uniform grid)."""
    if bits not in BITS:
        return None
    use = role in mode if mode != "auto" else (role, bits) in AUTO
    return code_levels(bits) if use and mode != "off" else None
