"""Scoring next-token predictions in numpy, whatever computes the logits (an onnxruntime graph, a PyTorch forward
read one layer at a time): the stable log normaliser and the mean NLL and argmax over packed blocks. Needs no torch
and no onnxruntime."""

from __future__ import annotations

import numpy as np

from bdlora.base.errors import DataError, require_finite_nll

SCORE_ELEMENTS = 1 << 26  # logits per scoring batch (256 MB in fp32): a large vocabulary scores fewer blocks at once


def log_normaliser(logits: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis, stable (logits minus this is the log-softmax), in float64: the exponentials
    in the logits' own precision (each in (0, 1] after the max is taken off), their sum in float64."""
    top = logits.max(-1, keepdims=True)
    e = logits - top
    np.exp(e, out=e)
    return np.log(e.sum(-1, dtype=np.float64)) + top[..., 0].astype(np.float64)


def score_batches(blocks, vocab_size: int, batch_size: int):
    """The (B, T) batches ``score_logits`` scores, in its order: ``batch_size`` blocks at a time, fewer where their
    logits would pass ``SCORE_ELEMENTS``. A scorer that must know its calls before it runs them (a graph run in
    pieces, ``bdlora.export.genai.pieces``) takes them from here."""
    batch_size = max(1, min(batch_size, SCORE_ELEMENTS // max(1, blocks.seq_len * vocab_size)))
    for start in range(0, len(blocks), batch_size):
        yield blocks.get(range(start, min(start + batch_size, len(blocks))))


def score_logits(logits_of, blocks, vocab_size: int, batch_size: int, what: str) -> tuple[float, np.ndarray]:
    """``score_blocks`` for any scorer: ``logits_of`` maps a (B, T) batch of blocks to its (B, T, V) logits (a graph
    from an empty cache, a PyTorch forward), called on ``score_batches`` in order; ``what`` names it when its NLL is
    not finite."""
    total, count, preds = 0.0, 0, []
    for x in score_batches(blocks, vocab_size, batch_size):
        logits = logits_of(x)[:, :-1]  # (B, T-1, V)
        logz = log_normaliser(logits)
        tgt = np.take_along_axis(logits, x[:, 1:, None], -1)[..., 0].astype(np.float64)
        total += float((logz - tgt).sum())
        count += tgt.size
        preds.append(logits.argmax(-1).reshape(-1))
    if count == 0:  # callers build blocks with blocks.scored_blocks; this is the last guard
        raise DataError("no tokens to score: the held-out slice is shorter than one block")
    return require_finite_nll(total / count, what), np.concatenate(preds)
