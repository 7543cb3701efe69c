"""The storage-format protocol and its registry.

A *format* says how one stream of cached vectors (the keys or the values of one layer) is stored.
It knows nothing about positions, eviction or transformers: it turns a block of vectors into a
few tensors and back.

Every stored tensor has the time axis at dim 2, in one of two granularities:

- ``token`` parts hold one entry per token along dim 2 (codes, per-token scales);
- ``group`` parts hold one entry per ``token_group`` tokens along dim 2 (the per-channel scales and
  zeros of KIVI's K quantization, shared by a group of tokens).

That split is all a cache layer needs to evict tokens one at a time: dropping the oldest ``k``
tokens slices the token parts, and drops a group entry only once every token of that group is gone
(the surviving tokens of a partly evicted group keep its scales, which stay exact for them).

Shapes: input ``x`` is ``(B, H, T, D)`` with ``T`` a multiple of ``token_group``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Parts = dict[str, torch.Tensor]


@dataclass
class Encoded:
    """The stored form of ``T`` tokens: ``token`` parts are ``(B, H, T, ...)``, ``group`` parts
    are ``(B, H, T // token_group, ...)``."""

    token: Parts = field(default_factory=dict)
    group: Parts = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.token.values(), *self.group.values()))


class Codec:
    """One configured format for one stream (K or V) of one layer.

    Attributes:
        name: the registry name (``int4``, ``q4_0``, ...).
        lossy: ``False`` only for ``none`` (the model's own dtype, stored as given).
        symmetric: zero-point free (q8_0, q4_0, q5_0, fp8): a per-channel mean costs it dynamic range,
            which is what K mean-centering gives back. Affine formats absorb a mean in their zero.
        token_group: how many tokens are quantized together (1 for per-token formats).
        family: the layout family kernels dispatch on.
    """

    name: str = ""
    lossy: bool = True
    symmetric: bool = False
    token_group: int = 1
    #: Storage layout family, for kernels that read the encoded parts directly (kvslim.kernels):
    #: affine_k, affine_v, ggml, fp8, cast; "generic" = only the decode+matmul reference.
    family: str = "generic"

    def encode(self, x: torch.Tensor) -> Encoded:
        """x: (B, H, T, D) floating point, T a multiple of ``token_group``."""
        raise NotImplementedError

    def decode(self, enc: Encoded, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """Back to ``(B, H, T, D)`` in ``dtype``.

        ``offset`` (0 <= offset < token_group) is how many leading tokens of the first group were
        already evicted: ``enc.token`` then holds ``T`` tokens that start ``offset`` tokens into
        ``enc.group``'s first group.
        """
        raise NotImplementedError

    def bits_per_element(self, head_dim: int) -> float:
        """Exact storage cost per cached element, metadata (scales, zeros) included."""
        raise NotImplementedError

    def nbytes(self, batch: int, heads: int, tokens: int, head_dim: int) -> int:
        """Exact bytes of ``tokens`` encoded tokens (a multiple of ``token_group``)."""
        raise NotImplementedError

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError if this format cannot store vectors of ``head_dim`` elements."""

    def describe(self) -> str:
        return self.name


class Format:
    """A registered format family member: builds a :class:`Codec` for a role.

    Subclasses register by class keyword: ``class Q4_0(Format, name="q4_0")``.
    """

    name: str = ""
    #: Human summary for ``--help`` and docs.
    summary: str = ""

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in FORMATS:
                raise ValueError(f"format {name!r} registered twice")
            cls.name = name
            FORMATS[name] = cls()

    def codec(self, role: str, *, group_size: int = 32, v_group_size: int | None = None) -> Codec:
        """A codec for ``role`` ("k" or "v"). ``group_size`` is KIVI's token group for per-channel K;
        ``v_group_size`` the channel group of per-token V (None = the whole head_dim)."""
        raise NotImplementedError


FORMATS: dict[str, Format] = {}


def format_names() -> list[str]:
    """All registered names, in a stable order for CLI choices and docs."""
    order = ["none", "fp16", "bf16", "fp8", "int8", "int4", "int2", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
    return [n for n in order if n in FORMATS] + sorted(n for n in FORMATS if n not in order)


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown KV format {name!r}; expected one of: {', '.join(format_names())}"
        ) from None


def make_codec(name: str, role: str, *, group_size: int = 32, v_group_size: int | None = None) -> Codec:
    """Build the codec for ``name`` in ``role`` ("k" or "v")."""
    if role not in ("k", "v"):
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")
    return get_format(name).codec(role, group_size=group_size, v_group_size=v_group_size)


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise a clear ValueError instead of letting NaN/inf become silent garbage codes."""
    if not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(
            f"{what} has non-finite values ({n_nan} NaN, {n_inf} inf) in a tensor of shape "
            f"{tuple(x.shape)}; quantization needs finite input"
        )
