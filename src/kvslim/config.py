"""Cache configuration: one frozen, validated dataclass and its one-line spec syntax.

The spec syntax is the same everywhere in the CLI (``eval --config``, ``bench --config``):
``FORMAT[,key=value...]`` with keys ``k``, ``v`` (per-tensor formats), ``sink``, ``window``,
``group``, ``residual``, ``v_group``, ``mean_center`` (a bias file), ``rotate`` and ``pre_rope``.
Examples::

    int4
    q4_0,mean_center=bias.gguf
    none,sink=4,window=1020
    int2,group=32,residual=128
    q8_0,k=q4_0            # K in q4_0, V in q8_0
    int2,rotate=kv,pre_rope=1

This module knows nothing about transformers or tensors beyond validation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .checks import check_int
from .formats import FORMATS, format_names, get_format

#: K formats mean-centering is enabled for (``Format.mean_center`` in the registry; measured, see
#: docs/mean-center.md), narrowest first: q4_0, q5_0, q8_0.
MEAN_CENTER_FORMATS: tuple[str, ...] = tuple(
    sorted((f.name for f in FORMATS.values() if f.mean_center), key=lambda n: (FORMATS[n].bits, n))
)


#: StreamingLLM position semantics (kvslim.layer): "cache" is the paper's, "original" the vanilla one;
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
#: Which encoded tensors are stored Hadamard-rotated (kvslim.hadamard): none, K, V or both; "auto" is
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


@dataclass(frozen=True)
class CacheConfig:
    """Everything that defines a cache mode. Validated on construction.

    kv_quantize: storage format of K and V unless overridden (``none`` = the model's dtype).
    k_quantize / v_quantize: per-tensor overrides (None = ``kv_quantize``).
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
    mean_center: path to a K bias file (GGUF, see :mod:`kvslim.biasfile`), or None.
    positions: where StreamingLLM's kept keys sit (see :mod:`kvslim.layer`, docs/streaming.md),
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
    """

    kv_quantize: str = "none"
    k_quantize: str | None = None
    v_quantize: str | None = None
    sink: int = 0
    window: int | None = None
    group_size: int = DEFAULT_GROUP_SIZE
    residual: int | str = "auto"
    v_group_size: int | None = None
    mean_center: str | None = None
    positions: str = DEFAULT_POSITIONS
    residual_dtype: str = DEFAULT_RESIDUAL_DTYPE
    rotate: str = DEFAULT_ROTATE
    pre_rope: bool | str = DEFAULT_PRE_ROPE

    def __post_init__(self):
        if self.rotate not in ROTATE:
            raise ValueError(
                f"rotate must be one of {', '.join(ROTATE)} (which encoded tensors are stored Hadamard-rotated), "
                f"got {self.rotate!r}"
            )
        if not (isinstance(self.pre_rope, bool) or self.pre_rope == "auto"):
            raise ValueError(
                f"pre_rope must be True, False or 'auto' (store K before RoPE), got {self.pre_rope!r}"
            )
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(
                f"residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)} (how a lossy format's full-precision "
                f"residual and sinks are stored), got {self.residual_dtype!r}"
            )
        if self.positions not in POSITIONS:
            raise ValueError(
                f"positions must be one of {', '.join(POSITIONS)} (where StreamingLLM's kept keys sit), "
                f"got {self.positions!r}"
            )
        for name in ("kv_quantize", "k_quantize", "v_quantize"):
            value = getattr(self, name)
            if value is None and name != "kv_quantize":
                continue
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a format name, got {value!r}")
            get_format(value)  # raises with the legal names
        check_int("sink", self.sink, minimum=0)
        if self.window is not None:
            check_int("window", self.window, minimum=1, hint="or None for an unbounded cache")
        check_int("group_size", self.group_size, minimum=1)
        if self.residual != "auto":
            check_int("residual", self.residual, minimum=0, hint="or 'auto'")
        if self.residual != "auto" and self.residual % self.group_size:
            raise ValueError(
                f"residual={self.residual} is not a multiple of group_size={self.group_size}: tokens leave "
                f"the full-precision residual one group at a time, so residual must be 0 or a multiple "
                f"of group_size (e.g. {self.group_size * max(1, round(self.residual / self.group_size))})"
            )
        if self.v_group_size is not None:
            check_int("v_group_size", self.v_group_size, minimum=1, hint="or None for the whole head_dim")
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
        return self.k_quantize or self.kv_quantize

    @property
    def v_format(self) -> str:
        return self.v_quantize or self.kv_quantize

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
        """The canonical one-line spec; ``parse_spec(c.to_spec()) == c``."""
        parts = [self.kv_quantize]
        if self.k_quantize is not None:
            parts.append(f"k={self.k_quantize}")
        if self.v_quantize is not None:
            parts.append(f"v={self.v_quantize}")
        if self.sink:
            parts.append(f"sink={self.sink}")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.group_size != DEFAULT_GROUP_SIZE:
            parts.append(f"group={self.group_size}")
        if self.residual != "auto":
            parts.append(f"residual={self.residual}")
        if self.v_group_size is not None:
            parts.append(f"v_group={self.v_group_size}")
        if self.mean_center is not None:
            parts.append(f"mean_center={self.mean_center}")
        if self.positions != DEFAULT_POSITIONS:
            parts.append(f"positions={self.positions}")
        if self.residual_dtype != DEFAULT_RESIDUAL_DTYPE:
            parts.append(f"residual_dtype={self.residual_dtype}")
        if self.rotate != DEFAULT_ROTATE:
            parts.append(f"rotate={self.rotate}")
        if self.pre_rope != DEFAULT_PRE_ROPE:
            parts.append(
                f"pre_rope={self.pre_rope if isinstance(self.pre_rope, str) else int(self.pre_rope)}"
            )
        return ",".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> CacheConfig:
        return replace(self, **changes)


# spec key -> (dataclass field, parser)
_SPEC_KEYS = {
    "k": ("k_quantize", str),
    "v": ("v_quantize", str),
    "sink": ("sink", int),
    "window": ("window", int),
    "group": ("group_size", int),
    "residual": ("residual", int),
    "v_group": ("v_group_size", int),
    "mean_center": ("mean_center", str),
    "positions": ("positions", str),
    "residual_dtype": ("residual_dtype", str),
    "rotate": ("rotate", str),
    "pre_rope": ("pre_rope", bool),
}

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
            f"cache spec {spec!r} must start with a format name (one of {', '.join(format_names())}), got {head!r}"
        )
    kwargs: dict = {"kv_quantize": head}
    for part in rest:
        if "=" not in part:
            raise ValueError(f"cache spec {spec!r}: {part!r} is not key=value; keys: {', '.join(_SPEC_KEYS)}")
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in _SPEC_KEYS:
            raise ValueError(f"cache spec {spec!r}: unknown key {key!r}; keys: {', '.join(_SPEC_KEYS)}")
        field_name, conv = _SPEC_KEYS[key]
        if field_name in kwargs:
            raise ValueError(f"cache spec {spec!r}: key {key!r} given twice")
        if conv is bool:
            if value.lower() == "auto":
                kwargs[field_name] = "auto"
                continue
            if value.lower() not in _BOOLS:
                raise ValueError(
                    f"cache spec {spec!r}: {key} must be 1, 0 or auto (true/false), got {value!r}"
                )
            kwargs[field_name] = _BOOLS[value.lower()]
            continue
        if conv is int:
            if value.lower() in ("none", "") and key in ("window", "v_group"):
                kwargs[field_name] = None
                continue
            if value.lower() == "auto" and key == "residual":
                kwargs[field_name] = "auto"
                continue
            try:
                kwargs[field_name] = int(value)
            except ValueError:
                raise ValueError(f"cache spec {spec!r}: {key} must be an integer, got {value!r}") from None
        else:
            kwargs[field_name] = value
    return CacheConfig(**kwargs)
