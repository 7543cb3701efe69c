"""KV storage formats: pure tensor functions and the codecs a cache layer uses.

Every fact about a format (nominal ``bits``, ``symmetric``, ``mean_center``, GGML ``block``, kernel
``family`` per role) is a class attribute of its registered :class:`Format`; codecs, config
validation, CLI choices and kernels read it from the registry (``get_format(name).bits``).

Families, one module each: :mod:`.floats` (none, fp16, bf16, fp8), :mod:`.affine` (KIVI int8/int4/int3/int2),
:mod:`.ggml` (llama.cpp's q8_0, q4_0, q4_1, q5_0, q5_1). Importing this package registers them all, and the
named asymmetric K/V presets of :mod:`.presets` (``k4v2`` = K int4, V int2, ...).
"""

from . import affine, floats, ggml  # noqa: F401  (registration)
from .base import FORMATS, Block, Codec, Encoded, Format, check_finite, format_names, get_format, make_codec
from .ggml import GGML_KINDS, dequantize_ggml, quantize_ggml
from .presets import PRESETS, Preset, pair_names, preset_names, resolve_pair

__all__ = [
    "FORMATS",
    "GGML_KINDS",
    "PRESETS",
    "Preset",
    "Block",
    "Codec",
    "Encoded",
    "Format",
    "check_finite",
    "dequantize_ggml",
    "format_names",
    "get_format",
    "make_codec",
    "pair_names",
    "preset_names",
    "quantize_ggml",
    "resolve_pair",
]
