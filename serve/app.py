"""The HTTP app of ``bdlora serve`` (FastAPI on uvicorn): routes wired to the serving classes, error handlers that
answer in OpenAI's error shape, metrics, and the process lifecycle (load in the background, drain on SIGTERM, exit
non-zero if the engine dies).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer has a chat template),
``GET /v1/models``, ``GET /health`` (503 until the model is loaded, or once the engine has died),
``GET /metrics`` (Prometheus text format).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from bdlora.serve.config import ServeConfig
from bdlora.serve.engine import Engine
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


def create_app(cfg: ServeConfig, loader=None, on_fatal=None) -> FastAPI:
    """The ASGI app. ``loader()`` builds the Engine (default: from ``cfg``); it runs in a thread after start-up,
    and /health answers 503 until it returns. ``on_fatal(message)`` is called once if the engine's worker dies
    (``serve`` stops the process with a non-zero exit, so a supervisor restarts it)."""
    state = _State()
    metrics = Metrics(lambda: state.engine)
    loader = loader or (lambda: Engine(cfg.onnx_dir, cfg.onnx_file, cfg.max_batch, cfg.threads))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async def load():
            try:
                eng = await asyncio.to_thread(loader)
            except Exception as e:  # noqa: BLE001
                state.load_error = f"{type(e).__name__}: {e}"
                return
            if on_fatal is not None:
                eng.on_fatal = on_fatal
                if eng.error is not None:  # died before we could listen
                    on_fatal(eng.error)
            state.engine = eng

        task = asyncio.create_task(load())
        yield
        task.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="bdlora serve", lifespan=lifespan)
    app.state.bdlora = state
    _add_error_handlers(app, metrics)
    refs = (cfg, lambda: state.engine, metrics, lambda: state.load_error)
    completions, chat = CompletionServing(*refs), ChatServing(*refs)

    @app.post("/v1/completions")
    async def v1_completions(body: CompletionRequest, request: Request):
        return await completions(body, request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat(body, request)

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


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.observe_request(getattr(route, "path", None), response.status_code)
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        elif e.get("type") == "extra_forbidden":
            msg = f"unrecognized request argument supplied: {loc[-1] if loc else '?'}"
        else:
            msg = f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid value')}"
        return JSONResponse(error_body(msg, param=".".join(loc) or None, code=e.get("type")), status_code=400)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):  # a bug, never a client's fault: say so
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


def check_onnx_dir(path: Path, onnx_file: str) -> None:
    """Fail fast (before the server starts) on a folder that cannot be served."""
    from bdlora.errors import ModelError

    if not path.is_dir():
        raise ModelError(f"{path}: no such folder (pass a `bdlora export onnx` output)")
    for need in (onnx_file, "config.json"):
        if not (path / need).exists():
            raise ModelError(f"{path}: no {need} (pass a `bdlora export onnx` output)")
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelError(f"{path}: no tokenizer files")


def serve(cfg: ServeConfig, host: str = "127.0.0.1", port: int = 8000, drain_seconds: int = 30,
          log_level: str = "info") -> None:
    """Run the server until SIGINT/SIGTERM; on either, stop accepting, finish in-flight requests (up to
    ``drain_seconds``), then exit. If the engine dies, stop and raise (exit 1)."""
    import signal

    import uvicorn

    from bdlora.errors import BdloraError

    check_onnx_dir(Path(cfg.onnx_dir), cfg.onnx_file)
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:  # from the engine's worker thread: stop serving, exit non-zero below
        fatal.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(cfg, on_fatal=on_fatal)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=drain_seconds, access_log=False))
    # uvicorn drains on SIGTERM, then re-raises the signal it caught under the handler that was there before it
    # started. A no-op handler makes a completed drain an ordinary exit (status 0), which is what process
    # supervisors expect after a graceful stop; SIGINT keeps its KeyboardInterrupt (exit 130).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if fatal:
        raise BdloraError(f"the generation engine stopped ({fatal[0]}); exiting so a supervisor can restart the "
                          "server")


__all__ = ["APIError", "ServeConfig", "create_app", "serve", "check_onnx_dir"]
