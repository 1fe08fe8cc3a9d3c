"""Where a command may write: every output path is checked before any work is done, so that nothing the user has is
replaced or lost. An output never overlaps an input, never lands inside another model, run or export folder (a
sweep's folder holds its members by design), never replaces anything but a regular file (a rename onto a device, a
FIFO or a link replaces the node itself), and replaces an existing file or folder only with ``--force``, a folder
only if bdlora wrote it. Each check ends by claiming the output for this process (one writer per output: a second
command writing the same path at the same time is refused before it does any work); what depends on the path's
current contents is checked after the claim, since a command that held it may have just finished writing it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bdlora.base.errors import UsageError
from bdlora.base.io import NotAFileError, OutputBusyError, check_replaceable, claim
from bdlora.base.runs import (
    BENCH_JSON,
    CKPT_STATE,
    CKPT_TRAINABLE,
    CONFIG,
    EXPORT_MARKER,
    GENAI_CONFIG,
    SHIP_OPTIONS,
    STUDENT_META,
    SWEEP_OPTIONS,
    RunDir,
    SweepDir,
)


def free_space(path: str | os.PathLike) -> tuple[Path, int]:
    """(the nearest folder at or above ``path`` that exists, its file system's free bytes): where a command that
    will write under ``path`` checks it has room before any work."""
    where = Path(path).resolve()
    while not where.exists():
        where = where.parent
    return where, shutil.disk_usage(where).free


def check_resumable_out(out: str | os.PathLike) -> None:
    """``ship --out``: a folder the command creates or resumes (what it holds is checked against its resume
    contract by the command), outside any other model or run folder, claimed by this process."""
    path = Path(out)
    _not_a_link(path)
    check_not_inside(path)
    _check_creatable(path, "--out")
    _claim(path, "--out")
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path}: is a file, not a folder (choose a new directory)")


def check_new_out(out: str | os.PathLike) -> None:
    """``train --out`` and ``sweep --out``: a new (or empty) folder outside any other run."""
    check_resumable_out(out)
    path = Path(out)
    if path.exists() and any(path.iterdir()):
        raise UsageError(f"--out {path}: exists and is not empty (choose a new directory or --resume it)")


def check_out_dir(out: str | os.PathLike, force: bool, inputs: tuple = ()) -> None:
    """Refuse an existing ``--out`` that is a file or a non-empty folder unless ``--force`` (a file is refused even
    then, and so is a non-empty folder that is not a bdlora output: --force replaces only what bdlora wrote); never
    allow writing over or inside an input, or inside another model or run folder."""
    out = Path(out)
    for src in inputs:
        s, o = Path(src).resolve(), out.resolve()
        if o == s or s in o.parents or o in s.parents:
            raise UsageError(f"--out {out}: overlaps the input {src}; inputs are never modified")
    _not_a_link(out)
    check_not_inside(out)
    _check_creatable(out, "--out")
    _claim(out, "--out")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder (choose a folder path)")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise UsageError(f"--out {out}: exists and is not empty (use --force to replace it)")
        if not is_artefact(out):
            raise UsageError(f"--out {out}: is not a folder bdlora wrote; --force replaces only those (choose a new "
                             "folder)")


def _not_a_link(out: Path) -> None:
    """An output folder is written under a temp name and renamed over ``out``: a symbolic link there (to a bdlora
    folder, or dangling) would be replaced, not followed, after the whole command ran ("Cannot call rmtree on a
    symbolic link"); refused before any work."""
    if out.is_symlink():
        target = os.readlink(out)
        raise UsageError(f"--out {out}: is a symbolic link (to {target}); give the folder itself or a new path")


def check_not_inside(out: str | os.PathLike, what: str = "--out") -> None:
    """Refuse an output folder inside another model, run or export folder (sweep folders hold their members)."""
    inside = artefact_folder(out, sweeps=False)
    if inside is not None:
        raise UsageError(f"{what} {out}: is inside the model/run folder {inside} (choose a folder outside it)")


# Files whose presence makes a folder a model, run or export folder: a report is never written into one (a --report
# named M/config.json replaced the model's config and the folder no longer loaded).
STREAMING = ("auto", "on", "off")  # --streaming: read and write a model one layer at a time (models.stream)
DEFAULT_STREAMING = STREAMING[0]
_WEIGHT_SUFFIXES = (".safetensors", ".onnx", ".onnx.data", ".gguf", ".bin", ".pt")
_ARTEFACT_MARKERS = ("summary.json", "compression.json", EXPORT_MARKER, BENCH_JSON, SWEEP_OPTIONS, GENAI_CONFIG,
                     STUDENT_META, CKPT_STATE, CKPT_TRAINABLE)


def is_artefact(folder: str | os.PathLike) -> bool:
    """A model, run, export, bench or sweep folder: one with a bdlora marker file, a run's config.json, or a
    transformers config.json beside weights."""
    folder = Path(folder)
    if any((folder / m).is_file() for m in _ARTEFACT_MARKERS) or RunDir(folder).started():
        return True
    return (folder / CONFIG).is_file() and any(f.name.endswith(_WEIGHT_SUFFIXES) for f in _files(folder))


def artefact_folder(path: str | os.PathLike, sweeps: bool = True) -> Path | None:
    """The artefact folder that holds ``path`` (at any depth), if any. ``sweeps=False`` passes over sweep and ship
    folders, which hold their members' folders by design."""
    for folder in Path(path).resolve().parents:
        if not sweeps and (SweepDir(folder).started() or (folder / SHIP_OPTIONS).is_file()):
            continue  # a sweep's or ship's folder holds its members' folders
        if is_artefact(folder):
            return folder
    return None


def _files(folder: Path):
    try:
        return [f for f in folder.iterdir() if f.is_file()]
    except OSError:
        return []


def check_out_file(path: str | os.PathLike, what: str = "--report", force: bool = False, ours: bool = False) -> None:
    """Refuse, before any work is done, an output file that names a folder, a device, a pipe, a socket or a link
    (a rename would replace it), lies inside a model, run or export folder (unless ``ours``: the command's own
    default place, e.g. eval's report beside the folder it scores), already exists (unless ``force``), or cannot be
    created."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path}: is a folder (name a file)")
    try:
        check_replaceable(path)
    except NotAFileError as e:
        raise UsageError(f"{what} {e}") from None
    inside = None if ours else artefact_folder(path)
    if inside is not None:
        raise UsageError(f"{what} {path}: is inside the model/run folder {inside}, whose files are never replaced "
                         "(name a file outside it)")
    _check_creatable(path, what)
    _claim(path, what)
    if path.is_dir():
        raise UsageError(f"{what} {path}: is a folder (name a file)")
    if path.exists() and not force:
        raise UsageError(f"{what} {path}: exists (use --force to replace it)")


def _claim(path: Path, what: str) -> None:
    try:
        claim(path)
    except OutputBusyError as e:
        raise UsageError(f"{what} {e}") from None


def _check_creatable(path: Path, what: str) -> None:
    """The nearest existing ancestor must be a writable folder (and a real one: /proc accepts no new files)."""
    parent = path.resolve().parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or str(parent).startswith(("/proc", "/sys")):
        raise UsageError(f"{what} {path}: cannot create it ({parent} is not a writable folder)")
