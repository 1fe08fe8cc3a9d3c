"""Where a run's low-rank paths start (``--lora-init``) and which modules the budget removes (``--allocation``).

- ``zero``: the SPEC's LoRA start (A random, B = 0); the paths must be learnt from nothing. The ``paper`` recipe.
- ``whitened``: the factors of each projection's activation-aware truncated SVD (``lowrank``), measured on
  ``--calib-tokens`` tokens of the run's own training split; the frozen dense path holds the residual ``W - B A``
  (``GatedLoRALinear.start_from``), so the student is unchanged at d = 1 and, as the controller takes d to 0, each
  dropped module becomes its best rank-r approximation on real inputs instead of a zero path.
- ``svd``: the same with plain SVD factors (no calibration); the baseline that shows why whitening matters.

``--allocation cost`` is the paper's removal order (cheapest dense path first, one rank for every module);
``quality`` spends the same projection MACs (or ``--mac-ratio``) where the Fisher-weighted truncation error per MAC
saved is least, with per-module ranks (``allocate``). A ``LowRankStart`` is computed once (rank 0 under torchrun),
saved in the run directory and read back by every process and by ``--resume``: nothing is recomputed, so all
processes and a resumed run start from bit-identical factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bdlora.base.io import load_tensors, read_json, save_tensors, write_json
from bdlora.base.reporter import SILENT, Reporter
from bdlora.compress.allocate import MACS, Allocation, Pricing, allocate, greedy_targets
from bdlora.compress.calibrate import calibrate, calibration_blocks
from bdlora.compress.forms.lowrank import factors, gram_root, rank_offers, spectrum
from bdlora.compress.pricing import break_even, mac_cost
from bdlora.models.arch import projection_modules
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.models.costs import ModuleShape, compression_report, decide_module


@dataclass
class LowRankStart:
    """Each module's LoRA rank, its initial factors ``{module: (A (r, d_in), B (d_out, r))}`` (float32, as stored;
    none for ``zero``) and, with ``--allocation quality``, the allocation (ranks, removal order)."""

    init: str
    ranks: dict[str, int]
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    allocation: Allocation | None = None
    calib_tokens: int = 0

    def save(self, meta_file: Path, factors_file: Path) -> None:
        """``meta_file`` (JSON: init, ranks, allocation) and, unless ``zero``, ``factors_file`` (safetensors)."""
        if self.factors:
            save_tensors(factors_file, {f"{n}.{k}": t for n, (a, b) in self.factors.items()
                                        for k, t in (("A", a), ("B", b))}, metadata={"init": self.init})
        write_json(meta_file, {"init": self.init, "calib_tokens": self.calib_tokens, "ranks": self.ranks,
                               "allocation": None if self.allocation is None else self.allocation.to_json()})

    @classmethod
    def load(cls, meta_file: Path, factors_file: Path) -> LowRankStart:
        meta = read_json(meta_file)
        tensors = load_tensors(factors_file) if meta["init"] != "zero" else {}
        found = {n: (tensors[f"{n}.A"], tensors[f"{n}.B"]) for n in meta["ranks"] if f"{n}.A" in tensors}
        alloc = Allocation.from_json(meta["allocation"]) if meta.get("allocation") else None
        return cls(meta["init"], {n: int(r) for n, r in meta["ranks"].items()}, found, alloc,
                   int(meta.get("calib_tokens", 0)))


def shapes_of(model) -> list[ModuleShape]:
    return [ModuleShape(n, m.in_features, m.out_features) for n, m in projection_modules(model)]


def paper_mac_ratio(shapes: list[ModuleShape], budget: float, rank: int) -> float:
    """The projection-MAC speed-up of the paper's structure at F = ``budget`` and one ``rank`` (cheapest dense paths
    dropped first): what ``--allocation quality`` spends by default, so both rules compare at equal MACs."""
    d = greedy_targets([s.dense_cost for s in shapes], budget)
    decisions = [decide_module(s, float(x), rank, rank, BudgetedConfig(rank=rank)) for s, x in zip(shapes, d)]
    return compression_report(decisions, budget)["speedup_vs_dense"]


def calibrate_with_progress(model, blocks, reporter: Reporter = SILENT, residual: bool = False, rounded=None,
                            head: bool = False, predicted: bool = False):
    """``calibrate`` with a stage line and a progress bar (``residual``: each layer's update too; ``rounded``: each
    projection's rounding error at 4 and 8 bits; ``head``: the LM head's too; ``predicted``: the model's summed
    probability and argmax counts of every token)."""
    reporter.stage(f"calibrating on {blocks.size:,} training tokens (input Gram matrices, output Fisher diagonals"
                   f"{', rounding errors at 4 and 8 bits' if rounded else ''}{' (LM head included)' if head else ''})")
    reporter.count(0, len(blocks), "calibration blocks")
    return calibrate(model, blocks, on_progress=lambda k: reporter.count(k, len(blocks), "calibration blocks"),
                     residual=residual, rounded=rounded, head=head, predicted=predicted)


def table_pricing(table, precision: str, rest: dict | None = None, fixed: float = 0.0) -> Pricing:
    """The ``Pricing`` of a measured latency table (``export.genai.latency.LatencyTable``, which the CLI builds: the
    core reads it through its methods): its cost in ``precision`` microseconds, where its times are cached and
    whether they were measured cleanly (no refusal rests on times that were not)."""
    return Pricing(table.cost, f"{precision} microsecond", rest or {}, fixed, table.measured_where(), table.noisy())


def allocate_by(shapes, offers: dict, target: float, pricing: Pricing = MACS,
                reporter: Reporter = SILENT, kv_heads: int = 0) -> Allocation:
    """The quality allocation for ``target`` among the forms' ``offers`` (``forms.context.Choice`` by site), priced
    by ``pricing`` (MACs, or a measured decode-time table's cost: ``target`` is then the projections' decode-time
    speed-up, or with ``pricing.rest`` the whole step's), with a stage line naming what is traded (``kv_heads``: the
    source's key/value heads per layer, what an attention site's kept groups count). Shared by the training start
    and ``compress --one-shot``."""
    forms = sorted({c.form for cs in offers.values() for c in cs})
    what = f"loss-weighted {', '.join(forms) or 'no'} error"
    if pricing.cost is not mac_cost:
        scope = "whole" if pricing.rest else "projection"
        reporter.stage(f"allocating {target:.2f}x less {scope} decode time ({pricing.unit}s) by {what}")
    else:
        reporter.stage(f"allocating {target:.2f}x fewer projection MACs by {what}")
    alloc = allocate(shapes, offers, target, pricing, kv_heads)
    if alloc.unmet:
        reporter.stage(alloc.unmet)
    return alloc


def compute_start(model, init: str, allocation: str, rank: int, budget: float, mac_ratio: float | None,
                  blocks=None, calib_tokens: int = 0, reporter: Reporter = SILENT, cost_model=None,
                  precision: str | None = None) -> LowRankStart:
    """The start of ``model``'s low-rank paths (before it is wrapped): calibrate if the init or the allocation
    needs it, allocate, then factor every projection at its rank (the allocated rank for modules the budget
    removes, ``rank`` for the rest, each capped below its break-even rank). ``cost_model`` (as
    ``oneshot.one_shot_structure``'s, measured at ``precision``): the quality allocation prices each form by it
    instead of by MACs."""
    stage = reporter.stage
    shapes = shapes_of(model)
    weights = {n: m.weight for n, m in projection_modules(model)}
    calib = None
    if init == "whitened" or allocation == "quality":
        calib = calibrate_with_progress(model, calibration_blocks(blocks, calib_tokens), reporter)
    stage("whitened, loss-weighted spectra of every projection" if calib is not None else "SVD of every projection")
    roots: dict[int, torch.Tensor] = {}
    spectra = {}
    for s in shapes:
        gram = calib.gram(s.name) if calib is not None else None
        root = None
        if gram is not None and s.out_features > s.in_features:  # only the (d_in, d_in) path needs S
            root = roots.setdefault(id(gram), gram_root(gram))
        spectra[s.name] = spectrum(weights[s.name], gram, fisher=calib.fisher[s.name] if calib else None,
                                   root=root)
    alloc = None
    if allocation == "quality":
        target = mac_ratio or paper_mac_ratio(shapes, budget, rank)
        table = cost_model.table(shapes) if cost_model is not None else None
        pricing = table_pricing(table, precision) if table is not None else MACS
        alloc = allocate_by(shapes, rank_offers(shapes, {n: sp.energy.cpu().numpy() for n, sp in spectra.items()},
                                                pricing.cost), target, pricing, reporter)
    ranks = {s.name: capped_rank(s, (alloc.ranks.get(s.name) if alloc else 0) or rank) for s in shapes}
    out = {}
    for s in shapes if init != "zero" else ():
        sp = spectra[s.name] if init == "whitened" else spectrum(weights[s.name], None)
        ranks[s.name] = min(ranks[s.name], sp.max_rank)
        a, b = factors(weights[s.name], sp, ranks[s.name])
        out[s.name] = (a.float().contiguous(), b.float().contiguous())
    return LowRankStart(init, ranks, out, alloc, calib.tokens if calib is not None else 0)


def capped_rank(shape: ModuleShape, rank: int) -> int:
    """A module's LoRA rank at ``rank``: at least 1, below the rank where its pair costs its dense product."""
    return max(1, min(rank, break_even(shape) - 1))


def structure_report(start: LowRankStart, shapes: list[ModuleShape], budget: float | None = None) -> dict:
    """What ``compress`` will make of a run started at ``start`` once the controller has taken every allocated
    module to d = 0 (and every gate stays open): the same report keys as ``plan`` and ``compress``."""
    dropped = {n for n, r in (start.allocation.ranks if start.allocation else {}).items() if r}
    decisions = [decide_module(s, 0.0 if s.name in dropped else 1.0, start.ranks[s.name], start.ranks[s.name])
                 for s in shapes]
    report = compression_report(decisions, budget)
    report["start"] = summary(start, shapes)
    return report


def summary(start: LowRankStart, shapes: list[ModuleShape]) -> dict:
    """What the summary and ``plan`` report of a start."""
    doc = {"lora_init": start.init, "calib_tokens": start.calib_tokens}
    if start.allocation is not None:
        a = start.allocation
        doc["allocation"] = {"rule": "quality", "mac_ratio": a.mac_ratio(shapes),
                             "lowrank": sum(1 for r in a.ranks.values() if r), "modules": len(shapes),
                             "mean_rank": float(np.mean([r for r in a.ranks.values() if r] or [0]))}
    return doc
