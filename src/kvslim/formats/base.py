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

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

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

    def narrow(self, start: int, stop: int, offset: int, token_group: int) -> tuple[Encoded, int]:
        """Tokens ``start:stop`` of this encoding, whose first token sits ``offset`` tokens into its
        first group: views ``(Encoded, offset')`` that a codec decodes as exactly those tokens.

        Group parts keep every group any of the tokens belongs to; ``offset'`` is how far the new
        first token sits into its group.
        """
        first = (offset + start) // token_group
        last = (offset + stop - 1) // token_group + 1
        return (
            Encoded(
                token={n: t[:, :, start:stop] for n, t in self.token.items()},
                group={n: t[:, :, first:last] for n, t in self.group.items()},
            ),
            (offset + start) % token_group,
        )


ROLES = ("k", "v")


class Block(NamedTuple):
    """One block of a block format (GGML): ``elements`` values stored in ``nbytes`` bytes."""

    elements: int
    nbytes: int


class Format:
    """A registered format: the facts of one storage format, and the :class:`Codec` it builds per role.

    Subclasses register by class keyword: ``class Q4_0(Format, name="q4_0")``. Every fact about a
    format lives here, once; codecs, config validation, CLI choices and kernels read it.

    Attributes:
        name: the registry name (``int4``, ``q4_0``, ...).
        summary: human summary for ``--help`` and docs.
        bits: nominal bits of one code (16 fp16/bf16; 8 fp8/int8/q8_0; 5 q5_0/q5_1; 4 int4/q4_0/q4_1;
            3 int3; 2 int2), metadata excluded (that is :meth:`Codec.bits_per_element`); None for ``none``,
            which stores the model's own dtype.
        lossy: ``False`` only for ``none`` (stored as given).
        symmetric: zero-point free, the grid anchored at 0 (floats, fp8, q8_0, q4_0, q5_0): a
            per-channel mean costs it dynamic range, which is what K mean-centering gives back.
            Affine formats (int8/4/3/2, q4_1, q5_1) absorb a mean in their zero point.
        mean_center: K mean-centering is allowed with this K format (measured, docs/mean-center.md).
        family: the storage layout family of the codec built for each role (``{"k": ..., "v": ...}``),
            which kernels dispatch on: affine_k, affine_v, ggml, fp8, cast; "generic" = only the
            decode + matmul reference.
        block: for block formats (GGML), elements and bytes of one block; None otherwise.
        pack: for bit-packed integer formats (the affine ones), codes and bytes of one packing unit
            along the head dim: int8 (1, 1), int4 (2, 1), int3 (8, 3), int2 (4, 1); the head dim must be
            a multiple of its ``elements``. None otherwise.
    """

    name: str = ""
    summary: str = ""
    bits: int | None = None
    lossy: bool = True
    symmetric: bool = False
    mean_center: bool = False
    family: Mapping[str, str] = MappingProxyType({"k": "generic", "v": "generic"})
    block: Block | None = None
    pack: Block | None = None

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in FORMATS:
                raise ValueError(f"format {name!r} registered twice")
            cls.name = name
            FORMATS[name] = cls()

    # One instance per registered name: copies and pickles of a codec point at the same facts.
    def __reduce__(self):
        return get_format, (self.name,)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def codec(self, role: str, *, group_size: int = 32, v_group_size: int | None = None) -> Codec:
        """A codec for ``role`` ("k" or "v"). ``group_size`` is KIVI's token group for per-channel K;
        ``v_group_size`` the channel group of per-token V (None = the whole head_dim)."""
        raise NotImplementedError


class Codec:
    """One configured format for one stream (K or V) of one layer.

    Its facts (``name``, ``bits``, ``lossy``, ``symmetric``, ``family``) are read from its
    :class:`Format`; only the configuration of this stream (``token_group``, group sizes) is its own.

    Attributes:
        format: the registered :class:`Format` this codec stores.
        role: "k" or "v".
        token_group: how many tokens are quantized together (1 for per-token formats).
    """

    token_group: int = 1

    def __init__(self, fmt: Format, role: str):
        if role not in ROLES:
            raise ValueError(f"role must be 'k' or 'v', got {role!r}")
        self.format = fmt
        self.role = role

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def bits(self) -> int | None:
        return self.format.bits

    @property
    def lossy(self) -> bool:
        return self.format.lossy

    @property
    def symmetric(self) -> bool:
        return self.format.symmetric

    @property
    def family(self) -> str:
        """Storage layout family, for kernels that read the encoded parts directly (kvslim.kernels)."""
        return self.format.family[self.role]

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


FORMATS: dict[str, Format] = {}


def format_names() -> list[str]:
    """All registered names, in a stable order for CLI choices and docs."""
    order = [
        "none",
        "fp16",
        "bf16",
        "fp8",
        "int8",
        "int4",
        "int3",
        "int2",
        "q8_0",
        "q4_0",
        "q4_1",
        "q5_0",
        "q5_1",
    ]
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
    if role not in ROLES:
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")
    return get_format(name).codec(role, group_size=group_size, v_group_size=v_group_size)


def tracing() -> bool:
    """Whether this runs inside a ``torch.compile`` trace (:mod:`kvslim.compiled`): the data-dependent checks
    of the encoders (a host sync each) are skipped there, and choices made on the data become branch-free."""
    return torch.compiler.is_compiling()


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise a clear ValueError instead of letting NaN/inf become silent garbage codes."""
    if not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(
            f"{what} has non-finite values ({n_nan} NaN, {n_inf} inf) in a tensor of shape "
            f"{tuple(x.shape)}; quantization needs finite input"
        )
