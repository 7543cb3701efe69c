"""Cache configuration: one frozen, validated dataclass and its one-line spec syntax.

The spec syntax is the same everywhere in the CLI (``eval --config``, ``bench --config``):
``FORMAT[,key=value...]`` with keys ``k``, ``v`` (per-tensor formats), ``sink``, ``window``,
``group``, ``residual``, ``v_group``, ``mean_center`` (a bias file), ``positions``, ``residual_dtype``,
``rotate``, ``pre_rope``, ``keep_layers`` and ``keep_format`` (per-layer precision). Examples::

    int4
    q4_0,mean_center=bias.gguf
    none,sink=4,window=1020
    int2,group=32,residual=128
    q8_0,k=q4_0            # K in q4_0, V in q8_0
    k4v2                   # the preset: K int4, V int2
    int2,rotate=kv,pre_rope=1
    int2,keep_layers=first,last              # layers 0 and -1 kept lossless (keep_format=none)
    k4v2,keep_layers=0,1,-1,keep_format=int8 # a list value takes the parts up to the next key=value

The head is a format name or a named K/V preset (:mod:`kvslim.formats.presets`: ``k4v2`` is K int4, V int2).
A list value (``keep_layers``) is comma-separated like the spec itself: the parts after ``keep_layers=`` that
are not ``key=value`` belong to it.

Every option is declared once, on its :class:`CacheConfig` field (:func:`option`): its type of value,
default, legal values, spec key and CLI flag. :data:`OPTIONS` lists the declarations; validation, the
spec syntax (:func:`parse_spec`, :meth:`CacheConfig.to_spec`) and the CLI's cache flags
(:mod:`kvslim.cli.common`) read them, and a test checks the README's lists against them.

This module knows nothing about transformers or tensors beyond validation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from .checks import check_int
from .formats import FORMATS, PRESETS, get_format, pair_names, resolve_pair

#: K formats mean-centering is enabled for (``Format.mean_center`` in the registry; measured, see
#: docs/mean-center.md), narrowest first: q4_0, q5_0, q8_0.
MEAN_CENTER_FORMATS: tuple[str, ...] = tuple(
    sorted((f.name for f in FORMATS.values() if f.mean_center), key=lambda n: (FORMATS[n].bits, n))
)


#: StreamingLLM position semantics (kvslim.cache.layer): "cache" is the paper's, "original" the vanilla one;
#: "auto" is "cache" wherever the model's RoPE lets kvslim move a key, else "original" (report() says which).
POSITIONS = ("auto", "cache", "original")
#: The default, chosen by measurement (docs/streaming.md: "cache" holds perplexity flat at 3x the
#: training context where "original" explodes).
DEFAULT_POSITIONS = "auto"
#: Storage of a lossy format's full-precision tokens: the model's dtype or a 16-bit float; "auto" is
#: float16 when the model's K/V are float32 and the model's dtype otherwise.
RESIDUAL_DTYPES = ("auto", "model", "float16", "bfloat16")
#: The default, chosen by measurement (docs/quality.md, "Residual and sinks": float16 costs no measurable
#: quality against an fp32 model and halves the full-precision part; a 16-bit model keeps its own dtype).
DEFAULT_RESIDUAL_DTYPE = "auto"
#: Which encoded tensors are stored Hadamard-rotated (kvslim.cache.hadamard): none, K, V or both; "auto" is
#: decided by the cache (SlimCache.rotate says what it chose).
ROTATE = ("auto", "none", "k", "v", "kv")
#: pre_rope: True, False, or "auto" (decided by the cache; SlimCache.pre_rope says what it chose).
PRE_ROPE = (True, False, "auto")
#: The defaults, chosen by measurement (docs/quality.md, "Low-bit levers"): the cache decides, per format
#: and from a bias file's recorded basis.
DEFAULT_ROTATE = "auto"
DEFAULT_PRE_ROPE = "auto"


#: the full-precision residual of an unbounded cache (and the most ``residual="auto"`` keeps with a window)
DEFAULT_RESIDUAL = 128
#: KIVI's token group (the unit tokens leave the residual in)
DEFAULT_GROUP_SIZE = 32


#: How each kind of option is read from a spec and checked (:class:`Option`):
#: ``format``: a format name (the registry's); ``pair``: a format name or a K/V preset name (``k4v2``);
#: ``int``: an integer >= ``minimum``; ``choice``: one of ``choices``; ``bool``: True or False; ``path``: a
#: file path, not checked here; ``layers``: a tuple of model layer indices (:func:`parse_layers`). ``None`` is
#: legal where the default is None, ``"auto"`` where the default is ``"auto"``.
KINDS = ("format", "pair", "int", "choice", "bool", "path", "layers")

#: How a layer list may name layers besides their indices (negative ones count from the end).
LAYER_NAMES = {"first": 0, "last": -1}
#: The default format of the layers ``keep_layers`` names: lossless, the model's own dtype (vLLM's
#: ``--kv-cache-dtype-skip-layers`` keeps them unquantized too).
DEFAULT_KEEP_FORMAT = "none"


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

    def spec_value(self, value):
        """``value`` as the spec writes it (``to_spec``)."""
        if self.kind == "layers":
            return ",".join(str(i) for i in value)
        return int(value) if isinstance(value, bool) else value

    def parse(self, text: str, spec: str):
        """The field value a spec's ``key=text`` gives; ValueError naming the spec and the key."""
        low = text.lower()
        if self.kind == "bool":
            if low == "auto" and self.auto:
                return "auto"
            if low not in _BOOLS:
                raise ValueError(
                    f"cache spec {spec!r}: {self.spec} must be 1, 0 or auto (true/false), got {text!r}"
                )
            return _BOOLS[low]
        if self.kind == "layers":
            try:
                return parse_layers(text)
            except ValueError as e:
                raise ValueError(f"cache spec {spec!r}: {e}") from None
        if self.kind != "int":
            return text
        if low in ("none", "") and self.optional:
            return None
        if low == "auto" and self.auto:
            return "auto"
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"cache spec {spec!r}: {self.spec} must be an integer, got {text!r}") from None


def option(default, kind: str, spec: str | None, **declared):
    """A CacheConfig field declared as an option: its default and the :class:`Option` facts."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return field(default=default, metadata={"option": Option(kind, spec, **declared)})


@dataclass(frozen=True)
class CacheConfig:
    """Everything that defines a cache mode. Validated on construction.

    kv_quantize: storage format of K and V unless overridden (``none`` = the model's dtype), or a named K/V
        preset (``k4v2``: K int4, V int2; :mod:`kvslim.formats.presets`).
    k_quantize / v_quantize: per-tensor overrides (None = ``kv_quantize``, or its preset's half).
    sink: the first ``sink`` tokens are kept at full precision (>= 0): StreamingLLM's attention sinks, kept
        forever with a window; without one (RotateKV's attention-sink-aware quantization) nothing is
        evicted and the sinks are simply never quantized.
    window: StreamingLLM window of most recent tokens (> 0), or None for an unbounded cache.
    group_size: KIVI token group of per-channel K scales (and the unit in which tokens leave the
        full-precision residual).
    residual: KIVI full-precision residual: the most recent ``residual`` tokens are never quantized
        (a multiple of ``group_size``; 0 quantizes every token as it arrives, as llama.cpp does).
        ``auto`` (default): 128 without a window; with one, the largest multiple of ``group_size`` that is
        at most 128 and at most a quarter of the window, so a bounded cache is mostly encoded whatever
        its window (:attr:`residual_tokens` is the number in effect).
    v_group_size: channel group of per-token V scales for affine formats (None = whole head_dim).
    mean_center: path to a K bias file (GGUF, see :mod:`kvslim.calibration.biasfile`), or None.
    positions: where StreamingLLM's kept keys sit (see :mod:`kvslim.cache.layer`, docs/streaming.md),
        ``auto`` (default: ``cache`` where the model's RoPE allows it, else ``original``),
        ``cache`` (the paper: the kept tokens as one contiguous sequence, sinks right before the
        window) or ``original`` (every key at its original position; query-to-sink distances grow
        with the stream). Only matters with a window.
    residual_dtype: how a lossy format's full-precision tokens (the residual and the sinks) are stored:
        ``auto`` (default: ``float16`` for an fp32 model, the model's dtype for a 16-bit one), ``model``
        (the model's dtype), ``float16`` or ``bfloat16``. Lossless ``none`` always keeps the model's dtype.
    rotate: which encoded tensors are stored rotated by an orthonormal Hadamard matrix (QuaRot /
        llama.cpp's attention rotation): ``none``, ``k``, ``v`` or ``kv``; ``auto`` (default) lets the
        cache decide (:class:`~kvslim.SlimCache`: every quantized tensor it can rotate, not fp16/bf16; K as a bias file
        records). Attention is unchanged.
    pre_rope: store K before RoPE (KVQuant) and rotate it on read; needs the model's RoPE. ``auto``
        (default) lets the cache decide (2-bit K where the model's RoPE allows it; as a bias file records).
    A ``mean_center`` bias must have been calibrated in the basis K is stored in (``rotate`` with K,
    ``pre_rope``); the bias file records it.
    keep_layers: model layers kept at ``keep_format`` instead of the cache's formats (per-layer precision:
        the first and last layers are the sensitive ones in practitioners' measurements, KVTuner): a tuple of
        indices, negative ones from the end (``(0, -1)``; a string ``"first,last"`` is parsed); default none.
        Needs ``config`` (the number of layers); an index out of range is a ValueError.
    keep_format: the format (or K/V preset) of the kept layers, ``none`` (default: lossless, the model's own
        dtype). Their encoded tensors get the cache's Hadamard rotation unless they are fp16/bf16, and the K
        bias only where their K format takes one.
    """

    kv_quantize: str = option(
        "none",
        "pair",
        None,
        flag="--kv-quantize",
        flag_help="K and V storage format, or a K/V preset ("
        + "; ".join(f"{p.name}: K {p.k}, V {p.v}" for p in PRESETS.values())
        + ") (default: none)",
    )
    k_quantize: str | None = option(
        None, "format", "k", flag="--k-quantize", flag_help="K storage format (overrides --kv-quantize)"
    )
    v_quantize: str | None = option(
        None, "format", "v", flag="--v-quantize", flag_help="V storage format (overrides --kv-quantize)"
    )
    sink: int = option(
        0,
        "int",
        "sink",
        minimum=0,
        flag="--streaming-llm-sink",
        metavar="N",
        flag_help="keep the first N tokens forever",
    )
    window: int | None = option(
        None,
        "int",
        "window",
        minimum=1,
        hint="or None for an unbounded cache",
        flag="--streaming-llm-window",
        metavar="M",
        flag_help="keep only the last M tokens beyond the sinks",
    )
    group_size: int = option(
        DEFAULT_GROUP_SIZE,
        "int",
        "group",
        minimum=1,
        flag="--kv-group-size",
        metavar="G",
        flag_auto=True,
        flag_help="KIVI token group (default: auto = 32, and for a window shorter than 64 the largest power of two "
        "at most half of it, so a small window is still mostly encoded)",
    )
    residual: int | str = option(
        "auto",
        "int",
        "residual",
        minimum=0,
        hint="or 'auto'",
        flag="--kv-residual",
        metavar="R",
        flag_auto=True,
        flag_help="recent tokens kept at full precision, a multiple of the group (default: auto = 128, and with a "
        "window at most a quarter of it, so a bounded cache is mostly encoded)",
    )
    v_group_size: int | None = option(
        None, "int", "v_group", minimum=1, hint="or None for the whole head_dim"
    )
    mean_center: str | None = option(
        None,
        "path",
        "mean_center",
        flag="--kv-mean-center",
        metavar="FILE",
        flag_help="K mean-centering bias file (GGUF)",
    )
    positions: str = option(
        DEFAULT_POSITIONS, "choice", "positions", choices=POSITIONS, what="where StreamingLLM's kept keys sit"
    )
    residual_dtype: str = option(
        DEFAULT_RESIDUAL_DTYPE,
        "choice",
        "residual_dtype",
        choices=RESIDUAL_DTYPES,
        what="how a lossy format's full-precision residual and sinks are stored",
    )
    rotate: str = option(
        DEFAULT_ROTATE,
        "choice",
        "rotate",
        choices=ROTATE,
        what="which encoded tensors are stored Hadamard-rotated",
        flag="--kv-rotate",
        flag_help="store K, V or both Hadamard-rotated (attention unchanged); auto: every quantized tensor, K as "
        f"the bias file records (default: {DEFAULT_ROTATE})",
    )
    pre_rope: bool | str = option(
        DEFAULT_PRE_ROPE,
        "bool",
        "pre_rope",
        what="store K before RoPE",
        flag="--kv-pre-rope",
        flag_help="store K before RoPE and rotate it on read (KVQuant); auto: 2-bit K (int2) and as the bias file "
        f"records (default: {DEFAULT_PRE_ROPE}; the flag alone: on)",
    )
    keep_layers: tuple[int, ...] = option(
        (),
        "layers",
        "keep_layers",
        flag="--kv-keep-layers",
        metavar="LAYERS",
        flag_help="keep these model layers at --kv-keep-format: comma-separated indices, negative from the end, "
        "or first/last, e.g. first,last (default: none; start a list with a negative index as --kv-keep-layers=-1)",
    )
    keep_format: str = option(
        DEFAULT_KEEP_FORMAT,
        "pair",
        "keep_format",
        flag="--kv-keep-format",
        flag_help=f"format (or K/V preset) of the layers --kv-keep-layers names (default: {DEFAULT_KEEP_FORMAT}, "
        "lossless)",
    )

    def __post_init__(self):
        # a layer list is stored as a tuple of indices, whichever way it was spelled (a list, "first,last")
        object.__setattr__(self, "keep_layers", parse_layers(self.keep_layers))
        for opt in OPTIONS:
            opt.check(getattr(self, opt.name))
        if self.keep_format != DEFAULT_KEEP_FORMAT and not self.keep_layers:
            raise ValueError(
                f"keep_format={self.keep_format} applies to the layers keep_layers names, and it names none: "
                f"give keep_layers (e.g. keep_layers=first,last) or leave keep_format at {DEFAULT_KEEP_FORMAT}"
            )
        if self.residual != "auto" and self.residual % self.group_size:
            raise ValueError(
                f"residual={self.residual} is not a multiple of group_size={self.group_size}: tokens leave "
                f"the full-precision residual one group at a time, so residual must be 0 or a multiple "
                f"of group_size (e.g. {self.group_size * max(1, round(self.residual / self.group_size))})"
            )
        if self.mean_center is not None and self.k_format not in MEAN_CENTER_FORMATS:
            why = (
                "its zero point already absorbs a per-channel mean"
                if not get_format(self.k_format).symmetric
                else "it does not quantize K with a symmetric (zero-point free) block format"
            )
            raise ValueError(
                f"mean_center does not apply to K format {self.k_format!r}: {why}; "
                f"it applies to {', '.join(MEAN_CENTER_FORMATS)}"
            )

    @property
    def k_format(self) -> str:
        """K's format: ``k_quantize``, else ``kv_quantize`` (a preset's K half)."""
        return self.k_quantize or resolve_pair(self.kv_quantize)[0]

    @property
    def v_format(self) -> str:
        """V's format: ``v_quantize``, else ``kv_quantize`` (a preset's V half)."""
        return self.v_quantize or resolve_pair(self.kv_quantize)[1]

    @property
    def keep_formats(self) -> tuple[str, str]:
        """``(K format, V format)`` of the layers ``keep_layers`` names (``keep_format`` resolved)."""
        return resolve_pair(self.keep_format)

    def kept_layers(self, n_layers: int) -> frozenset[int]:
        """The indices (0 .. n_layers - 1) of the layers kept at ``keep_format`` in a model of ``n_layers``
        layers; ValueError for an index out of range."""
        return resolve_layers(self.keep_layers, n_layers)

    def layer_formats(self, layer: int, n_layers: int) -> tuple[str, str]:
        """``(K format, V format)`` model layer ``layer`` of ``n_layers`` stores."""
        if layer in self.kept_layers(n_layers):
            return self.keep_formats
        return self.k_format, self.v_format

    @property
    def residual_tokens(self) -> int:
        """The full-precision residual in effect: ``residual``, or what ``auto`` chose (its docstring)."""
        if self.residual != "auto":
            return self.residual
        if self.window is None:
            return DEFAULT_RESIDUAL
        return (min(DEFAULT_RESIDUAL, self.window // 4) // self.group_size) * self.group_size

    @property
    def capacity(self) -> int | None:
        """Tokens stored per layer at most (sink + window), or None when unbounded."""
        return None if self.window is None else self.sink + self.window

    def to_spec(self) -> str:
        """The canonical one-line spec (the options that differ from their defaults, in declaration order);
        ``parse_spec(c.to_spec()) == c``."""
        parts = [self.kv_quantize]
        for opt in OPTIONS[1:]:
            value = getattr(self, opt.name)
            if value != opt.default:
                parts.append(f"{opt.spec}={opt.spec_value(value)}")
        return ",".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> CacheConfig:
        return replace(self, **changes)


#: Every option's declaration, in field order (the first is the spec's head, the format name).
OPTIONS: tuple[Option, ...] = tuple(
    replace(f.metadata["option"], name=f.name, default=f.default) for f in fields(CacheConfig)
)
#: spec key -> option
SPEC_KEYS: dict[str, Option] = {o.spec: o for o in OPTIONS if o.spec is not None}


#: How a spec spells a boolean.
_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def parse_spec(spec: str) -> CacheConfig:
    """Parse ``FORMAT[,key=value...]`` into a validated :class:`CacheConfig`.

    Raises ValueError naming the bad part and what is legal.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("empty cache spec; expected FORMAT[,key=value...], e.g. 'int4,sink=4,window=1020'")
    head, *rest = [p.strip() for p in spec.split(",")]
    if "=" in head:
        raise ValueError(
            f"cache spec {spec!r} must start with a format or K/V preset name (one of {', '.join(pair_names())}), "
            f"got {head!r}"
        )
    kwargs: dict = {OPTIONS[0].name: head}
    pairs: list[list[str]] = []  # [key, value]; a list value gathers the parts up to the next key=value
    for part in rest:
        if "=" not in part:
            if pairs and SPEC_KEYS.get(pairs[-1][0]) is not None and SPEC_KEYS[pairs[-1][0]].kind == "layers":
                pairs[-1][1] += "," + part
                continue
            raise ValueError(f"cache spec {spec!r}: {part!r} is not key=value; keys: {', '.join(SPEC_KEYS)}")
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in SPEC_KEYS:
            raise ValueError(f"cache spec {spec!r}: unknown key {key!r}; keys: {', '.join(SPEC_KEYS)}")
        pairs.append([key, value])
    for key, value in pairs:
        opt = SPEC_KEYS[key]
        if opt.name in kwargs:
            raise ValueError(f"cache spec {spec!r}: key {key!r} given twice")
        kwargs[opt.name] = opt.parse(value, spec)
    return CacheConfig(**kwargs)
