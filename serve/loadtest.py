"""``bdlora loadtest``: closed-loop load against an OpenAI-compatible completions endpoint (ours or any other).

``concurrency`` clients each send their next request as soon as the previous one returns, until ``requests``
requests have completed; reports requests/s, generated tokens/s (from each response's ``usage``) and latency
percentiles. Every response is checked (status 200, one choice); failures are counted, not hidden.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

DEFAULT_PROMPTS = ("def main(", "import os\n", "class Config:\n    def __init__(self", "for i in range(",
                   "# Licensed under", "return self.", "if __name__ ==", "with open(path) as f:\n")


async def _run(url: str, model: str, concurrency: int, requests: int, max_tokens: int, prompts, temperature: float,
               timeout: float) -> dict:
    import httpx

    latencies: list[float] = []
    tokens = 0
    failures: list[str] = []
    counter = iter(range(requests))

    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            nonlocal tokens
            for i in counter:
                body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                        "temperature": temperature}
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/completions", json=body)
                    ok = r.status_code == 200 and len(r.json().get("choices", [])) == 1
                except Exception as e:  # noqa: BLE001  a transport failure is a failed request, counted
                    failures.append(f"{type(e).__name__}: {e}")
                    continue
                if not ok:
                    failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
                    continue
                latencies.append(time.perf_counter() - t0)
                tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = np.array(latencies) * 1000.0
    return {"concurrency": concurrency, "requests": len(latencies), "failures": len(failures),
            "first_failure": failures[0] if failures else None, "wall_s": wall,
            "requests_per_s": len(latencies) / wall, "tokens_per_s": tokens / wall, "completion_tokens": tokens,
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
            "p90_ms": float(np.percentile(lat, 90)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
            "mean_ms": float(lat.mean()) if lat.size else None}


def load_test(url: str, model: str | None = None, concurrency: int = 1, requests: int = 100, max_tokens: int = 64,
              prompts=DEFAULT_PROMPTS, temperature: float = 0.0, timeout: float = 300.0) -> dict:
    """Run one closed-loop load test; ``model`` defaults to the first id /v1/models lists."""
    import httpx

    if model is None:
        model = httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    res = asyncio.run(_run(url, model, concurrency, requests, max_tokens, list(prompts), temperature, timeout))
    res.update(url=url, model=model, max_tokens=max_tokens)
    return res
