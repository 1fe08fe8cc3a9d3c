"""``train --forms F``: a student that starts as the structure ``compress --one-shot`` with the same options would
write of its layers (the one allocation over every form, ``oneshot.one_shot_structure``), then trains from it.

The structure is computed once (rank 0), before the run directory exists (a dial the allocation cannot reach writes
nothing), saved in the run directory as a model folder (``RunDir.structure``, with its ``compression.json``) and read
back from there by every process and by ``--resume``, so all of them train the same weights. What each method does
with it:

- ``kd-lora`` / ``kd-full`` heal a dense structure (pruned MLPs and attention blocks, removed layers, projections
  declared at 8 bits): the same as ``compress --one-shot`` then ``train --student-init FOLDER``, in one command.
- ``budgeted`` (``--allocation quality``, lowrank among the forms): the pruned sites, removed layers and 8-bit
  projections are fixed from step 0; the projections the allocation makes low rank stay dense in the structure and
  are the controller's to remove, their gated paths starting from the one-shot's whitened factors (the residual
  ``W - B A`` in the dense path, as ``--lora-init whitened``), in the allocation's order. Every other gated path
  starts as LoRA does (``B = 0``): it only adapts a projection that stays dense, and a second calibration pass of
  the structured student to whiten it would buy nothing the healing does not (a choice; the paper is silent).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import ModelDir, RunDir
from bdlora.compress.allocate import Allocation
from bdlora.compress.config import OneShotConfig
from bdlora.compress.forms.layers import renumbered
from bdlora.compress.forms.lowrank import factored
from bdlora.compress.oneshot import one_shot_structure
from bdlora.compress.start import LowRankStart, capped_rank, compute_start, shapes_of
from bdlora.deployed.folder import save_model_folder
from bdlora.forms.dials import Dials
from bdlora.models.arch import projection_modules
from bdlora.models.budgeted.model import build_deployed_model
from bdlora.models.costs import ModuleShape, compression_report
from bdlora.models.depth import take_layers
from bdlora.train.config import TrainConfig


@dataclass
class Structure:
    """The structured student (the bdlora architecture; projections made low rank still dense), the one-shot's
    factors of those projections ``{name: (A (r, d_in), B (d_out, r))}``, the allocation the controller follows
    (their ranks and removal order; None when none is low rank) and the report (its provenance names the student's
    layers kept, ``student_layers_kept``)."""

    model: torch.nn.Module
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    allocation: Allocation | None
    report: dict


def one_shot_options(cfg: TrainConfig) -> OneShotConfig:
    """The ``compress --one-shot`` options a run's ``--forms`` start stands for: its dials as they are (the one
    ``Dials``, train's wording of it), calibrated on the run's data."""
    return OneShotConfig(dials=Dials(**asdict(cfg.dials)), calib_tokens=cfg.calib_tokens, data=cfg.data,
                         calib_data=cfg.calib_data, seq_len=cfg.seq_len)


def structure(student, blocks, cfg: TrainConfig, reporter: Reporter = SILENT, cost_model=None) -> Structure:
    """The one-shot structure of ``student`` over its dials' forms at their ``mac_ratio`` (or ``speedup``),
    calibrated on ``blocks``; the student is not modified."""
    ocfg = one_shot_options(cfg)
    reporter.stage(f"the start: one allocation over --forms {cfg.dials.forms}")
    shot = one_shot_structure(student, blocks, ocfg, reporter, cost_model)
    decisions, deployed, tokens, facts, alloc = shot.decisions, shot.deployed, shot.tokens, shot.facts, shot.allocation
    mods = dict(projection_modules(student))
    pairs = {}
    for name, dep in list(deployed.items()):
        if dep.proj_in is not None:  # low rank: dense in the structure, the controller's to remove
            pairs[name] = (dep.proj_in.float().contiguous(), dep.proj_out.float().contiguous())
            m = mods[name]
            deployed[name] = factored(ModuleShape(name, m.in_features, m.out_features), m, 0, {})
    depth = student.config.num_hidden_layers
    kept = [i for i in range(depth) if f"model.layers.{i}" not in alloc.removed]
    base = student
    if len(kept) < depth:
        base, deployed, pairs = take_layers(student, kept), renumbered(deployed, kept), renumbered(pairs, kept)
    order = [n for n in renumbered(dict.fromkeys(alloc.order), kept) if n in pairs]
    provenance = {"name": f"train --forms {cfg.dials.forms} start", "method": "one-shot", "forms": cfg.dials.forms,
                  "mac_ratio": cfg.dials.mac_ratio, "speedup": cfg.dials.speedup, "calib_tokens": tokens,
                  "calib_data": cfg.calib_data or cfg.data, "student_layers_kept": kept,
                  "low_rank_in_training": sorted(pairs), **facts}
    report = compression_report(decisions, None, {}, baseline="source")
    report.update(source="train --forms", provenance=provenance)
    allocation = Allocation({n: int(a.shape[0]) for n, (a, _) in pairs.items()}, order) if pairs else None
    return Structure(build_deployed_model(base, deployed, provenance, shot.head), pairs, allocation,
                     report)


def save(s: Structure, tokenizer, run: RunDir) -> Path:
    """The structured student as a model folder in the run directory (atomically, with its report)."""
    return save_model_folder(s.model, tokenizer, run.structure, s.report)


def kept_layers(run: RunDir) -> list[int]:
    """The student's layers a saved structure keeps (its report's provenance)."""
    return list(ModelDir(run.structure).report()["provenance"]["student_layers_kept"])


def gated_start(s: Structure, rank: int) -> LowRankStart:
    """The budgeted run's start of a structure: each projection made low rank at its one-shot rank and factors,
    every other gated path at ``rank`` (capped below its break-even) with no factors (LoRA's ``B = 0``)."""
    ranks = {sh.name: capped_rank(sh, rank) for sh in shapes_of(s.model)}
    ranks.update({n: int(a.shape[0]) for n, (a, _) in s.pairs.items()})
    return LowRankStart("whitened", ranks, dict(s.pairs), s.allocation, int(s.report["provenance"]["calib_tokens"]))


def run_start(cfg: TrainConfig, student, blocks, rep: Reporter, cost_model, has_start: bool):
    """(the ``--forms`` structure or None, the low-rank start or None) of a new run's ``student``, calibrated on
    ``blocks`` (``has_start``: whether the method has a low-rank start, ``train.budgeted.start.needed``)."""
    if not cfg.structured:
        d = cfg.dials
        return None, compute_start(student, cfg.lora_init, cfg.allocation, cfg.lora_rank, cfg.budget, d.mac_ratio,
                                   blocks, cfg.calib_tokens, rep, cost_model, d.precision) if has_start else None
    shaped = structure(student, blocks, cfg, rep, cost_model)
    if cfg.traits.gated:
        return shaped, gated_start(shaped, cfg.lora_rank)
    if has_start:  # kd-lora's whitened (or svd) LoRA start over the structure, at one rank
        return shaped, compute_start(shaped.model, cfg.lora_init, None, cfg.lora_rank, cfg.budget, None,
                                     blocks, cfg.calib_tokens, rep)
    return shaped, None
