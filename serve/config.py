"""``ServeConfig``: the options of ``bdlora serve``, with their defaults and one validator."""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.errors import Checks

MAX_THREADS = 1024  # far above any machine's cores; bounds what a typo can ask onnxruntime to spawn


@dataclass
class ServeConfig:
    onnx_dir: str
    """A `bdlora export onnx` folder."""
    model_name: str
    """Model id clients send (default: the folder name)."""
    onnx_file: str = "model.onnx"
    """Graph to serve (model.onnx or model_int8.onnx), inside the folder."""
    max_batch: int = 16
    """Sequences decoded together (continuous batching)."""
    max_tokens: int = 512
    """Largest max_tokens a request may ask for."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (default: the model's context minus one)."""
    max_waiting: int = 1024
    """Queued requests beyond the batch before answering 429."""
    threads: int | None = None
    """onnxruntime intra-op threads (default: all cores)."""

    def validate(self) -> ServeConfig:
        c = Checks()
        for name in ("max_batch", "max_tokens", "max_waiting", "max_prompt_tokens"):
            c.integer(name, getattr(self, name), lo=1)
        c.integer("threads", self.threads, lo=1, hi=MAX_THREADS)
        c.done()
        return self
