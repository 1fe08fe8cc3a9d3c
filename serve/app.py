"""The HTTP app of ``bdlora serve`` (FastAPI on uvicorn): routes wired to the serving classes, error handlers that
answer in OpenAI's error shape, metrics, and the process lifecycle (load in the background, drain on SIGTERM, exit
non-zero if the engine dies).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer has a chat template),
``GET /v1/models``, ``GET /health`` (503 until the model is loaded, or once the engine has died),
``GET /metrics`` (Prometheus text format).
"""

from __future__ import annotations

import asyncio
import json
import re
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

from bdlora.base.errors import BdloraError
from bdlora.models.runtime import check_onnx_dir
from bdlora.serve.config import DEFAULT_DRAIN_SECONDS, DEFAULT_HOST, DEFAULT_PORT, ServeConfig
from bdlora.serve.engine import Engine
from bdlora.serve.engine_process import EngineProcess
from bdlora.serve.genai_engine import GenaiEngine
from bdlora.serve.handlers import ChatServing, CompletionServing
from bdlora.serve.interface import ServingEngine
from bdlora.serve.metrics import Metrics
from bdlora.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    error_body,
)
from bdlora.serve.transport import BodyLimit, Front, head_deadline_protocol, listening_socket


class _State:
    def __init__(self):
        self.engine: ServingEngine | None = None
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
        return Engine(cfg.onnx_dir, cfg.onnx_file, cfg.max_batch, cfg.pool.threads, speculation=cfg.speculation)

    return EngineProcess(engine_class("genai"), cfg.onnx_dir, cfg.onnx_file, cfg.max_batch, cfg.pool.threads,
                         waiting_served_ratio=cfg.waiting_served_ratio, max_waiting_steps=cfg.max_waiting_steps,
                         speculation=cfg.speculation)


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
    large = asyncio.Semaphore(1)  # large bodies are parsed one at a time (see parse_body)

    @app.post("/v1/completions", openapi_extra=request_schema(CompletionRequest))
    async def v1_completions(request: Request):
        return await completions(await parse_body(CompletionRequest, request, completions.body_bounds(), large),
                                 request)

    @app.post("/v1/chat/completions", openapi_extra=request_schema(ChatCompletionRequest))
    async def v1_chat_completions(request: Request):
        return await chat(await parse_body(ChatCompletionRequest, request, chat.body_bounds(), large), request)

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


# A body's JSON string literals (escapes included), blanked before its structure is counted: a "[" or "," inside a
# prompt's text is no list and no item. Linear: no alternative can match the same text two ways.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
LARGE_BODY = 256 * 1024  # bytes: bodies this large are parsed one at a time


def body_structure(raw: bytes) -> tuple[int, int]:
    """(containers, separators): the lists and objects, and the commas, a JSON body holds outside its strings,
    counted in C over the bytes (3 MB in ~4 ms) without building anything. Every list item or object member
    after the first needs a comma, so these bound the Python objects that parsing the body would make."""
    containers, separators = raw.count(b"[") + raw.count(b"{"), raw.count(b",")
    if b'"' in raw:  # strings may hold brackets and commas: count again without them
        bare = _STRING.sub(b'""', raw)
        containers, separators = bare.count(b"[") + bare.count(b"{"), bare.count(b",")
    return containers, separators


async def parse_body(model: type[BaseModel], request: Request, bounds: tuple[int, int] | None = None,
                     one_at_a_time: asyncio.Semaphore | None = None):
    """The request body, refused from its structure before it is parsed when it holds more lists and objects, or
    more items, than ``bounds`` (the most a valid request to this server can hold: a body of [[5]] * 600,000 made
    600k Python lists, 2 GB and half a second of the interpreter per request); then parsed and validated off the
    event loop, bodies of LARGE_BODY bytes or more one at a time under ``one_at_a_time`` (the JSON parser and
    pydantic hold the interpreter for a whole call: several at once left the loop almost no turns)."""
    raw = await request.body()
    if bounds is not None and len(raw) > 1024:  # a small body cannot hold much: no need to count
        containers, separators = body_structure(raw)
        most_containers, most_items = bounds
        if containers > most_containers or separators >= most_items:
            what = (f"{containers:,} lists and objects, more than the {most_containers:,}"
                    if containers > most_containers else f"{separators + 1:,} items, more than the {most_items:,}")
            raise APIError(413, f"request body: {what} a valid request to this server can hold (see --max-prompts "
                                "and --max-prompt-tokens)", None, "request_too_large")
    try:
        if one_at_a_time is None or len(raw) < LARGE_BODY:
            return await asyncio.to_thread(_validate, model, raw)
        async with one_at_a_time:
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
