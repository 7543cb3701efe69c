"""kvslim: a bounded, compressed KV cache for transformers models.

Three orthogonal axes composed in one cache: *policy* (which tokens are kept: all, or StreamingLLM
sinks + window), *codec* (how a kept token is stored: the model's dtype, fp16/bf16/fp8, KIVI affine
int8/4/2, llama.cpp's GGML blocks, optionally K mean-centered) and the *cache* (the transformers glue).

``import kvslim`` is cheap: it imports neither torch nor transformers. The public names below load
their modules on first use. The ``"kvslim"`` attention implementation is registered with
transformers when a :class:`SlimCache` is built, by :func:`enable`, or by an explicit
:func:`register`.
"""

from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

# public name -> (module, attribute); loaded on first access (PEP 562)
_LAZY = {
    "SlimCache": ("kvslim.cache.adapter", "SlimCache"),
    "StaticSlimCache": ("kvslim.cache.static_adapter", "StaticSlimCache"),
    "compile_decode": ("kvslim.compiled", "compile_decode"),
    "CacheConfig": ("kvslim.config", "CacheConfig"),
    "parse_spec": ("kvslim.config", "parse_spec"),
    "register": ("kvslim.attention", "register"),
    "models": ("kvslim.models", None),
}

__all__ = [
    "CacheConfig",
    "SlimCache",
    "StaticSlimCache",
    "compile_decode",
    "enable",
    "parse_spec",
    "register",
    "__version__",
]


def enable(model):
    """Switch a loaded transformers model to the ``"kvslim"`` attention (registering it first).

    Decode steps then read a SlimCache's compressed codes directly instead of materializing the
    history; with any other cache, and for prefill chunks, it is exactly sdpa. Returns the model.
    """
    from .attention import NAME, register

    if not callable(getattr(model, "set_attn_implementation", None)):
        raise ValueError(
            f"enable() needs a loaded transformers model (a PreTrainedModel), got {type(model).__name__}"
        )
    register()
    model.set_attn_implementation(NAME)
    return model


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
