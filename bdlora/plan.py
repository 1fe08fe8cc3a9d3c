"""``bdlora plan``: what ``compress`` would produce for a budget F, from shapes alone (no weights, no training).

The controller is run through the whole schedule with every gate open (so every LoRA rank is kept), then the
SPEC 6 rules decide each module; the report is ``costs.compression_report``, the same code ``compress`` uses.
"""

from __future__ import annotations

import json
from pathlib import Path

from bdlora.controller import DEFAULT_EPS_ZERO, DEFAULT_RETENTION_EMA, BudgetController
from bdlora.costs import (
    DEFAULT_EPS_LR,
    DEFAULT_SVD_MAX_RANK,
    compression_report,
    decide_module,
    shapes_from_config,
    training_compute_proxy,
)
from bdlora.errors import ConfigError, ModelError

SUPPORTED_MODEL_TYPES = ("mistral", "llama", "qwen2", "qwen3")
DEFAULT_PLAN_STEPS = 10_000


def read_model_config(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ModelError(f"--model-config {path}: no such file")
    try:
        config = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelError(f"--model-config {path}: not a Hugging Face config.json (not valid JSON)") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"--model-config {path}: not a Hugging Face config.json (no model_type)")
    base = config.get("bdlora", {}).get("base_model_type", config["model_type"])
    if base not in SUPPORTED_MODEL_TYPES:
        raise ModelError(f"--model-config {path}: model_type {config['model_type']!r} has no q/k/v/o/gate/up/down "
                         f"projections bdlora adapts (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return config


def check_plan_options(budget, rank, eps_lr, eps_zero, svd_max_rank, decay_start, decay_end, ema, layers, steps):
    p = []
    if not 0.0 <= budget <= 1.0:
        p.append(f"--budget {budget}: must be in [0, 1]")
    if rank < 1:
        p.append(f"--lora-rank {rank}: must be >= 1")
    try:  # the compression thresholds are checked by the same code as `compress`
        from bdlora.compress import Thresholds

        Thresholds(eps_zero=eps_zero, eps_lr=eps_lr, svd_max_rank=svd_max_rank).validate()
    except ConfigError as e:
        p.extend(e.problems)
    for name, v in (("--decay-start", decay_start), ("--decay-end", decay_end)):
        if not 0.0 <= v <= 1.0:
            p.append(f"{name} {v}: must be in [0, 1]")
    if decay_start > decay_end:
        p.append(f"--decay-start {decay_start} > --decay-end {decay_end}: the decay must start before it ends")
    if not 0.0 <= ema < 1.0:
        p.append(f"--retention-ema {ema}: must be in [0, 1)")
    if layers is not None and layers < 1:
        p.append(f"--layers {layers}: must be >= 1")
    if steps < 1:
        p.append(f"--steps {steps}: must be >= 1")
    if p:
        raise ConfigError(p)


def plan(config: dict, budget: float, layers: int | None = None, rank: int = 128, eps_lr: float = DEFAULT_EPS_LR,
         eps_zero: float = DEFAULT_EPS_ZERO, svd_max_rank: int = DEFAULT_SVD_MAX_RANK, decay_start: float = 0.1,
         decay_end: float = 0.3, ema: float = DEFAULT_RETENTION_EMA, steps: int = DEFAULT_PLAN_STEPS) -> dict:
    check_plan_options(budget, rank, eps_lr, eps_zero, svd_max_rank, decay_start, decay_end, ema, layers, steps)
    shapes = shapes_from_config(config, layers)
    ctrl = BudgetController([s.name for s in shapes], [s.dense_cost for s in shapes], budget, decay_start,
                            decay_end, ema=ema, eps_zero=eps_zero)
    for step in range(steps):
        ctrl.step(step / max(1, steps - 1))
    decisions = [decide_module(s, float(d), rank, rank, eps_zero, eps_lr, svd_max_rank)
                 for s, d in zip(shapes, ctrl.d)]
    report = compression_report(decisions, rank, budget, {"eps_zero": eps_zero, "eps_lr": eps_lr,
                                                          "gate_threshold": None, "svd_max_rank": svd_max_rank})
    proxy = training_compute_proxy(shapes, rank, ctrl.mean_retained)
    report["compute_proxy"] = proxy
    report["train_compute_vs_full"] = proxy["bud_vs_full"]
    report["schedule"] = {"decay_start": decay_start, "decay_end": decay_end, "retention_ema": ema, "steps": steps}
    report["source"] = "plan"
    return report
