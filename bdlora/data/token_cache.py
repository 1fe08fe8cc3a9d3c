"""A tokenised corpus's cache folder (``train.bin``, ``val.bin``, ``meta.json``), trusted only when whole: each split
file holds exactly the tokens ``meta.json`` counts and has the SHA-256 recorded when it was written (like the teacher
samples' ``samples.jsonl``). A rewritten ``val.bin`` was read as it was (eval 21.511 against the teacher's 26.678, the
true figure 36.381) and a truncated one failed with "mmap length is greater than file size"; a folder that is not
whole is tokenised (or mixed) again in its place. Folders written before the digests were recorded are made again
once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bdlora.base.io import sha256
from bdlora.base.runs import CORPUS_META

SPLITS = ("train", "val")
DIGESTS = "sha256"  # in meta.json: {split: the SHA-256 of SPLIT.bin}


def sealed(folder: Path, meta: dict) -> dict:
    """``meta`` with the digest of each split file of ``folder``, written as its meta.json (last: a folder without it
    is an interrupted build)."""
    meta = {**meta, DIGESTS: {s: sha256(Path(folder) / f"{s}.bin") for s in SPLITS}}
    (Path(folder) / CORPUS_META).write_text(json.dumps(meta, indent=2))
    return meta


def whole(folder: Path) -> dict | None:
    """The meta.json of a cache folder whose split files are whole, else None (absent, damaged, or written before
    digests were recorded: the caller builds it again)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / CORPUS_META).read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in SPLITS:
            f = folder / f"{split}.bin"
            if f.stat().st_size != int(meta["tokens"][split]) * itemsize or sha256(f) != meta[DIGESTS][split]:
                return None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return meta
