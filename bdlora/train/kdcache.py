"""The teacher's top-k targets for distillation, cached on disk (``--kd-topk K``).

Full-vocabulary KD runs the teacher on every micro-batch, every step, in every run. With ``--kd-topk K`` the loss
needs only the teacher's K most likely next tokens at temperature tau and their log-probabilities at each position
(``DistillationLoss.forward_topk`` puts the rest of the teacher's mass in one bucket). Those are computed once per
training sequence and kept in the cache, so a run's second epoch, a resumed run, a rerun with another learning rate
and every member of a sweep over the same teacher and data read them instead of running the teacher.

Layout: ``CACHE/kd-topk/<key>/`` where key hashes (format version, the teacher folder's SHA-256, K, tau, autocast);
``cache.json`` names the teacher and the settings; each sequence's targets are one safetensors file (``logp``
float32 and ``index`` int32, both (T-1, K)) named by the SHA-256 of its token ids and written atomically, so
concurrent runs that fill the same entry write identical files and an interrupted one leaves no file that looks
whole. The entry depends on the tokens alone (the teacher runs without a mask; causal attention keeps right padding
out of every real position), so packed blocks, truncated documents and mixtures share one cache. (ours)

Size: K x 8 bytes per token (K = 64: 512 B; the builtin quickstart's 1.2M training tokens took 600 MB), so this is
for the CPU-scale runs that reuse their data, not for a single pass over billions of tokens.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bdlora.base.io import load_tensors, save_tensors, write_json
from bdlora.models.arch import hidden_and_head
from bdlora.train.distill import autocast

FORMAT_VERSION = 1
DIR_NAME = "kd-topk"
META = "cache.json"


def teacher_topk(teacher, x: torch.Tensor, k: int, temperature: float, device: torch.device,
                 precision: str | None = None, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, index), each (B, T-1, K): the teacher's K largest log-probabilities at ``temperature`` for the token
    after each position but the last, and their token ids (int64), the LM head run over chunks of positions."""
    with torch.no_grad(), autocast(device, precision):
        hidden, head = hidden_and_head(teacher, x)
        b, t, h = hidden.shape
        flat = hidden[:, :-1].reshape(-1, h)
        values, index = [], []
        for i in range(0, flat.shape[0], chunk):
            logp = F.log_softmax(head(flat[i : i + chunk]).float() / temperature, dim=-1)
            v, ix = logp.topk(k, dim=-1)
            values.append(v)
            index.append(ix)
    return torch.cat(values).view(b, t - 1, k), torch.cat(index).view(b, t - 1, k)


def cache_dir(root: str | Path, fingerprint: str, k: int, temperature: float, precision: str | None) -> Path:
    """This teacher's and these settings' folder under ``root`` (the bdlora cache)."""
    key = hashlib.sha256(f"{FORMAT_VERSION}|{fingerprint}|{k}|{temperature!r}|{precision}".encode()).hexdigest()
    return Path(root) / DIR_NAME / key[:20]


def row_key(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()[:32]


# a stored top-k row's probabilities may sum past 1 by this much (float32 rounding of K log-probabilities)
MASS_TOLERANCE = 1e-3


def valid_targets(logp: torch.Tensor, index: torch.Tensor, positions: int, k: int, vocab: int) -> bool:
    """Whether (logp, index) is what ``teacher_topk`` writes for ``positions`` positions: float32 and int32 of shape
    (positions, k); finite log-probabilities, each row in non-increasing order with at most unit mass; token ids in
    [0, vocab), distinct within a row."""
    if logp.dtype != torch.float32 or index.dtype != torch.int32:
        return False
    if logp.shape != (positions, k) or index.shape != (positions, k):
        return False
    if positions == 0:
        return True
    if not torch.isfinite(logp).all() or (logp.diff(dim=-1) > 0).any():
        return False
    if (torch.logsumexp(logp.double(), dim=-1) > math.log1p(MASS_TOLERANCE)).any():
        return False
    if (index < 0).any() or (index >= vocab).any():
        return False
    ordered = index.sort(dim=-1).values
    return not (ordered.diff(dim=-1) == 0).any()


class TeacherTopK:
    """The teacher's top-k targets of training sequences: read from the cache when there, else computed on the
    sequences that miss (one teacher forward for all of them) and stored. ``hits`` / ``misses`` count sequences."""

    def __init__(self, teacher, k: int, temperature: float, root: Path, device: torch.device,
                 precision: str | None = None, chunk: int = 1024, describe: dict | None = None):
        self.teacher, self.k, self.temperature = teacher, k, temperature
        self.root, self.device, self.precision, self.chunk = Path(root), device, precision, chunk
        self.hits = self.misses = self.replaced = 0
        self.vocab = teacher.get_output_embeddings().out_features
        if not (self.root / META).exists():
            write_json(self.root / META, {"format_version": FORMAT_VERSION, "k": k, "temperature": temperature,
                                          "autocast": precision, **(describe or {})})

    def _file(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def _read(self, f: Path, positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A stored entry, or None when absent, unreadable or not what ``teacher_topk`` writes (then it is computed
        again and replaced; ``replaced`` counts those). Checked by value, not only by shape: entries rewritten
        with log-probabilities of +5 were read and the run ended at perplexity 1256 instead of 279, and an index
        past the vocabulary failed the run with a traceback on every rerun."""
        if not f.exists():
            return None
        try:
            t = load_tensors(f)
            logp, index = t["logp"], t["index"]
        except Exception:  # noqa: BLE001 - a damaged entry is recomputed, never trusted
            self.replaced += 1
            return None
        if not valid_targets(logp, index, positions, self.k, self.vocab):
            self.replaced += 1
            return None
        return logp, index.long()

    def targets(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp float32, index int64), each (B, T-1, K), on ``x``'s device."""
        keys = [row_key(row) for row in x.cpu().numpy()]
        found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, key in enumerate(keys):
            entry = self._read(self._file(key), x.shape[1] - 1)
            if entry is not None:
                found[i] = entry
        missing = [i for i in range(len(keys)) if i not in found]
        if missing:
            logp, index = teacher_topk(self.teacher, x[missing], self.k, self.temperature, self.device,
                                       self.precision, self.chunk)
            for j, i in enumerate(missing):
                found[i] = (logp[j].cpu(), index[j].cpu())
                save_tensors(self._file(keys[i]), {"logp": found[i][0], "index": found[i][1].to(torch.int32)})
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        logp = torch.stack([found[i][0] for i in range(len(keys))]).to(x.device)
        index = torch.stack([found[i][1] for i in range(len(keys))]).to(x.device)
        return logp, index

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"k": self.k, "dir": str(self.root), "sequences_read": self.hits, "sequences_computed": self.misses,
                "entries_replaced": self.replaced, "hit_rate": self.hits / total if total else None}
