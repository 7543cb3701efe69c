"""The rows call's piece records found again instead of built again (:func:`kvslim.kernels.cpu.attend_rows`).

A piece record is what the C rows call reads of one encoded body piece: its kind and format, the token count and
offset, and each part as (pointer, element strides of dims 0..2, dtype code). Building one checks every part
against its codec (:func:`kvslim.formats.layout.body_layout`): ~30 us of Python a piece, ~15-40 ms of a 16-row
decode step. Two ways skip it, both giving the very record the checks would build:

- **Kept on the body** (:func:`kept`, :func:`keep`): a decode step hands every row's unchanged body again (the
  cache hands out the same view tensors until the body changes); the record is kept as an attribute of the
  body's first token part and found again by the parts' identity and data pointers.
- **Templates by signature** (:func:`template_key`, :func:`from_template`, :func:`put_template`): a record is a
  pure function of the codec's configuration, the call's shape, the offset, the queries' layout and each part's
  shape, strides and dtype — and of the parts' data pointers, which are fields of their own. A body whose front
  moves every step (a windowed cache evicts a token a step; a key run's piece is narrowed anew) gets new views
  each step, but its signature repeats: the same geometry in every layer of a row, and in every row at the same
  phase of its groups. The template keeps the record with the positions of its pointer fields and which part each names; a piece of
  the same signature gets the template's record with its own parts' pointers written in.

This module knows the record only as a tuple of ints with pointer fields at known positions; what the fields
mean is :mod:`kvslim.kernels.cpu`'s (and ``csrc``'s ``ROWS_LAYOUT``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

#: The attribute of a body's first token part under which :func:`keep` keeps the piece record built from that
#: body, with what it was built from. The record lives and dies with the tensor; it holds the body's other parts
#: (never the tensor itself: no reference cycle keeps a freed body's memory alive) and every part's data pointer
#: (a deep copy of the tensor carries the attribute to new memory: the pointers differ, the record is built again).
_MEMO = "_kvslim_piece_record"

#: Templates kept (least recently used dropped first): a windowed 16-row step meets a few dozen signatures; a key
#: run's narrowed pieces add a new one per row and step, which a bound keeps from growing without end.
TEMPLATES_KEPT = 2048
_TEMPLATES: OrderedDict = OrderedDict()


def direct_parts(enc) -> tuple | None:
    """The body's parts (token parts, then group parts) when the call reads every one in place (4-D, dims 3..
    contiguous: nothing copied for the call), else None."""
    if not enc.token:
        return None
    parts = (*enc.token.values(), *enc.group.values())
    for t in parts:
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[3] > 1 and t.stride(3) != 1):
            return None
    return parts


def kept_key(codec, enc, offset: int, h: int, m: int, d: int, role: str, parts: tuple | None):
    """(the body's first token part, what the record is built for, the body's other parts) for a body whose every
    part the record points into directly (``parts``: :func:`direct_parts` of ``enc``), else None. A view's data
    pointer, shape, strides and dtype never change, so the same tensors give the same record."""
    if parts is None:
        return None
    ptrs = tuple(t.data_ptr() for t in parts)  # a copy (deepcopy, pickle) carries the attribute, not the memory
    return parts[0], (codec, offset, h, m, d, role, tuple(enc.token), tuple(enc.group), ptrs), parts[1:]


def kept(codec, enc, offset: int, h: int, m: int, d: int, role: str) -> tuple | None:
    """The record kept on ``enc``'s first token part if built from these very tensors (the same objects: the
    shapes and strides it checked) at these pointers for this call (:func:`kept_key`'s key), else None."""
    held = getattr(next(iter(enc.token.values()), None), _MEMO, None)
    if held is None:
        return None
    parts = (*enc.token.values(), *enc.group.values())
    if len(held[1]) != len(parts) - 1 or any(a is not b for a, b in zip(held[1], parts[1:])):
        return None
    ok = held[0] == (codec, offset, h, m, d, role, tuple(enc.token), tuple(enc.group), tuple(t.data_ptr() for t in parts))
    return held[2] if ok else None


def keep(key, rec: tuple) -> None:
    """Keep ``rec`` on the body :func:`kept_key` gave ``key`` for (None: nothing to keep)."""
    if key is not None:
        with contextlib.suppress(AttributeError, RuntimeError, TypeError):  # a tensor that takes no attributes
            setattr(key[0], _MEMO, (key[1], key[2], rec))


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


def _codec_value(codec) -> tuple:
    """A codec by value: its class and its own attributes (a format, a role, group sizes, dtypes, flags): every
    cache makes its own codecs per layer, equal where their configuration is. An attribute that hashes by
    identity (a level table) only makes the key narrower."""
    return type(codec), tuple(vars(codec).items())


def template_key(codec, enc, offset: int, h: int, m: int, d: int, role: str, qk, parts: tuple | None) -> tuple | None:
    """The signature a piece's record is a function of, pointers aside: the codec's value, the offset, the call's
    shape, the role, the parts' names and each part's shape, strides and dtype, and the piece's own queries'
    (``qk``: None or a tensor). ``parts``: :func:`direct_parts` of ``enc``; None where a part would be copied for
    the call (no template applies)."""
    if parts is None:
        return None
    return (
        _codec_value(codec), offset, h, m, d, role, tuple(enc.token), tuple(enc.group),
        tuple(_layout(t) for t in parts), None if qk is None else _layout(qk),
    )  # fmt: skip


def from_template(key, enc, qk) -> tuple | None:
    """The record of a piece of signature ``key`` (:func:`template_key`) from its template, its pointer fields
    written from the piece's own parts (``enc``'s, ``qk``), or None where no template is kept."""
    try:
        rec, slots = _TEMPLATES[key]
        _TEMPLATES.move_to_end(key)
    except (KeyError, TypeError, RuntimeError):  # none kept (or dropped meanwhile); a key that cannot hash or compare
        return None
    parts = (*enc.token.values(), *enc.group.values(), qk)
    out = list(rec)
    for at, which in slots:
        out[at] = parts[which].data_ptr()
    return tuple(out)


def put_template(key, rec: tuple, pointers, enc, qk) -> None:
    """Keep ``rec`` as the template of signature ``key`` (None: nothing kept). ``pointers``: ``(field index,
    tensor)`` for every pointer field of the record; each tensor must be one of the piece's own parts (``enc``'s
    or ``qk``) by identity, or nothing is kept (the record points into a copy made for the call)."""
    if key is None:
        return
    parts = (*enc.token.values(), *enc.group.values(), qk)
    if len({id(p) for p in parts if p is not None}) < sum(p is not None for p in parts):
        return  # a part given twice: a slot would name the first, and a piece with two parts would read one
    slots = []
    for at, t in pointers:
        which = next((i for i, p in enumerate(parts) if p is t), None)
        if which is None or rec[at] != t.data_ptr():
            return
        slots.append((at, which))
    try:
        _TEMPLATES[key] = (rec, tuple(slots))
    except (TypeError, RuntimeError):  # a codec attribute that cannot be hashed (or compared): no template
        return
    while len(_TEMPLATES) > TEMPLATES_KEPT:
        with contextlib.suppress(KeyError):
            _TEMPLATES.popitem(last=False)


def clear_templates() -> None:
    """Drop every kept template (tests; nothing else needs to: a template is valid for as long as its codec)."""
    _TEMPLATES.clear()
