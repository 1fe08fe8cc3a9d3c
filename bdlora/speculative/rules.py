"""The acceptance rules of speculative decoding, pure numpy: what a round of k proposed tokens commits.

A proposer (a draft model, or the prompt-lookup n-grams) suggests tokens ``d_1 .. d_k``; the target scores the
committed context followed by them in one call, giving its logits ``z_1 .. z_{k+1}`` (``z_i`` predicts the token at
the position of ``d_i``; ``z_{k+1}`` the one after ``d_k``). Then:

- **greedy** (temperature 0): ``d_i`` is accepted while it is the target's argmax of ``z_i``; the first mismatch is
  replaced by that argmax, and if all k match the target's argmax of ``z_{k+1}`` follows (the bonus token). The
  committed tokens are exactly the ones greedy decoding of the target alone gives.
- **sampling**: the rule of Leviathan, Kalman and Matias (2023, *Fast Inference from Transformers via Speculative
  Decoding*) and Chen et al. (2023): ``d_i``, drawn from the proposer's distribution ``q_i``, is accepted with
  probability ``min(1, p_i(d_i) / q_i(d_i))``; on the first rejection a token is drawn from the residual
  ``norm(max(0, p_i - q_i))``; if all k are accepted one more is drawn from ``p_{k+1}``. Every committed token is
  then distributed exactly as the target's own sampling (``p`` and ``q`` are the distributions *after* temperature
  and top-p, so the output is the target's under the request's settings). A deterministic proposer (prompt lookup)
  is the case ``q_i = one-hot(d_i)``: accept with probability ``p_i(d_i)``, on rejection draw from ``p_i`` without
  ``d_i``.

``distribution`` is the one definition of "the request's distribution" (serving's ``sample`` draws from it too).
"""

from __future__ import annotations

import numpy as np


def distribution(logits: np.ndarray, temperature: float, top_p: float = 1.0) -> np.ndarray:
    """The next-token distribution (float64, sums to 1) of one row of logits under ``temperature`` (0: all the mass
    on the argmax) and nucleus ``top_p`` (the smallest set of tokens whose probability reaches it). Non-finite
    logits raise ``FloatingPointError``."""
    if not np.isfinite(logits).all():
        raise FloatingPointError("the model produced non-finite logits for this sequence")
    if temperature <= 0.0:
        probs = np.zeros(logits.shape[-1], dtype=np.float64)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    # shift before dividing: (z - max) / T is <= 0 for every T > 0, so a tiny temperature gives -inf (exp 0), never
    # inf - inf = NaN
    z = (logits.astype(np.float64) - float(logits.max())) / temperature
    probs = np.exp(z)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs)
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return probs


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``probs`` (``distribution``'s output)."""
    return int(rng.choice(len(probs), p=probs))


def verify_greedy(proposal: list[int], target_logits: np.ndarray) -> tuple[int, int | None]:
    """(accepted, next token) of a greedy round: ``target_logits`` (n, V) with n = k + 1 rows (or k when the last
    proposed token was not fed, e.g. end-of-text: then a full acceptance has no bonus and the next token is None)."""
    best = target_logits.argmax(-1)
    for i, d in enumerate(proposal):
        if int(best[i]) != int(d):
            return i, int(best[i])
    return len(proposal), (int(best[len(proposal)]) if len(best) > len(proposal) else None)


def verify_sampled(proposal: list[int], q: np.ndarray | None, p: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int | None]:
    """(accepted, next token) of a sampled round. ``p``: the target's distributions (n, V), n = k + 1 (or k, as in
    ``verify_greedy``); ``q``: the proposer's (k, V) the tokens were drawn from, None for a deterministic proposer
    (each ``q_i`` one-hot on ``d_i``)."""
    for i, d in enumerate(proposal):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        if qd <= 0.0:
            raise ValueError(f"proposed token {d} has probability 0 under the distribution it was drawn from")
        if rng.random() < min(1.0, pd / qd):
            continue
        if q is None:
            residual = p[i].copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        # rejected with probability 1 - sum(min(p, q)) = sum(max(0, p - q)) > 0: the residual has mass, except for
        # floating-point dust when p and q nearly agree, where p itself is the right draw
        return i, draw(residual / total if total > 0.0 else p[i], rng)
    if len(p) > len(proposal):
        return len(proposal), draw(p[len(proposal)], rng)
    return len(proposal), None


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of k proposals commits on average when each is accepted with probability ``alpha``
    independently of the others (Leviathan et al., eq. 1): ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    alpha = min(max(float(alpha), 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
