"""What each step of a pipeline (``ship``'s, ``sweep``'s) read and wrote, so that a rerun keeps a step only when it
can be trusted:

- its output (a folder, or one file) is whole: the readers' own integrity checks pass (a model folder's recorded
  weight digests, an export's graph, tokenizer and config, a run's summary and student, a bench's JSON, an
  evaluation's figures), and no file in it changed since the step finished (the SHA-256 of every file, recorded
  then);
- it was made by the same command and parameters (its ``Invocation``: they hold what earlier steps decided, e.g. the
  teacher's chosen rounding scheme); a record written before settings files holds the command line, which is
  compared with this step's spelled (``cli.spell``), so a ship folder written then resumes;
- nothing it read changed: the outputs of the steps it read (by digest) and the user's teacher (its files' sizes and
  modification times), and none of them was redone by this invocation.

Any other step is redone, its old output removed first (every step's output is the pipeline's own), and so is every
step that read it. The record is ``DIR/steps.json``, rewritten (atomically) after each step. A step's output, or
anything in it, that is a symbolic link is refused: a pipeline reads and measures only what it wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from bdlora import SCHEMA_VERSION
from bdlora.base.argv import Invocation, Spell
from bdlora.base.errors import BdloraError, RunDirError, UsageError
from bdlora.base.io import read_json, sha256, write_json
from bdlora.base.runs import BENCH_JSON, EVAL, EXPORT_MARKER, MODEL_ONNX, BenchDir, ModelDir, RunDir
from bdlora.models.integrity import check_model_folder, check_safetensors
from bdlora.models.runtime import check_onnx_dir

STEPS_FILE = "steps.json"  # in the pipeline's folder: every finished step's record
SOURCE = "teacher"  # the name of the user's teacher among a step's reads


@dataclass
class Step:
    """One step of a pipeline: a bdlora command and its settings, what it writes last, and what it reads."""

    name: str  # its name in the ledger (and, unless ``output`` says otherwise, its output under the folder)
    invocation: Invocation  # the command and its parameters (ship: handed to it as a settings file)
    marker: str  # the file its command writes last (``verify_output`` checks the output by it; EVAL: the output
    # is that one file, an evaluation)
    what: str = ""  # one line for the progress display
    reads: tuple[str, ...] = ()  # the earlier steps whose outputs it reads (beside the teacher)
    output: str | None = None  # its output under the folder (default: ``name``)

    @property
    def out(self) -> str:
        return self.output or self.name


def _links_refused(path: Path, where: str) -> None:
    if path.is_symlink():
        raise UsageError(f"{path}: is a symbolic link (to {os.readlink(path)}); {where} holds only what bdlora "
                         "wrote there itself (remove the link, and that step is made again)")


def recorded(inv: Invocation) -> dict:
    """``inv`` as steps.json holds it (a tuple a list, as JSON reads it back), so a record compares equal to the step
    that made it."""
    return json.loads(json.dumps(inv.to_json()))


def folder_digest(path: Path) -> str:
    """SHA-256 over every file's path (relative to ``path``) and content, in sorted order (a file: its content's); a
    symbolic link anywhere in it refused (it would make the pipeline read or measure another model)."""
    path = Path(path)
    _links_refused(path, path.parent.name or str(path.parent))
    if path.is_file():
        return sha256(path)
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        _links_refused(p, str(path))
        if p.is_file():
            h.update(f"{p.relative_to(path).as_posix()}\0{sha256(p)}\n".encode())
    return h.hexdigest()


def source_fingerprint(source: str) -> str:
    """The user's teacher as ship read it: each file's name, size and modification time (not its content: a teacher
    of 8B parameters is 16 GB), or the name itself for a hub id."""
    path = Path(source)
    if not path.is_dir():
        return f"name:{source}"
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def verify_output(path: Path, marker: str) -> None:
    """The readers' checks of a step's output, by the file its command writes last (``BdloraError`` when damaged)."""
    if marker == EXPORT_MARKER:
        check_onnx_dir(path, MODEL_ONNX, "genai")
    elif marker == ModelDir.MARKER:
        check_model_folder(path, ModelDir(path).read(ModelDir.MARKER))
    elif marker == RunDir.MARKER:
        run = RunDir(path)
        run.require_finished()
        run.read(RunDir.MARKER)
        for f in sorted(run.student_dir.rglob("*.safetensors")):
            check_safetensors(f)
    elif marker == BENCH_JSON:
        BenchDir(path).timed()
    elif marker == EVAL:  # the output is this one file: an evaluation's figures
        try:
            figures = read_json(path)["ppl"]
        except (ValueError, KeyError, TypeError, OSError):
            figures = None
        if not isinstance(figures, dict):
            raise RunDirError(f"{path}: not an evaluation (no perplexity figures)")
    else:
        raise ValueError(f"no check for a step writing {marker}")


@dataclass
class Ledger:
    """``DIR/steps.json``: {step: {"invocation", "reads", "output"}} of every finished step, and this invocation's
    view: the digest of every output verified or made so far (``now``) and the steps it ran (``redone``)."""

    folder: Path
    spell: Spell | None  # an ``Invocation`` as its command line (without the program): how ship's records
    # written before settings files are read (None: such a record is not this step's)
    steps: dict[str, dict] = field(default_factory=dict)
    now: dict[str, str] = field(default_factory=dict)
    redone: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, folder: Path, source: str, spell: Spell | None = None) -> Ledger:
        path = Path(folder) / STEPS_FILE
        steps: dict = {}
        if path.is_file():
            try:
                steps = read_json(path)["steps"]
                assert isinstance(steps, dict) and all(isinstance(v, dict) for v in steps.values())
            except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
                steps = {}  # damaged: every step is verified afresh and recorded again
        return cls(Path(folder), spell, steps, {SOURCE: source_fingerprint(source)})

    def same_command(self, record: dict, step) -> bool:
        """Whether ``record`` was made by ``step``'s command and parameters: its ``invocation``, or, in a record
        written before settings files, its command line (``command``) as this step's is spelled."""
        if "invocation" in record:
            return record["invocation"] == recorded(step.invocation)
        return self.spell is not None and record.get("command") == self.spell(step.invocation)

    def reads(self, step) -> dict[str, str]:
        return {name: self.now.get(name, "") for name in (SOURCE, *step.reads)}

    def stale(self, step) -> str | None:
        """Why ``step`` must be (re)done, or None when its output can be kept (then its digest is in ``now``)."""
        out = self.folder / step.out
        _links_refused(out, str(self.folder))
        if not (out.is_file() if step.marker == EVAL else (out / step.marker).is_file()):
            return "not done" if not out.exists() else f"unfinished (no {step.marker})"
        if again := [r for r in step.reads if r in self.redone]:
            return f"{', '.join(again)} was made again"
        record = self.steps.get(step.name)
        if record is not None and not self.same_command(record, step):
            return "its command changed (an earlier step decided otherwise)"
        if record is not None and record.get("reads") != self.reads(step):
            changed = [k for k, v in self.reads(step).items() if (record.get("reads") or {}).get(k) != v]
            return f"what it read changed since ({', '.join(changed)})"
        try:
            verify_output(out, step.marker)
        except BdloraError as e:
            return f"damaged ({str(e)[:200]})"
        digest = folder_digest(out)
        if record is not None and record.get("output") != digest:
            return "a file in it changed after it finished"
        self.now[step.name] = digest
        if record is None or "invocation" not in record:  # written before records (or before settings files) were
            self.finished(step, digest, redone=False)  # kept: whole by the readers' checks; recorded now
        return None

    def clear(self, step) -> None:
        """Remove what a step left (its output is the pipeline's own), so its command starts from nothing."""
        out = self.folder / step.out
        _links_refused(out, str(self.folder))
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        self.steps.pop(step.name, None)
        self._write()

    def made(self, step) -> None:
        """The step's command finished: its output checked as a rerun would check it, then recorded."""
        out = self.folder / step.out
        try:
            verify_output(out, step.marker)
        except BdloraError as e:
            raise RunDirError(f"step {step.name} finished, but its output does not pass the readers' checks: "
                              f"{e}") from None
        self.finished(step, folder_digest(out), redone=True)

    def finished(self, step, digest: str, redone: bool) -> None:
        self.now[step.name] = digest
        if redone:
            self.redone.add(step.name)
        self.steps[step.name] = {"invocation": recorded(step.invocation), "reads": self.reads(step), "output": digest}
        self._write()

    def _write(self) -> None:
        write_json(self.folder / STEPS_FILE, {"schema_version": SCHEMA_VERSION, "steps": self.steps})


def do_step(ledger: Ledger, step: Step, rep, make, resumable=lambda: False) -> float | None:
    """One step of any pipeline (``ship``'s, run as a process; ``sweep``'s, in this one): ``make`` its output unless
    the ledger keeps it (whole, unchanged, made by the same settings from what it read then), why shown on ``rep``
    (a ``Reporter``); its old output removed first, unless ``resumable`` says the step continues from it (a training
    run from its latest checkpoint). The seconds ``make`` took, or None when the step was kept."""
    why = ledger.stale(step)
    if why is None:
        rep.stage(f"{step.name}: done before, verified and kept ({step.what})")
        return None
    if why != "not done":
        rep.stage(f"{step.name}: made again: {why}")
    if not (why.startswith("unfinished") and resumable()):
        ledger.clear(step)
    began = time.monotonic()
    make()
    ledger.made(step)
    return round(time.monotonic() - began, 1)
