"""The third builtin corpus, ``fortunes``: English of a different kind from the other two (not source code, not
software documentation): the quotations, literature, poems, proverbs and jokes of BSD ``fortune(6)``, as Debian's
``fortunes`` package ships them (about 2 MB of text, 12,526 entries in 30 files, after the software ones are
left out).

It exists so that a model calibrated or healed on ``builtin:1,prose:1`` still has a domain it never saw: bench's
``--eval-data`` and eval's ``--domains`` default to it then. Fetched once from Debian's package archive (the .deb,
pinned by version and SHA-256, unpacked in Python: an ``ar`` archive holding ``data.tar.xz``; nothing is installed)
and kept in the cache with its licence (the package's copyright file) and ``corpus.json``. Each file's fortunes
(separated by ``%`` lines) are grouped ``ENTRIES_PER_DOCUMENT`` to a document, so the held-out split (by document)
draws from every file.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bdlora.base.errors import DataError
from bdlora.base.io import atomic_dir, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import CORPUS_FILE

FORTUNES = "fortunes"
ENTRIES_PER_DOCUMENT = 40
HELDOUT_FRACTION = 0.05  # of 330 documents: about 100 KB (25k tokens of a 49k vocabulary) held out


@dataclass(frozen=True)
class DebSource:
    package: str
    version: str
    url: str
    sha256: str
    folder: str  # where the fortune files sit inside the package's data archive
    licence_member: str
    licence: str
    left_out: tuple[str, ...]  # files that are software talk or not prose
    note: str


FORTUNES_SOURCE = DebSource(
    "fortunes", "1:1.99.1-7.3",
    "http://deb.debian.org/debian/pool/main/f/fortune-mod/fortunes_1.99.1-7.3_all.deb",
    "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5",
    "./usr/share/games/fortunes/", "./usr/share/doc/fortunes/copyright", "BSD-4-Clause (UC Berkeley)",
    ("computers", "debian", "linux", "linuxcookie", "perl", "ascii-art", "translate-me"),
    "The fortune files of Debian's fortunes package (fortune-mod 1.99.1): quotations, literature, poems, proverbs "
    "and jokes; the files about computers and Linux, the ASCII art and the translation template left out")


def fetch(url: str, timeout: float = 60.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except (OSError, ValueError) as e:
        raise DataError(f"--data {FORTUNES}: could not fetch {url} from Debian's package archive ({e}); pass a "
                        "folder of your own text instead") from None


def deb_member(deb: bytes, prefix: str) -> bytes:
    """The member of an ``ar`` archive (a .deb) whose name starts with ``prefix`` (e.g. ``data.tar``)."""
    if not deb.startswith(b"!<arch>\n"):
        raise DataError(f"--data {FORTUNES}: the downloaded package is not a Debian archive")
    at = 8
    while at + 60 <= len(deb):
        name, size = deb[at:at + 16].decode().strip().rstrip("/"), int(deb[at + 48:at + 58].decode().strip())
        if name.startswith(prefix):
            return deb[at + 60:at + 60 + size]
        at += 60 + size + (size & 1)
    raise DataError(f"--data {FORTUNES}: the package holds no {prefix}*")


def entries(text: str) -> list[str]:
    """A fortune file's entries (separated by lines holding only ``%``), stripped, empty ones dropped."""
    out, cur = [], []
    for line in text.splitlines():
        if line.strip() == "%":
            out.append("\n".join(cur).strip())
            cur = []
        else:
            cur.append(line.rstrip())
    out.append("\n".join(cur).strip())
    return [e for e in out if e]


def write_documents(data_tar: bytes, src: DebSource, dst: Path) -> tuple[int, int]:
    """The kept fortune files as documents of ``ENTRIES_PER_DOCUMENT`` entries (``dst/docs/FILE-K.txt``) and the
    licence as ``dst/LICENSE``; (documents, entries)."""
    docs = n = 0
    (dst / "docs").mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data_tar) if data_tar[:6] == b"\xfd7zXZ\x00"
                                         else data_tar)) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            name = m.name[len(src.folder):] if m.name.startswith(src.folder) else None
            if not m.isfile() or not name or "/" in name or "." in name or name in src.left_out:
                continue
            found = entries(tar.extractfile(m).read().decode("utf-8", errors="replace"))
            for k in range(0, len(found), ENTRIES_PER_DOCUMENT):
                part = found[k:k + ENTRIES_PER_DOCUMENT]
                (dst / "docs" / f"{name}-{k // ENTRIES_PER_DOCUMENT:03d}.txt").write_text("\n\n".join(part) + "\n")
                docs, n = docs + 1, n + len(part)
        (dst / "LICENSE").write_bytes(tar.extractfile(src.licence_member).read())
    return docs, n


def fortunes_dir(cache: Path, reporter: Reporter = SILENT, src: DebSource = FORTUNES_SOURCE) -> Path:
    """The fortunes corpus as a folder of .txt files in the cache (with its LICENSE and ``corpus.json``), fetched and
    unpacked on first use; a changed download is refused."""
    out = Path(cache) / "corpora" / f"{FORTUNES}-{src.version.replace(':', '_')}"
    if (out / CORPUS_FILE).is_file():
        return out
    reporter.stage(f"fetching Debian's {src.package} {src.version} package (its fortune files are the {FORTUNES} "
                   "corpus; nothing is installed)")
    deb = fetch(src.url)
    digest = hashlib.sha256(deb).hexdigest()
    if digest != src.sha256:
        raise DataError(f"--data {FORTUNES}: {src.url} has SHA-256 {digest[:16]}..., not the pinned "
                        f"{src.sha256[:16]}...; refusing a changed corpus")
    with atomic_dir(out) as dst:
        docs, n = write_documents(deb_member(deb, "data.tar"), src, dst)
        write_json(dst / CORPUS_FILE, {"name": FORTUNES, "package": src.package, "version": src.version,
                                       "url": src.url, "sha256": digest, "licence": src.licence,
                                       "licence_file": "LICENSE", "note": src.note, "files": docs, "entries": n,
                                       "left_out": list(src.left_out)})
    return out
