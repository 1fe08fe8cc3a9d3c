"""Perplexity over the held-out slice (SPEC 7): exp of the mean next-token NLL over a fixed token count, packed to
the sequence length. The LM head runs in position chunks so full-vocabulary logits never sit in memory at once.

``TorchLM`` is the PyTorch side of ``bdlora eval``'s model interface (its onnxruntime side, ``OrtLM``, needs no
torch and lives in ``eval.targets``)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from bdlora.base.errors import DataError, require_finite_nll
from bdlora.data.blocks import PackedBlocks
from bdlora.models.arch import hidden_and_head
from bdlora.models.kv_cache import cache_argument, returned_cache


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
    if count == 0:  # exp(0 / 1) read as perplexity 1.000: callers build blocks with blocks.scored_blocks
        raise DataError("no tokens to score: the held-out slice is shorter than one block")
    return require_finite_nll(total / count), count


def perplexity(model, blocks: PackedBlocks, batch_size: int = 8, device: str | torch.device | None = None) -> float:
    if device is None:
        device = next(model.parameters()).device
    nll, _ = mean_nll(model, blocks, batch_size=batch_size, device=device)
    return math.exp(nll)


@torch.no_grad()
def agreement(teacher, draft, blocks: PackedBlocks, batch_size: int = 4) -> float:
    """How often ``draft``'s next-token argmax is ``teacher``'s, over every position of ``blocks`` with both reading
    the same (the text's) context: a speculative draft's greedy acceptance, token by token."""
    same = count = 0
    for start in range(0, len(blocks), batch_size):
        x = torch.from_numpy(blocks.get(range(start, min(start + batch_size, len(blocks)))))
        t = teacher(input_ids=x).logits.argmax(-1)
        d = draft(input_ids=x).logits.argmax(-1)
        same += int((t == d).sum())
        count += t.numel()
    if count == 0:
        raise DataError("no tokens to compare: the held-out slice is shorter than one block")
    return same / count


class TorchLM:
    """A causal LM in PyTorch (teacher, trained student with gated/PEFT modules, compressed or exported folder)."""

    kind = "torch"

    def __init__(self, model, device: str | torch.device = "cpu"):
        self.model = model.eval()
        self.device = torch.device(device)
        self.config = getattr(model, "config", None)
        self.cache_argument = cache_argument(model)

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    @torch.no_grad()
    def step(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past):
        """Logits of the last position (B, V) and the updated cache; ``past`` None on the first call."""
        t = self._t
        out = self.model(input_ids=t(ids), attention_mask=t(mask), position_ids=t(pos), use_cache=True,
                         logits_to_keep=1, **{self.cache_argument: past})  # the LM head on the last position only
        return out.logits[:, -1].float().cpu().numpy(), returned_cache(out)

    @torch.no_grad()
    def score(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past) -> np.ndarray:
        """Logits (B, n, V) of ``ids`` continuing the cached prefix ``past``, which is rolled back afterwards (so
        decoding can go on from the prefix as if this call never happened)."""
        t = self._t
        n = past.get_seq_length()
        out = self.model(input_ids=t(ids), attention_mask=t(mask), position_ids=t(pos), use_cache=True,
                         **{self.cache_argument: past})
        past.crop(n - past.get_seq_length())  # negative: remove that many (transformers 4.x and 5.x alike)
        return out.logits.float().cpu().numpy()

    @torch.no_grad()
    def logits(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, keep: int = 0) -> np.ndarray:
        """Logits (B, T, V) of every position, or of the last ``keep`` only (B, keep, V); no cache."""
        t = self._t
        out = self.model(input_ids=t(ids), attention_mask=t(mask), position_ids=t(pos), logits_to_keep=keep)
        return out.logits.float().cpu().numpy()

    def nll(self, blocks: PackedBlocks, batch_size: int = 8) -> tuple[float, int]:
        return mean_nll(self.model, blocks, batch_size=batch_size, device=self.device)
