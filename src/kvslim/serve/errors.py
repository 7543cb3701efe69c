"""Refusals in OpenAI's error shape, and what an error body may say.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx (or a documented 503)
status; the openai client turns these into its typed exceptions. An error body never carries a path on
the server: messages that come from below the HTTP layer (the engine's refusals and failure events) are
passed through :func:`scrub`, and a bug (an exception nobody refused on purpose) answers a generic 500
naming an id that the server log records with the traceback.
"""

from __future__ import annotations

import logging
import re
import uuid

from starlette.responses import JSONResponse

log = logging.getLogger("kvslim.serve")

#: an absolute path of two or more components (POSIX or a Windows drive), as a message may quote one
_PATH = re.compile(r"(?:\b[A-Za-z]:)?(?:[/\\][\w.~+@-]+){2,}[/\\]?")


class APIError(Exception):
    """A refusal: HTTP ``status``, OpenAI's error fields and extra response ``headers`` (Retry-After...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}
        self.counted = False  # the runner has counted this request's outcome already

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def scrub(message: str) -> str:
    """``message`` with every absolute path replaced by ``<path>``: the engine's messages may quote a file
    (a session file, a bias file, a model directory) that a client must not learn about."""
    return _PATH.sub("<path>", message)


def internal_error(exc: BaseException, where: str) -> APIError:
    """A bug answered as a 500 that names only an id; the traceback goes to the server log under that id
    (an exception's text may carry paths, and says nothing a client can act on)."""
    eid = f"err-{uuid.uuid4().hex[:12]}"
    log.error("internal error %s in %s", eid, where, exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, f"internal server error (id {eid}; the server log has the details)", type_="server_error")
