"""``kvslim serve``: an OpenAI-compatible HTTP server over the batch engine (:mod:`kvslim.engine`).

:mod:`.runner` drives the engine on one thread and hands events to the HTTP handlers; :mod:`.app` is the
HTTP side only (OpenAI's shapes, SSE, errors) and knows no tensors. Needs the ``serve`` extra
(``pip install "kvslim[serve]"``: starlette + uvicorn); importing :mod:`kvslim` never imports it.

From Python::

    from kvslim.serve import build_app
    app = build_app(model, tokenizer, model_name="mine", cache="int4,sink=4,window=1020")
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations


def build_app(
    model,
    tokenizer,
    *,
    model_name: str,
    cache="none",
    memory_budget: int | None = None,
    max_concurrency: int = 16,
    prefill_chunk: int = 256,
    session_dir=None,
    stop_ids=(),
    default_max_tokens: int = 256,
):
    """The ASGI app serving ``(model, tokenizer)``: a :class:`~kvslim.engine.Engine` (cache, memory_budget,
    max_batch=max_concurrency, prefill_chunk, session_dir) on a :class:`~.runner.Runner` thread, started and
    stopped with the app. The runner is ``app.state.runner``."""
    from .app import create_app
    from .runner import Runner

    runner = Runner.from_model(
        model,
        cache=cache,
        memory_budget=memory_budget,
        max_batch=max_concurrency,
        prefill_chunk=prefill_chunk,
        session_dir=session_dir,
    )
    app = create_app(
        runner, tokenizer, model_name=model_name, stop_ids=stop_ids, default_max_tokens=default_max_tokens
    )
    app.state.runner = runner
    return app


__all__ = ["build_app"]
