"""Perplexity over the held-out slice (SPEC 7): exp of the mean next-token NLL over a fixed token count, packed to
the sequence length. The LM head runs in position chunks so full-vocabulary logits never sit in memory at once."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bdlora.data import PackedBlocks
from bdlora.distill import hidden_and_head


@torch.no_grad()
def mean_nll(model, blocks: PackedBlocks, batch_size: int = 8, chunk_size: int = 1024,
             device: str | torch.device = "cpu") -> tuple[float, int]:
    """(mean next-token NLL in nats, number of predicted tokens) over every block."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        x = torch.from_numpy(blocks.get(range(start, min(start + batch_size, len(blocks))))).to(device)
        hidden, head = hidden_and_head(model, x)  # (B, T, H)
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # (N, H): positions with a next token
        y = x[:, 1:].reshape(-1)
        for i in range(0, h.shape[0], chunk_size):
            logits = head(h[i : i + chunk_size]).float()  # (n, V)
            total += F.cross_entropy(logits, y[i : i + chunk_size], reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1), count


def perplexity(model, blocks: PackedBlocks, batch_size: int = 8, device: str | torch.device | None = None) -> float:
    if device is None:
        device = next(model.parameters()).device
    nll, _ = mean_nll(model, blocks, batch_size=batch_size, device=device)
    return math.exp(nll)


def run_val_blocks(cfg: dict, tokenizer) -> PackedBlocks:
    """The held-out blocks a run was scored on (same corpus, split, sequence length and token count), from the
    tokenised-corpus cache (re-tokenised if the cache was cleared)."""
    from pathlib import Path

    from bdlora.data import Corpus, tokenize_corpus

    cache = Path(cfg["cache_dir"]).expanduser() if cfg.get("cache_dir") else None
    data = tokenize_corpus(Corpus(cfg["data"]), tokenizer, cfg["heldout_fraction"], cache)
    return PackedBlocks(data.tokens("val"), cfg["seq_len"], max_tokens=cfg["eval_tokens"])
