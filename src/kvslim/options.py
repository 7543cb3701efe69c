"""How a cache option is declared and checked: :class:`Option` and :func:`option`.

Every cache option is declared once, on its :class:`~kvslim.config.CacheConfig` field, with :func:`option`
(:mod:`kvslim.config` holds the declarations). This module holds what a declaration *is*: its kind of value
(:data:`KINDS`), its legal values and the one-line message for a value that is not legal, its spec key and its
CLI flag; and the one kind with a grammar of its own, a list of model layers (:func:`parse_layers`).

It knows nothing about the spec syntax (:mod:`kvslim.spec`), the CLI (:mod:`kvslim.cli.common` reads the flags)
or tensors; the only facts it reads are the format registry's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import check_int
from .formats import get_format, resolve_pair

#: How each kind of option is read from a spec and checked (:class:`Option`):
#: ``format``: a format name (the registry's); ``pair``: a format name or a K/V preset name (``k4v2``);
#: ``int``: an integer >= ``minimum``; ``choice``: one of ``choices``; ``bool``: True or False; ``path``: a
#: file path, not checked here; ``layers``: a tuple of model layer indices (:func:`parse_layers`). ``None`` is
#: legal where the default is None, ``"auto"`` where the default is ``"auto"``.
KINDS = ("format", "pair", "int", "choice", "bool", "path", "layers")

#: How a layer list may name layers besides their indices (negative ones count from the end).
LAYER_NAMES = {"first": 0, "last": -1}


def parse_layers(value) -> tuple[int, ...]:
    """A layer list as a tuple of indices: a string of comma-separated items, or a sequence of them; an item is
    an integer (negative: from the end, -1 the last layer) or ``first`` / ``last``. None, ``""`` or ``"none"``:
    ``()``.
    ValueError naming the bad item and what is legal; an index given twice is refused."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, (bytes, dict)) or not hasattr(items, "__iter__"):
        raise ValueError(f"keep_layers must be layer indices or first/last, got {value!r}")
    out: list[int] = []
    for item in items:
        text = item.strip().lower() if isinstance(item, str) else item
        if isinstance(text, str) and text in LAYER_NAMES:
            index = LAYER_NAMES[text]
        elif isinstance(text, int) and not isinstance(text, bool):
            index = text
        else:
            try:
                index = int(text) if isinstance(text, str) and text else None
            except ValueError:
                index = None
            if index is None:
                raise ValueError(
                    f"keep_layers must be layer indices (0 the first, -1 the last) or first/last, comma-separated; "
                    f"got {item!r} in {value!r}"
                )
        if index in out:
            raise ValueError(f"keep_layers names layer {index} twice in {value!r}")
        out.append(index)
    return tuple(out)


def resolve_layers(layers: tuple[int, ...], n_layers: int) -> frozenset[int]:
    """The model layer indices (0 .. n_layers - 1) a layer list names; ValueError in one line for an index out
    of range."""
    for i in layers:
        if not -n_layers <= i < n_layers:
            raise ValueError(
                f"keep_layers names layer {i}, out of range: this model has {n_layers} layers "
                f"(0..{n_layers - 1}, or -{n_layers}..-1 from the end)"
            )
    return frozenset(i % n_layers for i in layers)


@dataclass(frozen=True)
class Option:
    """One cache option, declared once (on its :class:`CacheConfig` field, with :func:`option`).

    name / default: the CacheConfig field and :class:`~kvslim.SlimCache` keyword, and its default.
    kind: one of :data:`KINDS`; with ``choices``, ``minimum`` and ``hint`` it decides validation and how
        the spec value is parsed. ``what``: what the option decides, in the validation message.
    spec: the key in the one-line spec (None: the spec's head, the format name).
    flag: the CLI flag (kebab-case; None: spec and Python only), with its ``metavar`` and ``flag_help``;
        ``flag_auto``: the flag also takes ``auto``, resolved by the CLI (the default is then ``auto``).
    """

    kind: str
    spec: str | None
    what: str = ""
    choices: tuple = ()
    minimum: int | None = None
    hint: str = ""
    flag: str | None = None
    metavar: str | None = None
    flag_help: str = ""
    flag_auto: bool = False
    name: str = ""
    default: object = None

    @property
    def optional(self) -> bool:
        """Whether None is legal (the default is None)."""
        return self.default is None

    @property
    def auto(self) -> bool:
        """Whether ``"auto"`` is legal (the default is ``"auto"``)."""
        return isinstance(self.default, str) and self.default == "auto"

    @property
    def flag_default(self):
        """The CLI flag's default: ``auto`` where the flag resolves it, else the field's."""
        return "auto" if self.flag_auto else self.default

    def check(self, value) -> None:
        """ValueError naming the option, the value and what is legal, unless ``value`` is."""
        if value is None and self.optional:
            return
        if self.kind == "format":
            if not isinstance(value, str):
                raise ValueError(f"{self.name} must be a format name, got {value!r}")
            get_format(value)  # raises with the legal names
        elif self.kind == "pair":
            if not isinstance(value, str):
                raise ValueError(f"{self.name} must be a format or K/V preset name, got {value!r}")
            resolve_pair(value)  # raises with the legal names
        elif self.kind == "layers":
            if not isinstance(value, tuple) or parse_layers(value) != value:
                raise ValueError(f"{self.name} must be a tuple of layer indices, got {value!r}")
        elif self.kind == "choice":
            if value not in self.choices:
                raise ValueError(
                    f"{self.name} must be one of {', '.join(self.choices)} ({self.what}), got {value!r}"
                )
        elif self.kind == "bool":
            if not (isinstance(value, bool) or (self.auto and value == "auto")):
                raise ValueError(f"{self.name} must be True, False or 'auto' ({self.what}), got {value!r}")
        elif self.kind == "int" and not (self.auto and value == "auto"):
            check_int(self.name, value, minimum=self.minimum, hint=self.hint)


def option(default, kind: str, spec: str | None, **declared):
    """A CacheConfig field declared as an option: its default and the :class:`Option` facts."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return field(default=default, metadata={"option": Option(kind, spec, **declared)})
