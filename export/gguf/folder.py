"""``bdlora export gguf``: a model folder -> ``OUT/model.gguf`` with ``export.json`` (settings, the llama.cpp layout,
tensor types, the checks and their figures) and an Ollama ``Modelfile``, written under a temp name and renamed into
place when whole. The file is planned from the folder's config and weight headers (``layout``), written one tensor
at a time (``writer``; q4_k_m at F16 first, then rounded by llama.cpp, ``llamacpp.quantize``), read back with the
gguf package and checked against the plan, then, with the ``[llamacpp]`` extra, loaded in llama.cpp and checked
against PyTorch (``llamacpp.validate``) before it is published."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bdlora import SCHEMA_VERSION
from bdlora.base.errors import Checks, ModelError, UsageError
from bdlora.base.io import atomic_dir, read_json, sha256, write_json
from bdlora.base.outputs import check_out_dir, free_space
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import CONFIG, EXPORT_MARKER, MODEL_GGUF, ModelDir
from bdlora.base.threads import flat
from bdlora.data.tokens import default_cache_dir
from bdlora.eval.reference import teacher_folder
from bdlora.export.gguf import llamacpp, vocab
from bdlora.export.gguf.layout import GgufLayout, Planned, plan_layout, tensor_plan
from bdlora.export.gguf.writer import nbytes, qtype_of, write_gguf
from bdlora.export.settings import GgufExportConfig
from bdlora.models.integrity import check_loadable, folder_tensors

MODELFILE = "Modelfile"


def teacher_of(model_dir: Path) -> Path | None:
    """The folder of the teacher a student came from (its provenance), where its tokenizer's GGUF keys may lie."""
    report = ModelDir(model_dir).report() if ModelDir(model_dir).finished() else {}
    spec = (report.get("provenance") or {}).get("teacher")
    folder, _ = teacher_folder(spec, default_cache_dir())
    return folder


def planned(model_dir: Path, settings: GgufExportConfig) -> tuple[GgufLayout, list[Planned], Path | None, dict]:
    """(layout, tensor plan, teacher folder, config) of ``model_dir``, every refusal raised before a byte is
    written."""
    check_loadable(model_dir)
    config = json.loads((model_dir / CONFIG).read_text())
    tensors = folder_tensors(model_dir)
    layout = plan_layout(config, tensors, settings.merge_lowrank)
    teacher = teacher_of(model_dir)
    rows = vocab.token_count(model_dir, int(config["vocab_size"]), teacher)
    return layout, tensor_plan(layout, tensors, rows), teacher, config


def export_gguf_folder(model_dir: str | Path, out: str | Path, settings: GgufExportConfig = GgufExportConfig(),
                       force: bool = False, reporter: Reporter = SILENT) -> dict:
    """Export ``model_dir`` (a teacher of a family with a llama.cpp architecture, or a student of the channels,
    groups and layers forms) as a GGUF file for llama.cpp at ``settings.quant``."""
    settings.check(Checks()).done()
    model_dir, out = Path(model_dir), Path(out)
    check_out_dir(out, force, (model_dir,))
    checker = llamacpp.available() if settings.quant == "q4_k_m" or settings.validate else None
    if settings.quant == "q4_k_m" and checker is None:
        raise UsageError("--quant q4_k_m: K-quants are rounded by llama.cpp's own quantizer; install it with "
                         "pip install -e \".[llamacpp]\" (builds llama-cpp-python), or give --quant q4_0 or q8_0")
    layout, plan, teacher, config = planned(model_dir, settings)
    check_room(out, layout, plan, settings.quant)
    seconds: dict[str, float] = {}
    info: dict = {"schema_version": SCHEMA_VERSION, "runtime": "llama.cpp", "source": str(model_dir.resolve()),
                  "quant": settings.quant, "settings": flat(settings), "architecture": layout.arch,
                  "layers": [{"heads": s.heads, "kv_heads": s.kv_heads, "ffn": s.ffn} for s in layout.layers],
                  "head_dim": layout.head_dim, "tied_embeddings": layout.tied}
    if layout.merged:
        info["merged_lowrank"] = layout.merged
    with atomic_dir(out) as tmp:
        t0 = time.time()
        info["file"] = _write(tmp, model_dir, layout, plan, config, teacher, settings, checker, reporter)
        seconds["write"] = time.time() - t0
        info["structure"] = read_back(tmp / MODEL_GGUF, layout, plan, settings.quant)
        if settings.validate and checker is None:
            info["validation"] = {"skipped": "llama-cpp-python is not installed (pip install -e \".[llamacpp]\" "
                                             "loads the file in llama.cpp and checks it against PyTorch)"}
            reporter.stage(f"not checked in llama.cpp: {info['validation']['skipped']}")
        elif settings.validate:
            t1 = time.time()
            info["validation"] = checker.validate(tmp / MODEL_GGUF, model_dir, settings, reporter)
            seconds["validation"] = time.time() - t1
        info["seconds"] = seconds
        (tmp / MODELFILE).write_text(f"# ollama create NAME -f {MODELFILE}\nFROM ./{MODEL_GGUF}\n")
        info["sha256"] = {MODEL_GGUF: sha256(tmp / MODEL_GGUF), "source_config": sha256(model_dir / CONFIG)}
        write_json(tmp / EXPORT_MARKER, info)
    return info


def check_room(out: Path, layout: GgufLayout, plan: list[Planned], quant: str) -> None:
    """The output's file system has room for the file (and, for q4_k_m, the F16 file llama.cpp rounds from)."""
    need = sum(nbytes(p.shape, qtype_of(p, quant, layout.tied)) for p in plan)
    if quant == "q4_k_m":
        need += sum(nbytes(p.shape, qtype_of(p, "f16", layout.tied)) for p in plan)
    _, free = free_space(out.parent)
    if need + (64 << 20) > free:
        raise UsageError(f"--out {out}: the export writes about {need / 2**30:,.1f} GiB there and its file system has "
                         f"{free / 2**30:,.1f} GiB free (free some, or choose another place)")


def _write(tmp: Path, model_dir: Path, layout: GgufLayout, plan: list[Planned], config: dict, teacher, settings,
           checker, reporter: Reporter) -> dict:
    """``tmp/model.gguf`` written (q4_k_m: at F16, then rounded by llama.cpp); what was written."""
    k_quant = settings.quant == "q4_k_m"
    first = tmp / ("model-f16.gguf" if k_quant else MODEL_GGUF)
    reporter.stage(f"writing {layout.arch} GGUF ({len(layout.layers)} layers"
                   + (", per-layer heads and MLP widths" if layout.per_layer else "")
                   + f") at {'f16 for llama.cpp to round' if k_quant else settings.quant}, one tensor at a time")
    info = write_gguf(first, model_dir, layout, plan, "f16" if k_quant else settings.quant,
                      config.get("_name_or_path") or model_dir.name,
                      lambda w: vocab.add_vocab(w, model_dir, int(config["vocab_size"]), teacher), reporter)
    if k_quant:
        reporter.stage("rounding to Q4_K_M with llama.cpp's quantizer")
        info["quantizer"] = checker.quantize(first, tmp / MODEL_GGUF, "q4_k_m", settings.pool.count)
        first.unlink()
        info["bytes"] = (tmp / MODEL_GGUF).stat().st_size
    return info


def read_back(path: Path, layout: GgufLayout, plan: list[Planned], quant: str) -> dict:
    """The written file read back with the gguf package: its architecture, layer count, per-layer arrays, and every
    tensor's name, shape and type as planned (what a damaged write or a layout bug would change)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    if arch != layout.arch:
        raise ModelError(f"{path}: written as {arch}, planned as {layout.arch}")
    blocks = reader.fields[f"{arch}.block_count"].contents()
    if blocks != len(layout.layers):
        raise ModelError(f"{path}: {blocks} layers written, {len(layout.layers)} planned")
    found = {t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type) for t in reader.tensors}
    tied = layout.tied
    for p in plan:
        if p.name not in found:
            raise ModelError(f"{path}: tensor {p.name} missing")
        shape, qt = found[p.name]
        want = qtype_of(p, "f16" if quant == "q4_k_m" else quant, tied)
        if shape != tuple(p.shape) or (quant != "q4_k_m" and qt != want):
            raise ModelError(f"{path}: tensor {p.name} is {list(shape)} {qt.name}, planned {list(p.shape)} "
                             f"{want.name}")
    if len(found) != len(plan):
        raise ModelError(f"{path}: {len(found)} tensors, {len(plan)} planned")
    return {"tensors": len(found), "architecture": arch, "layers": int(blocks)}


def read_export(folder: Path) -> dict:
    return read_json(Path(folder) / EXPORT_MARKER)
