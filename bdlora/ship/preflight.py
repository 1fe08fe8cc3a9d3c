"""Every ``ship`` setting that a later step would refuse, checked before the first step runs (a refusal after the
teacher's exports had run for 20 minutes left the user nothing): the domain pair train refuses, the bench's and the
heals' sequences against the teacher's context, and each speed-up against what ``bdlora plan`` says the forms reach
on this teacher (the largest student speed-up and the draft's: a smaller speed-up over the same forms is reached
when a larger one is)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bdlora.base.argv import Invocation, option_values, shown
from bdlora.base.errors import Checks, DataError, UsageError, flag
from bdlora.base.io import read_json, write_json
from bdlora.base.runs import CONFIG
from bdlora.base.schemes import SCHEMES
from bdlora.bench.config import NO_DOMAIN
from bdlora.compress.config import OneShotConfig
from bdlora.data.corpora import shared_corpus
from bdlora.export.defaults import MAX_CONTEXT
from bdlora.forms import reach_problem
from bdlora.models.budgeted.config import ALLOCATIONS
from bdlora.models.runtime import DecoderShape
from bdlora.ship.config import DRAFT_FORMS, ShipConfig
from bdlora.ship.process import spawn

QUALITY = ALLOCATIONS[1]  # plan's measured allocation (what a one-shot student's structure comes from)
# The calibration tokens of a reach check. Whether a speed-up is reached depends on the forms' costs alone (the
# cheapest choice of every site: every kept width, group count, rank and removable layer is offered whatever the
# errors), not on how many tokens measured the errors; only the draft's kept vocabularies are offered by the share of
# the teacher's choices they hold, estimated here on these tokens. At 1B the two checks on compress's 8,192 tokens took
# 21.5 minutes before the first step, on a ship whose students calibrate again on their own.
REACH_TOKENS = 1024


def check_settings(cfg: ShipConfig, source: str) -> None:
    """The settings against each other and against the teacher's folder (``source``), every problem at once."""
    c = Checks()
    if cfg.eval_data not in (None, NO_DOMAIN):
        try:
            shared = shared_corpus(cfg.eval_data, cfg.data)
        except DataError as e:
            c.add(str(e))
        else:
            c.require(shared is None, f"--eval-data {cfg.eval_data}: {shared} is in --data {cfg.data}; the second "
                                      "domain is text no student was calibrated or healed on (name another corpus)")
    if (Path(source) / CONFIG).is_file():
        positions = min(DecoderShape.from_folder(source).max_positions, MAX_CONTEXT)
        c.require(cfg.seq_len + cfg.decode_tokens <= positions,
                  f"--seq-len {cfg.seq_len} (+ --decode-tokens {cfg.decode_tokens}): above the {positions} positions "
                  "the teacher's export holds")
        c.require(not cfg.heals or cfg.heal_seq_len <= positions,
                  f"--heal-seq-len {cfg.heal_seq_len}: above the teacher's context of {positions} positions")
    c.done()


def plan_invocation(model: str, cfg: ShipConfig, forms: str, speedup: float, quant: str | None,
                    student: bool = True) -> Invocation:
    """The ``bdlora plan`` that allocates what a student's one-shot (``student`` False: the draft's) would (nothing
    written; its report as JSON)."""
    return Invocation(("plan",), {"model": model, "allocation": QUALITY, **option_values(
        OneShotConfig, forms=forms, speedup=float(speedup), precision=cfg.precision, data=cfg.data, quant=quant,
        threads=cfg.pool.threads, calib_tokens=REACH_TOKENS,
        width_multiple=cfg.width_multiple if student else None), "json_out": True})


def reach_checks(model: str, cfg: ShipConfig, quant: str | None) -> list[tuple[str, Invocation]]:
    """(the option, its plan) for the largest student speed-up and the draft's."""
    checks = []
    if cfg.speedup_list():
        checks.append((flag("speedups"), plan_invocation(model, cfg, cfg.forms, max(cfg.speedup_list()), quant)))
    if cfg.draft_speedup:
        checks.append((flag("draft_speedup"),
                       plan_invocation(model, cfg, DRAFT_FORMS, cfg.draft_speedup, quant, False)))
    return checks


def reach_quants(cfg: ShipConfig) -> list[str | None]:
    """The rounding schemes a student may be made with: --student-quant, else every scheme of --schemes (the
    teacher's best, which the students take, is known only after its exports; a scheme's nodes have their own
    decode times, so its reach differs: 1.25x was reached with rtn's and beyond reach, 1.23x, with affine's), the
    first of those timed alike (``Scheme.timed_as``) standing for the others."""
    if cfg.student_quant is not None:
        return [cfg.student_quant]
    # One check per timed node layout: a scheme timed as another (gptq as rtn: the same MatMulNBits nodes, other
    # values) has its costs, so its reach (at 1B a check is 4 minutes)
    by_nodes: dict[str, str] = {}
    for q in cfg.scheme_list():
        by_nodes.setdefault(SCHEMES[q].timed_as(cfg.precision).name if q in SCHEMES else q, q)
    return list(by_nodes.values()) or [None]


def check_reach(model: str, cfg: ShipConfig, spell, stage=lambda msg: None, source: str | None = None) -> None:
    """Each ``reach_checks`` plan run, for every scheme of ``reach_quants``, as its own process given its settings
    file (as a step is: its memory returned, and it ends with ship); a refusal (a speed-up beyond reach) raised as
    one line naming the option and the scheme. ``spell``: a plan as the line a person types (shown)."""
    config = read_json(Path(source) / CONFIG) if source and (Path(source) / CONFIG).is_file() else None
    targets = [(flag("speedups"), cfg.forms, max(cfg.speedup_list())) if cfg.speedup_list() else None,
               (flag("draft_speedup"), DRAFT_FORMS, cfg.draft_speedup) if cfg.draft_speedup else None]
    for option, forms, speedup in [t for t in targets if t] if config else ():
        problem = reach_problem(config, forms, speedup=float(speedup))
        if problem:  # from the teacher's shapes alone: no plan process calibrates and times for minutes first
            raise UsageError(f"{option}: {problem}")
    for quant in reach_quants(cfg):
        for option, plan in reach_checks(model, cfg, quant):
            quiet = Invocation(plan.command, {k: v for k, v in plan.values.items() if k != "json_out"})
            stage(f"checking {option} with `{shown(quiet, spell)}`")
            with tempfile.TemporaryDirectory(prefix="bdlora-reach-") as tmp:
                settings = Path(tmp) / "plan.json"
                write_json(settings, plan.to_json())
                proc = spawn([sys.executable, "-m", "bdlora.cli", *plan.file_argv(settings)])
                text = proc.stdout.read()
                code = proc.wait()
            rounding = f" rounded by {quant}" if quant else ""
            if code != 0:
                said = next((t for t in reversed(text.splitlines()) if t.startswith("error:")), text.strip()[-300:])
                raise UsageError(f"{option}: plan refuses it{rounding} before any step runs "
                                 f"({said.removeprefix('error:').strip()}); give a speed-up it reaches")
            unmet = planned_unmet(text)
            if unmet:  # beyond the reach of times measured on a busy machine: not refused, the bench decides
                stage(f"{option}{rounding}: {unmet}; going on")


def planned_unmet(text: str) -> str | None:
    """What plan's JSON (on the last lines of ``text``: its stage lines come first) says of a target beyond the reach
    of times it could not measure cleanly (``compress.allocate.Allocation.unmet``), or None."""
    start = 0 if text.startswith("{\n") else text.find("\n{\n") + 1  # the line holding only "{" opens the report
    try:
        report = json.loads(text[start:]) if start > 0 or text.startswith("{") else None
    except ValueError:
        return None
    cost = (report.get("provenance") or {}).get("allocation_cost") if isinstance(report, dict) else None
    return cost.get("unmet") if isinstance(cost, dict) else None
