"""Cache configuration: one frozen, validated dataclass and its one-line spec syntax.

The spec syntax is the same everywhere in the CLI (``eval --config``, ``bench --config``):
``FORMAT[,key=value...]`` with keys ``k``, ``v`` (per-tensor formats), ``sink``, ``window``,
``group``, ``residual``, ``v_group``, ``mean_center`` (a bias file), ``positions``, ``residual_dtype``,
``rotate``, ``pre_rope``, ``varnorm``, ``clip``, ``codebook``, ``keep_layers`` and ``keep_format`` (per-layer precision). Examples::

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

Every option is declared once, here, on its :class:`CacheConfig` field (:func:`~kvslim.options.option`): its
type of value, default, legal values, spec key and CLI flag. :data:`OPTIONS` lists the declarations; validation
(:class:`~kvslim.options.Option`), the spec syntax (:mod:`kvslim.spec`, joined here by :func:`parse_spec` and
:meth:`CacheConfig.to_spec`) and the CLI's cache flags (:mod:`kvslim.cli.common`) read them, and a test checks
the README's lists against them. This module holds the declarations, the defaults and the rules between options
(``residual`` a multiple of ``group_size``, ``mean_center`` only for the formats it applies to, ...).

This module knows nothing about transformers or tensors beyond validation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from .formats import FORMATS, PRESETS, get_format, resolve_pair
from .formats.codebook import BITS as CODEBOOK_BITS
from .options import Option, option, parse_layers, resolve_layers
from .spec import read_spec, write_spec

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
#: decided by the cache (SlimCache.rotate says what it chose); "fitted": K and V rotated by the per-layer, per-head
#: rotations a calibration file holds (kvslim.calibration.rotation; mean_center=FILE).
ROTATE = ("auto", "none", "k", "v", "kv", "fitted")
#: pre_rope: True, False, or "auto" (decided by the cache; SlimCache.pre_rope says what it chose).
PRE_ROPE = (True, False, "auto")
#: The defaults, chosen by measurement (docs/quality.md, "Low-bit levers"): the cache decides, per format
#: and from a bias file's recorded basis.
DEFAULT_ROTATE = "auto"
DEFAULT_PRE_ROPE = "auto"


#: Variance normalization of the affine formats' encoded groups (kvslim.formats.varnorm): "auto" is decided per
#: format by the cache (kvslim.formats.varnorm.AUTO, from docs/quality.md's "Variance normalization").
VARNORM = ("auto", "off", "on")
DEFAULT_VARNORM = "auto"
#: Range clipping of the affine formats' encoded slices (kvslim.formats.clip): which streams clip; "auto" as
#: measured (kvslim.formats.clip.AUTO, docs/quality.md's "Range clipping").
CLIP = ("auto", "off", "v", "k", "kv")
DEFAULT_CLIP = "auto"
#: Lloyd-Max codebooks of the 2- and 3-bit affine formats (kvslim.formats.codebook): which streams' codes index
#: the Gaussian Lloyd-Max levels; "auto" as measured (kvslim.formats.codebook.AUTO, docs/quality.md's "Lloyd-Max
#: codebooks").
CODEBOOK = ("auto", "off", "v", "k", "kv")
DEFAULT_CODEBOOK = "auto"


#: the full-precision residual of an unbounded cache (and the most ``residual="auto"`` keeps with a window)
DEFAULT_RESIDUAL = 128
#: KIVI's token group (the unit tokens leave the residual in)
DEFAULT_GROUP_SIZE = 32
#: The first tokens a cache that quantizes keeps at full precision when it has no window (``sink="auto"``): the
#: attention sink's short keys draw a large share of every query's attention, so their rounding moves the output
#: most (IntactKV's pivot tokens); measured in docs/quality.md, "The attention sink at full precision"
DEFAULT_SINK = 16


#: The default format of the layers ``keep_layers`` names: lossless, the model's own dtype (vLLM's
#: ``--kv-cache-dtype-skip-layers`` keeps them unquantized too).
DEFAULT_KEEP_FORMAT = "none"


@dataclass(frozen=True)
class CacheConfig:
    """Everything that defines a cache mode. Validated on construction.

    kv_quantize: storage format of K and V unless overridden (``none`` = the model's dtype), or a named K/V
        preset (``k4v2``: K int4, V int2; :mod:`kvslim.formats.presets`).
    k_quantize / v_quantize: per-tensor overrides (None = ``kv_quantize``, or its preset's half).
    sink: the first ``sink`` tokens are kept at full precision (>= 0): StreamingLLM's attention sinks, kept
        forever with a window; without one (RotateKV's attention-sink-aware quantization, IntactKV's pivot
        tokens) nothing is evicted and the sinks are simply never quantized. ``auto`` (default):
        :data:`DEFAULT_SINK` where the cache quantizes and has no window, else 0 (:attr:`sink_tokens` is the
        number in effect).
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
        records). Attention is unchanged. ``fitted``: every encoded K and V rotated by the orthogonal matrices
        fitted per layer and KV head by ``kvslim calibrate --fit-rotation`` (:mod:`kvslim.calibration.rotation`),
        read from the ``mean_center`` file (which then serves any K format; its bias applies only where the
        K format centers).
    pre_rope: store K before RoPE (KVQuant) and rotate it on read; needs the model's RoPE. ``auto``
        (default) lets the cache decide (2-bit K where the model's RoPE allows it; as a bias file records).
    A ``mean_center`` bias must have been calibrated in the basis K is stored in (``rotate`` with K,
    ``pre_rope``); the bias file records it.
    varnorm: variance normalization of the affine formats' encoded groups (:mod:`kvslim.formats.varnorm`, KVarN's
        two-axis balance): ``on`` for every affine K/V stream, ``off``, or ``auto`` (default: per format, as
        measured in docs/quality.md).
    clip: range clipping of the affine formats' encoded slices (:mod:`kvslim.formats.clip`: each slice's range
        shrunk to the one of least squared error at encode time): ``v``, ``k``, ``kv``, ``off``, or ``auto``
        (default: where docs/quality.md measured it helps, 2-bit V).
    codebook: Lloyd-Max codebooks for the 2- and 3-bit affine formats (:mod:`kvslim.formats.codebook`: the codes
        index the Gaussian Lloyd-Max levels placed over the slice's range, min-max or as ``clip`` chooses it; same
        bytes): ``v``, ``k``, ``kv``, ``off``, or ``auto`` (default: where docs/quality.md measured it helps).
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
    sink: int | str = option(
        "auto",
        "int",
        "sink",
        minimum=0,
        hint="or 'auto'",
        flag="--streaming-llm-sink",
        metavar="N",
        flag_auto=True,
        flag_help=f"keep the first N tokens forever, at full precision (default: auto = {DEFAULT_SINK} for a cache "
        "that quantizes and has no window, else 0)",
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
        DEFAULT_POSITIONS,
        "choice",
        "positions",
        choices=POSITIONS,
        what="where StreamingLLM's kept keys sit",
        flag="--streaming-llm-positions",
        flag_help="where the kept keys sit with a window: cache (the paper: one contiguous sequence), original (each "
        f"at its own position: what `kvslim serve --pages` keeps) or auto: cache where the model's RoPE allows it "
        f"(default: {DEFAULT_POSITIONS})",
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
        f"the bias file records; fitted: K and V by the rotations of the --kv-mean-center file (kvslim calibrate "
        f"--fit-rotation) (default: {DEFAULT_ROTATE})",
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
    varnorm: str = option(
        DEFAULT_VARNORM,
        "choice",
        "varnorm",
        choices=VARNORM,
        what="variance normalization of the affine formats",
        flag="--kv-varnorm",
        flag_help="balance each encoded group's variance along tokens and channels before rounding (KVarN's idea; "
        f"affine formats only); auto: where docs/quality.md measured it helps (default: {DEFAULT_VARNORM})",
    )
    clip: str = option(
        DEFAULT_CLIP,
        "choice",
        "clip",
        choices=CLIP,
        what="range clipping of the affine formats",
        flag="--kv-clip",
        flag_help="encode each affine slice over the range of least squared error instead of its min-max (v, k, "
        f"kv or off); auto: where docs/quality.md measured it helps, 2-bit V (default: {DEFAULT_CLIP})",
    )
    codebook: str = option(
        DEFAULT_CODEBOOK,
        "choice",
        "codebook",
        choices=CODEBOOK,
        what="Lloyd-Max codebooks of the 2- and 3-bit affine formats",
        flag="--kv-codebook",
        flag_help="int2/int3 codes index the Gaussian Lloyd-Max levels instead of an even grid over the range --kv-clip "
        f"chooses (v, k, kv or off; same bytes); auto: where docs/quality.md measured it helps (default: "
        f"{DEFAULT_CODEBOOK})",
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
        if self.varnorm == "on" and not any(
            getattr(get_format(f), "pack", None) is not None for f in (self.k_format, self.v_format)
        ):
            raise ValueError(
                f"varnorm=on applies to the affine formats (int8, int4, int3, int2), and this cache stores K as "
                f"{self.k_format} and V as {self.v_format}: pick an affine format or leave varnorm at auto/off"
            )
        if self.clip not in ("off", "auto") and self.varnorm == "on":
            raise ValueError(
                f"clip={self.clip} and varnorm=on do not combine (a variance-normalized stream encodes its own "
                f"way): leave one of them at auto/off"
            )
        if self.clip not in ("off", "auto") and not any(
            getattr(get_format(f), "pack", None) is not None
            for r, f in (("k", self.k_format), ("v", self.v_format))
            if r in self.clip
        ):
            raise ValueError(
                f"clip={self.clip} applies to the affine formats (int8, int4, int3, int2), and this cache stores K "
                f"as {self.k_format} and V as {self.v_format}: pick an affine format or leave clip at auto/off"
            )
        self._check_codebook()
        if self.residual != "auto" and self.residual % self.group_size:
            raise ValueError(
                f"residual={self.residual} is not a multiple of group_size={self.group_size}: tokens leave "
                f"the full-precision residual one group at a time, so residual must be 0 or a multiple "
                f"of group_size (e.g. {self.group_size * max(1, round(self.residual / self.group_size))})"
            )
        if self.rotate == "fitted" and self.mean_center is None:
            raise ValueError(
                "rotate='fitted' needs the calibration file holding the fitted rotation: mean_center=FILE "
                "(written by kvslim calibrate --fit-rotation)"
            )
        if self.mean_center is not None and self.k_format not in MEAN_CENTER_FORMATS and self.rotate != "fitted":
            why = (
                "its zero point already absorbs a per-channel mean"
                if not get_format(self.k_format).symmetric
                else "it does not quantize K with a symmetric (zero-point free) block format"
            )
            raise ValueError(
                f"mean_center does not apply to K format {self.k_format!r}: {why}; "
                f"it applies to {', '.join(MEAN_CENTER_FORMATS)}"
            )

    def _check_codebook(self) -> None:
        """ValueError in one line unless every stream ``codebook`` names is 2- or 3-bit affine and not normalized."""
        if self.codebook in ("off", "auto"):
            return
        if self.varnorm == "on":
            raise ValueError(
                f"codebook={self.codebook} and varnorm=on do not combine (a variance-normalized stream encodes its "
                f"own grid): leave one of them at auto/off"
            )
        for role, name in (("k", self.k_format), ("v", self.v_format)):
            fmt = get_format(name)
            if role in self.codebook and (getattr(fmt, "pack", None) is None or fmt.bits not in CODEBOOK_BITS):
                raise ValueError(
                    f"codebook={self.codebook} applies to the 2- and 3-bit affine formats (int3, int2), and this "
                    f"cache stores {role.upper()} as {name}: store {role.upper()} as int2/int3, name only such "
                    f"streams, or leave codebook at auto/off"
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
    def sink_tokens(self) -> int:
        """The sinks in effect: ``sink``, or what ``auto`` chose: :data:`DEFAULT_SINK` where the cache quantizes
        (K or V not ``none``) and has no window, else 0 (a window's sinks are StreamingLLM's, given explicitly)."""
        if self.sink != "auto":
            return self.sink
        quantizes = self.k_format != "none" or self.v_format != "none"
        return DEFAULT_SINK if quantizes and self.window is None else 0

    @property
    def capacity(self) -> int | None:
        """Tokens stored per layer at most (sink + window), or None when unbounded."""
        return None if self.window is None else self.sink_tokens + self.window

    def to_spec(self) -> str:
        """The canonical one-line spec (the options that differ from their defaults, in declaration order);
        ``parse_spec(c.to_spec()) == c``."""
        return write_spec({o.name: getattr(self, o.name) for o in OPTIONS}, OPTIONS)

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


def parse_spec(spec: str) -> CacheConfig:
    """Parse ``FORMAT[,key=value...]`` (:mod:`kvslim.spec`) into a validated :class:`CacheConfig`.

    Raises ValueError naming the bad part and what is legal.
    """
    return CacheConfig(**read_spec(spec, OPTIONS))
