"""The logic of the completion endpoints (vLLM's serving classes): ``CompletionServing`` for ``/v1/completions``
and ``ChatServing`` for ``/v1/chat/completions``, over a shared ``Serving`` base that turns a request into engine
requests and their events into an OpenAI response, whole or streamed as server-sent events
(``data: {json}\\n\\n`` chunks, then ``data: [DONE]``). A client that disconnects cancels its sequences, which leave
the batch at the next decode step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from bdlora.base.memory import release_freed_memory
from bdlora.serve.config import ServeConfig
from bdlora.serve.engine import Request as EngineRequest
from bdlora.serve.interface import ServingEngine
from bdlora.serve.metrics import Metrics
from bdlora.serve.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingRequest,
    Usage,
    error_body,
)
from bdlora.serve.sampling import SamplingParams

LARGE_RESPONSE = 1 << 20  # bytes: after building an answer this large, freed heap pages go back to the system


class _Hangup:
    """Rate-limited ``request.is_disconnected()``: a request's events can arrive faster than any timeout, so the
    check runs on the clock, not only when waiting times out."""

    every = 0.5

    def __init__(self, request: Request):
        self.request, self.last = request, time.monotonic()

    async def check(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            if await self.request.is_disconnected():
                raise asyncio.CancelledError


def usage(results: list[dict]) -> Usage:
    p = sum(r["prompt_tokens"] for r in results)
    c = sum(r["completion_tokens"] for r in results)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def sse(obj) -> bytes:
    data = obj.model_dump() if hasattr(obj, "model_dump") else obj
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Serving:
    """Shared request handling: checks, submission to the engine, collecting or streaming the events."""

    endpoint = ""

    def __init__(self, cfg: ServeConfig, engine_ref, metrics: Metrics, load_error_ref):
        self.cfg, self.engine_ref, self.metrics, self.load_error_ref = cfg, engine_ref, metrics, load_error_ref

    def engine(self) -> ServingEngine:
        eng = self.engine_ref()
        if eng is None:
            err = self.load_error_ref()
            raise APIError(503, f"model failed to load: {err}" if err else "model is loading", code="not_ready",
                           type_="server_error")
        return eng

    def prompt_limit(self, eng: ServingEngine) -> int:
        return self.cfg.max_prompt_tokens or eng.max_positions - 1

    # list and object fields, and items, a request holds besides its prompt or messages (stop strings, options)
    FIELDS = 64

    def body_bounds(self) -> tuple[int, int]:
        """(lists and objects, items) the largest valid request to this server holds, checked on the raw body
        before it is parsed (``app.parse_body``). Raises 503 while the model loads: until then no limit is known,
        and no body is parsed."""
        raise NotImplementedError

    def check_text_size(self, eng: ServingEngine, texts: list[str], param: str) -> None:
        """Before anything is tokenised: a text of more bytes than ``limit`` tokens can stand for cannot fit, so it
        is refused at once (tokenising 4 MB of 'a' took seconds of a core and a gigabyte per request)."""
        limit, per_token = self.prompt_limit(eng), eng.tokenizer.max_token_bytes()
        size = sum(len(t.encode("utf-8")) for t in texts)
        if size > limit * per_token:
            raise APIError(400, f"{param}: {size:,} bytes, more than the {limit:,} tokens this server takes can hold "
                                f"(a token of this model stands for at most {per_token} bytes)", param,
                           "context_length_exceeded")

    def check_prompt(self, eng: ServingEngine, ids: list[int], params: SamplingParams) -> None:
        limit = self.prompt_limit(eng)
        if not ids:
            raise APIError(400, "prompt: empty (needs at least one token)", "prompt", "invalid_value")
        if len(ids) > limit:
            raise APIError(400, f"prompt: {len(ids)} tokens, above the limit of {limit}", "prompt",
                           "context_length_exceeded")
        if len(ids) + params.max_tokens > eng.max_positions:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                                f"context of {eng.max_positions} tokens", "max_tokens", "context_length_exceeded")
        vocab = eng.shape.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt", "invalid_value")
        refused = eng.refuse(ids)
        if refused:
            raise APIError(400, f"prompt: {refused}", "prompt", "invalid_value")

    def submit(self, eng: ServingEngine, prompts: list[list[int]], params: SamplingParams, stream: bool):
        """One engine request per prompt, admitted together or not at all (a request of k prompts needs k free
        places in the queue); returns (requests, asyncio queues of their events)."""
        if eng.waiting + len(prompts) > self.cfg.max_waiting:
            raise APIError(429, "server overloaded: too many queued requests, retry later", None, "overloaded",
                           "rate_limit_error")
        loop = asyncio.get_running_loop()
        reqs, queues = [], []
        for ids in prompts:
            q: asyncio.Queue = asyncio.Queue()

            def emit(kind, payload, q=q):
                loop.call_soon_threadsafe(q.put_nowait, (kind, payload))

            reqs.append(EngineRequest(list(ids), params, emit, stream=stream))
            reqs[-1].group = reqs[0].id  # one group per HTTP request: admitted in turn with other requests
            queues.append(q)
            self.metrics.prompt_tokens.inc(len(ids))
        for r in reqs:
            eng.submit(r)
        return reqs, queues

    @staticmethod
    async def next_event(q: asyncio.Queue, watch: _Hangup):
        """The next engine event; raises CancelledError once the client has gone away (checked at least every
        ``_Hangup.every`` seconds, whether or not events keep arriving)."""
        while True:
            await watch.check()
            try:
                return await asyncio.wait_for(q.get(), timeout=watch.every)
            except asyncio.TimeoutError:
                pass

    def _cancel(self, reqs) -> None:
        for r in reqs:
            r.cancel()
        self.metrics.cancelled.inc(len(reqs))

    async def collect(self, reqs, queues, request: Request) -> list[dict]:
        """Wait for every request to finish (non-streaming); cancels them all if the client goes away."""
        results, watch = [], _Hangup(request)
        try:
            for q in queues:
                while True:
                    kind, payload = await self.next_event(q, watch)
                    if kind == "error":
                        raise APIError(500, f"generation failed: {payload}", code="engine_error", type_="server_error")
                    if kind == "done":
                        results.append(payload)
                        self.metrics.generated_tokens.inc(payload["completion_tokens"])
                        break
        except asyncio.CancelledError:
            self._cancel(reqs)
            raise
        return results

    async def stream(self, reqs, queues, request: Request, chunk, include_usage: bool):
        t0 = time.perf_counter()
        first, finished, watch = True, False, _Hangup(request)
        try:
            start_chunk = chunk(None, None, start=True)
            if start_chunk is not None:
                yield sse(start_chunk)
            while True:
                kind, payload = await self.next_event(queues[0], watch)
                if kind == "delta":
                    if first:
                        self.metrics.ttft.observe(time.perf_counter() - t0)
                        first = False
                    yield sse(chunk(payload, None))
                elif kind == "error":
                    yield sse(error_body(f"generation failed: {payload}", "server_error"))
                    break
                else:
                    self.metrics.generated_tokens.inc(payload["completion_tokens"])
                    yield sse(chunk(None, payload["finish_reason"]))
                    if include_usage:
                        yield sse({**chunk(None, None, usage_only=True).model_dump(),
                                   "usage": usage([payload]).model_dump()})
                    break
            finished = True
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # client went away (or the server is stopping): free the slot
                self._cancel(reqs)
            self.metrics.latency.labels(self.endpoint).observe(time.perf_counter() - t0)

    async def respond(self, reqs, queues, request: Request, body: SamplingRequest, chunk, whole):
        """The response of submitted requests: SSE chunks built by ``chunk`` when ``body.stream``, otherwise
        ``whole(results)`` once every request has finished."""
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self.stream(reqs, queues, request, chunk, include),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        t0 = time.perf_counter()
        results = await self.collect(reqs, queues, request)
        # built and serialised in a thread: with echo and logprobs a response can hold millions of entries
        body = await asyncio.to_thread(_json_of, whole, results)
        del results
        if len(body) > LARGE_RESPONSE:
            await asyncio.to_thread(release_freed_memory)
        self.metrics.latency.labels(self.endpoint).observe(time.perf_counter() - t0)
        return Response(body, media_type="application/json")


def _json_of(whole, results) -> bytes:
    return whole(results).model_dump_json().encode()


class CompletionServing(Serving):
    endpoint = "/v1/completions"

    def body_bounds(self) -> tuple[int, int]:
        """At most --max-prompts prompts (each its own list when they are token ids), each of at most the prompt
        limit's ids."""
        limit = self.prompt_limit(self.engine())
        return self.cfg.max_prompts + self.FIELDS, self.cfg.max_prompts * limit + self.FIELDS

    async def __call__(self, body: CompletionRequest, request: Request):
        eng = self.engine()
        params = body.to_sampling_params(self.cfg.model_name, self.cfg.max_tokens)
        p = body.prompt
        prompts = [p] if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else list(p)
        if not prompts:
            raise APIError(400, "prompt: empty list", "prompt", "invalid_value")
        if len(prompts) > self.cfg.max_prompts:
            raise APIError(400, f"prompt: {len(prompts)} prompts, above this server's limit of "
                                f"{self.cfg.max_prompts} per request", "prompt", "too_many_prompts")
        for x in prompts:
            if isinstance(x, str):
                self.check_text_size(eng, [x], "prompt")
            elif len(x) > self.prompt_limit(eng):
                raise APIError(400, f"prompt: {len(x)} tokens, above the limit of {self.prompt_limit(eng)}",
                               "prompt", "context_length_exceeded")
        def prepared() -> list[list[int]]:  # off the loop: up to max_prompts x the prompt limit ids to check
            ids = [eng.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in prompts]
            for x in ids:
                self.check_prompt(eng, x, params)
            return ids

        ids = await asyncio.to_thread(prepared)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.cfg.model_name}

        def chunk(text, finish, start=False, usage_only=False):
            if start:
                return None
            choices = [] if usage_only else [CompletionChoice(text=text or "", finish_reason=finish)]
            return CompletionResponse(**base, choices=choices)

        def choice(i: int, r: dict) -> CompletionChoice:
            prompt_text, lp = "", None
            if body.echo or body.logprobs is not None:
                prompt_text = prompts[i] if isinstance(prompts[i], str) else eng.tokenizer.decode(ids[i])
            if body.logprobs is not None:  # offsets count from the start of the choice's text
                lp = legacy_logprobs(eng.tokenizer, ids[i] if body.echo else [], r["prompt_scores"] or [],
                                     r["generated"], r["scores"], 0 if body.echo else len(prompt_text))
            return CompletionChoice(text=(prompt_text if body.echo else "") + r["text"], index=i,
                                    finish_reason=r["finish_reason"], logprobs=lp)

        def whole(results):
            return CompletionResponse(**base, usage=usage(results), choices=[choice(i, r)
                                                                             for i, r in enumerate(results)])

        reqs, queues = self.submit(eng, ids, params, body.stream)
        return await self.respond(reqs, queues, request, body, chunk, whole)


def legacy_logprobs(tok, prompt_ids, prompt_scores, generated, scores, offset: int) -> dict:
    """OpenAI's legacy completions ``logprobs``: ``tokens`` (each token's text), ``token_logprobs``,
    ``top_logprobs`` ({token text: log-probability} of the top alternatives and the token itself) and
    ``text_offset`` (character offset of each token in the choice's text: cumulative token lengths, from
    ``offset``). With echo the prompt's tokens come first; its first token has ``None`` (nothing predicts it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    rows = [(t, s) for t, s in zip(prompt_ids, prompt_scores)] + list(zip(generated, scores))
    texts: dict[int, str] = {}  # each distinct token decoded once (a response may name a token thousands of times)

    def text_of(token: int) -> str:
        if token not in texts:
            texts[token] = tok.decode([token])
        return texts[token]

    for token, scored in rows:
        text = text_of(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if scored is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        _, lp, alts = scored
        out["token_logprobs"].append(lp)
        top: dict[str, float] = {}
        for a, v in alts.items():  # tokens that read the same (e.g. partial bytes) keep the most likely one's value,
            text = text_of(a)  # so max(top.values()) is still the chosen token's when it was the argmax
            top[text] = max(v, top.get(text, -np.inf))
        out["top_logprobs"].append(top)
    return out


class ChatServing(Serving):
    endpoint = "/v1/chat/completions"

    def body_bounds(self) -> tuple[int, int]:
        """At most one message per token of the prompt limit, each an object of at most three members."""
        limit = self.prompt_limit(self.engine())
        return limit + self.FIELDS, 3 * limit + self.FIELDS

    async def __call__(self, body: ChatCompletionRequest, request: Request):
        eng = self.engine()
        if not eng.tokenizer.chat_template:
            raise APIError(400, f"the model '{self.cfg.model_name}' has no chat template; use /v1/completions",
                           "messages", "chat_template_missing")
        params = body.to_sampling_params(self.cfg.model_name, self.cfg.max_tokens)
        if len(body.messages) > self.prompt_limit(eng):  # every message renders to at least one token
            raise APIError(400, f"messages: {len(body.messages):,} messages, more than the {self.prompt_limit(eng):,} "
                                "tokens this server takes", "messages", "context_length_exceeded")
        self.check_text_size(eng, [m.content for m in body.messages], "messages")
        msgs = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            ids = await asyncio.to_thread(eng.tokenizer.apply_chat_template, msgs, True, True)
        except Exception as e:  # noqa: BLE001  a template that rejects the conversation (e.g. role order)
            raise APIError(400, f"messages: the chat template rejected them ({e})", "messages",
                           "invalid_value") from None
        self.check_prompt(eng, ids, params)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.cfg.model_name}

        def chunk(text, finish, start=False, usage_only=False):
            if usage_only:
                return ChatCompletionChunk(**base, choices=[])
            delta = {"role": "assistant", "content": ""} if start else ({"content": text} if text else {})
            return ChatCompletionChunk(**base, choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])

        def whole(results):
            r = results[0]
            return ChatCompletionResponse(**base, usage=usage(results), choices=[
                ChatChoice(message=AssistantMessage(content=r["text"]), finish_reason=r["finish_reason"])])

        reqs, queues = self.submit(eng, [ids], params, body.stream)
        return await self.respond(reqs, queues, request, body, chunk, whole)
