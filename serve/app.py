"""The HTTP app of ``bdlora serve`` (FastAPI on uvicorn): routes wired to the serving classes, error handlers that
answer in OpenAI's error shape, metrics, and the process lifecycle (load in the background, drain on SIGTERM, exit
non-zero if the engine dies).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer has a chat template),
``GET /v1/models``, ``GET /health`` (503 until the model is loaded, or once the engine has died),
``GET /metrics`` (Prometheus text format).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import signal
import socket
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from bdlora.errors import BdloraError, UsageError
from bdlora.runtime import check_onnx_dir
from bdlora.serve.config import DEFAULT_DRAIN_SECONDS, DEFAULT_HOST, DEFAULT_PORT, ServeConfig
from bdlora.serve.engine import Engine
from bdlora.serve.engine_process import EngineProcess
from bdlora.serve.genai_engine import GenaiEngine
from bdlora.serve.handlers import ChatServing, CompletionServing
from bdlora.serve.metrics import Metrics
from bdlora.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    error_body,
)


class _State:
    def __init__(self):
        self.engine: Engine | None = None
        self.load_error: str | None = None


async def _load(state: _State, loader, on_fatal) -> None:
    """Build the engine off the event loop; a failure (or an engine that dies later) reaches ``on_fatal``."""
    try:
        eng = await asyncio.to_thread(loader)
    except Exception as e:  # noqa: BLE001
        state.load_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if on_fatal is not None:  # a server that can never answer must not look alive
            on_fatal(f"could not load the model ({state.load_error})")
        return
    if on_fatal is not None:
        def engine_died(message: str) -> None:
            on_fatal(f"the generation engine stopped ({message}); exiting so a supervisor can restart the server")

        eng.on_fatal = engine_died
        if eng.error is not None:  # died before we could listen
            engine_died(eng.error)
    state.engine = eng


def engine_class(runtime: str) -> type[Engine]:
    if runtime == "genai":
        return GenaiEngine
    return Engine


def default_engine(cfg: ServeConfig):
    """The server's engine: onnxruntime in-process (its calls release the GIL, so the event loop runs beside them);
    onnxruntime-genai in a child process (its calls keep the GIL for a whole model step: see engine_process)."""
    if cfg.runtime != "genai":
        return Engine(cfg.onnx_dir, cfg.onnx_file, cfg.max_batch, cfg.threads)

    return EngineProcess(engine_class("genai"), cfg.onnx_dir, cfg.onnx_file, cfg.max_batch, cfg.threads,
                         waiting_served_ratio=cfg.waiting_served_ratio, max_waiting_steps=cfg.max_waiting_steps)


def create_app(cfg: ServeConfig, loader=None, on_fatal=None) -> FastAPI:
    """The ASGI app. ``loader()`` builds the Engine (default: from ``cfg``); it runs in a thread after start-up,
    and /health answers 503 until it returns. ``on_fatal(message)`` is called once if loading fails or the
    engine's worker dies (``serve`` then stops the process with a non-zero exit, so a supervisor restarts it)."""
    state = _State()
    metrics = Metrics(lambda: state.engine)
    loader = loader or (lambda: default_engine(cfg))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_load(state, loader, on_fatal))
        yield
        task.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    docs = {} if cfg.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="bdlora serve", lifespan=lifespan, **docs)
    app.state.bdlora = state
    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes, timeout=cfg.request_timeout)
    app.add_middleware(Front, routes_of=app, metrics=metrics, api_key=cfg.api_key)  # outermost: counts 401s, 413s
    _add_error_handlers(app)
    refs = (cfg, lambda: state.engine, metrics, lambda: state.load_error)
    completions, chat = CompletionServing(*refs), ChatServing(*refs)

    @app.post("/v1/completions", openapi_extra=request_schema(CompletionRequest))
    async def v1_completions(request: Request):
        return await completions(await parse_body(CompletionRequest, request), request)

    @app.post("/v1/chat/completions", openapi_extra=request_schema(ChatCompletionRequest))
    async def v1_chat_completions(request: Request):
        return await chat(await parse_body(ChatCompletionRequest, request), request)

    add_schemas(app, (CompletionRequest, ChatCompletionRequest))

    @app.get("/v1/models")
    async def v1_models():
        return ModelList(data=[ModelCard(id=cfg.model_name)])

    @app.get("/health")
    async def health():
        eng = state.engine
        if eng is not None and eng.error is None:
            return {"status": "ok", "model": cfg.model_name, "active": eng.active, "waiting": eng.waiting}
        detail = state.load_error or (eng.error if eng else None)
        return JSONResponse({"status": "error" if detail else "loading", "error": detail}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        body, media_type = metrics.render()
        return Response(body, media_type=media_type)

    return app


async def parse_body(model: type[BaseModel], request: Request):
    """The request body validated off the event loop: a body of up to --max-request-bytes (100k chat messages, a
    million token ids) takes pydantic a while, and the loop must keep answering the other requests meanwhile."""
    raw = await request.body()
    try:
        return await asyncio.to_thread(_validate, model, raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_input=False, include_context=False)) from None


def _validate(model: type[BaseModel], raw: bytes) -> BaseModel:
    try:  # Python's parser, as FastAPI's own: it keeps a lone surrogate escape for the field validator to name
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the recursion limit
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}]) \
            from None
    return model.model_validate(obj)


def request_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses its body itself (``parse_body``); ``add_schemas`` puts the
    model in the document's components."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_schemas(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """FastAPI documents the models of typed body parameters only: add those ``parse_body`` reads itself."""
    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            found = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                doc = m.model_json_schema(ref_template="#/components/schemas/{model}")
                found.update(doc.pop("$defs", {}))
                found[m.__name__] = doc
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


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


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):  # 404, 405, unparseable bodies
        code = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "request_too_large"}.get(exc.status_code,
                                                                                         "invalid_request")
        return JSONResponse(error_body(str(exc.detail), param=None, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {"msg": "invalid request", "loc": ()}
        # pydantic names the union member it tried ("function-after[...]", "list[int]"): keep field names and indices
        loc = [str(x) for x in e.get("loc", ()) if x != "body" and (isinstance(x, int) or str(x).isidentifier())]
        message = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if e.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        elif e.get("type") == "extra_forbidden":
            msg = f"unrecognized request argument supplied: {loc[-1] if loc else '?'}"
        else:
            msg = f"{'.'.join(loc) or 'body'}: {message}"
        return JSONResponse(error_body(msg, param=".".join(loc) or None, code=e.get("type")), status_code=400)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)


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


def serve(cfg: ServeConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          drain_seconds: int = DEFAULT_DRAIN_SECONDS, log_level: str = "info", sock: socket.socket | None = None) \
        -> None:
    """Run the server until SIGINT/SIGTERM; on either, stop accepting, finish in-flight requests (up to
    ``drain_seconds``), then exit. If the engine dies, stop and raise (exit 1)."""

    check_onnx_dir(Path(cfg.onnx_dir), cfg.onnx_file, cfg.runtime)
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:  # from the engine's worker thread: stop serving, exit non-zero below
        fatal.append(message)
        if server is not None:
            server.should_exit = True

    sock = sock or listening_socket(host, port)  # before any log line: a port in use is one line and exit 2
    app = create_app(cfg, on_fatal=on_fatal)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=drain_seconds, access_log=False,
                                           http=head_deadline_protocol(cfg.request_timeout)))
    # uvicorn drains on SIGTERM, then re-raises the signal it caught under the handler that was there before it
    # started. A no-op handler makes a completed drain an ordinary exit (status 0), which is what process
    # supervisors expect after a graceful stop; SIGINT keeps its KeyboardInterrupt (exit 130). uvicorn catches
    # SIGINT even when the server was started with it ignored (a background job of a non-interactive shell), so it
    # still drains and stops; the handler is made Python's own for that re-raise, else such a stop would exit 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    if fatal:
        raise BdloraError(fatal[0])


__all__ = ["APIError", "ServeConfig", "create_app", "serve"]
