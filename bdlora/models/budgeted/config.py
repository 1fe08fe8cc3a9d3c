"""``BudgetedConfig``: every setting of Budgeted LoRA in one place, each with its default and a docstring the CLI
turns into help text. Training (``bdlora train``), ``plan`` and ``compress`` read their defaults from here.

Defaults are the paper's unless marked (ours). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from bdlora.base.errors import Checks
from bdlora.base.settings import Settings


@dataclass
class BudgetedConfig(Settings):
    rank: int = 128
    """LoRA rank r_max of every gated module (paper: 128)."""
    alpha: float = 256.0
    """LoRA alpha; the low-rank path is scaled by alpha / r_max (paper: 256)."""
    gate_init: float = 3.0
    """Initial rank-gate logit: sigmoid(3) = 0.953, well above the hardening threshold, so a fresh module starts
    close to plain LoRA (ours; SPEC 4 asks for a documented value)."""
    budget: float = 0.4
    """F, the dense fraction retained after the decay."""
    decay_start: float = 0.1
    """t0, start of the budget decay as a fraction of training."""
    decay_end: float = 0.3
    """t1, end of the budget decay; t0 == t1 drops to F at once."""
    retention_ema: float = 0.9
    """EMA factor beta of d <- beta d + (1 - beta) target, in [0, 1); 0 disables smoothing. 0.9 lags the greedy
    target by ~10 steps (ours; the paper does not state its value)."""
    eps_zero: float = 1e-3
    """Retentions below this are clamped to 0 (training: the dense path is skipped; compress: it is dropped)."""
    eps_lr: float = 0.7
    """compress: d below this (and >= eps-zero) is SVD-approximated; at or above, merged into one dense Linear."""
    gate_threshold: float = 0.3
    """compress: ranks whose gate sigmoid(g) is below this are pruned (at least one is kept)."""
    svd_max_rank: int = 128
    """compress: r_dense_max, the SVD rank at d = eps-lr (k = round(r_dense_max d / eps_lr))."""

    def check(self, c: Checks) -> Checks:
        """Add every problem of these settings to ``c`` (``validate`` raises them)."""
        c.integer("lora_rank", self.rank, lo=1)
        c.number("lora_alpha", self.alpha, lo=0.0, lo_open=True)
        c.number("gate_init", self.gate_init)
        c.number("budget", self.budget, 0.0, 1.0)
        start_ok = c.number("decay_start", self.decay_start, 0.0, 1.0)
        if c.number("decay_end", self.decay_end, 0.0, 1.0) and start_ok:
            c.require(self.decay_start <= self.decay_end, f"--decay-start {self.decay_start} > --decay-end "
                      f"{self.decay_end}: the decay must start before it ends")
        c.number("retention_ema", self.retention_ema, 0.0, 1.0, hi_open=True)
        self.check_thresholds(c)
        return c

    def check_thresholds(self, c: Checks) -> None:
        """The compression thresholds alone (``compress`` takes only these)."""
        zero_ok = c.number("eps_zero", self.eps_zero, 0.0, 1.0, lo_open=True, hi_open=True)
        lr_ok = c.number("eps_lr", self.eps_lr, 0.0, 1.0, lo_open=True, hi_open=True)
        if zero_ok and lr_ok:
            c.require(self.eps_zero < self.eps_lr, f"--eps-zero {self.eps_zero} >= --eps-lr {self.eps_lr}: the drop "
                      "threshold must be below the SVD threshold")
        c.number("gate_threshold", self.gate_threshold, 0.0, 1.0, lo_open=True, hi_open=True)
        c.integer("svd_max_rank", self.svd_max_rank, lo=1)

    def validate_thresholds(self) -> BudgetedConfig:
        c = Checks()
        self.check_thresholds(c)
        c.done()
        return self

    def thresholds(self) -> dict:
        """The compression thresholds as recorded in reports."""
        return {"eps_zero": self.eps_zero, "eps_lr": self.eps_lr, "gate_threshold": self.gate_threshold,
                "svd_max_rank": self.svd_max_rank}


DEFAULTS = BudgetedConfig()
LORA_INITS = ("zero", "whitened", "svd")  # --lora-init (budgeted.start)
ALLOCATIONS = ("cost", "quality")  # --allocation (budgeted.start, budgeted.allocate)
FIELDS = tuple(f.name for f in fields(BudgetedConfig))
THRESHOLDS = ("eps_zero", "eps_lr", "gate_threshold", "svd_max_rank")  # the fields compress uses
