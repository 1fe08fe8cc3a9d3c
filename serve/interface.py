"""What the server needs of an engine (``ServingEngine``): the in-process engines (``Engine`` for onnxruntime,
``GenaiEngine`` for onnxruntime-genai) and ``EngineProcess`` (either of them in a child process) implement it, so
the request handlers, ``/health`` and ``/metrics`` never ask which one they talk to.

``submit`` is the one entry point and its checks are written once here: a stopped engine answers at once instead of
queueing forever, and a prompt the runtime cannot continue exactly (``refuse``) gets its one-line error; only then
does the engine's own ``_accept`` take the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from bdlora.serve.sequence import Request, safe_emit


class ServingEngine(ABC):
    """The engine surface the server uses. Counters read by /metrics: ``active`` (sequences in the batch),
    ``steps``, ``decode_rows``, ``runs``, ``failed``; ``error`` is set once the engine cannot serve any more."""

    error: str | None = None
    active = steps = decode_rows = runs = failed = 0

    def refuse(self, prompt_ids: list[int]) -> str | None:
        """Why this runtime cannot continue this prompt exactly (None: it can)."""
        return None

    def submit(self, req: Request) -> None:
        """Thread-safe and never blocks on inference: the request's events arrive through its own channel."""
        if self.error is not None:  # the worker is gone: answer now instead of queueing forever
            safe_emit(req, "error", f"the engine stopped: {self.error}")
            return
        refused = self.refuse(req.prompt_ids)
        if refused:
            safe_emit(req, "error", refused)
            return
        self._accept(req)

    @abstractmethod
    def _accept(self, req: Request) -> None:
        """Take a request that passed ``submit``'s checks."""

    @abstractmethod
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the worker; requests still running get an error."""

    @property
    @abstractmethod
    def waiting(self) -> int:
        """Requests queued and not yet running."""

    @property
    @abstractmethod
    def tracked(self) -> int:
        """Requests the engine still holds anything for: 0 once idle, else a leak."""
