"""What :meth:`Engine.memory <kvslim.engine.engine.Engine.memory>` reports: the engine's bytes and counters now."""

from __future__ import annotations

from . import pages


def memory(engine) -> dict:
    """Bytes now: held by the admitted caches, by the decoded copies kept while prompts are read
    (``kept_decoded_bytes``, :meth:`kvslim.SlimCache.keep_decoded`), reserved for them, held by idle sessions in memory,
    the budget; ``fp16_bytes``: what plain fp16 caches of every token the admitted rows and the idle sessions hold
    would take (no window, no compression: the comparison a user makes); rows waiting and active; requests ended by a
    failure (``row_errors``); sessions kept in memory and parked on disk, and the session counters. A paged engine
    (``pages``) adds its pool: ``pool_bytes`` (every page, allocated up front), ``stage_bytes`` (the full-precision
    staging of each row's newest tokens and sinks), ``pages`` and ``free_pages``. The caller holds the engine's lock."""
    active = engine.scheduler.active
    sh = engine.shapes
    per_token = 2 * sh.n_layers * sh.n_kv_heads * (sh.k_head_dim + sh.v_head_dim)  # fp16 K + V, all layers
    tokens = sum(r.fed + max(len(r.tokens) - 1, 0) for r in active if r.cache is not None)
    tokens += sum(len(k.tokens) for k in engine.sessions.kept.values())
    out = {
        "cache_bytes": sum(r.cache.nbytes() for r in active if r.cache is not None),
        "kept_decoded_bytes": sum(r.cache.kept_nbytes() for r in active if r.cache is not None),
        "packed_weight_bytes": engine.linears.nbytes,
        "reserved_bytes": engine.scheduler.reserved,
        "session_bytes": engine.sessions.held(),
        "memory_budget": engine.scheduler.memory_budget,
        "fp16_bytes": tokens * per_token,
        "active": len(active),
        "waiting": len(engine.scheduler.waiting),
        "row_errors": engine.row_errors,
        "sessions_kept": len(engine.sessions.kept),
        "sessions_on_disk": engine.sessions.on_disk(),
        "prefilled_tokens": engine.prefilled_tokens,
        **{f"sessions_{k}": v for k, v in vars(engine.sessions.stats).items()},
    }
    if engine.pool is not None:
        out.update(pages.memory(engine.pool))
    return out
