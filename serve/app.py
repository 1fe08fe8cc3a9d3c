"""The OpenAI-compatible HTTP API of ``bdlora serve`` (FastAPI on uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the tokenizer has a chat template),
``GET /v1/models``, ``GET /health`` (503 until the model is loaded), ``GET /metrics`` (Prometheus text format).
Inference runs on the engine's worker thread (``engine.Engine``); handlers only await per-request queues, so the
event loop never blocks. Every client error is a 4xx with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``; streaming uses server-sent events exactly like the OpenAI API
(``data: {json}\\n\\n`` chunks, then ``data: [DONE]``). A client that disconnects mid-request cancels its
sequence, which leaves the batch at the next decode step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from bdlora.serve.engine import Engine, SamplingParams
from bdlora.serve.engine import Request as GenRequest

MAX_STOP = 4
# Sampling temperatures in (0, MIN_TEMPERATURE) are refused: they mean "greedy" and should say so with 0.
MIN_TEMPERATURE = 1e-3
MAX_SEED = 2**63 - 1  # numpy's generators take any non-negative integer; bound it to a signed 64-bit one


@dataclass
class ServeConfig:
    onnx_dir: str
    model_name: str
    onnx_file: str = "model.onnx"
    max_batch: int = 16
    max_tokens: int = 512  # the largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None  # default: the model's context minus one
    max_waiting: int = 1024  # queued requests beyond the batch before 429
    threads: int | None = None


# ------------------------------------------------------------------------------------------------------------------
# Request bodies (extra fields are refused: an unknown parameter is a 400 naming it, as in the OpenAI API)
# ------------------------------------------------------------------------------------------------------------------

Number = StrictFloat | StrictInt


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    stop: StrictStr | list[StrictStr] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = 1
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict | None = None
    user: StrictStr | None = None


class CompletionBody(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = None


class ChatBody(_Common):
    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------------------------


class Metrics:
    def __init__(self, state):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("bdlora_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("bdlora_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("bdlora_generated_tokens", "Completion tokens generated", registry=r)
        self.latency = Histogram("bdlora_request_latency_seconds", "Completion request latency (to the last token)",
                                 ["endpoint"], registry=r,
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.ttft = Histogram("bdlora_time_to_first_token_seconds", "Time to the first streamed text",
                              registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.cancelled = Counter("bdlora_cancelled_sequences", "Sequences cancelled by a client disconnect",
                                 registry=r)
        eng = lambda attr: (lambda: getattr(state.engine, attr) if state.engine is not None else 0)  # noqa: E731
        Gauge("bdlora_active_sequences", "Sequences in the running batch", registry=r).set_function(eng("active"))
        Gauge("bdlora_waiting_requests", "Requests queued for the batch", registry=r).set_function(eng("waiting"))
        Gauge("bdlora_decode_steps", "Decode steps run", registry=r).set_function(eng("steps"))
        Gauge("bdlora_decode_rows", "Sum of batch sizes over decode steps", registry=r).set_function(
            eng("decode_rows"))
        Gauge("bdlora_ready", "1 while the model is loaded and the engine is running", registry=r).set_function(
            lambda: 1.0 if state.engine is not None and state.engine.error is None else 0.0)
        Gauge("bdlora_failed_sequences", "Sequences that failed alone (error to their request; engine went on)",
              registry=r).set_function(eng("failed"))


# ------------------------------------------------------------------------------------------------------------------
# App
# ------------------------------------------------------------------------------------------------------------------


class _State:
    def __init__(self):
        self.engine: Engine | None = None
        self.load_error: str | None = None


def create_app(cfg: ServeConfig, loader=None, on_fatal=None) -> FastAPI:
    """The ASGI app. ``loader()`` builds the Engine (default: from ``cfg``); it runs in a thread after start-up,
    and /health answers 503 until it returns. ``on_fatal(message)`` is called once if the engine's worker dies
    (``serve`` stops the process with a non-zero exit, so a supervisor restarts it)."""
    state = _State()
    metrics = Metrics(state)
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

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
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

    def engine() -> Engine:
        if state.engine is None:
            msg = f"model failed to load: {state.load_error}" if state.load_error else "model is loading"
            raise APIError(503, msg, code="not_ready", type_="server_error")
        return state.engine

    @app.get("/health")
    async def health():
        if state.engine is not None and state.engine.error is None:
            return {"status": "ok", "model": cfg.model_name, "active": state.engine.active,
                    "waiting": state.engine.waiting}
        status = "error" if state.load_error or (state.engine and state.engine.error) else "loading"
        detail = state.load_error or (state.engine.error if state.engine else None)
        return JSONResponse({"status": status, "error": detail}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "bdlora"}]}

    # -- shared request handling ----------------------------------------------------------------------------------

    def check_common(body: _Common, max_tokens: int | None) -> SamplingParams:
        if body.model != cfg.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist (served: '{cfg.model_name}')", "model",
                           "model_not_found")
        unsupported = [("n", body.n != 1), ("presence_penalty", body.presence_penalty != 0),
                       ("frequency_penalty", body.frequency_penalty != 0), ("logit_bias", bool(body.logit_bias))]
        for name, bad in unsupported:
            if bad:
                raise APIError(400, f"{name}: not supported by bdlora serve (use the default)", name, "unsupported")
        if body.stream_options and (set(body.stream_options) - {"include_usage"} or not body.stream):
            raise APIError(400, "stream_options: only {'include_usage': bool} with stream=true is supported",
                           "stream_options", "unsupported")
        if 0.0 < body.temperature < MIN_TEMPERATURE:
            raise APIError(400, f"temperature {body.temperature}: must be 0 (greedy) or at least {MIN_TEMPERATURE}",
                           "temperature", "invalid_value")
        mt = 16 if max_tokens is None else max_tokens
        if mt < 1:
            raise APIError(400, f"max_tokens {mt}: must be >= 1", "max_tokens", "invalid_value")
        if mt > cfg.max_tokens:
            raise APIError(400, f"max_tokens {mt}: above this server's limit of {cfg.max_tokens}", "max_tokens",
                           "invalid_value")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP or any(s == "" for s in stop):
            raise APIError(400, f"stop: at most {MAX_STOP} non-empty strings", "stop", "invalid_value")
        return SamplingParams(max_tokens=mt, temperature=float(body.temperature), top_p=float(body.top_p),
                              stop=tuple(stop), seed=body.seed)

    def check_prompt(eng: Engine, ids: list[int], params: SamplingParams) -> None:
        limit = cfg.max_prompt_tokens or eng.max_positions - 1
        if not ids:
            raise APIError(400, "prompt: empty (needs at least one token)", "prompt", "invalid_value")
        if len(ids) > limit:
            raise APIError(400, f"prompt: {len(ids)} tokens, above the limit of {limit}", "prompt",
                           "context_length_exceeded")
        if len(ids) + params.max_tokens > eng.max_positions:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                                f"context of {eng.max_positions} tokens", "max_tokens", "context_length_exceeded")
        vocab = eng.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt", "invalid_value")

    def start(eng: Engine, prompts: list[list[int]], params: SamplingParams, stream: bool):
        """Submit one engine request per prompt; returns (requests, asyncio queues)."""
        if eng.waiting >= cfg.max_waiting:
            raise APIError(429, "server overloaded: too many queued requests, retry later", None, "overloaded",
                           "rate_limit_error")
        loop = asyncio.get_running_loop()
        reqs, queues = [], []
        for ids in prompts:
            q: asyncio.Queue = asyncio.Queue()

            def emit(kind, payload, q=q):
                loop.call_soon_threadsafe(q.put_nowait, (kind, payload))

            r = GenRequest(list(ids), params, emit, stream=stream)
            reqs.append(r)
            queues.append(q)
            metrics.prompt_tokens.inc(len(ids))
        for r in reqs:
            eng.submit(r)
        return reqs, queues

    async def next_event(q: asyncio.Queue, request: Request):
        """The next engine event, watching for a client disconnect while waiting."""
        while True:
            try:
                return await asyncio.wait_for(q.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise asyncio.CancelledError from None

    async def collect(reqs, queues, request: Request) -> list[dict]:
        """Wait for every request to finish (non-streaming); cancels them all if the client goes away."""
        results = []
        try:
            for q in queues:
                while True:
                    kind, payload = await next_event(q, request)
                    if kind == "error":
                        raise APIError(500, f"generation failed: {payload}", code="engine_error", type_="server_error")
                    if kind == "done":
                        results.append(payload)
                        metrics.generated_tokens.inc(payload["completion_tokens"])
                        break
        except asyncio.CancelledError:
            for r in reqs:
                r.cancel()
            metrics.cancelled.inc(len(reqs))
            raise
        return results

    def usage(results: list[dict]) -> dict:
        p = sum(r["prompt_tokens"] for r in results)
        c = sum(r["completion_tokens"] for r in results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def sse(obj) -> bytes:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()

    async def stream(reqs, queues, request: Request, endpoint: str, make_chunk, include_usage: bool):
        t0 = time.perf_counter()
        first, finished = True, False
        try:
            start_chunk = make_chunk(None, None, start=True)
            if start_chunk is not None:
                yield sse(start_chunk)
            q = queues[0]
            while True:
                kind, payload = await next_event(q, request)
                if kind == "delta":
                    if first:
                        metrics.ttft.observe(time.perf_counter() - t0)
                        first = False
                    yield sse(make_chunk(payload, None))
                elif kind == "error":
                    yield sse(error_body(f"generation failed: {payload}", "server_error"))
                    break
                else:
                    metrics.generated_tokens.inc(payload["completion_tokens"])
                    yield sse(make_chunk(None, payload["finish_reason"]))
                    if include_usage:
                        yield sse({**make_chunk(None, None, usage_only=True), "usage": usage([payload])})
                    break
            finished = True
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # client went away (or the server is stopping): free the slot
                for r in reqs:
                    r.cancel()
                metrics.cancelled.inc(len(reqs))
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)

    async def respond(reqs, queues, request: Request, endpoint: str, body: _Common, chunk, whole):
        """The response of submitted requests: SSE chunks built by ``chunk`` when ``body.stream``, otherwise
        ``whole(results)`` once every request has finished."""
        if body.stream:
            include = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream(reqs, queues, request, endpoint, chunk, include),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        t0 = time.perf_counter()
        results = await collect(reqs, queues, request)
        metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        return whole(results)

    # -- /v1/completions --------------------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        eng = engine()
        params = check_common(body, body.max_tokens)
        for name, bad in (("echo", body.echo), ("logprobs", body.logprobs is not None),
                          ("best_of", body.best_of not in (None, 1)), ("suffix", body.suffix is not None)):
            if bad:
                raise APIError(400, f"{name}: not supported by bdlora serve", name, "unsupported")
        p = body.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt: empty list", "prompt", "invalid_value")
        ids = [eng.tokenizer(x)["input_ids"] if isinstance(x, str) else list(x) for x in prompts]
        for x in ids:
            check_prompt(eng, x, params)
        if body.stream and len(ids) > 1:
            raise APIError(400, "stream: supported for a single prompt only", "stream", "unsupported")
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": cfg.model_name}

        def chunk(text, finish, start=False, usage_only=False):
            if start:
                return None
            if usage_only:
                return {**base, "choices": []}
            return {**base, "choices": [{"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}]}

        def whole(results):
            return {**base, "choices": [{"text": r["text"], "index": i, "logprobs": None,
                                         "finish_reason": r["finish_reason"]} for i, r in enumerate(results)],
                    "usage": usage(results)}

        reqs, queues = start(eng, ids, params, body.stream)
        return await respond(reqs, queues, request, "/v1/completions", body, chunk, whole)

    # -- /v1/chat/completions ---------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        eng = engine()
        if not getattr(eng.tokenizer, "chat_template", None):
            raise APIError(400, f"the model '{cfg.model_name}' has no chat template; use /v1/completions", "messages",
                           "chat_template_missing")
        if body.logprobs or body.top_logprobs is not None:
            raise APIError(400, "logprobs: not supported by bdlora serve", "logprobs", "unsupported")
        if not body.messages:
            raise APIError(400, "messages: empty list", "messages", "invalid_value")
        params = check_common(body, body.max_completion_tokens if body.max_completion_tokens is not None
                              else body.max_tokens)
        msgs = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            ids = eng.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001  a template that rejects the conversation (e.g. role order)
            raise APIError(400, f"messages: the chat template rejected them ({e})", "messages",
                           "invalid_value") from None
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        ids = list(ids)
        check_prompt(eng, ids, params)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": cfg.model_name}

        def chunk(text, finish, start=False, usage_only=False):
            head = {**base, "object": "chat.completion.chunk"}
            if usage_only:
                return {**head, "choices": []}
            delta = {"role": "assistant", "content": ""} if start else ({"content": text} if text else {})
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def whole(results):
            r = results[0]
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": r["text"]},
                                 "logprobs": None, "finish_reason": r["finish_reason"]}], "usage": usage(results)}

        reqs, queues = start(eng, [ids], params, body.stream)
        return await respond(reqs, queues, request, "/v1/chat/completions", body, chunk, whole)

    return app


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
    ``drain_seconds``), then exit."""
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
