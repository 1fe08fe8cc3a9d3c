"""The teacher's figures beside a student's: ``bdlora eval`` of a model whose teacher is known (from its run or its
one-shot provenance) scores the teacher on exactly the same held-out slice and ICL prompts, once per teacher and
settings (cached under ``<cache>/evals/``), so a figure is never read without what it is compared to."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from bdlora.base.io import read_json, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import CONFIG, MODEL_ONNX
from bdlora.data.corpora import SAMPLES_PREFIXES
from bdlora.data.documents import BUILTIN
from bdlora.data.tokens import default_cache_dir
from bdlora.eval.evaluate import EvalConfig, evaluate_target
from bdlora.models import sources
from bdlora.models.teacher import builtin_teacher_dir

EVALS = "evals"


def evaluate_with_teacher(path: str | Path, ecfg: EvalConfig, teacher: bool = True, device: str = "cpu",
                          reporter: Reporter = SILENT) -> dict:
    """``evaluate_target`` of ``path``, plus ``doc["teacher"]``: the teacher's evaluation on the same settings
    (``None`` with a reason in ``doc["teacher_note"]`` when there is no teacher to compare with)."""
    doc = evaluate_target(path, ecfg, device, reporter)
    if not teacher:
        return doc
    folder, why = teacher_folder(doc["data"].get("teacher"), Path(doc["data"].get("cache_dir") or
                                                                   default_cache_dir()))
    if folder is not None and _same(folder, path):
        folder, why = None, "this is the teacher"
    if folder is None:
        doc["teacher"], doc["teacher_note"] = None, why
        return doc
    same = dataclasses.replace(ecfg, data=doc["data"]["data"], heldout_fraction=doc["data"]["heldout_fraction"],
                               seq_len=doc["data"]["seq_len"], tokens=doc["data"]["eval_tokens"],
                               onnx_file=MODEL_ONNX,
                               domains=";".join(d for d in doc.get("domains") or {} if d != doc["data"]["data"]))
    cache = Path(doc["data"].get("cache_dir") or default_cache_dir()).expanduser() / EVALS
    samples = {k: doc["data"].get(k) for k in ("teacher", "source_path", "cache_dir", "samples_runtime",
                                               SAMPLES_PREFIXES)}
    key = _key(folder, same, samples)
    stored = cache / f"teacher-{key}.json"
    if stored.is_file():
        reporter.stage(f"the teacher's figures on these settings: {stored}")
        found = read_json(stored)
    else:
        reporter.stage(f"scoring the teacher {folder} on the same slice and prompts (once; cached)")
        found = evaluate_target(folder, same, device, reporter, samples_from=samples)  # teacher:N: the same samples
        write_json(stored, found)
    doc["teacher"] = {"source": str(folder), **{k: found[k] for k in ("ppl", "domains", "icl") if k in found}}
    return doc


def teacher_folder(spec: str | None, cache_dir: Path) -> tuple[Path | None, str]:
    """The folder of a run's teacher (the builtin one only if already built), or (None, why not)."""
    if not spec:
        return None, "no teacher recorded for this model"
    if spec == BUILTIN:
        folder = builtin_teacher_dir(cache_dir)
        return (folder, "") if (folder / CONFIG).is_file() else (None, f"the builtin teacher is not built in "
                                                                              f"{cache_dir}")
    if spec in sources.PRESETS:
        try:
            return Path(sources.resolve(spec, cache_dir, "eval")), ""
        except Exception as e:  # noqa: BLE001  never fail the student's evaluation for the comparison
            return None, f"the teacher {spec} could not be loaded ({type(e).__name__})"
    folder = Path(spec)
    return (folder, "") if (folder / CONFIG).is_file() else (None, f"the teacher {spec} is not a folder here")


def _same(a: Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _key(folder: Path, ecfg: EvalConfig, samples: dict) -> str:
    """The teacher's files (names, sizes, modification times) and every setting that changes a figure (``samples``:
    which ``teacher:N`` samples a mixture holds)."""
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir() if f.is_file())
    settings = {k: v for k, v in dataclasses.asdict(ecfg).items() if k != "batch_size"}  # batching changes nothing
    blob = json.dumps([str(folder.resolve()), files, settings, samples], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]
