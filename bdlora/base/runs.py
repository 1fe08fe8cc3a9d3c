"""The artefact layout: where every command reads and writes, and when an artefact counts as finished.

Every command reads the previous one's output (default: the latest finished one under ``runs/``) and writes a new
folder beside it; none modifies its input::

    runs/<time>-<method>/                 RunDir     train      finished when summary.json exists (written last)
    runs/<time>-<method>.compressed/      ModelDir   compress   finished when compression.json exists
    runs/<source>.oneshot-<R>x.compressed/ ModelDir  compress --one-shot (a pretrained model, no training)
    runs/<...>.compressed.onnx/           OnnxDir    export onnx  finished when export.json exists
    runs/<...>.compressed.hf/             ModelDir   export hf
    runs/<...>.compressed.bench/          BenchDir   bench      finished when bench.json exists
    runs/<...>.compressed.eval.json                  eval
    runs/sweep-<time>/                    SweepDir   sweep      options in sweep.json, finished with results.json
    runs/ship-<model>-<precision>/                   ship       options in ship.json, finished with recommendation.json

Every folder is written under a temp name and renamed into place (``io.atomic_dir``): a folder that exists is complete.

Provenance (the run a compressed model came from) is stored as an absolute path and one relative to the folder that
records it; ``ModelDir.source_run`` tries the relative one first (a tree moved whole still resolves).
"""

from __future__ import annotations

import itertools
import os
import shutil
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

from bdlora.base.errors import RunDirError
from bdlora.base.io import read_json, write_json
from bdlora.base.schemes import rounded

RUNS_DIR = "runs"
COMPRESSED, ONNX, HF, BENCH, EVAL, GENAI = ".compressed", ".onnx", ".hf", ".bench", ".eval.json", ".genai"
# File names inside the folders (the one place they are spelled; the classes below use them too)
CONFIG = "config.json"  # a run's options ({"config": ...}), or a model / export folder's transformers config
GENAI_CONFIG = "genai_config.json"  # what onnxruntime-genai reads beside its graph
EXPORT_MARKER = "export.json"  # written last by export onnx / export genai
MODEL_GGUF = "model.gguf"  # the file of an `export gguf` folder (beside its export.json and Modelfile)
BENCH_JSON = "bench.json"  # written last by bench
SWEEP_OPTIONS = "sweep.json"  # a sweep's options: its resume contract
# bdlora ship's model and options (its resume contract); its answer, written last; as a table; as a picture
SHIP_OPTIONS, SHIP_RESULT, SHIP_REPORT, SHIP_PLOT = "ship.json", "recommendation.json", "recommendation.md", "ship.png"
STUDENT_META = "bdlora_student.json"  # a run's student/: how to rebuild it (method, teacher, layers, adapter)
ADAPTER = "adapter"  # a kd-lora student's PEFT adapter folder, inside student/
CONTROLLER_LOG = "controller.jsonl"
MODEL_ONNX = "model.onnx"  # the graph of an export onnx / export genai folder (its weights: MODEL_ONNX + ".data")
ALL_LOGITS_ONNX = "model_all_logits.onnx"  # beside a genai model.onnx (last positions): every position's logits
MODEL_INT8_ONNX = "model_int8.onnx"  # export onnx --int8: the dynamically quantised graph beside it
TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"  # transformers' tokenizer files
TEACHER_JSON = "teacher.json"  # a built teacher's folder: what it is and how it was built (bdlora.models.teacher)
FACTORS_FILE, META_FILE = "budgeted.safetensors", "budgeted.json"  # a budgeted student's gates and factors
CORPUS_META = "meta.json"  # a tokenized corpus's cache folder: its source, tokenizer and splits
CORPUS_FILE, TEACHER_SAMPLES = "corpus.json", "samples.jsonl"  # a fetched/generated corpus: its record; teacher:N's
CKPT_STATE, CKPT_TRAINABLE, CKPT_OPTIMIZER, CKPT_RNG = (  # a training checkpoint's folder (checkpoint.py)
    "state.json", "trainable.safetensors", "optimizer.safetensors", "rng.safetensors")
PAPER_MAIN, PAPER_TABLE9, PAPER_ICL = "main.md", "table9.md", "icl.png"  # eval --paper / sweep merge outputs


def all_logits_graph(folder: str | os.PathLike) -> str:
    """The graph of an export folder with every position's logits: a genai folder's twin, else model.onnx."""
    return ALL_LOGITS_ONNX if (Path(folder) / ALL_LOGITS_ONNX).is_file() else MODEL_ONNX


class Artefact:
    """A folder written by one command. Subclasses name the file that marks it finished."""

    MARKER = ""
    GLOB = "*"
    WHAT = "artefact"
    MAKE = ""  # the command that writes one (for error messages)

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    def finished(self) -> bool:
        return (self.path / self.MARKER).is_file()

    def require_finished(self) -> None:
        if not self.path.is_dir():
            raise RunDirError(f"{self.path}: no such folder (pass a {self.WHAT}: {self.MAKE} writes one)")
        if not self.finished():
            raise RunDirError(f"{self.path}: not a finished {self.WHAT} (no {self.MARKER}; {self.MAKE} writes it "
                              "last)")

    def sibling(self, suffix: str) -> Path:
        """The default output of the next command: this folder's name plus ``suffix``, beside it."""
        return self.path.with_name(self.path.name + suffix)

    def read(self, name: str) -> dict:
        """A JSON file of this artefact, with a one-line error when it is missing or not valid JSON."""
        f = self.path / name
        try:
            doc = read_json(f)
        except FileNotFoundError:
            raise RunDirError(f"{f}: missing ({self.MAKE} writes it)") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise RunDirError(f"{f}: not valid JSON ({type(e).__name__}); the {self.WHAT} is damaged") from None
        if not isinstance(doc, dict):
            raise RunDirError(f"{f}: not a JSON object; the {self.WHAT} is damaged")
        return doc

    @classmethod
    def latest(cls, runs_dir: str | os.PathLike = RUNS_DIR):
        """The most recently finished artefact of this kind under ``runs_dir``."""
        found = [cls(p) for p in Path(runs_dir).glob(cls.GLOB) if p.is_dir()]
        found = [a for a in found if a.finished()]
        if not found:
            raise RunDirError(f"no finished {cls.WHAT} under {runs_dir}/ (run `{cls.MAKE}` first, or pass its folder)")
        return max(found, key=lambda a: (a.path / a.MARKER).stat().st_mtime)


FAILED = "failed.json"  # in a run folder whose training failed after a checkpoint


@dataclass(frozen=True)
class RunFacts:
    """What a training run resolved when it started, beside its options in config.json (under ``"run"``): world size
    (a resume must match), teacher checkpoint, kept layers, corpus cache and counts. Written by ``train``."""

    world_size: int = 1
    teacher_path: str | None = None
    layer_indices: tuple[int, ...] = ()
    teacher_layers: int | None = None
    data_cache: str | None = None
    data_tokens: dict | None = None
    samples_prefixes: bool = False  # teacher:N in a mixture continued the other parts' prefixes (False: older runs)

    @classmethod
    def of(cls, stored: dict) -> RunFacts:
        known = {f.name: stored[f.name] for f in fields(cls) if f.name in stored}
        if "layer_indices" in known:
            known["layer_indices"] = tuple(known["layer_indices"] or ())
        return cls(**known)


class RunDir(Artefact):
    """``bdlora train``'s run: config.json, metrics.jsonl, controller.jsonl, checkpoints/, student/, summary.json."""

    MARKER = "summary.json"
    WHAT = "bdlora run"
    MAKE = "bdlora train"

    @property
    def student_dir(self) -> Path:
        return self.path / "student"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG

    @property
    def metrics_log(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def controller_log(self) -> Path:
        return self.path / CONTROLLER_LOG

    @property
    def lora_start(self) -> tuple[Path, Path]:
        """Where the low-rank paths started (``train.budgeted.start.LowRankStart``): ranks and allocation (JSON),
        factors (safetensors). Written once before the first step; ``--resume`` reads them, never recomputes."""
        return self.path / "lora_start.json", self.path / "lora_start.safetensors"

    @property
    def structure(self) -> Path:
        """``train --forms``: the structured student the run started from (a model folder, ``train.forms_start``).
        Written once before the first step; every process and ``--resume`` read it, never recompute it."""
        return self.path / "structure"

    def started(self) -> bool:
        """A run's config.json (``{"config": {...options}}``), not a model folder's (``{"model_type": ...}``)."""
        f = self.config_file
        if not f.is_file():
            return False
        try:
            doc = read_json(f)
        except (ValueError, UnicodeDecodeError, OSError):  # damaged: a run only if it has a run's other files
            return any(p.exists() for p in (self.metrics_log, self.checkpoints_dir, self.student_dir))
        return isinstance(doc, dict) and "config" in doc and "model_type" not in doc

    def finished(self) -> bool:
        return self.started() and super().finished() and self.student_dir.is_dir()

    def config(self) -> dict:
        """The resolved training options the run was started with."""
        cfg = self.read(CONFIG).get("config")
        if not isinstance(cfg, dict):
            raise RunDirError(f"{self.config_file}: has no 'config' mapping; the run is damaged")
        return cfg

    def facts(self) -> RunFacts:
        """What the run resolved when it started (``RunFacts``)."""
        doc = self.read(CONFIG)
        stored = doc.get("run")
        if stored is None:  # runs written before RunFacts kept these among the options, under "extra"
            stored = (doc.get("config") or {}).get("extra") or {}
        return RunFacts.of(stored)

    def data_settings(self) -> dict:
        """What a corpus reader needs to rebuild the run's data: its options and what its facts say of ``teacher:N``
        (the checkpoint sampled, prefixes); a one-shot compression records the same as ``data_settings``."""
        f = self.facts()
        return {**self.config(), "source_path": f.teacher_path, "samples_prefixes": f.samples_prefixes}

    def summary(self) -> dict:
        return self.read("summary.json")

    def steps_taken(self) -> int:
        """The optimiser steps the finished run took (its summary's)."""
        steps = self.summary().get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise RunDirError(f"{self.path / self.MARKER}: no step count; the {self.WHAT} is damaged")
        return steps

    def compressed(self) -> Path:
        return self.sibling(COMPRESSED)

    def settle_failure(self, error: BaseException, step: int) -> str:
        """After training failed (not an interrupt): a run with no checkpoint has nothing to continue from, so its
        folder is removed and ``--out`` can be reused; otherwise ``failed.json`` marks it (a ``--resume`` from its
        last checkpoint removes the mark). Returns what was done, for the error message."""

        if not self.path.is_dir():
            return ""
        if not any(self.checkpoints_dir.glob("step-*")):
            shutil.rmtree(self.path, ignore_errors=True)
            return f"{self.path} removed (no checkpoint to continue from)"
        try:
            write_json(self.path / FAILED, {"error": str(error), "step": step, "time": datetime.now().isoformat()})
        except OSError:  # the disk that failed the run may refuse the mark too; the checkpoints are what matters
            return f"{self.path} kept with its checkpoints"
        return f"{self.path} kept with its checkpoints and marked failed ({FAILED})"

    def require_resumable(self) -> None:
        if not self.path.is_dir():
            raise RunDirError(f"--resume {self.path}: no such run directory")
        if not self.started():
            raise RunDirError(f"--resume {self.path}: not a bdlora run directory (no config.json)")
        if super().finished():
            raise RunDirError(f"--resume {self.path}: this run already finished (summary.json exists)")

    @staticmethod
    def new(method: str, runs_dir: str | os.PathLike = RUNS_DIR, out: str | os.PathLike | None = None) -> RunDir:
        """``out`` (checked and claimed first by ``outputs.check_new_out``), or a new ``runs_dir/<time>-<method>``,
        made here by an exclusive mkdir: two runs started in the same second get two folders, never one."""
        if out:
            return RunDir(out)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        Path(runs_dir).mkdir(parents=True, exist_ok=True)
        for i in itertools.count():
            path = Path(runs_dir) / (f"{stamp}-{method}" + (f"-{i}" if i else ""))
            try:
                path.mkdir()
            except FileExistsError:
                continue
            return RunDir(path)


class ModelDir(Artefact):
    """A compressed model folder (``bdlora compress`` or ``export hf``): a Hugging Face folder of the bdlora
    architecture with compression.json (the SPEC 6.4 report and its provenance)."""

    MARKER = "compression.json"
    GLOB = f"*{COMPRESSED}"
    WHAT = "compressed model folder"
    MAKE = "bdlora compress"

    def finished(self) -> bool:
        return (self.path / CONFIG).is_file() and super().finished()

    def report(self) -> dict:
        return self.read(self.MARKER)

    def source_run(self) -> RunDir | None:
        """The run this model was compressed from, if it can still be found (see the module docstring)."""
        return source_run(self.path, self.report().get("provenance", {}))

    def onnx_out(self) -> Path:
        return self.sibling(ONNX)

    def hf_out(self) -> Path:
        return self.sibling(HF)

    def bench_out(self) -> Path:
        return self.sibling(BENCH)

    def genai_out(self) -> Path:
        return self.sibling(GENAI)


class OnnxDir(Artefact):
    """``bdlora export onnx``'s folder: model.onnx (+ model_int8.onnx), config, tokenizer, export.json."""

    MARKER = EXPORT_MARKER
    GLOB = f"*{ONNX}"
    WHAT = "ONNX export folder"
    MAKE = "bdlora export onnx"


class GenaiDir(Artefact):
    """``bdlora export genai``'s folder: model.onnx(.data), genai_config.json, config, tokenizer, export.json."""

    MARKER = EXPORT_MARKER
    GLOB = f"*{GENAI}*"
    WHAT = "genai export folder"
    MAKE = "bdlora export genai"

    def quantized_ppl(self) -> float:
        """The rounded export's held-out perplexity, as its validation measured it."""
        ppl = ((self.read(self.MARKER).get("validation") or {}).get("quality") or {}).get("val_ppl_quantized")
        if isinstance(ppl, bool) or not isinstance(ppl, int | float):
            raise RunDirError(f"{self.path / self.MARKER}: no held-out perplexity of the rounded graph (an fp32 "
                              "export, or one written with --no-validate)")
        return float(ppl)


class BenchDir(Artefact):
    MARKER = BENCH_JSON
    GLOB = f"*{BENCH}"
    WHAT = "bench folder"
    MAKE = "bdlora bench"

    def report(self) -> dict:
        """bench.json, refused in one line when it holds no front of timed rows."""
        doc = self.read(self.MARKER)
        if not isinstance(doc.get("front"), list) or not doc["front"]:
            raise RunDirError(f"{self.path / self.MARKER}: no front of timed rows; the {self.WHAT} is damaged")
        return doc

    def timed(self) -> dict:
        """bench.json, refused in one line when it holds no timed rows: neither a front (a deployed bench's) nor
        results (an onnxruntime bench's, ``--scope modules/model/both``)."""
        doc = self.read(self.MARKER)
        if not any(isinstance(doc.get(k), list) and doc[k] for k in ("front", "results")):
            raise RunDirError(f"{self.path / self.MARKER}: no timed rows; the {self.WHAT} is damaged")
        return doc


class SweepDir(Artefact):
    """``bdlora sweep``'s folder: sweep.json (the options: the resume contract), one RunDir / ModelDir / eval file /
    BenchDir per member named ``<member>``, ``<member>.compressed``, ..., and results.json written last."""

    MARKER = "results.json"
    GLOB = "sweep-*"
    WHAT = "sweep folder"
    MAKE = "bdlora sweep"

    def started(self) -> bool:
        return (self.path / SWEEP_OPTIONS).is_file()

    def member(self, name: str) -> RunDir:
        return RunDir(self.path / name)

    @staticmethod
    def new(runs_dir: str | os.PathLike = RUNS_DIR, out: str | os.PathLike | None = None) -> SweepDir:
        """``out`` (checked first by ``outputs.check_new_out``), or ``runs_dir/sweep-<time>``."""
        if out:
            return SweepDir(out)
        return SweepDir(Path(runs_dir) / f"sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}")


def one_shot_out(source: str, mac_ratio: float, runs_dir: str | os.PathLike = RUNS_DIR,
                 precision: str | None = None, forms: str | None = None, decode: bool = False,
                 quant: str | None = None) -> Path:
    """Where ``compress SOURCE --one-shot`` writes by default: ``runs/<source>.oneshot-<R>x.compressed`` (with
    ``--precision P``: ``oneshot-P-<R>x``, and ``--quant Q``: ``oneshot-P-Q-<R>x``; with ``forms`` (``--forms``
    other than the default, which the caller passes as None), the forms joined by ``+`` before the ratio;
    ``decode`` (``--speedup``): ``decode`` before it; a compressed folder like any other, so ``export``, ``bench``
    and ``eval`` find it as the latest)."""
    name = Path(source.rstrip("/")).name.removesuffix(".gguf").replace("/", "-") or "model"
    named = forms.replace(",", "+").replace(" ", "") if forms else None
    tags = [t for t in (precision, quant, named, "decode" if decode else None) if t]
    return Path(runs_dir) / f"{name}.oneshot-{''.join(t + '-' for t in tags)}{mac_ratio:g}x{COMPRESSED}"


GGUF = "gguf-"  # a llama.cpp row's precision: gguf-q4_k_m (``gguf_precision``)


def gguf_precision(quant: str) -> str:
    """The front's precision of a GGUF file of ``quant`` (q4_k_m -> gguf-q4_k_m): its rows are compared with the
    teacher's GGUF of the same type, as genai rows with the teacher's export at their precision."""
    return GGUF + quant


def row_name(model: str, precision: str) -> str:
    """The genai bench's name of ``model``'s row at ``precision`` and of its folder (``genai-`` before it):
    ``compressed``, ``compressed-int4``, ``peer-NAME-int4``, a llama.cpp row ``compressed-gguf-q4_k_m`` (fp32: none;
    ``bench.front.precision_of`` reads it)."""
    return f"{model}-{precision}" if rounded(precision) or precision.startswith(GGUF) else model


def eval_json(source: str | os.PathLike) -> Path:
    """Where ``bdlora eval`` writes its report for ``source``: beside it, ``<name>.eval.json``."""
    source = Path(source)
    return source.with_name(source.name + EVAL)


def source_run(folder: str | os.PathLike, provenance: dict) -> RunDir | None:
    """The RunDir a provenance record points at (relative to ``folder`` first, then absolute), if it exists."""
    candidates = []
    if provenance.get("run_dir_relative"):
        candidates.append(Path(folder) / provenance["run_dir_relative"])
    if provenance.get("run_dir"):
        candidates.append(Path(provenance["run_dir"]))
    for c in candidates:
        run = RunDir(c)
        if run.started():
            return run
    return None
