"""Who may talk to the server: the Host check, the API key and the JSON content type, for every endpoint.

:class:`Guard` is a plain ASGI middleware in front of every route (unknown paths included), so no
endpoint can forget a check. In order:

1. **Host (421).** A server bound to loopback answers only requests whose ``Host`` header names loopback
   (``localhost``, ``127.x.x.x``, ``[::1]``, with an optional port). A web page the user visits can make the
   browser send requests to 127.0.0.1 through a name it controls that resolves there (DNS rebinding, the
   class of Ollama's CVE-2024-28224); such requests carry the page's host name, and are refused.
2. **API key (401).** With a key, every request carries ``Authorization: Bearer <key>``, compared in
   constant time (:func:`hmac.compare_digest`), so the answer's timing does not leak how much of a guess
   was right.
3. **Content type (415).** A POST must say ``Content-Type: application/json`` (parameters such as
   ``charset`` allowed). A page can POST ``text/plain`` cross-origin without the browser asking the server
   first (a "simple request"); ``application/json`` makes the browser send a CORS preflight, which this
   server does not grant.

This module knows no engine and no OpenAI fields; the body size limit is enforced where the body is read
(:func:`kvslim.serve.app.read_json`), since a chunked body declares no length.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable

from .errors import APIError

#: methods whose body is read as JSON
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a bind address or a host name, no port) names this machine's loopback: ``localhost``,
    an address in 127.0.0.0/8 or ``::1`` (brackets allowed)."""
    name = host.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_header_is_loopback(value: str) -> bool:
    """Whether a ``Host`` header value (``name[:port]``, ``[v6]:port``) names loopback."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return False
        name, rest = value[: end + 1], value[end + 1 :]
    else:
        name, _, port = value.partition(":")
        rest = ":" + port if _ else ""
    if rest and not (rest.startswith(":") and rest[1:].isdigit() and len(rest) <= 6):
        return False
    return is_loopback_host(name)


class Guard:
    """ASGI middleware: the Host, key and content-type checks above, before any route runs.

    api_key: the key every request must bear (None: none needed). loopback_only: refuse Host headers that
    do not name loopback (set when the server is bound to a loopback address). refused: called once per
    request refused here (the runner counts them)."""

    def __init__(self, app, *, api_key: str | None = None, loopback_only: bool = True,
                 refused: Callable[[], None] | None = None):
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise ValueError("api_key must be a non-empty string or None")
        self.app = app
        self.key = api_key.encode("utf-8") if api_key is not None else None
        self.loopback_only = loopback_only
        self.refused = refused

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self.check(scope)
            if err is not None:
                if self.refused is not None:
                    self.refused()
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        """The first refusal this request earns, or None."""
        headers: dict[bytes, list[bytes]] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), []).append(v)
        if self.loopback_only:
            hosts = headers.get(b"host", [])
            if len(hosts) > 1 or (hosts and not host_header_is_loopback(hosts[0].decode("latin-1"))):
                shown = hosts[0].decode("latin-1")[:100] if len(hosts) == 1 else f"{len(hosts)} Host headers"
                return APIError(
                    421,
                    f"Host {shown!r} is not a loopback name: this server listens on loopback only and answers "
                    "requests addressed to localhost, 127.0.0.1 or [::1] (a guard against DNS rebinding)",
                    code="misdirected_request",
                )
        if self.key is not None:
            auth = headers.get(b"authorization", [b""])
            scheme, _, given = auth[0].partition(b" ")
            ok = len(auth) == 1 and scheme.lower() == b"bearer"
            # compare_digest whatever the scheme said, so a bad scheme costs the same time as a bad key
            if not hmac.compare_digest(given.strip(), self.key) or not ok:
                return APIError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the server's "
                    "--api-key",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if scope.get("method") in _BODY_METHODS:
            types = headers.get(b"content-type", [])
            media = types[0].split(b";", 1)[0].strip().lower() if len(types) == 1 else b""
            if media != b"application/json":
                shown = types[0].decode("latin-1")[:100] if types else "none"
                return APIError(
                    415,
                    f"the request body must be JSON with 'Content-Type: application/json', got {shown!r}",
                    code="unsupported_media_type",
                )
        return None
