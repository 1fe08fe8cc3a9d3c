"""``bdlora serve`` (an OpenAI-compatible server over an ONNX export) and ``bdlora loadtest``."""

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bdlora.base.errors import Checks, UsageError
from bdlora.base.io import write_json
from bdlora.base.outputs import check_out_file
from bdlora.base.runs import RUNS_DIR, GenaiDir, OnnxDir
from bdlora.base.threads import from_options
from bdlora.cli import render
from bdlora.cli.app import command, err, fail
from bdlora.cli.options import Force, Report, RunsDir, from_dataclass, int_list
from bdlora.models.runtime import check_onnx_dir
from bdlora.serve.config import DEFAULT_DRAIN_SECONDS, DEFAULT_HOST, DEFAULT_PORT, ServeConfig
from bdlora.serve.loadtest import CONCURRENCY, MAX_TOKENS, REQUESTS, TEMPERATURE, base_url, first_model, load_test
from bdlora.speculative.config import SpeculationConfig
from bdlora.speculative.decoders import check_draft

LIMITS = "Limits and scheduling"
SERVE_PANELS = {  # serve --help: where and what to serve first; the server's limits and its files after
    LIMITS: ("waiting_served_ratio", "max_waiting_steps", "max_tokens", "max_prompt_tokens", "max_waiting",
             "max_prompts", "max_request_bytes", "request_timeout"),
    "Files and documentation": ("onnx_file", "docs"),
}


@command(options=from_dataclass(ServeConfig, skip=("onnx_dir", "model_name", "speculation"), defaults=True,
                                panels=SERVE_PANELS)
         + from_dataclass(SpeculationConfig, defaults=True, panel="Speculative decoding"))
def serve(
    onnx_dir: Annotated[Optional[str], typer.Argument(help="A `bdlora export onnx` folder (default: the latest), "
                                                           "or with --runtime genai a `bdlora export genai` folder.")]
    = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(help="TCP port.")] = DEFAULT_PORT,
    model_name: Annotated[Optional[str], typer.Option(help="Model id clients send (default: the folder name).")]
    = None,
    drain_seconds: Annotated[int, typer.Option(help="On SIGTERM/SIGINT: seconds to let in-flight requests "
                                                    "finish.", rich_help_panel=LIMITS)] = DEFAULT_DRAIN_SECONDS,
    runs_dir: RunsDir = RUNS_DIR,
    **opts,
):
    """Serve an exported ONNX model with an OpenAI-compatible API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics)."""
    from bdlora.serve.app import serve as run_server
    from bdlora.serve.transport import listening_socket

    c = Checks()
    c.integer("port", port, lo=0, hi=65535)
    c.integer("drain_seconds", drain_seconds, lo=0)
    c.done()
    latest = GenaiDir if opts.get("runtime") == "genai" else OnnxDir
    src = Path(onnx_dir) if onnx_dir else latest.latest(runs_dir).path
    if opts.get("api_key") is None:
        opts["api_key"] = os.environ.get("BDLORA_API_KEY")
    spec = SpeculationConfig(**{k: opts.pop(k) for k in list(opts) if k in SpeculationConfig.__dataclass_fields__})
    cfg = from_options(ServeConfig, {"onnx_dir": str(src), "model_name": model_name or src.name, "speculation": spec,
                                  **opts}).validate()
    check_onnx_dir(src, cfg.onnx_file, cfg.runtime)
    if spec.draft:
        check_draft(src, Path(spec.draft))
    sock = listening_socket(host, port)
    auth = "API key required" if cfg.api_key else "no API key (--api-key or $BDLORA_API_KEY to require one)"
    err.print(f"[cyan]>[/] serving {escape(str(src))} as '{escape(cfg.model_name)}' on http://{host}:{port}/v1 "
              f"({auth})", highlight=False)
    run_server(cfg, host, port, drain_seconds, sock=sock)


@command()
def loadtest(
    url: Annotated[str, typer.Argument(help="Server base URL, e.g. http://127.0.0.1:8000 (or the .../v1 address "
                                            "`bdlora serve` prints).")],
    concurrency: Annotated[str, typer.Option(help="Comma-separated numbers of concurrent clients.")]
    = ",".join(map(str, CONCURRENCY)),
    requests: Annotated[int, typer.Option(help="Completed requests per concurrency level.")] = REQUESTS,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of every request.")] = MAX_TOKENS,
    model: Annotated[Optional[str], typer.Option(help="Model id (default: the first /v1/models lists).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the requests.")] = TEMPERATURE,
    stream: Annotated[bool, typer.Option(help="Stream the responses; adds time to first token and inter-token "
                                              "latency (p50/p90/p99).")] = False,
    api_key: Annotated[Optional[str], typer.Option(help="Bearer key of the server (default: $BDLORA_API_KEY).")]
    = None,
    json_path: Report = None,
    force: Force = False,
):
    """Closed-loop load test of an OpenAI-compatible /v1/completions endpoint: requests/s, tokens/s, latency
    percentiles; with --stream also time to first token and inter-token latency."""
    import httpx

    levels = int_list(concurrency, "--concurrency")
    c = Checks()
    for v in levels:
        c.integer("concurrency", v, lo=1)
    c.integer("requests", requests, lo=1)
    c.integer("max_tokens", max_tokens, lo=1)
    c.number("temperature", temperature, 0.0, 2.0)  # the server's own range (OpenAI's)
    c.done()
    if json_path:
        check_out_file(json_path, force=force)
    url = base_url(url)
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        raise UsageError(f"{url}: not a valid URL ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UsageError(f"{url}: not an http(s) address with a host (e.g. http://127.0.0.1:8000)")
    try:
        httpx.get(url + "/health", timeout=10)
    except httpx.TransportError as e:
        raise UsageError(f"{url}: no server answers there ({type(e).__name__})") from None
    key = api_key or os.environ.get("BDLORA_API_KEY")
    if model is None:
        try:
            model = first_model(url, key)
        except ValueError as e:
            raise UsageError(str(e)) from None
    rows = [load_test(url, model, n, requests, max_tokens, temperature=temperature, stream=stream, api_key=key)
            for n in levels]
    render.loadtest(rows, url, max_tokens)
    if json_path:
        write_json(json_path, {"results": rows})
    if any(r["failures"] for r in rows):
        first = next(r["first_failure"] for r in rows if r["failures"])
        raise fail(f"some requests failed; the first: {first}")
