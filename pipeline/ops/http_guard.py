"""What the sandbox service's HTTP server refuses before a request handler runs.

The service runs on uvicorn (an established ASGI server) with its h11 protocol, whose own
settings bound the request head's size (`h11_max_incomplete_event_size`), the idle time
between requests (`timeout_keep_alive`) and reject a malformed or negative Content-Length
(400). uvicorn has no deadline for a request head nor for a body, and no cap on
connections (its `limit_concurrency` answers 503 only once a head has arrived, so it
bounds nothing against connections that never send one). Those three are added here at
uvicorn's extension points, a protocol class (`Config(http=...)`) and an ASGI middleware,
rather than by a server of our own:

- `ConnectionGuard` + `guarded_protocol`: a connection must deliver a complete request
  head within `header_timeout_s` of opening (or of its previous response), else it is
  closed: trickling one header byte at a time (slowloris) keeps no connection. At most
  `max_connections` are open; one beyond closes the oldest connection still waiting for
  its head (so a flood of half-open connections cannot lock out honest clients, whose
  heads arrive at once), or the newcomer when every connection is busy with a request.
- `RequestGuard`: the token is checked on the head alone (401/403 without reading a byte
  of the body); a declared Content-Length above `max_body_bytes` is 413 at once, a
  chunked body is 413 as soon as it passes the limit, and a body that has not arrived
  within `body_timeout_s` of its head is 408. Every refusal closes the connection, so an
  unread body is never drained.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from pipeline.errors import check

MIB = 1 << 20
# h11's own default: far above any honest head (a few hundred bytes), and the most one
# connection can make the server hold before its head is complete.
MAX_HEADER_BYTES = 16 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class HttpLimits:
    """What one client may hold of the server (defaults: docs/sandbox.md).

    max_body_bytes: the largest request body (a program and its stdin); 413 beyond.
    header_timeout_s: seconds from a connection's opening (or its previous response) to
        the end of its request head; the connection is closed past it.
    body_timeout_s: seconds from the end of a head to the end of its body; 408 past it.
    idle_timeout_s: seconds an idle keep-alive connection is kept (uvicorn's own).
    max_connections: connections open at once (each holds a socket and up to a body).
    """

    max_body_bytes: int = 4 * MIB
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0
    max_connections: int = 256

    def __post_init__(self) -> None:
        check(self.max_body_bytes >= 1024, "--max-body-kb", self.max_body_bytes // 1024, ">= 1")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            flag = "--" + name.removesuffix("_s").replace("_", "-")
            check(0 < value <= 3600, flag, value, "0 < seconds <= 3600")
        check(self.max_connections >= 1, "--max-connections", self.max_connections, ">= 1")


class ConnectionGuard:
    """The head deadline and the connection cap, shared by every connection's protocol.
    Touched only on the event loop's thread (protocol callbacks and handlers)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.open: set[Any] = set()  # connections not being closed by us
        # Connections waiting for a request head, oldest first, with their deadline.
        self.waiting: dict[Any, asyncio.TimerHandle] = {}
        self.counters = {
            "closed_head_timeout": 0,
            "closed_for_newer": 0,
            "refused_connection": 0,
            "refused_body_timeout": 0,
            "refused_too_large": 0,
            "refused_token": 0,
        }

    def opened(self, conn: Any) -> None:
        self.open.add(conn)
        if len(self.open) > self.limits.max_connections:
            if self.waiting:
                self._close(next(iter(self.waiting)), "closed_for_newer")
            else:
                self._close(conn, "refused_connection")
                return
        self.await_head(conn)

    def await_head(self, conn: Any) -> None:
        self.head_arrived(conn)
        timer = conn.loop.call_later(
            self.limits.header_timeout_s, self._close, conn, "closed_head_timeout"
        )
        self.waiting[conn] = timer

    def head_arrived(self, conn: Any) -> None:
        timer = self.waiting.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def closed(self, conn: Any) -> None:
        self.head_arrived(conn)
        self.open.discard(conn)

    def _close(self, conn: Any, why: str) -> None:
        self.counters[why] += 1
        self.closed(conn)
        conn.transport.close()

    def health(self) -> dict[str, int]:
        return {"connections": len(self.open), **self.counters}


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, with `guard`'s head deadline and connection cap."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            guard.opened(self)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(self)
            super().connection_lost(exc)

        def handle_events(self) -> None:
            # A new request cycle is the sign its head is complete (h11 parsed it).
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:
                guard.head_arrived(self)

        def on_response_complete(self) -> None:
            # The next head's deadline starts now; a pipelined request that `super`
            # handles at once cancels it again.
            if not self.transport.is_closing():
                guard.await_head(self)
            super().on_response_complete()

    return GuardedH11Protocol


class Refused(Exception):
    """A request refused before the application saw it."""

    def __init__(self, status: int, message: str, counter: str, **headers: str) -> None:
        super().__init__(message)
        self.status, self.message, self.counter, self.headers = status, message, counter, headers


class RequestGuard:
    """ASGI middleware: the token, then the body (size and deadline), then `app`, which
    gets the whole body at once. `open_paths`: paths served without a token."""

    def __init__(
        self,
        app: ASGIApp,
        guard: ConnectionGuard,
        *,
        token: str | None,
        token_help: str,
        open_paths: tuple[str, ...],
    ) -> None:
        self.app = app
        self.guard = guard
        self.limits = guard.limits
        self.expected = f"Bearer {token}".encode() if token else None
        self.token_help = token_help
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        try:
            for check_head in (self._check_token, self._check_length):
                check_head(scope, headers)
            body = await self._read_body(receive)
        except Refused as refused:
            self.guard.counters[refused.counter] += 1
            await _reply(send, refused)
            return
        if body is None:  # the client went away
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check_token(self, scope: Scope, headers: dict[bytes, bytes]) -> None:
        # Constant-time, so the compare leaks no prefix length.
        if self.expected is None or scope["path"] in self.open_paths:
            return
        given = headers.get(b"authorization")
        if not given:
            raise Refused(
                401,
                "this service needs a token: send 'Authorization: Bearer <token>' with "
                f"{self.token_help}",
                "refused_token",
                **{"www-authenticate": "Bearer"},
            )
        if not hmac.compare_digest(given, self.expected):
            raise Refused(
                403,
                "the token is not the one this service was started with; allowed: "
                f"'Authorization: Bearer <token>' with {self.token_help}",
                "refused_token",
            )

    def _check_length(self, _scope: Scope, headers: dict[bytes, bytes]) -> None:
        # h11 has refused a Content-Length that is not a non-negative integer (400).
        declared = headers.get(b"content-length")
        if declared is not None and int(declared) > self.limits.max_body_bytes:
            raise self._too_large(f"Content-Length {int(declared)}")

    def _too_large(self, what: str) -> Refused:
        limit = self.limits.max_body_bytes
        return Refused(
            413,
            f"the request body ({what}) is larger than this service takes; allowed: at most "
            f"{limit} bytes ({limit // 1024} KiB, its --max-body-kb)",
            "refused_too_large",
        )

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None when the client disconnected first."""
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.limits.max_body_bytes:
                        raise self._too_large(f"{size} bytes so far, chunked")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise Refused(
                408,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                f"of its head ({size} bytes came); allowed: a whole body within the "
                "service's --body-timeout",
                "refused_body_timeout",
            ) from None


async def _reply(send: Send, refused: Refused) -> None:
    """A JSON refusal (FastAPI's {"detail": ...} shape) that closes the connection."""
    body = json.dumps({"detail": refused.message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((k.encode(), v.encode()) for k, v in refused.headers.items()),
    ]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
