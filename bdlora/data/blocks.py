"""Training sequences from a tokenised corpus and their order: packed blocks (nanoGPT), one truncated document per
sequence (the paper's), and the deterministic sampler that makes a batch a pure function of (seed, step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from bdlora.base.errors import DataError

if TYPE_CHECKING:
    import torch

class PackedBlocks:
    """A token stream viewed as consecutive ``seq_len`` blocks (the tail that does not fill a block is dropped).
    With ``bos`` (a model whose tokenizer starts every text with it, ``data.bos_first``), each block is ``bos``
    followed by the next ``seq_len - 1`` tokens of the stream: the model sees position 0 as it was trained to."""

    def __init__(self, tokens: np.ndarray, seq_len: int, max_tokens: int | None = None, bos: int | None = None):
        self.bos = bos
        self.stride = seq_len - 1 if bos is not None else seq_len  # stream tokens per block
        if max_tokens is not None:
            tokens = tokens[: max(1, max_tokens // seq_len) * self.stride]
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_blocks = len(tokens) // self.stride if self.stride > 0 else 0

    def __len__(self) -> int:
        return self.num_blocks

    def get(self, indices) -> np.ndarray:
        """(len(indices), seq_len) int64 array of the selected blocks."""
        s = self.stride
        rows = [np.asarray(self.tokens[i * s : (i + 1) * s], dtype=np.int64) for i in indices]
        if self.bos is not None:
            rows = [np.concatenate([[self.bos], r]) for r in rows]
        return np.stack(rows)


    def batch(self, indices) -> tuple[torch.Tensor, None]:
        """(ids, attention mask): packed blocks are all real tokens, so no mask."""
        import torch

        return torch.from_numpy(self.get(indices)), None


def scored_blocks(tokens: np.ndarray, seq_len: int, max_tokens: int | None, what: str,
                  split: str = "held-out slice", bos: int | None = None) -> PackedBlocks:
    """``PackedBlocks`` of a slice that is scored or calibrated on, refused in one line (naming ``what``, e.g.
    ``--data DIR``) when it is shorter than one block: scoring no token gave perplexity exp(0) = 1.000."""
    blocks = PackedBlocks(tokens, seq_len, max_tokens=max_tokens, bos=bos)
    if len(blocks) < 1:
        raise DataError(f"{what}: its {split} has {len(tokens):,} tokens, fewer than one block of {seq_len} (a "
                        "corpus with more documents, a larger --heldout-fraction, or another --data)")
    return blocks


class DocumentBlocks:
    """One document per sequence: its first ``seq_len`` tokens (its EOS included when it fits), right-padded with EOS
    and masked. Right padding under causal attention never changes a real position's logits, so the mask only keeps
    the padding out of the loss. Documents are found by their EOS separators in the token stream (scanned in chunks,
    so a memmapped corpus larger than RAM works); a document needs a token and its successor, so bare EOS are
    skipped. With ``bos``, each document is preceded by it (its first ``seq_len - 1`` tokens follow)."""

    CHUNK = 1 << 24

    def __init__(self, tokens: np.ndarray, seq_len: int, eos: int, bos: int | None = None):
        ends = [np.flatnonzero(np.asarray(tokens[i : i + self.CHUNK]) == eos) + i
                for i in range(0, len(tokens), self.CHUNK)]
        ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64) if len(ends) else ends
        keep = ends > starts
        self.tokens, self.seq_len, self.eos, self.bos = tokens, seq_len, eos, bos
        room = seq_len - (bos is not None)
        self.starts, self.stops = starts[keep], np.minimum(ends[keep] + 1, starts[keep] + room)

    def __len__(self) -> int:
        return len(self.starts)

    def batch(self, indices):
        """(ids, mask), each a (len(indices), seq_len) int64 tensor; mask 1 on the document's own tokens."""
        import torch

        ids = np.full((len(indices), self.seq_len), self.eos, dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, i in enumerate(indices):
            doc = np.asarray(self.tokens[self.starts[i] : self.stops[i]], dtype=np.int64)
            if self.bos is not None:
                doc = np.concatenate([[self.bos], doc])
            ids[row, : len(doc)], mask[row, : len(doc)] = doc, 1
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def get(self, indices) -> np.ndarray:
        return self.batch(indices)[0].numpy()


def training_blocks(tokens: np.ndarray, seq_len: int, packing: str, eos: int,
                    bos: int | None = None) -> PackedBlocks | DocumentBlocks:
    return DocumentBlocks(tokens, seq_len, eos, bos) if packing == "truncate" else PackedBlocks(tokens, seq_len,
                                                                                                bos=bos)


class BlockSampler:
    """Deterministic batch order: sample ``k`` of the run is position ``k`` of an endless sequence of per-epoch
    permutations seeded by (seed, epoch). A batch is therefore a pure function of (seed, step), which is what lets
    ``--resume`` continue the data stream exactly without storing a data cursor beyond the step."""

    def __init__(self, num_blocks: int, seed: int):
        self.num_blocks = num_blocks
        self.seed = seed
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)}
        return self._perm_cache[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        out = []
        for k in range(start, start + count):
            epoch, pos = divmod(k, self.num_blocks)
            out.append(int(self._perm(epoch)[pos]))
        return out
