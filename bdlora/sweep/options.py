"""The options of ``bdlora sweep`` and the members they define (standard library only)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bdlora.budgeted.config import DEFAULTS as BUDGETED
from bdlora.budgeted.config import BudgetedConfig
from bdlora.errors import Checks, UsageError

BASELINES = ("kd-full", "kd-lora")


@dataclass(frozen=True)
class Member:
    name: str
    method: str
    budget: float | None


def family(budgets: list[float], baselines: list[str]) -> list[Member]:
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise UsageError(f"--baselines {','.join(bad)}: unknown (allowed: {', '.join(BASELINES)}, or none)")
    bad_f = [f for f in budgets if not 0.0 <= f <= 1.0]
    if bad_f:
        raise UsageError(f"--budgets {bad_f[0]}: a budget F must be in [0, 1]")
    if len(set(budgets)) != len(budgets):
        raise UsageError(f"--budgets {','.join(map(str, budgets))}: each budget once")
    members = [Member(b, b, None) for b in dict.fromkeys(baselines)]
    members += [Member(f"budgeted-F{f:g}", "budgeted", f) for f in budgets]
    if not members:
        raise UsageError("--budgets and --baselines are both empty: nothing to sweep")
    return members


@dataclass
class SweepOptions:
    budgets: list[float]
    baselines: list[str]
    train: dict  # TrainConfig fields shared by every member (method/budget/out set per member)
    eps_lr: float = BUDGETED.eps_lr
    eval_examples: int = 50
    eval_seeds: int = 3
    bench: bool = True
    bench_batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1])
    bench_seq_lens: list[int] = dataclasses.field(default_factory=lambda: [128])
    bench_repeats: int = 20
    bench_decode_tokens: int = 32

    def validate(self) -> SweepOptions:
        family(self.budgets, self.baselines)
        c = Checks()
        for name in ("eval_examples", "eval_seeds", "bench_repeats", "bench_decode_tokens"):
            c.integer(name, getattr(self, name), lo=1)
        BudgetedConfig(eps_lr=self.eps_lr).check_thresholds(c)
        c.done()
        return self
