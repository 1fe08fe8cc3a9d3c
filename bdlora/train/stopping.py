"""When a healing run stops and which of its students it keeps: the best checkpoint on data it never trained on
(``--eval-data``) and a run that fits a wall-clock budget (``--time-budget``).

A student healed on narrow data can get worse on everything else while its training loss still falls (the healing
issue measured SmolLM2 at 2.36x the teacher on ``fortunes`` after healing to the teacher's perplexity on its own
mixture). ``BestKeeper`` scores the student on ``--eval-data``'s held-out slice at every validation and keeps the
trainable weights (and the method's state) of the best step in ``RUN/best/``, written atomically, so an interrupted
run keeps it; the run's saved student is that step's. A budgeted student is only eligible once its budget schedule is
over (before that it still carries the dense paths the budget removes).

``TimeBudget`` counts from the moment ``bdlora train`` starts (loading, teacher samples and calibration included),
times the first ``PROBE_STEPS`` optimiser steps and plans the step count that fits: the LR schedule (and a budgeted
run's decay) are then laid out over that many steps. After every step it checks that the next one, its validation
if one is due and the finish (one more validation, saving the student) still fit, and stops cleanly when they would
not.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from bdlora.base.errors import DataError, RunDirError, TrainingError, flag
from bdlora.base.io import atomic_dir, load_tensors, read_json, save_tensors, write_json
from bdlora.data.corpora import shared_corpus

BEST = "best"  # RUN/best/: the best step on --eval-data (trainable weights + best.json)
BEST_WEIGHTS, BEST_META = "trainable.safetensors", "best.json"
PROBE_STEPS = 4  # steps timed before the plan (the first is left out of the rate: it pays one-off costs)
FINISH_SHARE = 0.02  # of the budget, kept for saving the student and the summary, beside one validation
_UNITS = {"s": 1, "m": 60, "h": 3600}
# --time-budget's range: below 30 s no run gets past loading and calibration (1s ran 102 s before its refusal); above
# 30 days it is a typo ("99999999999h" planned 237,651,204,793,628 steps into config.json)
MIN_BUDGET, MAX_BUDGET = 30.0, 30 * 24 * 3600.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*$")


def stopping_problems(c, cfg) -> None:
    """--eval-data (never a corpus of --data) and --time-budget (a duration; not beside a step count)."""
    if c.text("eval_data", cfg.eval_data) and cfg.eval_data is not None and isinstance(cfg.data, str):
        try:
            shared = shared_corpus(cfg.eval_data, cfg.data)
        except DataError as e:
            c.require(False, str(e))
        else:
            c.require(shared is None, f"--eval-data {cfg.eval_data}: {shared} is in --data {cfg.data}; the run "
                                      "is scored there on text it never trained on (name another corpus)")
    if cfg.time_budget is not None and c.text("time_budget", cfg.time_budget):
        try:
            parse_duration(cfg.time_budget)
        except ValueError as e:
            c.require(False, str(e))
        c.require((cfg.max_steps is None or "max_steps" in cfg.defaulted) and cfg.tokens is None,
                  f"--time-budget {cfg.time_budget}: sets the step count itself; drop --max-steps / --tokens")


def now() -> float:
    """The clock budgets are measured on (a function, so a test can give the loop a clock it controls)."""
    return time.monotonic()


def parse_duration(text: str | None, name: str = "time_budget") -> float | None:
    """Seconds of ``--time-budget`` (or the option ``name``, e.g. ship's heal_time_budget): ``90s``, ``60m``,
    ``1.5h`` or a plain number of seconds; None for None."""
    if text is None:
        return None
    m = _DURATION.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{flag(name)} {text}: a positive duration such as 90s, 60m or 1.5h")
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if not MIN_BUDGET <= seconds <= MAX_BUDGET:
        raise ValueError(f"{flag(name)} {text}: a duration from {MIN_BUDGET:g}s (loading the teacher, its text and "
                         f"the calibration come first) to {MAX_BUDGET // 3600:g}h")
    return seconds


def budget_steps(seconds_left: float, step_seconds: float, eval_seconds: float, eval_every: int) -> int:
    """How many more optimiser steps fit in ``seconds_left``, a validation every ``eval_every`` steps costing
    ``eval_seconds`` (and one at the end, whatever the count)."""
    per_step = step_seconds + eval_seconds / max(1, eval_every)
    return max(0, math.floor((seconds_left - eval_seconds) / per_step)) if per_step > 0 else 0


@dataclass
class TimeBudget:
    """``--time-budget``: the step plan and the stop (see the module docstring)."""

    seconds: float
    started: float  # ``now()`` when the command started
    reserve: float = 0.0  # seconds kept for the finish (saving; the finish's validation is ``eval_seconds``)
    eval_seconds: float = 0.0  # one validation (every scored slice), measured before the first step
    step_times: list[float] = field(default_factory=list)
    planned: int | None = None  # the step count chosen after the probe
    stopped_early: bool = False
    _last: float | None = None

    @classmethod
    def start(cls, seconds: float, started: float) -> TimeBudget:
        return cls(seconds, started, reserve=FINISH_SHARE * seconds)

    def left(self) -> float:
        return self.seconds - (now() - self.started)

    def begin(self) -> None:
        """The loop starts (after the initial validation, whose time is ``eval_seconds``): refused in one line when
        what was spent before it leaves no room for a step and the finish (nothing would be healed)."""
        self._last = now()
        spent = self.seconds - self.left()
        if self.left() < 2 * self.eval_seconds + self.reserve:
            raise TrainingError(f"--time-budget {self.seconds:g}s: {spent:.0f} s went before the first step "
                                f"(loading, samples, calibration, a validation of {self.eval_seconds:.0f} s), "
                                "so no step and its finish fit; give a longer budget or fewer --eval-tokens")

    def step_seconds(self) -> float:
        t = self.step_times[1:] or self.step_times
        return sum(t) / len(t) if t else 0.0

    def after_step(self, done: int, start_step: int, eval_every: int) -> int | None:
        """Called once after every optimiser step (``done`` steps in all): the step count to lay the schedule over
        when the probe has just ended (None otherwise)."""
        t = now()
        self.step_times.append(t - (self._last if self._last is not None else t))
        self._last = t
        if self.planned is None and done - start_step >= PROBE_STEPS:
            more = budget_steps(self.left() - self.reserve, self.step_seconds(), self.eval_seconds, eval_every)
            self.planned = done + more
            return self.planned
        return None

    def must_stop(self, done: int, eval_every: int) -> bool:
        """Whether the next step (its validation if one is due) and the finish no longer fit."""
        nxt = self.step_seconds() + (self.eval_seconds if (done + 1) % eval_every == 0 else 0.0)
        if self.left() < nxt + self.eval_seconds + self.reserve:
            self.stopped_early = True
            return True
        return False

    def summary(self) -> dict:
        return {"seconds": self.seconds, "used_seconds": self.seconds - self.left(), "planned_steps": self.planned,
                "step_seconds": self.step_seconds(), "eval_seconds": self.eval_seconds,
                "stopped_by_budget": self.stopped_early}


class BestKeeper:
    """``--eval-data``: the best step's trainable weights and method state in ``folder`` (``RUN/best/``)."""

    def __init__(self, folder: Path, spec: str):
        self.folder, self.spec = Path(folder), spec
        self.best: dict | None = None  # {"step", "eval_ppl", "val_ppl"}
        self.initial: float | None = None
        self.last: float | None = None
        if (self.folder / BEST_META).is_file():  # a resumed run: the best so far
            try:
                self.best = read_json(self.folder / BEST_META)
                float(self.best["eval_ppl"]), int(self.best["step"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise RunDirError(f"{self.folder}: its {BEST_META} does not read ({e}); the run is damaged") \
                    from None

    def offer(self, step: int, eval_ppl: float, val_ppl: float | None, model, method, eligible: bool) -> bool:
        """Record the score of ``step``; keep its weights when it is eligible and the best so far."""
        self.last = eval_ppl
        if not eligible or not math.isfinite(eval_ppl):
            return False
        if self.best is not None and eval_ppl >= self.best["eval_ppl"]:
            return False
        with atomic_dir(self.folder) as tmp:
            save_tensors(tmp / BEST_WEIGHTS, {n: p for n, p in model.named_parameters() if p.requires_grad})
            write_json(tmp / BEST_META, {"step": step, "eval_ppl": eval_ppl, "val_ppl": val_ppl,
                                         "eval_data": self.spec, "method": method.state()})
        self.best = {"step": step, "eval_ppl": eval_ppl, "val_ppl": val_ppl}
        return True

    def restore(self, model, method, final_step: int) -> bool:
        """Put the best step's weights (and method state) back into ``model`` unless it is ``final_step``."""
        if self.best is None or self.best["step"] == final_step:
            return False
        weights = load_tensors(self.folder / BEST_WEIGHTS)
        params = dict(model.named_parameters())
        missing = sorted(set(weights) - set(params))
        if missing:
            raise RunDirError(f"{self.folder}: {BEST_WEIGHTS} names weights this student lacks ({missing[0]})")
        for n, t in weights.items():
            params[n].data.copy_(t)
        method.load_state(read_json(self.folder / BEST_META).get("method") or {})
        return True

    def summary(self, final_step: int) -> dict:
        b = self.best or {}
        return {"eval_data": self.spec, "eval_data_ppl_initial": self.initial, "eval_data_ppl_last": self.last,
                "best_step": b.get("step"), "eval_data_ppl_best": b.get("eval_ppl"),
                "kept": "best" if b and b.get("step") != final_step else "last"}


# --------------------------------------------------------------------------------------------------------------------
# The loop's side: ``run`` is ``bdlora.train.loop.Run``
# --------------------------------------------------------------------------------------------------------------------


def attach(run, started: float) -> None:
    """--eval-data's keeper of the best step and --time-budget's clock (a resumed run keeps its planned steps and
    gets the budget again for the rest)."""
    cfg = run.cfg
    if run.sess.eval_blocks is not None:
        run.keeper = BestKeeper(run.run.path / BEST, cfg.eval_data)
    if cfg.time_budget is not None:
        run.budget = TimeBudget.start(parse_duration(cfg.time_budget), started)
        if run.start_step:
            run.budget.planned = cfg.max_steps


def validate(run, done: int, initial: bool = False) -> dict:
    """The student's held-out perplexity (and --eval-data's, offered to the keeper of the best step)."""
    from bdlora.models.perplexity import perplexity  # torch

    was = run.model.training
    scores = {"val_ppl": perplexity(run.model, run.sess.val_blocks)}
    if run.keeper is not None:
        scores["eval_data_ppl"] = perplexity(run.model, run.sess.eval_blocks)
        if initial and done == 0:
            run.keeper.initial = scores["eval_data_ppl"]
        if not initial or done == 0:  # a resumed run's first score is its checkpoint's, already offered
            progress = max(0, done - 1) / max(1, run.cfg.max_steps - 1)  # the schedule point of step ``done``
            run.keeper.offer(done, scores["eval_data_ppl"], scores["val_ppl"], run.model, run.method,
                             run.method.final_form(progress))
    run.model.train(was)
    return scores


def fit_budget(run, done: int, write_config) -> None:
    """--time-budget: after the probe, lay the schedule over the steps that fit; stop when the next would not."""
    from bdlora.train import distributed as D  # torch
    from bdlora.train.distill import warmup_cosine

    b, cfg = run.budget, run.cfg
    if b is None:
        return
    planned = D.broadcast_object(run.env, b.after_step(done, run.start_step, cfg.eval_every))
    if planned is not None:
        cfg.max_steps = max(done, planned)
        run.scheduler.lr_lambdas[0] = warmup_cosine(cfg.max_steps)
        run.reporter.stage(f"--time-budget {cfg.time_budget}: {b.step_seconds():.2f} s a step, "
                           f"{cfg.max_steps:,} steps fit")
        run.reporter.start(cfg.max_steps, done)
        if run.env.is_main:  # a resumed run continues to the planned count
            write_config()
    if done < cfg.max_steps and D.broadcast_object(run.env, b.must_stop(done, cfg.eval_every)):
        cfg.max_steps = done


def keep_best(run) -> dict:
    """At the finish: the best step's weights back in the model (its validation figure with them), and what the
    summary says of the keeper and the budget."""
    kept = {}
    if run.keeper is not None:
        if run.keeper.restore(run.model, run.method, run.cfg.max_steps):
            run.figures["student_val_ppl"] = run.keeper.best["val_ppl"]
            run.reporter.stage(f"keeping step {run.keeper.best['step']}, the best on --eval-data {run.cfg.eval_data}")
        kept = run.keeper.summary(run.cfg.max_steps)
    if run.budget is not None:
        kept["time_budget"] = run.budget.summary()
    return kept
