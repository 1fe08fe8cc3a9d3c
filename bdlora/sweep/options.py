"""The options of ``bdlora sweep`` and the members they define (standard library only)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bdlora.base.errors import Checks, UsageError
from bdlora.base.method_table import GATED, METHOD_TABLE, method_of
from bdlora.base.settings import Settings
from bdlora.base.threads import from_options
from bdlora.compress.config import OneShotConfig
from bdlora.data.documents import BUILTIN
from bdlora.models.budgeted.config import DEFAULTS as BUDGETED
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.sweep.vary import check_axes, grid, label
from bdlora.train.config import OPTION_NAMES, TrainConfig, resolve_defaults
from bdlora.train.defaults import teacher_defaults

BASELINES = tuple(m.name for m in METHOD_TABLE.values() if not m.gated)


@dataclass(frozen=True)
class Member:
    """One row of the sweep. ``run`` names its training folder: members that differ only in compress-time settings
    share it (``name`` is ``run`` plus those settings)."""

    name: str
    method: str
    budget: float | None
    run: str
    train_settings: dict = dataclasses.field(default_factory=dict)
    compress_settings: dict = dataclasses.field(default_factory=dict)

    @property
    def settings(self) -> dict:
        return {**self.train_settings, **self.compress_settings}


def family(budgets: list[float], baselines: list[str], vary: list[dict] = (),
           one_shot: list[float] = ()) -> list[Member]:
    """The members: each method (baselines, then budgeted at each F) at every point of the ``--vary`` grid; the
    compress-time axes only multiply the budgeted members (the baselines merge or pass through at compress). Then
    one ``one-shot-<R>x`` member per ``--one-shot`` ratio: the teacher compressed without training (no grid)."""
    bad_r = [r for r in one_shot if not r >= 1.0]
    if bad_r:
        raise UsageError(f"--one-shot {bad_r[0]}: a projection-MAC ratio must be >= 1")
    if len(set(one_shot)) != len(one_shot):
        raise UsageError(f"--one-shot {','.join(map(str, one_shot))}: each ratio once")
    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise UsageError(f"--baselines {','.join(bad)}: unknown (allowed: {', '.join(BASELINES)}, or none)")
    bad_f = [f for f in budgets if not 0.0 <= f <= 1.0]
    if bad_f:
        raise UsageError(f"--budgets {bad_f[0]}: a budget F must be in [0, 1]")
    if len(set(budgets)) != len(budgets):
        raise UsageError(f"--budgets {','.join(map(str, budgets))}: each budget once")
    methods = [(b, b, None) for b in dict.fromkeys(baselines)]
    methods += [(f"{GATED}-F{f:g}", GATED, f) for f in budgets]
    if not methods and not one_shot:
        raise UsageError("--budgets and --baselines are both empty: nothing to sweep")
    check_axes(list(vary))
    train_points, compress_points = grid(list(vary), compress=False), grid(list(vary), compress=True)
    members = []
    for base, method, budget in methods:
        for tp in train_points:
            run = base + label(tp)
            for cp in compress_points if method_of(method).gated else [{}]:
                members.append(Member(run + label(cp), method, budget, run, tp, cp))
    members += [Member(f"one-shot-{r:g}x", "one-shot", None, f"one-shot-{r:g}x", {}, {"mac_ratio": r})
                for r in one_shot]
    names = [m.name for m in members]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise UsageError(f"--vary: two grid points are both named {clash[0]} (values differing only in characters "
                         "a folder name cannot hold)")
    return members


DEFAULT_BUDGETS = (0.0, 0.4)  # `sweep --budgets`: the paper's two operating points
DEFAULT_BASELINES = BASELINES  # `sweep --baselines`
DEFAULT_BENCH_BATCH_SIZES, DEFAULT_BENCH_SEQ_LENS = (1,), (128,)  # `sweep --bench-batch-sizes / --bench-seq-lens`


@dataclass
class SweepConfig(Settings):
    budgets: list[float]
    baselines: list[str]
    train: dict  # TrainConfig fields shared by every member (method/budget/out set per member)
    eps_lr: float = BUDGETED.eps_lr
    eval_examples: int = 50
    eval_seeds: int = 3
    bench: bool = True
    bench_batch_sizes: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_BENCH_BATCH_SIZES))
    bench_seq_lens: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_BENCH_SEQ_LENS))
    bench_repeats: int = 20
    bench_decode_tokens: int = 32
    vary: list[dict] = dataclasses.field(default_factory=list)  # parsed --vary axes (see bdlora.sweep.vary)
    one_shot: list[float] = dataclasses.field(default_factory=list)  # --one-shot ratios: untrained members
    front: bool = False  # --front: the whole family on one onnxruntime-genai quality/speed front (sweep.front)

    def thresholds(self, m: Member, eps_zero: float | None) -> BudgetedConfig:
        """The compress settings of a member: --eps-lr and its compress-time grid point; dense paths are dropped
        below the run's own training threshold eps_zero (the paper fixes one value for training and compression)."""
        return BudgetedConfig(**{"eps_lr": self.eps_lr, "eps_zero": BUDGETED.eps_zero if eps_zero is None
                                 else eps_zero, **m.compress_settings})

    def members(self) -> list[Member]:
        return family(self.budgets, self.baselines, self.vary, self.one_shot)

    def one_shot_config(self, m: Member):
        """A one-shot member's compression: the sweep's teacher, corpus, split and evaluation slice."""

        t = self.train
        defaults = teacher_defaults(self.teacher == BUILTIN)
        return from_options(OneShotConfig, {
            "mac_ratio": m.compress_settings["mac_ratio"], "data": t.get("data") or BUILTIN,
            "calib_tokens": t.get("calib_tokens") or defaults["calib_tokens"],
            "heldout_fraction": t.get("heldout_fraction"), "seq_len": t.get("seq_len") or defaults["seq_len"],
            "eval_tokens": t.get("eval_tokens") or defaults["eval_tokens"]})

    def train_config(self, m: Member, out: str | None = None):
        """The training options of a member: the shared ones, its grid point, its method and budget."""

        values = {k: v for k, v in self.train.items() if k in OPTION_NAMES}
        values.update(m.train_settings)
        values.update(method=m.method, out=out)
        if m.budget is not None:
            values["budget"] = m.budget
        return from_options(TrainConfig, values)

    @property
    def teacher(self) -> str:
        """The teacher every member is made from (the embedded default unless the train options name one)."""
        return self.train.get("teacher") or BUILTIN

    def lora_rank(self, m: Member) -> int:
        """The LoRA rank a member's options resolve to (its LoRA baseline's), trained or not."""
        return resolve_defaults(self.train_config(m), builtin_teacher=self.teacher == BUILTIN).lora_rank

    def check(self, c: Checks) -> Checks:
        """The sweep's own values (each member's are checked by ``validate``, member by member)."""
        for name in ("eval_examples", "eval_seeds", "bench_repeats", "bench_decode_tokens"):
            c.integer(name, getattr(self, name), lo=1)
        BudgetedConfig(eps_lr=self.eps_lr).check_thresholds(c)
        return c

    def validate(self) -> SweepConfig:
        """Every member's options checked like the flags before anything runs (a bad grid point fails at once,
        not after the members before it have trained), then the sweep's own (``check``)."""
        for m in self.members():
            if m.method == "one-shot":
                self.one_shot_config(m).validate()
                continue
            try:
                cfg = self.train_config(m).validate()
                self.thresholds(m, cfg.eps_zero).validate_thresholds()
            except UsageError as e:
                if not self.vary:
                    raise
                raise UsageError(f"--vary member {m.name}: {str(e).splitlines()[0]}") from None
        return super().validate()
