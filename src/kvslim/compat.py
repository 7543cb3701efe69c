"""transformers version differences: the ONE module that knows them.

kvslim supports transformers 5.6 through 5.24 (``pyproject.toml``; CI runs the fast tests against the
oldest and the newest, see ``.ci/run``). Every place whose code depends on the release asks here; no
other module compares versions or probes transformers with ``hasattr``.

What moved inside the supported range (each measured on the released wheels):

===========================  =====================================  =======================================
what                         before                                 from
===========================  =====================================  =======================================
the model's cache argument   ``past_key_values=``                   5.24: ``cache=`` (the old name is
                                                                    deprecated, still accepted until 5.40)
position ids at              not passed (5.0-5.3: a ``cache_kwargs`` 5.24: the attention layer's kwargs
``Cache.update``             dict with ``cache_position`` only)     (``kwargs={"position_ids": ...}``)
``get_mask_sizes(...)``      ``cache_position`` (a tensor)          5.4: ``query_length`` (an int)
max length of a layer        ``get_max_cache_shape()``              5.13: ``get_max_length()``
per-layer attention types    ``config.layer_types`` /               5.14: ``get_layer_types_and_kwargs``
                             ``sliding_window`` fields              (one kwargs dict; 5.20: one per layer)
linear-attention layers      none                                   5.5: ``LinearAttentionLayer``
KV-sharing layers            left out of the cache                  5.23: ``DummyLayer``
GGUF dequantize on load      implied by ``gguf_file=``              5.20: ``GgufConfig(dequantize=True)``
===========================  =====================================  =======================================

Below 5.6: the cache itself works on 4.57 through this module (``tests/test_compat.py`` passes on
4.57.6), but 5.0-5.5 unpack the embedded model's GGUF tokenizer as a CodeLlama tokenizer that adds a BOS
token (the model then writes other text; 5.0 also has no ``GgufConfig``), and a 4.x release reads a config
saved by 5.x (``rope_parameters``) without its RoPE settings. The embedded model, not the cache API, sets
the floor at 5.6 (``tests/test_embedded_conversion.py``, run by ``make compat``); the notes on releases
before it below are kept for the cache code that still handles them.

What kvslim loses before 5.24, where position ids never reach the cache:

- kvslim's own loop (:mod:`kvslim.generate`) does not re-base position ids on endless streams (ids
  grow as in ``model.generate()``; the cache follows absolute positions, which is exact);
- under ``model.generate()``, the cache cannot read a left-padded batch's padding off the position
  ids: StreamingLLM sinks of a padded batch need ``cache.set_left_padding(pads)`` (kvslim's loop does
  this itself). :func:`warn_padding_unseen` says so, once.
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

#: The oldest and newest transformers releases kvslim is tested against (also in pyproject.toml's range).
OLDEST = "5.6.0"
NEWEST = "5.24.0"

VERSION = Version(transformers.__version__)


def at_least(version: str) -> bool:
    """Whether the installed transformers is at least ``version`` ("5.24"); pre-releases count as their
    release (5.25.0.dev0 as 5.25.0)."""
    installed = VERSION.release
    return installed >= Version(version).release


#: The model's keyword for the cache (``model(ids, **{CACHE_KWARG: cache})``).
CACHE_KWARG = "cache" if at_least("5.24") else "past_key_values"
#: Whether ``Cache.update`` receives the forward's position ids.
POSITIONS_REACH_CACHE = at_least("5.24")


def cache_kwargs(cache) -> dict:
    """``{CACHE_KWARG: cache}``: the keyword arguments that hand ``cache`` to a model's forward."""
    return {CACHE_KWARG: cache}


def update_position_ids(kwargs: dict):
    """The forward's position ids as a cache layer's ``update(..., **kwargs)`` receives them, or None.

    5.24 passes the attention layer's kwargs as ``kwargs=...``; a caller may pass ``position_ids=``
    directly; earlier releases pass neither.
    """
    inner = kwargs.get("kwargs") or {}
    return inner.get("position_ids", kwargs.get("position_ids"))


def mask_query_length(arg) -> int:
    """``get_mask_sizes``'s argument as a number of new tokens: an int (5.4+) or ``cache_position`` (earlier)."""
    if isinstance(arg, int):
        return arg
    return int(arg.shape[0])


# transformers' layer types that take each kwarg (its get_layer_types_and_kwargs, 5.20+)
_WINDOWED = ("sliding_attention", "hybrid_sliding", "reference_sliding_attention", "chunked_attention")
_STATEFUL = ("conv", "linear_attention", "hybrid", "hybrid_sliding")
_WITH_CONFIG = ("heavily_compressed_attention", "compressed_sparse_attention")


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """Each cache layer's type and constructor kwargs for a text config, in transformers 5.20+'s shape
    (one kwargs dict per layer) on every supported release.

    5.14-5.19 return one kwargs dict for all layers (a full-attention layer would get a sliding model's
    ``sliding_window``), so it is split by type here; before 5.14 the rules are those of
    ``DynamicCache(config=...)``. Before 5.23 KV-sharing layers are left out of the list (transformers'
    own caches have no layer for them), from 5.23 they are ``dummy``.
    """
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs  # 5.14+
    except ImportError:
        get_layer_types_and_kwargs = _layer_types_before_5_14
    types, kwargs = get_layer_types_and_kwargs(config)
    types = list(types)
    if isinstance(kwargs, dict):  # 5.14-5.19 (and the fallback): shared by every layer
        kwargs = [_kwargs_for(t, kwargs) for t in types]
    return types, list(kwargs)


def _kwargs_for(layer_type: str, shared: dict) -> dict:
    out = {}
    if layer_type in _WINDOWED and "sliding_window" in shared:
        out["sliding_window"] = shared["sliding_window"]
    if layer_type in _STATEFUL and "number_of_states" in shared:
        out["number_of_states"] = shared["number_of_states"]
    if layer_type in _WITH_CONFIG and "config" in shared:
        out["config"] = shared["config"]
    return out


def _layer_types_before_5_14(config) -> tuple[list[str], dict]:
    """``get_layer_types_and_kwargs`` as 5.14 wrote it, for the releases before it."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        if getattr(config, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        elif getattr(config, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    shared = getattr(config, "num_kv_shared_layers", None)
    if shared:
        types = types[:-shared]
    kwargs: dict = {}
    if "sliding_attention" in types or "hybrid_sliding" in types:
        kwargs["sliding_window"] = config.sliding_window
    if "chunked_attention" in types:
        kwargs["sliding_window"] = config.attention_chunk_size
    if any(t in _STATEFUL for t in types):
        kwargs["number_of_states"] = getattr(config, "number_of_conv_states", 1)
    return list(types), kwargs


# Layer classes that only newer releases have. A stand-in is never instantiated by a model of a release
# without the real one (its configs cannot name that layer type), and isinstance checks against it are False.
try:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer  # 5.5+
except ImportError:

    class LinearAttentionCacheLayerMixin:  # type: ignore[no-redef]
        """Stand-in before transformers 5.5 (no linear-attention cache layers)."""

    class LinearAttentionLayer(LinearAttentionCacheLayerMixin):  # type: ignore[no-redef]
        """Stand-in before transformers 5.5."""

        def __init__(self, *args, **kwargs):
            raise ValueError(
                f"linear-attention cache layers need transformers >= 5.5, this is {transformers.__version__}"
            )


try:
    from transformers.cache_utils import DummyLayer  # 5.23+
except ImportError:

    class DummyLayer:  # type: ignore[no-redef]
        """Stand-in before transformers 5.23 (KV-sharing layers had no cache layer at all)."""

        def __init__(self, *args, **kwargs):
            raise ValueError(
                f"dummy cache layers need transformers >= 5.23, this is {transformers.__version__}"
            )


def gguf_load_kwargs(path: str) -> dict:
    """``from_pretrained`` keyword arguments that load a GGUF file dequantized to plain tensors."""
    if at_least("5.20"):
        from transformers import GgufConfig

        return {"gguf_file": path, "quantization_config": GgufConfig(gguf_file=path, dequantize=True)}
    return {"gguf_file": path}  # before GgufConfig, gguf_file= always dequantized


_padding_warned = False


def warn_padding_unseen(batch: int) -> None:
    """Once per process: a batch whose padding this transformers cannot show the cache (before 5.24)."""
    global _padding_warned
    if _padding_warned or batch < 2 or POSITIONS_REACH_CACHE:
        return
    _padding_warned = True
    warnings.warn(
        f"transformers {transformers.__version__} does not pass position ids to the cache, so SlimCache cannot "
        f"see a left-padded batch's padding; StreamingLLM sinks then include pad tokens. Call "
        f"cache.set_left_padding(pads) before model.generate() (kvslim's own loop does), or use transformers >= 5.24.",
        stacklevel=4,
    )
