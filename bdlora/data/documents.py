"""Corpora as documents: the builtin corpus (the Python standard library's own sources) and a user's files (text,
JSONL, Parquet, a saved Hugging Face dataset), read document by document, and the held-out split
(``bdlora.data.tokens`` tokenises what is read here into the on-disk token streams training reads).

Held-out split (SPEC 7): a document is validation when MD5(document id), read as a 128-bit integer, falls below
``fraction * 2**128``. The decision is taken document by document while streaming, so it never needs the whole
corpus in memory and is stable across machines, orders and runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bdlora.base.errors import DataError

BUILTIN = "builtin"
# 0.2% of the builtin corpus's ~1.8k documents leaves a handful for validation; 2% keeps ~70k held-out tokens (ours)
BUILTIN_HELDOUT_FRACTION = 0.02
DEFAULT_HELDOUT_FRACTION = 0.002
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_TEXT_SUFFIXES = {".txt", ".jsonl", ".parquet"}


# Memory bounds of tokenisation (issue: a 200 MB single-line .txt was killed at 22 GB). A fast tokenizer needs a few
# hundred bytes of working memory per byte of text it encodes in one call, so no call sees more than PIECE_CHARS of
# one document or BATCH_CHARS in all: a longer document is read and encoded in consecutive pieces (cut after a
# newline, else after a space, else anywhere), and its tokens are concatenated with one EOS after the last piece;
# shorter documents are encoded whole. A JSONL record is parsed whole: a longer line than MAX_JSONL_LINE is refused.
PIECE_CHARS = 1 << 20
BATCH_CHARS = 1 << 20
MAX_JSONL_LINE = 64 << 20


@dataclass(frozen=True)
class Document:
    """One document, or one piece of a document longer than ``PIECE_CHARS`` (then ``last`` is False on every piece
    but the final one; the pieces share the id)."""

    id: str  # stable id: relative path, or path:record-index
    text: str
    last: bool = True


def pieces(doc_id: str, chunks: Iterator[str], size: int = PIECE_CHARS) -> Iterator[Document]:
    """Re-cut a stream of text chunks into Documents of at most ``size`` characters, each ending after a newline
    where the text has one (else after a space), with ``last`` set on the final piece. Blank documents yield
    nothing."""
    buf, pending, any_text = "", None, False
    for chunk in chunks:
        buf += chunk
        while len(buf) > size:
            cut = _cut(buf, size)
            piece, buf = buf[:cut], buf[cut:]
            if pending is not None:
                yield pending
            any_text = any_text or bool(piece.strip())
            pending = Document(doc_id, piece, last=False)
    any_text = any_text or bool(buf.strip())
    if not any_text:
        return
    if pending is not None:
        yield pending
    yield Document(doc_id, buf, last=True)


def _cut(text: str, size: int) -> int:
    for sep in ("\n", " "):
        at = text.rfind(sep, size // 2, size)
        if at >= 0:
            return at + 1
    return size


def _text_pieces(path: Path, rel: str) -> Iterator[Document]:
    with open(path, encoding="utf-8", errors="replace") as fh:  # streamed: a file is never read whole
        yield from pieces(rel, iter(lambda: fh.read(PIECE_CHARS), ""))


def _printable(name: str) -> str:
    """A path as a str that encodes to UTF-8 (undecodable bytes of a file name shown as \\xNN), so a document id
    hashes and prints; unchanged for every valid name."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def is_heldout(doc_id: str, fraction: float) -> bool:
    """SPEC 7: MD5 of the stable document id, as an integer, below ``fraction`` of the hash space."""
    h = int(hashlib.md5(doc_id.encode("utf-8")).hexdigest(), 16)
    return h < int(fraction * (1 << 128))


# --------------------------------------------------------------------------------------------------------------------
# Corpus sources
# --------------------------------------------------------------------------------------------------------------------


def builtin_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def builtin_files() -> list[Path]:
    """The running interpreter's standard-library ``.py`` files, minus test suites and site-packages."""
    root = builtin_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                files.append(Path(dirpath) / name)
    return files


def _corpus_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in _TEXT_SUFFIXES]
    return [p for p in files if not any(part.startswith(".") for part in p.relative_to(path).parts)]


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


class Corpus:
    """A named source of documents: ``builtin`` or a path (file, directory, or ``datasets.save_to_disk`` folder)."""

    def __init__(self, spec: str | os.PathLike, what: str = "--data", name: str | None = None):
        self.spec = str(spec)
        self.name = name or self.spec  # what the user named (``prose``, ``teacher:N``) when spec is its folder
        self.is_builtin = self.spec == BUILTIN
        if self.is_builtin:
            self.root = builtin_root()
            self.files = builtin_files()
            self.kind = "builtin"
        else:
            path = Path(spec).expanduser()
            if not path.exists():
                raise DataError(f"{what} {spec}: no such file or directory (use 'builtin', 'prose', 'teacher:N', a "
                                "path to .txt, .jsonl, .parquet files or a datasets.save_to_disk folder, or a mixture "
                                "such as builtin:0.5,prose:0.5)")
            self.root = path if path.is_dir() else path.parent
            if _is_saved_dataset(path):
                self.kind = "saved_dataset"
                self.files = sorted(p for p in path.rglob("*") if p.is_file())
            else:
                self.kind = "files"
                self.files = _corpus_files(path)
                bad = [p for p in self.files if p.suffix not in _TEXT_SUFFIXES]
                if bad:
                    raise DataError(f"{what} {bad[0]}: unsupported file type '{bad[0].suffix}' "
                                    "(allowed: .txt, .jsonl with a 'text' field, .parquet with a 'text' column, "
                                    "or a datasets.save_to_disk folder)")
            if not self.files:
                raise DataError(f"{what} {spec}: no .txt, .jsonl or .parquet files found")
        self.default_heldout_fraction = BUILTIN_HELDOUT_FRACTION if self.is_builtin else DEFAULT_HELDOUT_FRACTION

    def fingerprint(self) -> str:
        """SHA-256 over every file's relative path and bytes, streamed (content-addressed cache key)."""
        h = hashlib.sha256(f"{self.kind}\n".encode())
        for f in self.files:
            h.update(os.fsencode(f.relative_to(self.root)) + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()

    def documents(self) -> Iterator[Document]:
        """Every document in a fixed order; one longer than ``PIECE_CHARS`` comes as consecutive pieces."""
        if self.kind == "saved_dataset":
            yield from _saved_dataset_documents(Path(self.spec))
            return
        for f in self.files:
            rel = _printable(str(f.relative_to(self.root)) if f != self.root else f.name)
            try:
                if self.is_builtin or f.suffix == ".txt":
                    yield from _text_pieces(f, rel)
                elif f.suffix == ".jsonl":
                    yield from _jsonl_documents(f, rel)
                elif f.suffix == ".parquet":
                    yield from _parquet_documents(f, rel)
            except OSError as e:  # removed, replaced or unreadable while the corpus was read
                raise DataError(f"--data {_printable(str(f))}: could not be read ({e.strerror or type(e).__name__}); "
                                "did it change while bdlora read the corpus?") from None


def _jsonl_documents(path: Path, rel: str) -> Iterator[Document]:
    where = _printable(str(path))
    with open(path, "rb") as fh:  # decoded line by line so a bad byte is reported with its line number
        for lineno, raw in enumerate(_bounded_lines(fh, where)):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"--data {where}:{lineno + 1}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); JSONL corpora must be UTF-8 encoded") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"--data {where}:{lineno + 1}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f"--data {where}:{lineno + 1}: each JSONL record needs a string 'text' field")
            text = rec["text"]
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON's \ud800 escapes decode to a lone surrogate, which is not text
                raise DataError(f"--data {where}:{lineno + 1}: 'text' holds the lone surrogate "
                                f"\\u{ord(text[e.start]):04x} at character {e.start + 1} (not a Unicode character; "
                                "fix or drop the record)") from None
            yield from pieces(_printable(str(rec.get("id", f"{rel}:{lineno}"))), iter((text,)))


def _bounded_lines(fh, where: str) -> Iterator[bytes]:
    """Lines of a binary file, each read with a bound: a line longer than ``MAX_JSONL_LINE`` is refused before it is
    held in memory."""
    lineno = 0
    while True:
        raw = fh.readline(MAX_JSONL_LINE + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_JSONL_LINE:
            raise DataError(f"--data {where}:{lineno}: a JSONL line longer than {MAX_JSONL_LINE:,} bytes; split the "
                            "record into several documents")
        yield raw


def _parquet_documents(path: Path, rel: str) -> Iterator[Document]:
    import pyarrow
    import pyarrow.parquet as pq

    def unreadable(e: Exception) -> DataError:
        return DataError(f"--data {path}: not a readable parquet file ({str(e).splitlines()[0][:120]})")

    try:
        pf = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise unreadable(e) from None
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"--data {path}: parquet file has no 'text' column (columns: {pf.schema_arrow.names})")
    has_id = "id" in pf.schema_arrow.names
    batches = pf.iter_batches(batch_size=1024, columns=["text", "id"] if has_id else ["text"])
    row = 0
    while True:
        try:  # a valid footer over damaged pages fails only here
            batch = next(batches)
        except StopIteration:
            return
        except (pyarrow.ArrowException, OSError) as e:
            raise unreadable(e) from None
        texts = batch.column("text").to_pylist()
        ids = batch.column("id").to_pylist() if has_id else [None] * len(texts)
        for text, doc_id in zip(texts, ids):
            if isinstance(text, str):
                yield from pieces(str(doc_id) if doc_id is not None else f"{rel}:{row}", iter((text,)))
            row += 1


def _saved_dataset_documents(path: Path) -> Iterator[Document]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a damaged folder; all mean "unreadable"
        raise DataError(f"--data {path}: not a readable datasets.save_to_disk folder "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})") from None
    splits = list(ds.items()) if isinstance(ds, datasets.DatasetDict) else [("", ds)]
    for split, d in splits:
        if "text" not in d.column_names:
            raise DataError(f"--data {path}: dataset has no 'text' column (columns: {d.column_names})")
        has_id = "id" in d.column_names
        for i, rec in enumerate(d):  # Arrow-backed, memory-mapped: rows stream from disk
            text = rec["text"]
            if isinstance(text, str):
                doc_id = str(rec["id"]) if has_id else (f"{split}:{i}" if split else str(i))
                yield from pieces(doc_id, iter((text,)))


