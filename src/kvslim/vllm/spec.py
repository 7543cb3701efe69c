"""The plugin's cache spec: where it comes from, and what of kvslim's options a vLLM backend can honour.

Two sources, each parsed and validated by :mod:`kvslim.config` (the same messages as ``SlimCache``):

- ``additional_config={"kvslim": ...}`` (``LLM(..., additional_config=...)``, ``vllm serve
  --additional-config '{"kvslim": ...}'``): either a one-line spec string (``"q4_0"``,
  ``"q8_0,k=q4_0"``) or a dict of :class:`~kvslim.config.CacheConfig` keywords
  (``{"kv_quantize": "q4_0"}``);
- the environment variable :data:`ENV` (``KVSLIM_VLLM_SPEC=q4_0``), a one-line spec.

Giving both is refused (which one wins would be a guess). Neither (:func:`given` False): the plugin leaves vLLM's
own CPU backend in charge, so installing kvslim changes nothing until a spec is given (``none``: kvslim's pages
in the model's dtype, lossless).

A vLLM attention backend stores what vLLM's scheduler and KV-cache manager decide to keep; it does not
choose which tokens are kept, when a token is quantized, or which layers are special. So the options of
:class:`~kvslim.config.CacheConfig` that decide those are refused here, one line each (:func:`check_supported`):
``window`` (StreamingLLM eviction is the KV-cache manager's business: docs/vllm.md; ``sink`` without a window is
taken: the first pages of every sequence kept at full precision, :mod:`.staging`), ``residual``
(every token is encoded as it is written, as llama.cpp does: residual 0), ``keep_layers``, ``positions``,
``residual_dtype``, and, until they are built, ``pre_rope`` and ``rotate=fitted`` (whose matrices come with a
``mean_center`` file). ``rotate`` (Hadamard) and ``mean_center`` (a post-RoPE K bias file) are honoured inside
the backend (:mod:`.basis`, which checks them against the page layout and the model).
``pre_rope=auto`` resolves to off.

This module imports nothing of vLLM.
"""

from __future__ import annotations

import os

from ..config import CacheConfig, parse_spec
from ..formats import get_format
from .pages import PAGE_TOKENS

#: The environment variable holding a one-line spec.
ENV = "KVSLIM_VLLM_SPEC"
#: The key of vLLM's ``additional_config`` the plugin reads.
KEY = "kvslim"

#: Layout families a page can hold (per role).
PAGE_FAMILIES = ("cast", "ggml", "affine_k", "affine_v", "fp8")
#: Affine K is stored per token in pages (KIVI's per-channel K groups are not built yet): only the widths
#: where per-token K keeps usable quality (docs/vllm.md).
PER_TOKEN_K_BITS = (8, 4)

#: CacheConfig options a page cannot honour, with why (their value must stay at the default).
_REFUSED = {
    "window": "StreamingLLM eviction is the business of vLLM's KV-cache manager, not of an attention backend "
    "(docs/vllm.md); use kvslim's own engine for sinks + window",
    "residual": "vLLM's pages encode every token as it is written (residual 0)",
    "group_size": "a page is one group of 32 tokens",
    "v_group_size": "V scales cover the whole head in pages",
    "keep_layers": "per-layer formats are not built in the vLLM plugin",
    "keep_format": "per-layer formats are not built in the vLLM plugin",
    "positions": "positions are vLLM's",
    "residual_dtype": "pages keep no full-precision residual",
    "clip": "range clipping is not built in the vLLM pages yet (they encode min-max ranges, whatever auto chooses)",
    "codebook": "Lloyd-Max codebooks are not built in the vLLM pages (they decode even grids, whatever auto chooses)",
}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def given(additional_config: dict | None, environ: os._Environ | dict | None = None) -> bool:
    """Whether this engine names a kvslim spec at all (without one, the plugin leaves vLLM's own backend)."""
    environ = os.environ if environ is None else environ
    in_config = isinstance(additional_config, dict) and additional_config.get(KEY) is not None
    return in_config or bool(environ.get(ENV, "").strip())


def from_sources(additional_config: dict | None, environ: os._Environ | dict | None = None) -> CacheConfig:
    """The validated :class:`CacheConfig` of this engine (``none`` when neither source gives one).

    additional_config: vLLM's ``VllmConfig.additional_config`` (None or a dict); environ: the environment
    (default ``os.environ``). ValueError in one line for a bad spec, an unsupported option, or both sources."""
    environ = os.environ if environ is None else environ
    given = (additional_config or {}).get(KEY) if isinstance(additional_config, dict) else None
    env = environ.get(ENV, "").strip()
    if given is not None and env:
        raise ValueError(
            f"kvslim: both additional_config[{KEY!r}] ({given!r}) and ${ENV} ({env!r}) give a cache spec; give one"
        )
    try:
        if given is None:
            config = parse_spec(env) if env else CacheConfig()
        elif isinstance(given, str):
            config = parse_spec(given)
        elif isinstance(given, dict):
            config = CacheConfig(**given)
        else:
            raise ValueError(
                f"additional_config[{KEY!r}] must be a spec string (e.g. 'q4_0') or a dict of cache options "
                f"(e.g. {{'kv_quantize': 'q4_0'}}), got {type(given).__name__}"
            )
    except TypeError as e:  # an unknown keyword of CacheConfig
        raise ValueError(f"kvslim: additional_config[{KEY!r}]: {_one_line(e)}") from None
    except ValueError as e:
        raise ValueError(f"kvslim: {_one_line(e)}") from None
    check_supported(config)
    return config


def sink_pages(config: CacheConfig) -> int:
    """How many of each sequence's first pages are kept staged at full precision: ``ceil(sink / 32)``
    (:mod:`.staging`, "Sink pages"). ``sink=auto`` is none here: a sink page holds a staging slot per running
    sequence, so in vLLM the pages are asked for (``sink=N``), not kvslim's own cache's default."""
    sink = 0 if config.sink == "auto" else config.sink
    return -(-sink // PAGE_TOKENS)


def check_supported(config: CacheConfig) -> None:
    """ValueError in one line unless a vLLM page can store ``config`` (see the module docstring)."""
    defaults = CacheConfig()
    for name, why in _REFUSED.items():
        if getattr(config, name) != getattr(defaults, name):
            raise ValueError(f"kvslim: {name}={getattr(config, name)!r} is not supported in vLLM: {why}")
    if config.pre_rope is True:
        raise ValueError(
            "kvslim: pre_rope=1 is not supported in vLLM (K is written after RoPE by vLLM's model)"
        )
    for role, name in (("k", config.k_format), ("v", config.v_format)):
        fmt = get_format(name)
        family = fmt.family[role]
        if family not in PAGE_FAMILIES:
            raise ValueError(
                f"kvslim: {role.upper()} format {name!r} (family {family}) has no vLLM page layout yet; "
                f"supported: none, fp16, bf16, fp8, q8_0, q4_0, q4_1, q5_0, q5_1, int8, int4 (and int3/int2 for V)"
            )
        if family == "affine_k" and fmt.bits not in PER_TOKEN_K_BITS:
            raise ValueError(
                f"kvslim: K format {name!r} needs KIVI's per-channel K groups, not built in the vLLM plugin yet "
                f"(pages store affine K per token); use int8, int4 or q4_0 for K"
            )
