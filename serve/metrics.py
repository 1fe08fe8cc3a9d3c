"""Prometheus metrics of ``bdlora serve`` (``GET /metrics``): requests by route and status, tokens, latency and time
to first token, and live gauges of the engine (active and waiting sequences, decode steps, failures, readiness).

Requests are labelled by the *route template* that served them (``/v1/completions``), or ``unmatched`` for a path
no route serves, so a client probing random paths cannot grow the series without bound."""

from __future__ import annotations


class Metrics:
    def __init__(self, engine_ref):
        """``engine_ref()`` returns the current engine or None (the gauges read it at scrape time)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("bdlora_requests", "HTTP requests by route and status code", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("bdlora_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("bdlora_generated_tokens", "Completion tokens generated", registry=r)
        self.latency = Histogram("bdlora_request_latency_seconds", "Completion request latency (to the last token)",
                                 ["endpoint"], registry=r,
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.ttft = Histogram("bdlora_time_to_first_token_seconds", "Time to the first streamed text",
                              registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.cancelled = Counter("bdlora_cancelled_sequences", "Sequences cancelled by a client disconnect",
                                 registry=r)

        def live(attr):
            return lambda: getattr(engine_ref(), attr) if engine_ref() is not None else 0

        for name, doc, attr in (("bdlora_active_sequences", "Sequences in the running batch", "active"),
                                ("bdlora_waiting_requests", "Requests queued for the batch", "waiting"),
                                ("bdlora_decode_steps", "Decode steps run", "steps"),
                                ("bdlora_decode_rows", "Sum of batch sizes over decode steps", "decode_rows"),
                                ("bdlora_model_runs", "Executions of the model (prefills and decode steps; under "
                                 "--runtime genai one per cohort of requests admitted together)", "runs"),
                                ("bdlora_failed_sequences", "Sequences that failed alone (error to their request; "
                                 "the engine went on)", "failed"),
                                ("bdlora_tracked_requests", "Requests the engine still holds anything for (0 when "
                                 "idle: anything else is a leak)", "tracked")):
            Gauge(name, doc, registry=r).set_function(live(attr))
        Gauge("bdlora_ready", "1 while the model is loaded and the engine is running", registry=r).set_function(
            lambda: 1.0 if engine_ref() is not None and engine_ref().error is None else 0.0)

    def observe_request(self, route: str | None, status: int) -> None:
        self.requests.labels(route or "unmatched", str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
