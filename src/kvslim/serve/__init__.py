"""``kvslim serve``: an OpenAI-compatible HTTP server over the batch engine (:mod:`kvslim.engine`).

:mod:`.runner` drives the engine on one thread and hands events to the HTTP handlers; :mod:`.app` is the
HTTP side (endpoints, SSE) over :mod:`.openai` (request fields), :mod:`.shapes` (responses, logprobs),
:mod:`.stops` (stop strings), :mod:`.security` (Host, API key, content type) and :mod:`.errors`; it knows no
tensors. :mod:`.shutdown` runs uvicorn with a bounded, session-parking shutdown; :mod:`.defaults` holds the
server's defaults (the memory budget derived from the machine). Needs the ``serve`` extra
(``pip install "kvslim[serve]"``: starlette + uvicorn); importing :mod:`kvslim` never imports it.

From Python::

    from kvslim.serve import build_app
    app = build_app(model, tokenizer, model_name="mine", cache="int8", memory_budget=2 << 30)
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

from .defaults import (
    DEFAULT_CACHE,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_TTL,
    DEFAULT_SHUTDOWN_GRACE,
    MAX_BODY,
)


def build_app(
    model,
    tokenizer,
    *,
    model_name: str,
    cache=DEFAULT_CACHE,
    memory_budget: int | None = None,
    max_concurrency: int = 16,
    prefill_chunk: int = 128,
    session_dir=None,
    stop_ids=(),
    default_max_tokens: int = 256,
    max_queue: int | None = DEFAULT_MAX_QUEUE,
    max_prompt_tokens: int | None = None,
    max_sessions: int | None = DEFAULT_MAX_SESSIONS,
    session_ttl: float | None = DEFAULT_SESSION_TTL,
    api_key: str | None = None,
    bind_host: str = "127.0.0.1",
    max_body: int = MAX_BODY,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
    allow_other_model: bool = False,
    linears: str = "auto",
    pages: int | str | None = None,
    compile: bool | str = False,
):
    """The ASGI app serving ``(model, tokenizer)``: a :class:`~kvslim.engine.Engine` (cache, memory_budget,
    max_batch=max_concurrency, prefill_chunk, session_dir, max_queue, max_prompt_tokens — None: the model's
    context —, max_sessions, session_ttl in seconds) on a :class:`~.runner.Runner` thread, started with the
    app and drained at its shutdown (``shutdown_grace`` seconds for what is in flight, then idle sessions
    parked). api_key: the Bearer key every request must bear (None: none). bind_host: the address the
    server listens on; when it is loopback (the default), requests whose Host header names anything but
    loopback are refused (421), so pass the real address when binding elsewhere. max_body: the largest
    request body, bytes. allow_other_model: take a ``mean_center`` bias file calibrated for another model (the
    engine reads and checks it once, here). linears: the engine's route for the model's linear layers
    (:mod:`kvslim.engine.linears`). pages: every request's cache in one pool of pages (:mod:`kvslim.engine.pages`;
    None: a cache of its own each). compile: with ``pages``, decode steps through the compiled paged step
    (:mod:`kvslim.cache.paged_compiled`; True or ``"python"``, or ``"cpp"`` for Inductor's C++ wrapper; call the
    engine's ``warm_up()`` before serving to compile every bucket first). The runner is ``app.state.runner``."""
    from .app import create_app
    from .runner import Runner
    from .security import is_loopback_host

    if max_prompt_tokens is None:  # the model's context: longer prompts only through a windowed cache, on request
        from ..shapes import ModelShapes

        max_prompt_tokens = ModelShapes.from_config(model.config).max_position_embeddings
    runner = Runner.from_model(
        model,
        cache=cache,
        memory_budget=memory_budget,
        max_batch=max_concurrency,
        prefill_chunk=prefill_chunk,
        session_dir=session_dir,
        max_queue=max_queue,
        max_prompt_tokens=max_prompt_tokens,
        max_sessions=max_sessions,
        session_ttl=session_ttl,
        allow_other_model=allow_other_model,
        linears=linears,
        pages=pages,
        compile=compile,
    )
    app = create_app(
        runner,
        tokenizer,
        model_name=model_name,
        stop_ids=stop_ids,
        default_max_tokens=default_max_tokens,
        api_key=api_key,
        loopback_only=is_loopback_host(bind_host),
        max_body=max_body,
        shutdown_grace=shutdown_grace,
    )
    app.state.runner = runner
    return app


__all__ = ["build_app"]
