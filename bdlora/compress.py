"""``bdlora compress``: a finished run -> its deployment form, as a Hugging Face folder of the bdlora architecture
(paper Sec. 3.3; SPEC 6). Budgeted students go through ``budgeted.model.compress_budgeted`` (harden, then drop /
SVD / merge each dense path); kd-lora students have their adapter merged and kd-full students pass through, so
every method yields the same deployable format and the same report keys. The run is never modified.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from bdlora import SCHEMA_VERSION, __version__
from bdlora.budgeted.config import BudgetedConfig
from bdlora.budgeted.costs import ModuleShape, compression_report, decide_module, is_attention, prune_decision
from bdlora.budgeted.layer import DeployedModule
from bdlora.budgeted.model import (
    build_deployed_model,
    compress_budgeted,
    declared_bits,
    dense_projections,
    narrow_sites,
)
from bdlora.corpora import heldout_blocks
from bdlora.deployed.folder import save_model_folder
from bdlora.models import load_run_student
from bdlora.outputs import check_out_dir
from bdlora.perplexity import perplexity
from bdlora.reporter import SILENT, Reporter
from bdlora.runs import RunDir, provenance_paths


def unpruned(config, shape: ModuleShape, keep: int) -> tuple[ModuleShape, int]:
    """(the shape ``shape`` had before its block was pruned to ``keep``, the source's key/value heads for an
    attention projection (0 for an MLP one)), from the model's config."""
    if not is_attention(shape.name):
        return shape.narrowed(int(config.intermediate_size)), 0
    heads = int(config.num_attention_heads)
    of = int(getattr(config, "num_key_value_heads", None) or heads)
    return shape.grouped(of, keep), of  # every width scaled back by of / keep


def compress_dense(model: nn.Module, lora_rank: int, provenance: dict):
    """kd-lora (PEFT adapter merged into dense: the LoRA baseline's deployment form) and kd-full (unchanged): every
    projection deployed dense, in the same architecture and with the same report keys."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    deployed = {}
    narrow = narrow_sites(model)  # a student started from a pruned folder
    bits = declared_bits(model)  # ... or from one keeping some projections at 8 bits
    for name, mod in dense_projections(model).items():
        keep = narrow.get(name.rsplit(".", 1)[0], {}).get("keep")
        if keep:  # reported against the full-width block it was pruned from
            full, of = unpruned(model.config, ModuleShape(name, mod.in_features, mod.out_features), keep)
            dec = prune_decision(full, keep, has_bias=mod.bias is not None, of=of)
        else:
            dec = decide_module(ModuleShape(name, mod.in_features, mod.out_features), 1.0, lora_rank, lora_rank,
                                has_bias=mod.bias is not None)
        dec.bits = bits.get(name, 0)
        bias = None if mod.bias is None else mod.bias.detach().clone()
        deployed[name] = DeployedModule(dec, weight=mod.weight.detach().clone(), bias=bias)
    report = compression_report([c.decision for c in deployed.values()], provenance.get("budget"), {},
                                baseline="dense")
    return build_deployed_model(model, deployed, provenance), report


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
    provenance = {"name": f"{run.name} compressed", "method": method, "teacher": train_cfg.get("teacher"),
                  "budget": train_cfg.get("budget") if method == "budgeted" else None,
                  "student_layers": train_cfg.get("student_layers"), "layer_indices": summary.get("layer_indices"),
                  # the run's corpus and split, so the folder's held-out slice outlives the run directory
                  "data_settings": run.data_settings(), **provenance_paths(run.path, out)}
    reporter.stage("compressing")
    if method == "budgeted":
        compressed, report = compress_budgeted(model, cfg, provenance)
    else:
        compressed, report = compress_dense(model, train_cfg["lora_rank"] if method == "kd-lora" else 0, provenance)
    report.update(schema_version=SCHEMA_VERSION, bdlora_version=__version__, source="compress",
                  lora_rank=train_cfg.get("lora_rank") if method in ("budgeted", "kd-lora") else None,
                  provenance=provenance)
    if evaluate:
        reporter.stage("scoring the held-out slice (uncompressed vs compressed)")
        blocks = heldout_blocks(provenance["data_settings"], tok)
        report["eval"] = {"student_val_ppl": perplexity(model, blocks), "compressed_val_ppl":
                          perplexity(compressed, blocks), "tokens": len(blocks) * blocks.seq_len}
    reporter.stage(f"writing {out}")
    save_model_folder(compressed, tok, out, report)
    return report, out
