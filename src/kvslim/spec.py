"""The one-line cache spec syntax: ``FORMAT[,key=value...]`` <-> option values.

The grammar (:mod:`kvslim.config`'s docstring lists the keys): the head is a format or K/V preset name; every
other part is ``key=value``; a list value (``keep_layers``) takes the parts after it that are not ``key=value``.
A value is read by its option's kind (:class:`~kvslim.options.Option`): integers, ``none`` / ``auto`` where the
option allows them, booleans as ``1``/``0``/``true``/``false``/``on``/``off``, layer lists.

The functions take the option declarations as an argument (:data:`kvslim.config.OPTIONS`), so this module
knows the syntax and nothing about :class:`~kvslim.config.CacheConfig`: :func:`kvslim.config.parse_spec` and
:meth:`~kvslim.config.CacheConfig.to_spec` are the two calls that join them. Errors are one ValueError line that
names the spec, the bad part and what is legal; validating the values is the config's job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .formats import pair_names
from .options import Option, parse_layers

#: How a spec spells a boolean.
BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def parse_value(opt: Option, text: str, spec: str):
    """The field value a spec's ``key=text`` gives for option ``opt``; ValueError naming the spec and the key."""
    low = text.lower()
    if opt.kind == "bool":
        if low == "auto" and opt.auto:
            return "auto"
        if low not in BOOLS:
            raise ValueError(
                f"cache spec {spec!r}: {opt.spec} must be 1, 0 or auto (true/false), got {text!r}"
            )
        return BOOLS[low]
    if opt.kind == "layers":
        try:
            return parse_layers(text)
        except ValueError as e:
            raise ValueError(f"cache spec {spec!r}: {e}") from None
    if opt.kind != "int":
        return text
    if low in ("none", "") and opt.optional:
        return None
    if low == "auto" and opt.auto:
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"cache spec {spec!r}: {opt.spec} must be an integer, got {text!r}") from None


def spec_value(opt: Option, value) -> str:
    """``value`` of option ``opt`` as the spec writes it (a layer list comma-separated, a bool as 1/0)."""
    if opt.kind == "layers":
        return ",".join(str(i) for i in value)
    return str(int(value) if isinstance(value, bool) else value)


def read_spec(spec: str, options: Sequence[Option]) -> dict:
    """The keyword values a spec gives, by field name (``options[0]`` is the head, the format name); only the
    keys the spec names. ValueError in one line naming the bad part: an empty spec, a head that is a key=value,
    an unknown or repeated key, a part that is not key=value, a value its kind cannot read."""
    keys: dict[str, Option] = {o.spec: o for o in options if o.spec is not None}
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("empty cache spec; expected FORMAT[,key=value...], e.g. 'int4,sink=4,window=1020'")
    head, *rest = [p.strip() for p in spec.split(",")]
    if "=" in head:
        raise ValueError(
            f"cache spec {spec!r} must start with a format or K/V preset name (one of {', '.join(pair_names())}), "
            f"got {head!r}"
        )
    kwargs: dict = {options[0].name: head}
    pairs: list[list[str]] = []  # [key, value]; a list value gathers the parts up to the next key=value
    for part in rest:
        if "=" not in part:
            if pairs and keys[pairs[-1][0]].kind == "layers":
                pairs[-1][1] += "," + part
                continue
            raise ValueError(f"cache spec {spec!r}: {part!r} is not key=value; keys: {', '.join(keys)}")
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in keys:
            raise ValueError(f"cache spec {spec!r}: unknown key {key!r}; keys: {', '.join(keys)}")
        pairs.append([key, value])
    for key, value in pairs:
        opt = keys[key]
        if opt.name in kwargs:
            raise ValueError(f"cache spec {spec!r}: key {key!r} given twice")
        kwargs[opt.name] = parse_value(opt, value, spec)
    return kwargs


def write_spec(values: Mapping[str, object], options: Sequence[Option]) -> str:
    """The canonical spec of ``values`` (field name -> value): the head, then the options that differ from their
    defaults, in declaration order. ``read_spec(write_spec(v, o), o)`` gives those values back."""
    parts = [str(values[options[0].name])]
    for opt in options[1:]:
        value = values[opt.name]
        if value != opt.default:
            parts.append(f"{opt.spec}={spec_value(opt, value)}")
    return ",".join(parts)
