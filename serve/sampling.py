"""Sampling in one place: the parameters a request asks for (``SamplingParams``) and the pure function that draws
the next token from one row of logits (``sample``). Requests build their parameters themselves
(``protocol.SamplingRequest.to_sampling_params``); both engines call ``sample`` through ``Sequence``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # score each generated token with this many top alternatives (None: do not score)
    echo: bool = False  # also score the prompt's tokens (with logprobs); max_tokens may then be 0 (score only)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """The next token: the argmax at temperature 0, else a draw from softmax(logits / T) restricted to the smallest
    set of tokens whose probability reaches ``top_p`` (nucleus). ``rng`` is only used (and needed) when sampling.
    Non-finite logits raise ``FloatingPointError`` (the engine fails that sequence alone)."""
    if not np.isfinite(logits).all():
        raise FloatingPointError("the model produced non-finite logits for this sequence")
    if params.temperature <= 0.0:
        return int(np.argmax(logits))
    # shift before dividing: (z - max) / T is <= 0 for every T > 0, so a tiny temperature gives -inf (exp 0), never
    # inf - inf = NaN
    z = (logits.astype(np.float64) - float(logits.max())) / params.temperature
    probs = np.exp(z)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs)
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, params.top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return int(rng.choice(len(probs), p=probs))
