"""``bdlora plan`` (what compress would produce, from shapes alone) and ``bdlora compress``."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from bdlora.budgeted.config import THRESHOLDS, BudgetedConfig
from bdlora.cli import render
from bdlora.cli.app import command, err, out
from bdlora.cli.options import from_dataclass
from bdlora.plan import DEFAULT_PLAN_STEPS
from bdlora.runs import RUNS_DIR

PLAN_FIELDS = ("budget", "rank", "eps_lr", "eps_zero", "svd_max_rank", "decay_start", "decay_end", "retention_ema")


@command(options=from_dataclass(BudgetedConfig, names=PLAN_FIELDS, rename={"rank": "lora_rank"}, defaults=True))
def plan(
    model_config: Annotated[str, typer.Option(help="Hugging Face config.json (or a folder holding one).")],
    layers: Annotated[Optional[int], typer.Option(help="Student decoder layers (default: the config's).")] = None,
    steps: Annotated[int, typer.Option(help="Optimiser steps the schedule is simulated over.")] = DEFAULT_PLAN_STEPS,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    **opts,
):
    """Predict what `compress` would produce for a budget F from a model config alone: per-module case and rank,
    MAC speed-ups vs dense and vs LoRA, parameter reduction and the training-compute proxy."""
    from bdlora.arch import check_lora_rank
    from bdlora.errors import Checks
    from bdlora.plan import plan as run_plan
    from bdlora.plan import read_model_config

    rank = opts.pop("lora_rank")
    c = Checks()  # every option's own range first, then what the model allows
    BudgetedConfig(**opts, rank=rank).check(c)
    c.integer("layers", layers, lo=1)
    c.integer("steps", steps, lo=1)
    c.done()
    config = read_model_config(model_config)
    opts["rank"] = check_lora_rank(rank, config)
    report = run_plan(config, BudgetedConfig(**opts), layers=layers, steps=steps)
    if json_out:
        print(json.dumps(report, indent=2))
        return
    render.compression_report(report, title=f"plan: F = {opts['budget']}")


@command(options=from_dataclass(BudgetedConfig, names=THRESHOLDS, defaults=True))
def compress(
    run_dir: Annotated[Optional[str], typer.Argument(help="A finished run (default: the latest under --runs-dir).")]
    = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default: RUN_DIR.compressed).")]
    = None,
    force: Annotated[bool, typer.Option(help="Replace an existing non-empty --out.")] = False,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip the held-out perplexity of both models.")] = False,
    runs_dir: Annotated[str, typer.Option(help="Where runs live.")] = RUNS_DIR,
    json_out: Annotated[bool, typer.Option("--json", help="Print compression.json instead of tables.")] = False,
    **opts,
):
    """Turn a trained student into its deployment form: drop, SVD-approximate or merge each dense path (budgeted),
    merge the adapter (kd-lora) or pass through (kd-full); saved as a Hugging Face model folder."""
    from bdlora.cli.progress import RichReporter
    from bdlora.compress import compress_run
    from bdlora.runs import RunDir

    cfg = BudgetedConfig(**opts).validate_thresholds()
    run = RunDir(run_dir) if run_dir else RunDir.latest(runs_dir)
    report, folder = compress_run(run, cfg, out=out_dir, force=force, evaluate=not no_eval,
                                  reporter=RichReporter(err if json_out else out))
    if json_out:
        print(json.dumps(report, indent=2))
        return
    render.compression_report(report, title=f"compress {Path(run.path).name} ({report['provenance']['method']})")
    out.print(f"[green]wrote[/] {folder}")
