"""``bdlora plan``: what ``compress`` would produce for a budget F, from shapes alone (no weights, no training).

The controller is run through the whole schedule with every gate open (so every LoRA rank is kept), then the
SPEC 6 rules decide each module; the report is ``costs.compression_report``, the same code ``compress`` uses.
Standard library + numpy only.
"""

from __future__ import annotations

import json
from pathlib import Path

from bdlora.base.errors import Checks, ModelError, UsageError
from bdlora.base.runs import CONFIG
from bdlora.compress.bounds import check_shape_config
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.models.costs import compression_report, decide_module, shapes_from_config, training_compute_proxy
from bdlora.models.families import family
from bdlora.train.budgeted.controller import BudgetController

DEFAULT_PLAN_STEPS = 10_000


def read_model_config(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG
    if not p.exists():
        raise ModelError(f"--model-config {path}: no such file")
    try:
        config = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelError(f"--model-config {path}: not a Hugging Face config.json (not valid JSON)") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"--model-config {path}: not a Hugging Face config.json (no model_type)")
    base = (config.get("bdlora") or {}).get("base_model_type", config["model_type"])
    try:  # plan needs shapes only: every family of the table, those without a bdlora architecture too
        family(base, f"--model-config {path}: model_type", loaded=False)
    except UsageError as e:
        raise ModelError(str(e)) from None
    check_shape_config(config, f"--model-config {path}")  # bounded before a synthetic graph is built from it
    return config


def plan(config: dict, cfg: BudgetedConfig, layers: int | None = None, steps: int = DEFAULT_PLAN_STEPS) -> dict:
    """Simulate the controller over ``steps`` steps with ``cfg``'s schedule, then decide every module."""
    c = Checks()
    cfg.check(c)
    c.integer("layers", layers, lo=1)
    c.integer("steps", steps, lo=1)
    c.done()
    shapes = shapes_from_config(config, layers)
    ctrl = BudgetController([s.name for s in shapes], [s.dense_cost for s in shapes], cfg.budget, cfg.decay_start,
                            cfg.decay_end, ema=cfg.retention_ema, eps_zero=cfg.eps_zero)
    for step in range(steps):
        ctrl.step(step / max(1, steps - 1))
    decisions = [decide_module(s, float(d), cfg.rank, cfg.rank, cfg) for s, d in zip(shapes, ctrl.d)]
    report = compression_report(decisions, cfg.budget, {**cfg.thresholds(), "gate_threshold": None})
    proxy = training_compute_proxy(shapes, cfg.rank, ctrl.mean_retained)
    report["compute_proxy"] = proxy
    report["train_compute_vs_full"] = proxy["bud_vs_full"]
    report["schedule"] = {"decay_start": cfg.decay_start, "decay_end": cfg.decay_end,
                          "retention_ema": cfg.retention_ema, "steps": steps}
    report["source"] = "plan"
    return report
