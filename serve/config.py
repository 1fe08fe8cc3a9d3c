"""``ServeConfig``: the options of ``bdlora serve``, with their defaults and one validator."""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import Checks
from bdlora.base.runs import MODEL_ONNX
from bdlora.base.settings import Settings
from bdlora.base.threads import ThreadPool
from bdlora.speculative.config import SpeculationConfig

# Where and how the server listens (not part of ServeConfig: the app does not need them); the CLI's defaults.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_DRAIN_SECONDS = 30  # on SIGTERM/SIGINT: seconds in-flight requests get to finish


@dataclass
class ServeConfig(Settings):
    onnx_dir: str
    """A `bdlora export onnx` folder."""
    model_name: str
    """Model id clients send (default: the folder name)."""
    onnx_file: str = MODEL_ONNX
    """Graph to serve (model.onnx or model_int8.onnx), inside the folder."""
    runtime: str = "ort"
    """ort (a `bdlora export onnx` folder, onnxruntime with a batched KV cache) or genai (a `bdlora export genai`
    folder, onnxruntime-genai: requests admitted together decode as one batched generator)."""
    max_batch: int = 16
    """Sequences decoded together (continuous batching; under genai also the largest cohort)."""
    waiting_served_ratio: float = 1.2
    """genai: while cohorts run, waiting requests are admitted once they number this many times the running
    sequences (or fill the free slots, or have waited max_waiting_steps), so they start one batched cohort."""
    max_waiting_steps: int = 20
    """genai: decode steps the oldest waiting request waits at most before it is admitted."""
    max_tokens: int = 512
    """Largest max_tokens a request may ask for."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (default: the model's context minus one)."""
    max_waiting: int = 1024
    """Queued sequences beyond the batch before answering 429 (a request of k prompts counts k)."""
    max_prompts: int = 64
    """Prompts one /v1/completions request may carry (a list prompt); at most max_waiting."""
    pool: ThreadPool = ThreadPool()
    """--threads: of the model's sessions."""
    max_request_bytes: int = 4 * 1024 * 1024
    """Largest request body in bytes (413 above it)."""
    request_timeout: float = 30.0
    """Seconds a client has to send a request's head (from connecting, or from its previous response) and then its
    body: a connection that sends nothing is closed, a body still incomplete is answered 408, so idle or trickling
    clients cannot hold the server's connections."""
    api_key: str | None = None
    """Require 'Authorization: Bearer KEY' on /v1/* (default: $BDLORA_API_KEY if set; /health and /metrics stay
    open). Prefer the environment variable: a command line is visible to every user of the machine."""
    docs: bool = False
    """Serve the interactive API docs (/docs, /openapi.json)."""
    speculation: SpeculationConfig | None = None
    """--draft / --prompt-lookup: how a sequence running alone is continued speculatively (None: never)."""

    def check(self, c: Checks) -> Checks:
        for name in ("max_batch", "max_tokens", "max_waiting", "max_prompt_tokens", "max_request_bytes"):
            c.integer(name, getattr(self, name), lo=1)
        c.integer("max_prompts", self.max_prompts, lo=1, hi=self.max_waiting)
        c.integer("max_waiting_steps", self.max_waiting_steps, lo=0)
        c.number("waiting_served_ratio", self.waiting_served_ratio, lo=0.0)
        self.pool.check(c)
        c.number("request_timeout", self.request_timeout, lo=0.0, lo_open=True)
        c.choice("runtime", self.runtime, ("ort", "genai"))
        if self.speculation is not None:
            self.speculation.check(c)
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            c.add("--api-key: must be a non-empty string without surrounding spaces")
        return c
