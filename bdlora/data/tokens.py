"""Corpora: the builtin (Python standard library) corpus and user corpora, tokenised once into on-disk token files
that training reads through ``numpy.memmap``, so a corpus larger than RAM streams.

Layout of a tokenised corpus (a cache directory, keyed by a hash of corpus content + tokenizer + split):
    train.bin, val.bin   flat token streams (uint16 when the vocabulary fits, else uint32); each document is
                         followed by the tokenizer's EOS token. Training reads it (``bdlora.data.blocks``) as packed
                         blocks that may cross document boundaries (nanoGPT's packing, the default) or, with
                         ``--packing truncate``, one document per sequence cut to ``seq_len`` (the paper's
                         "truncated to sequences of length 1024"). Held-out perplexity always reads packed blocks
                         (each after BOS when the tokenizer starts every text with one), comparable across runs.
    meta.json            dtype, token and document counts per split, the fingerprint; written last, so a
                         directory without it is an interrupted build and is rebuilt.

The documents themselves (the builtin corpus, a user's files, the held-out split) are read by
``bdlora.data.documents``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bdlora.base.errors import DataError
from bdlora.base.io import atomic_dir
from bdlora.data.documents import BATCH_CHARS, Corpus, Document, is_heldout
from bdlora.data.token_cache import sealed, whole

FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------------------------------
# Tokenisation to an on-disk token stream
# --------------------------------------------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class TokenizedCorpus:
    path: Path
    meta: dict
    bos: int | None = None  # the BOS every sequence of its model starts with (tokenizer.bos_first), else None

    def tokens(self, split: str) -> np.ndarray:
        n = self.meta["tokens"][split]
        if n == 0:
            return np.zeros(0, dtype=self.meta["dtype"])
        return np.memmap(self.path / f"{split}.bin", dtype=self.meta["dtype"], mode="r", shape=(n,))


def default_cache_dir() -> Path:
    return Path(os.environ.get("BDLORA_CACHE", Path.home() / ".cache" / "bdlora")).expanduser()


def tokenize_corpus(
    corpus: Corpus,
    tokenizer,
    heldout_fraction: float,
    cache_dir: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    batch_docs: int = 256,
) -> TokenizedCorpus:
    """Tokenise ``corpus`` into train/val token files, reusing the cache when corpus, tokenizer and split match.

    Documents are encoded in batches with the fast (Rust, multi-threaded) tokenizer and appended to the files as
    they stream, so memory stays bounded by one batch whatever the corpus size.
    """
    cache_dir = Path(cache_dir or default_cache_dir()) / "data"
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token; bdlora separates packed documents with it")
    key = hashlib.sha256(
        f"{FORMAT_VERSION}|{corpus.fingerprint()}|{tokenizer_fingerprint(tokenizer)}|{heldout_fraction!r}".encode()
    ).hexdigest()[:20]
    out = cache_dir / f"tokens-{key}"
    if (meta := whole(out)) is not None:  # else absent, interrupted or damaged: tokenised again in its place
        return TokenizedCorpus(out, meta, bos_first(tokenizer))
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    with atomic_dir(out) as tmp:
        writer = _SplitWriter(tmp, dtype, tokenizer.eos_token_id, heldout_fraction)
        try:
            batch: list[Document] = []
            chars = 0
            for i, doc in enumerate(corpus.documents()):
                batch.append(doc)
                chars += len(doc.text)
                if len(batch) >= batch_docs or chars >= BATCH_CHARS:
                    writer.write(batch, tokenizer)
                    chars = 0
                if on_progress and corpus.kind != "saved_dataset":
                    on_progress(min(i + 1, len(corpus.files)), len(corpus.files))
            writer.write(batch, tokenizer)
        finally:
            writer.close()
        if writer.counts["train"] + writer.counts["val"] == 0:
            raise DataError(f"--data {corpus.spec}: the corpus is empty (no non-blank documents)")
        meta = sealed(tmp, {"format_version": FORMAT_VERSION, "corpus": corpus.spec, "corpus_kind": corpus.kind,
                            "heldout_fraction": heldout_fraction, "dtype": np.dtype(dtype).name,
                            "tokens": writer.counts, "documents": writer.docs,
                            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)})
    return TokenizedCorpus(out, meta, bos_first(tokenizer))


class _SplitWriter:
    """Appends each document's tokens plus EOS to train.bin or val.bin, by the MD5 split of its id."""

    def __init__(self, folder: Path, dtype, eos: int, heldout_fraction: float):
        self.dtype, self.eos, self.fraction = dtype, eos, heldout_fraction
        self.handles = {s: open(folder / f"{s}.bin", "wb") for s in ("train", "val")}
        self.counts = {"train": 0, "val": 0}
        self.docs = {"train": 0, "val": 0}

    def write(self, batch: list[Document], tokenizer) -> None:
        """Encode a batch of documents (or pieces) and append them; EOS and the document count follow the last
        piece of each document."""
        if not batch:
            return
        enc = tokenizer([d.text for d in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for d, ids in zip(batch, enc):
            split = "val" if is_heldout(d.id, self.fraction) else "train"
            arr = np.asarray(ids + [self.eos] if d.last else ids, dtype=self.dtype)
            self.handles[split].write(arr.tobytes())
            self.counts[split] += len(arr)
            self.docs[split] += int(d.last)
        batch.clear()

    def close(self) -> None:
        for h in self.handles.values():
            h.close()


def bos_first(tokenizer) -> int | None:
    """The BOS id the tokenizer starts every encoded text with, or None when it adds none (SmolLM2's, the builtin
    teacher's). A model whose tokenizer adds one was trained with it at position 0 and is scored and trained that way
    (``PackedBlocks(bos=...)``): Gemma 3 270M's held-out perplexity on the builtin corpus in blocks of 128 is 20.9
    with it and 160.7 without (512: 12.6 and 29.4)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def encode_prompt(tokenizer, text: str, bos: int | None) -> list[int]:
    """``text``'s tokens as the model reads a sequence: after ``bos`` when its tokenizer starts every text with one
    (``data.bos_first``: Gemma's), its special tokens otherwise left out."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [bos, *ids] if bos is not None else ids
