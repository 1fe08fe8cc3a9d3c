"""Budget schedule and controller (paper Sec. 3.2; SPEC 5).

Built like PEFT's AdaLoRA ``RankAllocator``: a plain class (not an ``nn.Module``) with a pure schedule function and
one ``step(progress)`` to call once per optimiser step, *before* that step's forward pass, so the logged C(t) is the
dense compute the step actually used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from bdlora.compress.allocate import greedy_targets
from bdlora.models.budgeted.config import DEFAULTS


def budget_schedule(progress: float, final_fraction: float, decay_start: float = DEFAULTS.decay_start,
                    decay_end: float = DEFAULTS.decay_end) -> float:
    """b(t): 1 up to t0, cosine from 1 to F between t0 and t1, F after (paper Sec. 3.2).

    t0 == t1 means no schedule: the budget drops to F at t0.
    """
    t, f, t0, t1 = progress, final_fraction, decay_start, decay_end
    if t0 == t1:
        return 1.0 if t < t0 else f
    if t <= t0:
        return 1.0
    if t >= t1:
        return f
    return f + (1.0 - f) * (1.0 + math.cos(math.pi * (t - t0) / (t1 - t0))) / 2.0


class BudgetController:
    """Sets each gated module's dense retention d_m to follow the budget schedule.

    Args:
        names: gated module names in ``named_modules()`` order.
        costs: dense MACs per token c_m = d_in * d_out of each module.
        final_fraction: F, the dense fraction retained at the end of the schedule.
        decay_start, decay_end: t0, t1 as fractions of training.
        ema: beta of the EMA applied to the greedy targets (0 = none).
        eps_zero: retentions below this are clamped to exactly 0 (the dense path is then skipped).
        modules: optional ``{name: GatedLoRALinear}``; when given, every ``step`` writes d into them.
        scores: optional removal scores (ascending = removed first); default the costs (SPEC 5's cheapest first).
    """

    def __init__(self, names: Sequence[str], costs: Sequence[int], final_fraction: float,
                 decay_start: float = DEFAULTS.decay_start, decay_end: float = DEFAULTS.decay_end,
                 ema: float = DEFAULTS.retention_ema, eps_zero: float = DEFAULTS.eps_zero,
                 modules: dict | None = None, scores: Sequence[float] | None = None):
        if len(names) != len(costs) or not names or (scores is not None and len(scores) != len(names)):
            raise ValueError("names, costs (and scores) must be non-empty and of equal length")
        self.names = list(names)
        self.costs = np.asarray(costs, dtype=np.float64)
        self.scores = None if scores is None else [float(x) for x in scores]
        self.final_fraction = final_fraction
        self.decay_start = decay_start
        self.decay_end = decay_end
        self.ema = ema
        self.eps_zero = eps_zero
        self.modules = modules
        self.d = np.ones(len(names), dtype=np.float64)
        self.steps = 0
        self.retained_sum = 0.0  # sum over steps of C(t)/D, for d_bar (training-compute proxy, SPEC 5)

    @classmethod
    def for_model(cls, gated: dict, cfg, allocation=None) -> BudgetController:
        """A controller driving ``gated`` ({name: GatedLoRALinear}) with the schedule of ``cfg`` (a BudgetedConfig).
        With an ``allocation`` (``allocate.Allocation``) it removes exactly the modules the allocation drops, in its
        order: F becomes their complement's share of the dense MACs."""
        names, costs = list(gated), [m.dense_cost for m in gated.values()]
        budget, scores = cfg.budget, None
        if allocation is not None:
            scores = allocation.scores(names)
            budget = sum(c for n, c in zip(names, costs) if not allocation.ranks.get(n)) / sum(costs)
        return cls(names, costs, final_fraction=budget, decay_start=cfg.decay_start, decay_end=cfg.decay_end,
                   ema=cfg.retention_ema, eps_zero=cfg.eps_zero, modules=gated, scores=scores)

    @property
    def total_cost(self) -> float:
        return float(self.costs.sum())

    def schedule(self, progress: float) -> float:
        return budget_schedule(progress, self.final_fraction, self.decay_start, self.decay_end)

    def retained_fraction(self) -> float:
        return float((self.d * self.costs).sum() / self.costs.sum())

    def step(self, progress: float) -> dict:
        """Update every d_m for training progress t in [0, 1]; call once per optimiser step before its forward.

        Returns the log record: progress, b(t), retained C(t)/D, modules at zero, and the per-module d.
        """
        b = self.schedule(progress)
        target = greedy_targets(self.costs, b, self.scores)
        self.d = self.ema * self.d + (1.0 - self.ema) * target
        self.d[self.d < self.eps_zero] = 0.0
        if self.modules is not None:
            for name, d in zip(self.names, self.d):
                self.modules[name].set_retention(float(d))
        retained = self.retained_fraction()
        self.steps += 1
        self.retained_sum += retained
        return {"progress": progress, "budget": b, "retained": retained, "zero": int((self.d == 0.0).sum()),
                "d": [round(float(x), 6) for x in self.d]}

    @property
    def mean_retained(self) -> float:
        """d_bar: mean over the steps so far of C(t)/D."""
        return self.retained_sum / self.steps if self.steps else 1.0

    def state_dict(self) -> dict:
        return {"names": self.names, "d": self.d.tolist(), "steps": self.steps, "retained_sum": self.retained_sum,
                "final_fraction": self.final_fraction, "decay_start": self.decay_start,
                "decay_end": self.decay_end, "ema": self.ema, "eps_zero": self.eps_zero, "scores": self.scores}

    def load_state_dict(self, state: dict) -> None:
        if state["names"] != self.names:
            raise ValueError("controller state is for different modules")
        self.d = np.asarray(state["d"], dtype=np.float64)
        self.steps = int(state["steps"])
        self.retained_sum = float(state["retained_sum"])
        if self.modules is not None:
            for name, d in zip(self.names, self.d):
                self.modules[name].set_retention(float(d))
