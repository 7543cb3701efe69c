"""kvslim: a bounded, compressed KV cache for transformers models.

Three orthogonal axes composed in one cache: *policy* (which tokens are kept: all, or StreamingLLM
sinks + window), *codec* (how a kept token is stored: the model's dtype, fp16/bf16/fp8, KIVI affine
int8/4/2, llama.cpp's GGML blocks, optionally K mean-centered) and the *cache* (the transformers glue).
"""

__version__ = "0.1.0"

from .config import CacheConfig, parse_spec  # noqa: E402

__all__ = ["CacheConfig", "SlimCache", "parse_spec", "__version__"]


def __getattr__(name):
    # SlimCache imports transformers (seconds); keep `import kvslim` light for the CLI's --help.
    if name == "SlimCache":
        from .cache import SlimCache

        return SlimCache
    raise AttributeError(f"module 'kvslim' has no attribute {name!r}")
