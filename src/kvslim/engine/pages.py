"""The engine's rows in one pool of pages (``Engine(pages=...)``): the pool, a row's handle, a request's checks.

By default every request of the :class:`~kvslim.engine.engine.Engine` has a :class:`~kvslim.SlimCache` of its own
and a step pays Python for every row in every layer. With ``pages`` every row's K/V lives in ONE
:class:`~kvslim.cache.pagepool.PagePool` (the vLLM plugin's pages, kvslim's formats byte for byte) and a step is
:func:`~kvslim.cache.paged_adapter.forward_pages`: two kernel calls a layer whatever the rows (docs/performance.md,
"Many rows in one pool of pages").

What changes for a request:

- one format for every row: the engine's default cache settings, which the pool stores (a request naming other
  settings is refused, :class:`~kvslim.engine.errors.SettingsRefusal`; so are the settings pages cannot store:
  :func:`kvslim.cache.pagepool.check_config`); a window keeps every key at its original position
  (``sink=N,window=W,positions=original``, :mod:`kvslim.cache.pagespec`), so a row still ends at the context;
- admission by pages: a row reserves ``ceil((prompt + max_new_tokens) / 32)`` pages when it is admitted, or with a
  window the most it can hold (its sink pages, its window and a prefill chunk: :func:`window_pages`; the scheduler's
  byte budget is the pool's pages), so a step never runs out of them;
- sessions are kept in memory: a session's row stays in the pool, its pages counted against the budget (dropped,
  least recently used first, when admission needs them); at most ``max_batch`` idle sessions (each holds a row's
  staging slots); no ``session_dir`` (parking pages on disk: not yet); any other finished row's pages go back;
- a forward that fails ends every row of it (the pool is put back as it was); there is no per-row drop as in the
  ragged step.

Greedy output of a request equals the request run alone through a paged engine, token for token
(:mod:`kvslim.cache.paged_adapter`), and each row's logits stay within the format's error of the SlimCache rows'.
"""

from __future__ import annotations

from ..cache.pagepool import PagedRow, PagePool, check_config, pool_for
from ..cache.pagespec import window_pages
from ..config import CacheConfig
from ..vllm.pages import PAGE_TOKENS
from .errors import BudgetRefusal, ContextRefusal, SettingsRefusal

#: the context assumed for ``pages="auto"`` when the model's config names none
DEFAULT_CONTEXT = 4096


class PooledCache:
    """A row's handle on the pool: what the engine reads of a row's cache (its bytes, its length) and how it
    gives its pages back."""

    __slots__ = ("pool", "row")

    def __init__(self, pool: PagePool, row: PagedRow):
        self.pool, self.row = pool, row

    def nbytes(self) -> int:
        """Bytes of the row's pages, every layer (the pool's staging is the pool's: :func:`memory`)."""
        return self.pool.nbytes(self.row)

    def kept_nbytes(self) -> int:
        return 0  # a paged prompt keeps no decoded copy between its chunks: its codes are read in the kernel

    def get_seq_length(self) -> int:
        return self.row.length

    @property
    def dtype(self):
        return self.pool.dtype

    def stores(self) -> tuple:
        """What the continuation rule reads of a kept session's cache: its K/V dtype (:meth:`SavedCache.of
        <kvslim.promptcache.SavedCache.of>`)."""
        return (self,)

    def release(self) -> None:
        """The row's pages back to the pool (once: a second call does nothing)."""
        if self.pool.is_alive(self.row):
            self.pool.free(self.row)


def pages_for(tokens: int) -> int:
    """Pages a row of ``tokens`` tokens holds (32 tokens a page)."""
    return -(-tokens // PAGE_TOKENS)


def build_pool(
    model, config: CacheConfig, pages, *, max_batch: int, memory_budget: int | None, context, rows: int, chunk: int
) -> PagePool:
    """The engine's pool of ``rows`` rows alive at most (decoding and kept for sessions): ``pages`` pages a layer (an
    int), or ``"auto"``: as many as ``memory_budget`` holds beside the staging pool, at most ``max_batch`` rows at the
    model's whole context (``context``; DEFAULT_CONTEXT when None). ValueError in one line for settings pages cannot
    store, or a budget that holds no page."""
    try:
        check_config(config)
    except ValueError as e:
        raise ValueError(f"pages: {e}") from None
    if pages == "auto":
        most = max_batch * pages_for(context or DEFAULT_CONTEXT)
        if config.window is not None:  # a windowed row holds at most its window and a chunk
            most = min(most, max_batch * window_pages(config, chunk))
        probe = pool_for(model, config, pages=1, max_rows=rows)
        if memory_budget is None:
            pages = most
        else:
            pages = (memory_budget - probe.stage_bytes()) // probe.page_bytes()
            if pages < 1:
                raise ValueError(
                    f"memory_budget {memory_budget} bytes holds no page of {config.to_spec()} beside the staging "
                    f"pool ({probe.stage_bytes()} bytes; a page is {probe.page_bytes()} bytes): raise the budget"
                )
            pages = min(pages, most)
        del probe
    elif memory_budget is not None:
        raise ValueError("give pages=N or memory_budget, not both: with pages=N the pool's pages are the budget")
    elif isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
        raise ValueError(f"pages must be a positive number of pages a layer, 'auto' or None, got {pages!r}")
    return pool_for(model, config, pages=pages, max_rows=rows)


def setup(
    model, config: CacheConfig, pages, *, compile, session_dir, max_sessions, max_batch, memory_budget, context, chunk
):
    """An engine's pool and what comes with it: ``(pool, its byte budget, the idle sessions kept at most, the
    compiled step or None)`` (:func:`build_pool`; ``compile``: True for a new
    :class:`~kvslim.cache.paged_compiled.CompiledStep`, a wrapper's name for a new one with that wrapper ("python",
    True's; "cpp"), or one of ``model``'s to share its graphs). ValueError in one line for what pages refuse."""
    from ..cache.paged_compiled import WRAPPERS, CompiledStep, wrapper_of

    if not (isinstance(compile, (bool, CompiledStep)) or compile in WRAPPERS):
        raise ValueError(
            f"compile must be True, False, a wrapper ({', '.join(map(repr, WRAPPERS))}) or a CompiledStep of the "
            f"model, got {compile!r}"
        )
    if isinstance(compile, CompiledStep) and compile.model is not model:
        raise ValueError("compile: that CompiledStep compiles another model's step: give True, or this model's")
    if pages is None:
        raise ValueError("compile compiles the paged step: give pages=N or pages='auto' as well")
    if session_dir is not None:
        raise ValueError("pages keep sessions in memory only: run without session_dir, or without pages")
    compiled = compile if isinstance(compile, CompiledStep) else None
    if compile is True or compile in WRAPPERS:  # ValueError in one line for a model it does not serve, before the pool
        compiled = CompiledStep(model, wrapper=wrapper_of(compile))
    if compiled is not None and (why := compiled.row_invariant()) is not None:
        raise ValueError(f"compile: {why}, so a row's tokens would depend on the rows decoding beside it")
    max_sessions = min(max_sessions or max_batch, max_batch)  # each kept row holds staging slots
    pool = build_pool(
        model, config, pages, max_batch=max_batch, memory_budget=memory_budget, context=context,
        rows=max_batch + max_sessions, chunk=chunk,
    )
    return pool, budget(pool), max_sessions, compiled


def check_request(request, gate, pool: PagePool, *, scheduler, chunk: int) -> int:
    """A request's checks in a paged engine; returns the bytes it reserves (its pages). Raises the ``gate``'s
    :class:`~kvslim.engine.errors.InputRefusal` (:meth:`Gate.check_input <kvslim.engine.gate.Gate.check_input>`),
    :class:`SettingsRefusal` (its own settings), :class:`ContextRefusal`, :class:`BudgetRefusal` (more pages than
    the pool has). chunk: the engine's ``prefill_chunk`` (a windowed row holds at most its window and a chunk)."""
    gate.check_input(request)
    default, context = gate.default_cache, gate.shapes.max_position_embeddings
    if request.cache is not None and request.cache != default:
        raise SettingsRefusal(
            f"this engine keeps every row in one pool of {default.to_spec()} pages: a request cannot bring its own "
            f"cache settings ({request.cache.to_spec()}); run the engine without pages to allow them"
        )
    total = len(request.prompt) + request.max_new_tokens
    if context is not None and total > context:
        raise ContextRefusal(
            f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) = {total} is past "
            f"the model's context of {context} tokens, and pages keep every key at its position: shorten it"
        )
    need = pages_for(total)
    bound = window_pages(pool.config, chunk)
    if bound is not None:
        need = min(need, bound)
    reserved = need * pool.page_bytes()
    if not scheduler.fits_alone(reserved):
        raise BudgetRefusal(
            f"this request needs {need} pages ({total} tokens, {PAGE_TOKENS} a page), more than the whole pool of "
            f"{pool.n_pages}: lower max_new_tokens or build the engine with more pages"
        )
    return reserved


def memory(pool: PagePool) -> dict:
    """The pool's figures for :meth:`Engine.memory <kvslim.engine.engine.Engine.memory>`."""
    return {
        "pool_bytes": budget(pool),
        "stage_bytes": pool.stage_bytes(),
        "pages": pool.n_pages,
        "free_pages": pool.free_pages,
    }


def budget(pool: PagePool) -> int:
    """The scheduler's byte budget in a paged engine: every page of the pool."""
    return pool.n_pages * pool.page_bytes()


__all__ = [
    "DEFAULT_CONTEXT", "PooledCache", "budget", "build_pool", "check_request", "memory", "pages_for", "setup",
]
