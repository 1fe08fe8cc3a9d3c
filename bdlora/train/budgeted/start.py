"""How a training run applies its start (``compress.start``: where the low-rank paths start and which modules the
budget removes, computed once and stored in the run): whether a method has one, and the factors set into the gated
modules (budgeted) or the PEFT adapters (kd-lora); and ``plan --allocation quality``, the structure a budgeted
student is trained towards, before any training."""

from __future__ import annotations

from pathlib import Path

import torch

from bdlora.base.method_table import method_of
from bdlora.base.reporter import SILENT, Reporter
from bdlora.compress.config import OneShotConfig
from bdlora.compress.oneshot import load_source
from bdlora.compress.start import LowRankStart, compute_start, shapes_of, structure_report
from bdlora.train.student import build_student


def needed(method: str, init: str | None, allocation: str | None) -> bool:
    """Whether a run of ``method`` has a start to compute: a non-zero init (kd-lora, budgeted) or the quality
    allocation (budgeted). The paper's zero start with the cost rule has none (SPEC 4's init, one rank)."""
    traits = method_of(method)
    return traits.low_rank and (init not in (None, "zero") or (traits.gated and allocation == "quality"))


def start_gated(gated: dict, start: LowRankStart) -> None:
    """Set every ``GatedLoRALinear`` to its initial factors (residual in the dense path); zero init leaves them."""
    if start.init == "zero":
        return
    for name, m in gated.items():
        if name not in start.factors:  # a ``--forms`` start factors only the projections it makes low rank
            continue
        a, b = start.factors[name]
        m.start_from(a, b)


@torch.no_grad()
def start_peft(model, start: LowRankStart) -> None:
    """The same for a PEFT LoRA model (kd-lora): ``lora_A = A``, ``lora_B = B / scaling``, base ``W - B A``."""
    if start.init == "zero":
        return
    for name, m in model.named_modules():
        if not (hasattr(m, "lora_A") and hasattr(m, "base_layer") and "default" in getattr(m, "lora_A", {})):
            continue
        key = name.removeprefix("base_model.model.")
        a, b = start.factors[key]
        m.lora_A["default"].weight.copy_(a)
        m.lora_B["default"].weight.copy_(b / m.scaling["default"])
        stored = (m.lora_B["default"].weight.double() * m.scaling["default"]) @ m.lora_A["default"].weight.double()
        m.base_layer.weight.copy_(m.base_layer.weight.double() - stored)


def quality_plan(source: str, cfg: OneShotConfig, layers: int | None, rank: int, budget: float,
                 cache_dir: Path | None = None, reporter: Reporter = SILENT) -> dict:
    """``plan --model SOURCE --allocation quality``: the structure a budgeted student of ``source`` (``layers``
    deep, the mixed selection) is trained towards with the quality allocation, before any training. ``mac_ratio``
    None: the paper's rule at ``budget`` and ``rank``."""
    model, _, _, train_blocks, _, _ = load_source(source, cfg, cache_dir, reporter, "--model")
    student = build_student(model, layers, "mixed")[0] if layers else model
    start = compute_start(student, "whitened", "quality", rank, budget, cfg.dials.mac_ratio, train_blocks,
                          cfg.calib_tokens, reporter)
    report = structure_report(start, shapes_of(student), budget)
    report["source"] = "plan --allocation quality"
    return report
