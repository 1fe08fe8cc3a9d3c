"""One request inside the engine's batch (``Sequence``): its random generator, its incremental detokeniser, its stop
strings and, when asked, the log-probabilities of its tokens (``SamplingParams.logprobs``) and of its prompt's
(``echo``).

Log-probabilities are the model's own (log-softmax of the raw logits, before temperature and top-p, as vLLM and
OpenAI report them), computed in float64; each scored token carries its top ``logprobs`` alternatives plus itself.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bdlora.serve.sampling import SamplingParams, sample


@dataclass
class Request:
    """One prompt to continue. ``emit(kind, payload)`` receives ("delta", text) events and one ("done", info)."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[str, object], None]
    stream: bool = True  # False: only the final ("done") event, no per-token wake-ups of the caller
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    group: int = 0  # the prompts of one list-prompt request share it (admitted in turn with other groups); 0: its id

    def __post_init__(self) -> None:
        self.group = self.group or self.id

    def cancel(self) -> None:
        self.cancelled.set()


_ids = itertools.count(1)

Scored = tuple[int, float, dict[int, float]]  # (token, its log-probability, {token: log-probability} of the top-k)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def score(lsm: np.ndarray, token: int, k: int) -> Scored:
    """``token``'s log-probability under ``lsm`` (one position's log-softmax) and the ``k`` most likely tokens
    (highest first), plus ``token`` itself if it is not among them."""
    top = np.argpartition(-lsm, k - 1)[:k] if k > 0 else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-lsm[top], kind="stable")]
    alts = {int(i): float(lsm[i]) for i in top}
    alts.setdefault(int(token), float(lsm[token]))
    return int(token), float(lsm[token]), alts


def score_prompt(logits: np.ndarray, prompt: list[int], k: int) -> list[Scored | None]:
    """Scores of a prompt's tokens from the prefill logits of its own positions (``logits[j]`` predicts
    ``prompt[j + 1]``); the first token has none (nothing predicts it)."""
    lsm = log_softmax(logits[: len(prompt) - 1])
    return [None] + [score(lsm[j], prompt[j + 1], k) for j in range(len(prompt) - 1)]


def safe_emit(req: Request, kind: str, payload) -> None:
    """Deliver an event; a failing callback (the client's loop is gone) must not take the worker down."""
    try:
        req.emit(kind, payload)
    except Exception:  # noqa: BLE001
        pass


class Sequence:
    """A request inside the batch: generated ids, the next token to feed, its position, its sampler.

    Text is detokenised incrementally (``tokenizers``' ``DecodeStream``): each token costs the decode of that token,
    not of everything generated so far, and a multi-byte character split across tokens waits for its last byte.
    Stop strings are searched only in the text not yet emitted (a tail that may start a stop string is held back),
    and the final text is one full decode, so it equals ``tokenizer.decode(generated)`` exactly."""

    def __init__(self, req: Request, tokenizer, eos: int | None):
        self.req = req
        self.tok = tokenizer
        self.eos = eos
        self.generated: list[int] = []
        self.sent = 0  # characters of text already emitted
        self.pos = len(req.prompt_ids)  # position of the next fed token
        self.next_token: int | None = None
        self.rng: np.random.Generator | None = None  # built on first sampling, where a bad seed fails this row alone
        self.finish: str | None = None
        self.text = ""  # the final text, set when the sequence finishes
        self.chunks: list[str] = []  # decoded text released so far (emitted, when streaming)
        self.pending = ""  # decoded, not yet released: it may be the start of a stop string
        self.seen = ""  # the full decode so far (only for tokenizers that clean up spaces)
        self.scores: list[Scored] = []  # generated tokens' log-probabilities (params.logprobs set)
        self.prompt_scores: list[Scored | None] | None = None  # the prompt's (params.echo with logprobs)
        # the streaming detokeniser; tokenizers that clean up spaces (" ." -> ".") across token boundaries, and
        # sequences with nothing to look at before the end, decode once at the finish instead
        self.watch = req.stream or bool(req.params.stop)
        self.incremental = self.watch and not getattr(tokenizer, "clean_up_spaces", False)
        self.stream = tokenizer.decode_stream() if self.incremental else None

    def sample(self, logits: np.ndarray) -> int:
        """The next token under this request's parameters (``sampling.sample``); the generator is built on the
        first draw, where a seed numpy refuses fails this sequence alone."""
        p = self.req.params
        if self.rng is None and p.temperature > 0.0:
            self.rng = np.random.default_rng(p.seed)
        return sample(logits, p, self.rng)

    def _new_text(self, token: int) -> str:
        """Text ``token`` adds (incremental), or, for tokenizers that clean up spaces, the difference of two full
        decodes (exact, quadratic: only those tokenizers pay it)."""
        if self.incremental:
            return self.stream.step(self.tok.backend_tokenizer, token) or ""
        text = self.tok.decode(self.generated, skip_special_tokens=True).rstrip("\ufffd")
        new, self.seen = text[len(self.seen):], text
        return new

    def accept(self, token: int, logits: np.ndarray | None = None) -> None:
        """Record a sampled token (scored from ``logits`` when the request asks for logprobs): stop on EOS / stop
        string / max_tokens, emit the text that is final."""
        p = self.req.params
        if self.eos is not None and token == self.eos:
            self.close("stop")
            return
        self.generated.append(token)
        if p.logprobs is not None and logits is not None:
            self.scores.append(score(log_softmax(logits), token, p.logprobs))
        if self.watch:
            self.pending += self._new_text(token)
            cut = min((i for i in (self.pending.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.close("stop", "".join(self.chunks) + self.pending[:cut])
                return
        if len(self.generated) >= p.max_tokens:
            self.close("length")
            return
        self.next_token = token
        if self.watch:
            self._release(p.stop)

    def _release(self, stops) -> None:
        """Release the pending text except a tail that may start a stop string (emitted when streaming), so
        each step searches only a few characters, however long the text grows."""
        n = len(self.pending)
        hold = max((k for s in stops for k in range(1, min(len(s), n + 1)) if self.pending.endswith(s[:k])),
                   default=0)
        if hold < n:
            ready, self.pending = self.pending[: n - hold], self.pending[n - hold :]
            self.chunks.append(ready)
            self.sent += len(ready)
            if self.req.stream:
                self.req.emit("delta", ready)

    def close(self, reason: str, text: str | None = None) -> None:
        self.finish = reason
        self.text = self.tok.decode(self.generated, skip_special_tokens=True) if text is None else text
        if self.req.stream and len(self.text) > self.sent:
            self.req.emit("delta", self.text[self.sent :])
            self.sent = len(self.text)
        done = {"finish_reason": reason, "prompt_tokens": len(self.req.prompt_ids),
                "completion_tokens": len(self.generated), "text": self.text, "generated": self.generated}
        if self.req.params.logprobs is not None:
            done.update(scores=self.scores, prompt_scores=self.prompt_scores)
        self.req.emit("done", done)
