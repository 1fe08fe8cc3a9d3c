"""The second builtin corpus, ``prose``: English prose, the reStructuredText documentation of Django (640 files, 6 MB,
BSD-3-Clause), fetched once from the package registry as the project's source distribution with ``pip download
--no-deps`` (nothing is installed), pinned by version and SHA-256, and kept in the cache with its licence and
``corpus.json``.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bdlora.base.errors import DataError
from bdlora.base.io import atomic_dir, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import CORPUS_FILE

PROSE = "prose"


@dataclass(frozen=True)
class ProseSource:
    requirement: str
    sdist: str
    sha256: str
    docs: str  # the folder inside the sdist whose .txt files are the corpus
    licence: str
    licence_member: str
    note: str


# Django's documentation: technical English prose about web development, written for people (tutorials, how-tos,
# reference pages, release notes), not Python source. Pinned by version and hash so every machine reads the same text.
PROSE_SOURCE = ProseSource(
    "django==5.2.8", "django-5.2.8.tar.gz", "23254866a5bb9a2cfa6004e8b809ec6246eba4b58a7589bc2772f1bcc8456c7f",
    "django-5.2.8/docs/", "BSD-3-Clause", "django-5.2.8/LICENSE",
    "The documentation of Django 5.2.8 (reStructuredText sources, docs/**/*.txt) from its source distribution on PyPI")



def prose_dir(cache: Path, reporter: Reporter = SILENT) -> Path:
    """The prose corpus as a folder of .txt files in the cache (with its LICENSE and ``corpus.json``), fetched
    and extracted on first use."""
    src = PROSE_SOURCE
    out = Path(cache) / "corpora" / f"prose-{src.sdist.removesuffix('.tar.gz')}"
    if (out / CORPUS_FILE).is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="bdlora-prose-") as tmp:
        reporter.stage(f"fetching {src.requirement}'s source distribution from the package registry (its "
                       "documentation is the prose corpus; nothing is installed)")
        sdist = fetch_sdist(src.requirement, src.sdist, Path(tmp))
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != src.sha256:
            raise DataError(f"--data prose: {src.sdist} from the registry has SHA-256 {digest[:16]}..., not the "
                            f"pinned {src.sha256[:16]}...; refusing a changed corpus")
        with atomic_dir(out) as dst:
            files = extract_docs(sdist, src.docs, src.licence_member, dst)
            write_json(dst / CORPUS_FILE, {"name": PROSE, "requirement": src.requirement, "sdist": src.sdist,
                                           "sha256": digest, "licence": src.licence, "licence_file": "LICENSE",
                                           "note": src.note, "files": files})
    return out


def fetch_sdist(requirement: str, name: str, dest: Path) -> Path:
    """``pip download --no-deps --no-binary :all:`` of one requirement into ``dest`` (the index pip is configured
    with)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), requirement]
    res = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / name
    if res.returncode != 0 or not path.is_file():
        last = (res.stderr.strip().splitlines() or [f"no {name} downloaded"])[-1]
        raise DataError(f"--data prose: could not fetch {requirement} from the package registry ({last[:200]}); "
                        "pass a folder of your own text instead")
    return path


def extract_docs(sdist: Path, prefix: str, licence_member: str, dst: Path) -> int:
    """The ``.txt`` files under ``prefix`` of a source tarball into ``dst`` (paths kept, nothing outside ``prefix``
    and no links), and its licence as ``dst/LICENSE``; returns the number of documents."""
    n = 0
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith(prefix) and m.name.endswith(".txt") and ".." not in m.name:
                rel = Path(m.name[len(prefix):])
                if rel.parts[0].startswith(("_", ".")) or rel.name == "requirements.txt":  # theme, build deps
                    continue
                (dst / "docs" / rel).parent.mkdir(parents=True, exist_ok=True)
                (dst / "docs" / rel).write_bytes(tar.extractfile(m).read())
                n += 1
        (dst / "LICENSE").write_bytes(tar.extractfile(licence_member).read())
    return n
