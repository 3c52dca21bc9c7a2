"""`Guard`: the ASGI middleware in front of every route. It checks the API key, refuses a body
past the size limit before reading it, and names the replica that answered.

A plain ASGI middleware, not Starlette's `BaseHTTPMiddleware`: that one wraps `receive`, and
behind it a handler's `request.is_disconnected()` never saw its client leave (a non-streamed
request then ran to its end). The body is read here, at most `max_body_bytes` of it, and
replayed to the app; after the replay, `receive` is the server's own again.

The key: `Authorization: Bearer KEY` (the scheme in any case, as RFC 9110 says), or HTTP Basic
with KEY as the password (any user name). A 401 asks for Basic (`WWW-Authenticate`), so a
browser opening `/viz` prompts for the key once and then sends it with the page's own calls.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from specdecode.server.errors import APIError
from specdecode.server.limits import MAX_BODY_BYTES, PUBLIC_PATHS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REPLICA_HEADER = "x-specdecode-replica"  # which replica answered
_CHALLENGE = 'Basic realm="specdecode", charset="UTF-8"'


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """api_key: when set, every route but `public_paths` needs it.
    public_paths: exact paths open without the key.
    max_body_bytes: the largest request body read; a longer one is a 413.
    replica_id: when set, every response carries it in the `x-specdecode-replica` header."""

    api_key: str | None = None
    public_paths: tuple[str, ...] = PUBLIC_PATHS
    max_body_bytes: int = MAX_BODY_BYTES
    replica_id: str | None = None


class Guard:
    """Wraps the app `app` with the checks `config` asks for."""

    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.config.replica_id is not None:
            send = _with_header(send, REPLICA_HEADER, self.config.replica_id)
        if not self._authorized(scope):
            error = APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                None,
                "invalid_api_key",
            )
            await _answer(send, error, {"www-authenticate": _CHALLENGE})
            return
        limit = self.config.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _answer(send, _too_large(int(declared), limit))
            return
        body = await _read_body(receive, limit)
        if body is None:
            await _answer(send, _too_large(None, limit))
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        key = self.config.api_key
        if key is None or scope["path"] in self.config.public_paths:
            return True
        given = _credential(_header(scope, b"authorization") or "")
        return given is not None and hmac.compare_digest(given.encode(), key.encode())


def _credential(header: str) -> str | None:
    """The key an Authorization header carries: Bearer's token, or Basic's password."""
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2]
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _read_body(receive: Receive, limit: int) -> list[Message] | None:
    """The request's messages up to the body's end (or a disconnect); None past `limit`
    bytes, without reading further."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        size += len(message.get("body", b""))
        if size > limit:
            return None
        if not message.get("more_body", False):
            return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` giving `messages` first, then the server's own (a disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _with_header(send: Send, name: str, value: str) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message.setdefault("headers", [])
            message["headers"] = [*message["headers"], (name.encode(), value.encode("latin-1"))]
        await send(message)

    return sending


def _too_large(declared: int | None, limit: int) -> APIError:
    size = f"is {declared} bytes" if declared is not None else "goes past the limit"
    return APIError(
        413,
        f"the request body {size}; this server reads at most {limit} bytes (serve --max-body-mib)",
        "invalid_request_error",
        None,
        "request_too_large",
    )


async def _answer(send: Send, error: APIError, headers: dict[str, str] | None = None) -> None:
    """Send `error` as the whole response, with `headers` added."""
    response = error.response()
    for name, value in (headers or {}).items():
        response.headers[name] = value
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})
