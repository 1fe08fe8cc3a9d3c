"""``bdlora compress``: a finished run -> its deployment form, as a Hugging Face folder of the bdlora architecture
(paper Sec. 3.3; SPEC 6). The step is the method's (``TrainingMethod.compress``): budgeted students go through
``models.budgeted.model.compress_budgeted`` (harden, then drop / SVD / merge each dense path); kd-lora students have
their adapter merged and kd-full students pass through, so every method yields the same deployable format and the
same report keys. The run is never modified.
"""

from __future__ import annotations

from pathlib import Path

from bdlora import SCHEMA_VERSION, __version__
from bdlora.base.method_table import method_of
from bdlora.base.outputs import check_out_dir
from bdlora.base.provenance import provenance_paths
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import RunDir
from bdlora.data.corpora import heldout_blocks
from bdlora.deployed.folder import save_model_folder
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.models.load import load_run_student
from bdlora.models.perplexity import perplexity
from bdlora.models.teacher import recorded_teacher
from bdlora.train.methods import METHOD_CLASSES


def compress_run(run: RunDir | str | Path, cfg: BudgetedConfig, out: str | Path | None = None, force: bool = False,
                 evaluate: bool = True, reporter: Reporter = SILENT) -> tuple[dict, Path]:
    """Compress a finished run into a model folder; returns (report, folder). Only ``cfg``'s thresholds are used."""

    cfg.validate_thresholds()
    run = run if isinstance(run, RunDir) else RunDir(run)
    run.require_finished()
    out = Path(out) if out else run.compressed()
    check_out_dir(out, force, (run.path,))
    train_cfg, summary = run.config(), run.summary()
    method = summary.get("method")
    reporter.stage(f"loading the {method} student from {run.path}")
    model, tok, _ = load_run_student(run)
    traits = method_of(method)
    provenance = {"name": f"{run.name} compressed", "method": method, "teacher": train_cfg.get("teacher"),
                  "budget": train_cfg.get("budget") if traits.gated else None,
                  "student_layers": train_cfg.get("student_layers"), "layer_indices": summary.get("layer_indices"),
                  "teacher_layers": run.facts().teacher_layers,  # bounds layer_indices for plan FOLDER
                  # the run's corpus and split, so the folder's held-out slice outlives the run directory
                  "data_settings": run.data_settings(), **provenance_paths(run.path, out)}
    reporter.stage("compressing")
    compressed, report = METHOD_CLASSES[method].compress(model, cfg, train_cfg.get("lora_rank"), provenance)
    report.update(schema_version=SCHEMA_VERSION, bdlora_version=__version__, source="compress",
                  lora_rank=train_cfg.get("lora_rank") if traits.low_rank else None,
                  provenance=provenance)
    if evaluate:
        reporter.stage("scoring the held-out slice (uncompressed vs compressed)")
        blocks = heldout_blocks(provenance["data_settings"], tok,
                                        teacher=recorded_teacher(provenance["data_settings"]))
        report["eval"] = {"student_val_ppl": perplexity(model, blocks), "compressed_val_ppl":
                          perplexity(compressed, blocks), "tokens": len(blocks) * blocks.seq_len}
    reporter.stage(f"writing {out}")
    save_model_folder(compressed, tok, out, report)
    return report, out
