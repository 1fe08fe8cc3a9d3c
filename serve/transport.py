"""What stands between a client's socket and the routes of ``bdlora serve``: the listening socket, deadlines for a
request's head and body, the body size limit, the API key, the request counter and the 500 of last resort."""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import socket

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from bdlora.base.errors import UsageError
from bdlora.serve.metrics import Metrics
from bdlora.serve.protocol import error_body


class _TooLarge(StarletteHTTPException):
    """Raised from the body stream (an HTTPException, so FastAPI's body parsing passes it on unchanged)."""

    def __init__(self, limit: int):
        super().__init__(413, _too_large_message(limit))


class _TooSlow(StarletteHTTPException):
    def __init__(self, timeout: float):
        super().__init__(408, f"request body not received within {timeout:g} s (this server's --request-timeout)")


def _too_large_message(limit: int) -> str:
    return f"request body above this server's limit of {limit} bytes"


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse(error_body(_too_large_message(limit), param=None, code="request_too_large"),
                        status_code=413)


class BodyLimit:
    """ASGI middleware bounding request bodies: above ``limit`` bytes 413 (a declared Content-Length before anything
    is read, a chunked body as soon as it crosses the limit), and 408 when the whole body has not arrived within
    ``timeout`` seconds of the request head (a client trickling its body would otherwise hold a connection and a
    handler forever). Once the body is complete, reads pass through untouched (the handlers' disconnect checks)."""

    def __init__(self, app, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit)(scope, receive, send)
        seen, complete = 0, False
        deadline = asyncio.get_running_loop().time() + self.timeout

        async def limited():
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise _TooSlow(self.timeout) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge(self.limit)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited, send)


def _route_path(app: FastAPI, scope) -> str | None:
    """The route template serving ``scope`` (also for requests answered before routing: 401, 413), or None."""

    route = scope.get("route")
    if route is not None:
        return route.path
    for r in app.router.routes:
        if r.matches(scope)[0] != Match.NONE:
            return getattr(r, "path", None)
    return None


class Front:
    """The outermost middleware (pure ASGI: Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect
    from the endpoints, so abandoned requests would never be cancelled): the API key on ``/v1/*``, the request
    counter labelled by route template, and a 500 in OpenAI's error shape (logged) for anything unexpected."""

    def __init__(self, app, routes_of: FastAPI, metrics: Metrics, api_key: str | None):
        self.app, self.routes_of, self.metrics = app, routes_of, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    def _authorised(self, scope) -> bool:
        if self.expected is None or not scope["path"].startswith("/v1/"):
            return True
        return hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, started = 500, False

        async def watched_send(message):
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            if not self._authorised(scope):
                await JSONResponse(error_body("Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                                              param=None, code="invalid_api_key"), status_code=401)(
                    scope, receive, watched_send)
            else:
                await self.app(scope, receive, watched_send)
        except Exception as exc:  # noqa: BLE001  a bug, never a client's fault: say so, log it, count it

            logging.getLogger("bdlora.serve").exception("internal error on %s %s", scope["method"], scope["path"])
            if not started:
                await JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"),
                                   status_code=500)(scope, receive, watched_send)
        finally:
            self.metrics.observe_request(_route_path(self.routes_of, scope), status)


def head_deadline_protocol(timeout: float):
    """uvicorn's HTTP protocol (whichever it picks: httptools or h11) closing a connection that has not sent a
    complete request head within ``timeout`` seconds of connecting or of its previous response. uvicorn's own
    keep-alive timeout starts only after a response and stops at the first byte of the next request, so a client
    that connects and sends nothing, or trickles its headers, would hold its connection (a file descriptor and a
    task) for ever; enough of them and the server accepts nobody."""

    class HeadDeadline(AutoHTTPProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout, self._head_overdue)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_overdue(self) -> None:
            waiting_for_head = self.cycle is None or self.cycle.response_complete
            if waiting_for_head and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound here rather than by uvicorn, which reports a port in use with its own log lines
    and exit code 3 after the start-up banner."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: not an address this machine can listen on ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "in use (another server listens there)" if e.errno == errno.EADDRINUSE else e.strerror
        raise UsageError(f"--port {port}: cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


