"""Quality of a cache mode, measured through the cached path, side by side with the reference.

Every measurement feeds tokens through a real cache object exactly as decoding does, by the one
decode loop in :mod:`kvslim.generate` (which owns the forwards and the positions). The reference is
the uncompressed, unbounded mode ``none``; it is always run in the same call and included in the
results, so every number has its baseline next to it. One module per measurement:

- :mod:`.modes`: the modes of a run (the reference first), cache makers, progress bars;
- :mod:`.perplexity`: :func:`perplexity_through_cache` / :func:`compare_perplexity` — teacher-forced
  perplexity ± standard error, KL(reference || mode), top-1 agreement, a per-position curve;
- :mod:`.plot`: :func:`plot_ppl_curves` (matplotlib, imported lazily);
- :mod:`.greedy`: :func:`greedy_prefix_match` — the fraction of the reference's greedy continuation
  a mode reproduces before its first divergence;
- :mod:`.longgen`: :func:`long_generation` — every mode free-runs N tokens: its first divergence, its
  agreement over the run, and its own continuation scored by the reference (KL that compounds);
- :mod:`.retrieval`: :func:`passkey` — a 5-digit key hidden in filler text, the model asked for it;
- :mod:`.memory`: :func:`memory_table` — the bytes each mode holds at each length; :func:`kv_bits` —
  bits per stored K/V element of a real cache, which every measurement above reports for each mode.

This package knows nothing about the command line; :mod:`kvslim.cli.eval` only parses and prints.
Caches are built from specs (``parse_spec``) by ``SlimCache.from_config``; every entry point takes
an optional ``make_cache(CacheConfig) -> Cache`` to substitute another cache (tests use it).
"""

from __future__ import annotations

from .greedy import (
    BUILTIN_PROMPTS,
    GreedyReport,
    GreedyResult,
    Prompt,
    PromptMatch,
    encode_prompt,
    greedy_prefix_match,
    load_prompts,
)
from .longgen import LONG_PROMPTS, LongReport, LongResult, LongRun, long_generation
from .memory import (
    KVBits,
    MemoryRow,
    ModelShape,
    cache_bytes,
    kv_bits,
    memory_records,
    memory_table,
    stream_layout,
)
from .modes import REFERENCE, CacheMaker, Mode, resolve_modes, slim_cache_maker
from .perplexity import (
    MAX_REFERENCE_BYTES,
    PerplexityReport,
    PerplexityResult,
    compare_perplexity,
    full_forward_nll,
    perplexity_through_cache,
)
from .plot import plot_ppl_curves
from .retrieval import (
    PASSKEY_ANSWER,
    PASSKEY_FILLER,
    PASSKEY_INTRO,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
    PasskeyCell,
    PasskeyPrompt,
    PasskeyReport,
    PasskeyResult,
    build_passkey_prompt,
    passkey,
    passkey_answer_correct,
)

__all__ = [
    "BUILTIN_PROMPTS",
    "LONG_PROMPTS",
    "MAX_REFERENCE_BYTES",
    "PASSKEY_ANSWER",
    "PASSKEY_FILLER",
    "PASSKEY_INTRO",
    "PASSKEY_NEEDLE",
    "PASSKEY_QUESTION",
    "REFERENCE",
    "CacheMaker",
    "GreedyReport",
    "GreedyResult",
    "KVBits",
    "LongReport",
    "LongResult",
    "LongRun",
    "MemoryRow",
    "Mode",
    "ModelShape",
    "PasskeyCell",
    "PasskeyPrompt",
    "PasskeyReport",
    "PasskeyResult",
    "PerplexityReport",
    "PerplexityResult",
    "Prompt",
    "PromptMatch",
    "build_passkey_prompt",
    "cache_bytes",
    "compare_perplexity",
    "encode_prompt",
    "full_forward_nll",
    "greedy_prefix_match",
    "kv_bits",
    "load_prompts",
    "long_generation",
    "memory_records",
    "memory_table",
    "passkey",
    "passkey_answer_correct",
    "perplexity_through_cache",
    "plot_ppl_curves",
    "resolve_modes",
    "slim_cache_maker",
    "stream_layout",
]
