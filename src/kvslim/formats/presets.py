"""Named asymmetric K/V presets: one name for a pair of registered formats (K, V).

K carries the query-key dot products, whose errors the softmax amplifies, and has a few outlier channels;
V errors only average into the output. Practitioners' measurements agree that K needs more bits than V
(KIVI, KVTuner; TurboQuant's ``k8v4`` and KVarN's ``k4v2`` presets), so every preset keeps K at least as wide
as V. A preset is a name where a K/V format name is accepted (``kv_quantize``, ``keep_format``), resolved
by :func:`resolve_pair`; ``k=`` / ``v=`` still override either half.

This module knows only format names (the registry's facts are in :mod:`.base`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import FORMATS, format_names, get_format


@dataclass(frozen=True)
class Preset:
    """K in ``k``, V in ``v`` (registered format names); ``summary`` for ``--help`` and docs."""

    name: str
    k: str
    v: str
    summary: str


#: name -> Preset, in registration order (widest first)
PRESETS: dict[str, Preset] = {}


def register_preset(name: str, k: str, v: str, summary: str) -> Preset:
    """Add a preset; its name may not be a format's, its halves must be registered formats."""
    if name in FORMATS or name in PRESETS:
        raise ValueError(f"preset {name!r} is already a format or preset name")
    get_format(k), get_format(v)  # raise with the legal names
    PRESETS[name] = Preset(name, k, v, summary)
    return PRESETS[name]


register_preset("k8v4", "int8", "int4", "K int8, V int4 (TurboQuant's k8v4: K nearly lossless, V at 4 bits)")
register_preset("k4v3", "int4", "int3", "K int4, V int3")
register_preset("k4v2", "int4", "int2", "K int4, V int2 (KVarN's 4-bit K / 2-bit V)")
register_preset("k3v2", "int3", "int2", "K int3, V int2")


def preset_names() -> list[str]:
    """Every preset name, in registration order (for CLI choices and docs)."""
    return list(PRESETS)


def pair_names() -> list[str]:
    """What a K/V format option accepts: every format name, then every preset name."""
    return format_names() + preset_names()


def resolve_pair(name: str) -> tuple[str, str]:
    """``(K format, V format)`` of a format name (the same for both) or a preset; ValueError naming both
    kinds of legal name otherwise."""
    if name in PRESETS:
        p = PRESETS[name]
        return p.k, p.v
    if name in FORMATS:
        return name, name
    raise ValueError(
        f"unknown KV format {name!r}; expected a format ({', '.join(format_names())}) "
        f"or a K/V preset ({', '.join(preset_names())})"
    )
