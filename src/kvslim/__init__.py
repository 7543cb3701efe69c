"""kvslim: a bounded, compressed KV cache for transformers models.

Three orthogonal axes composed in one cache: *policy* (which tokens are kept: all, or StreamingLLM
sinks + window), *codec* (how a kept token is stored: the model's dtype, fp16/bf16/fp8, KIVI affine
int8/4/2, llama.cpp's GGML blocks, optionally K mean-centered) and the *cache* (the transformers glue).

Importing kvslim registers the attention implementation ``"kvslim"`` with transformers
(attention computed on the compressed store; see :mod:`kvslim.attention`).
"""

__version__ = "0.1.0"

from . import attention as _attention  # noqa: E402,F401  (registers "kvslim" with transformers)
from .cache import SlimCache  # noqa: E402
from .config import CacheConfig, parse_spec  # noqa: E402

__all__ = ["CacheConfig", "SlimCache", "parse_spec", "__version__"]
