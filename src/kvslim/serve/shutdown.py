"""uvicorn with a shutdown that loses nothing and takes a bounded time.

uvicorn's own first Ctrl-C / SIGTERM waits for every open connection with no limit, so one stream of
100,000 tokens holds the server up; its second Ctrl-C skips the app's shutdown (nothing is parked); and
after a signal it re-raises the signal once done, so the process ends by SIGTERM or KeyboardInterrupt
rather than with exit status 0. :class:`GracefulServer` changes that:

- **first signal**: stop admitting (new requests: 503), drain the runner on a thread
  (:meth:`~kvslim.serve.runner.Runner.drain`: in-flight requests get ``grace`` seconds, then end with an
  error event, then every idle session is parked); uvicorn closes its sockets and waits for the
  connections, at most ``grace`` + :data:`MARGIN` seconds, then cancels what is left.
- **second signal**: stop waiting for connections (uvicorn's force exit) and hurry the drain, which still
  parks; the app's own shutdown (which uvicorn skips on a force exit) still runs, bounded.
- the signal is not re-raised: :func:`run_server` returns once every session is parked, and the CLI exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import uvicorn

log = logging.getLogger("kvslim.serve")

#: seconds past the grace uvicorn waits for connections to close (the cancel events still to be sent)
MARGIN = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose signals drain ``runner`` (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, runner, grace: float):
        config.timeout_graceful_shutdown = grace + MARGIN
        super().__init__(config)
        self.runner, self.grace = runner, grace
        self.signals = 0
        self._drains: list[threading.Thread] = []

    def handle_exit(self, sig, frame) -> None:  # called in the main thread, between bytecodes: no waiting here
        self.signals += 1
        self.should_exit = True
        if self.signals > 1:
            self.force_exit = True  # stop waiting for connections; the drain below still parks
            log.warning("second signal: ending every request now and parking idle sessions")
        grace = self.grace if self.signals == 1 else 0.0
        t = threading.Thread(target=self._drain, args=(grace,), name="kvslim-drain", daemon=True)
        self._drains.append(t)
        t.start()

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the app's shutdown then; ours is bounded (the drain is hurried)
            await self.lifespan.shutdown()

    def _drain(self, grace: float) -> None:
        try:
            self.runner.drain(grace)
        except Exception:  # noqa: BLE001 - logged; run_and_park drains again
            log.exception("draining the engine failed")

    def run_and_park(self, timeout: float = 30.0) -> None:
        """``run`` until a signal (or ``should_exit``), then make sure the runner is drained and every idle
        session parked — a forced exit skips the app's own shutdown — waiting at most ``timeout`` seconds
        for a drain already under way. Signals while parking are logged, not obeyed."""
        try:
            self.run()
        finally:
            with _signals_only_logged():  # a signal now would cut the parking of sessions short
                for t in self._drains:
                    t.join(timeout)
                self.runner.drain(0.0)


def run_server(app, *, host: str, port: int, grace: float, log_level: str = "warning") -> GracefulServer:
    """Serve ``app`` (from :func:`kvslim.serve.build_app`) on ``host:port`` until a signal; returns after a
    bounded shutdown with every idle session parked."""
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), app.state.runner, grace)
    server.run_and_park()
    return server


@contextlib.contextmanager
def _signals_only_logged():
    """While sessions are parked after the server stopped: SIGINT / SIGTERM are logged, not raised (in the
    main thread only; ``kill -9`` still stops the process)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _log_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _log_signal(sig, frame) -> None:
    log.warning("signal %s: still parking idle sessions (kill -9 stops now and loses them)", sig)
