"""``bdlora loadtest``: closed-loop load against an OpenAI-compatible completions endpoint (ours or any other).

``concurrency`` clients each send their next request as soon as the previous one returns, until ``requests``
requests have completed; reports requests/s, generated tokens/s (from each response's ``usage``) and latency
percentiles. Every response is checked (status 200, one choice); failures are counted, not hidden.

With ``stream``, requests stream (server-sent events, ``stream_options.include_usage``) and the report adds what
vLLM's bench, guidellm and aiperf report: time to first token (request sent -> first chunk carrying text) and
inter-token latency (the gaps between successive text chunks), as p50/p90/p99 over all requests.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

CONCURRENCY = (1, 16)  # `bdlora loadtest --concurrency`: one client, then a batch's worth
REQUESTS = 100  # completed requests per concurrency level
MAX_TOKENS = 64  # max_tokens of every request
TEMPERATURE = 0.0  # greedy: every level generates the same tokens
DEFAULT_PROMPTS = ("def main(", "import os\n", "class Config:\n    def __init__(self", "for i in range(",
                   "# Licensed under", "return self.", "if __name__ ==", "with open(path) as f:\n")


def _count(usage) -> int:
    """``usage.completion_tokens`` of a server's answer, which must be a whole number (a server answering "lots" was
    a TypeError traceback when the counts were added up)."""
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise RuntimeError(f"usage.completion_tokens is not a whole number of tokens: {str(n)[:40]!r}")
    return n


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.array(values) * 1000.0, q)) if values else None


async def _one_stream(client, body: dict) -> tuple[float, list[float], int]:
    """(ttft, inter-token gaps, completion tokens) of one streamed completion; raises on a malformed stream."""

    t0 = time.perf_counter()
    last = ttft = None
    gaps: list[float] = []
    tokens = None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error'].get('message')}")
            if chunk.get("usage"):
                tokens = _count(chunk["usage"])
            if any(c.get("text") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
    if tokens is None:
        raise RuntimeError("the stream carried no usage chunk")
    return (ttft if ttft is not None else time.perf_counter() - t0), gaps, tokens


async def _run(url: str, model: str, concurrency: int, requests: int, max_tokens: int, prompts, temperature: float,
               timeout: float, stream: bool = False, api_key: str | None = None) -> dict:
    import httpx

    latencies: list[float] = []
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = 0
    failures: list[str] = []
    counter = iter(range(requests))
    headers = _auth_headers(api_key)

    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            nonlocal tokens
            for i in counter:
                body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                        "temperature": temperature}
                t0 = time.perf_counter()
                try:
                    if stream:
                        ttft, gaps, n = await _one_stream(client, body)
                        ttfts.append(ttft)
                        itls.extend(gaps)
                    else:
                        r = await client.post("/v1/completions", json=body)
                        if r.status_code != 200 or len(r.json().get("choices", [])) != 1:
                            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                        n = _count(r.json()["usage"])
                except Exception as e:  # noqa: BLE001  a transport or protocol failure is a failed request, counted
                    failures.append(f"{type(e).__name__}: {e}")
                    continue
                latencies.append(time.perf_counter() - t0)
                tokens += n

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    res = {"concurrency": concurrency, "stream": stream, "requests": len(latencies), "failures": len(failures),
           "first_failure": failures[0] if failures else None, "wall_s": wall,
           "requests_per_s": len(latencies) / wall, "tokens_per_s": tokens / wall, "completion_tokens": tokens,
           "p50_ms": _pct(latencies, 50), "p90_ms": _pct(latencies, 90), "p99_ms": _pct(latencies, 99),
           "mean_ms": float(np.mean(latencies) * 1000.0) if latencies else None}
    if stream:
        res.update({f"ttft_p{q}_ms": _pct(ttfts, q) for q in (50, 90, 99)})
        res.update({f"itl_p{q}_ms": _pct(itls, q) for q in (50, 90, 99)})
    return res


def _auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def base_url(url: str) -> str:
    """The server's root. OpenAI clients are given ``.../v1`` (the address ``bdlora serve`` prints); the paths
    requested here add ``/v1`` themselves, so a trailing ``/v1`` is dropped rather than doubled."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def first_model(url: str, api_key: str | None = None) -> str:
    """The first model id ``/v1/models`` lists; ``ValueError`` naming the address and its answer if it lists none
    (not an OpenAI-compatible server, a wrong path, a missing key)."""
    import httpx

    headers = _auth_headers(api_key)
    where = base_url(url) + "/v1/models"
    r = httpx.get(where, timeout=30, headers=headers)
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        body = " ".join(r.text.split())[:120]
        raise ValueError(f"{where} answered HTTP {r.status_code} without a model list ({body!r}); give the server's "
                         "base URL (e.g. http://127.0.0.1:8000) or the model id with --model") from None


def load_test(url: str, model: str | None = None, concurrency: int = 1, requests: int = REQUESTS,
              max_tokens: int = MAX_TOKENS, prompts=DEFAULT_PROMPTS, temperature: float = TEMPERATURE,
              timeout: float = 300.0, stream: bool = False,
              api_key: str | None = None) -> dict:
    """Run one closed-loop load test; ``model`` defaults to the first id /v1/models lists."""
    url = base_url(url)
    if model is None:
        model = first_model(url, api_key)
    res = asyncio.run(_run(url, model, concurrency, requests, max_tokens, list(prompts), temperature, timeout,
                           stream, api_key))
    res.update(url=url, model=model, max_tokens=max_tokens)
    return res
