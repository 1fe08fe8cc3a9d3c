"""``bdlora eval`` (perplexity and ICL probes of one model) and ``bdlora sweep`` (a whole budget family)."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bdlora.base.errors import UsageError, flag
from bdlora.base.io import write_json
from bdlora.base.outputs import check_new_out, check_out_file
from bdlora.base.runs import PAPER_MAIN, RUNS_DIR, ModelDir, SweepDir, eval_json
from bdlora.base.threads import flat
from bdlora.cli import render
from bdlora.cli.app import command, err, out
from bdlora.cli.options import (
    TRAIN_PANELS,
    Force,
    Json,
    Out,
    Report,
    RunsDir,
    common,
    float_list,
    from_dataclass,
    int_list,
    str_list,
)
from bdlora.cli.progress import RichReporter
from bdlora.eval.evaluate import EvalConfig
from bdlora.sweep.options import (
    DEFAULT_BASELINES,
    DEFAULT_BENCH_BATCH_SIZES,
    DEFAULT_BENCH_SEQ_LENS,
    DEFAULT_BUDGETS,
    SweepConfig,
)
from bdlora.sweep.paper import OUTPUTS, merge_sweeps
from bdlora.sweep.report import markdown
from bdlora.sweep.vary import parse_axis
from bdlora.train.config import TrainConfig, defaults_help, merge
from bdlora.train.option_files import load_yaml

SWEEP_TRAIN_OPTIONS = ("teacher", "student_init", "data", "student_layers", "layer_selection", "seq_len", "batch_size",
                       "max_steps", "tokens", "lr", "temperature", "kd_weight", "lora_rank", "lora_alpha",
                       "eval_tokens", "heldout_fraction", "seed", "device", "cache_dir", "kd_topk")


EVAL_PANELS = {  # eval --help: what to score and where the report goes first; each measure's settings after
    "Perplexity": ("seq_len", "heldout_fraction", "domains", "batch_size"),
    "ICL probes": ("shots", "seeds", "examples", "tasks"),
    "Folders": ("onnx_file",),
}


@command(name="eval", options=from_dataclass(EvalConfig, skip=("ppl", "icl"), defaults=True, panels=EVAL_PANELS))
def eval_cmd(
    model_dir: Annotated[Optional[str], typer.Argument(help="A run directory, model folder (teacher, compressed, "
                                                            "exported HF) or ONNX folder (default: the latest "
                                                            "compressed model).")] = None,
    ppl: Annotated[bool, typer.Option("--ppl", help="Held-out perplexity (with neither --ppl nor --icl: both).")]
    = False,
    icl: Annotated[bool, typer.Option("--icl", help="The 19 ICL probes of SPEC 7.")] = False,
    json_path: Report = None,
    force: Force = False,
    vs_teacher: Annotated[bool, typer.Option(help="Score the model's teacher (from its run) on the same slice and "
                                                  "prompts, once per settings (cached), and show it beside.")]
    = True,
    runs_dir: RunsDir = RUNS_DIR,
    **opts,
):
    """Score a model: perplexity on the held-out slice and the 19 function-style ICL probes (10-shot, 3
    demonstration seeds, exact match; per-task mean and std, macro average). The report goes to MODEL_DIR.eval.json
    beside the folder, or to --report."""

    opts["tasks"] = str_list(opts["tasks"])
    ecfg = EvalConfig(ppl=ppl or not icl, icl=icl or not ppl, **opts).validate()
    src = Path(model_dir) if model_dir else ModelDir.latest(runs_dir).path
    dst = Path(json_path) if json_path else eval_json(src)
    check_out_file(dst, force=force, ours=json_path is None)
    from bdlora.eval.reference import evaluate_with_teacher  # loads the teacher module (torch)

    doc = evaluate_with_teacher(src, ecfg, vs_teacher, reporter=RichReporter(out))
    write_json(dst, doc)
    render.evaluation(doc)
    out.print(f"[green]wrote[/] {escape(str(dst))}")
MEMBERS = "Members' evaluation and bench"  # sweep --help: the panel of what each member is scored and timed with


def _member(text: str):
    return typer.Option(help=text, rich_help_panel=MEMBERS)


@command(options=from_dataclass(TrainConfig, names=SWEEP_TRAIN_OPTIONS, notes=defaults_help(), panels=TRAIN_PANELS))
def sweep(
    budgets: Annotated[str, typer.Option(help="Comma-separated budgets F of the budgeted members.")]
    = ",".join(map(str, DEFAULT_BUDGETS)),
    baselines: Annotated[str, typer.Option(help="Comma-separated baselines (kd-full, kd-lora; '' for none).")]
    = ",".join(DEFAULT_BASELINES),
    one_shot: Annotated[str, typer.Option("--one-shot", help="Comma-separated projection-MAC ratios: the teacher "
                                          "compressed without training (`compress --one-shot`) as members of their "
                                          "own, e.g. 1.5,1.9.")] = "",
    config: Annotated[Optional[str], typer.Option(help="YAML of any `bdlora train` option, shared by every member; "
                                                       "flags override.")] = None,
    vary: Annotated[Optional[list[str]], typer.Option(
        help="Ablation grid axis, repeatable: OPTION=V1,V2 (any train option, or the compress thresholds eps_lr, "
             "gate_threshold, svd_max_rank: re-compressed, not retrained); OPT1,OPT2=A1:B1,A2:B2 varies options "
             "together. Every method runs at every point of the product of all axes.")] = None,
    eps_lr: Annotated[float, _member("compress --eps-lr of every budgeted member.")] = SweepConfig.eps_lr,
    examples: Annotated[int, _member("ICL query prompts per task and seed.")] = SweepConfig.eval_examples,
    seeds: Annotated[int, _member("ICL demonstration seeds.")] = SweepConfig.eval_seeds,
    bench: Annotated[bool, typer.Option(help="Bench each compressed member (onnxruntime, CPU).")] = True,
    bench_batch_sizes: Annotated[str, _member("bench --batch-sizes.")] = ",".join(map(str, DEFAULT_BENCH_BATCH_SIZES)),
    bench_seq_lens: Annotated[str, _member("bench --seq-lens.")] = ",".join(map(str, DEFAULT_BENCH_SEQ_LENS)),
    bench_repeats: Annotated[int, _member("bench --repeats.")] = SweepConfig.bench_repeats,
    front: Annotated[bool, typer.Option(help="Then the family and the teacher's own exports (fp32/int8/int4) in one "
                                             "onnxruntime-genai run: one quality/speed front.")] = SweepConfig.front,
    out_dir: Out = None,
    runs_dir: RunsDir = RUNS_DIR,
    resume: Annotated[Optional[str], typer.Option(help="Finish an interrupted sweep folder (its stored options are "
                                                        "used; finished stages are skipped).")] = None,
    json_out: Json = False,
    **opts,
):
    """Train, compress, evaluate and bench a budget family (baselines + budgeted at each F, at every point of the
    --vary grid) with everything else fixed; writes sweep.md, results.json, pareto.png and the paper's layouts
    (main.md, table9.md, icl.png). --out: the sweep folder (default RUNS_DIR/sweep-<time>)."""
    from bdlora.sweep.run import run_sweep

    rep = RichReporter(err if json_out else out)
    if resume is not None:
        _check_resume_alone(resume, opts, config, vary)
        doc = run_sweep(None, SweepDir(resume), rep, resume=True)
    else:
        cfg = merge(load_yaml(config) if config else {}, {**opts, "runs_dir": runs_dir}).validate()
        train_opts = {k: v for k, v in flat(cfg).items() if k not in ("method", "budget", "out", "defaulted")}
        sopts = SweepConfig(budgets=float_list(budgets, "--budgets"), baselines=str_list(baselines) or [],
                            train=train_opts, eps_lr=eps_lr, eval_examples=examples, eval_seeds=seeds, bench=bench,
                            bench_batch_sizes=int_list(bench_batch_sizes, "--bench-batch-sizes"),
                            bench_seq_lens=int_list(bench_seq_lens, "--bench-seq-lens"), bench_repeats=bench_repeats,
                            vary=[parse_axis(v) for v in vary or []], one_shot=float_list(one_shot, "--one-shot"),
                            front=front)
        if out_dir:
            check_new_out(out_dir)
        doc = run_sweep(sopts.validate(), SweepDir.new(runs_dir, out_dir), rep)
    if json_out:
        print(json.dumps(doc, indent=2))
        return
    out.print(markdown(doc))
    out.print(f"[green]wrote[/] {escape(str(doc['sweep_dir']))}/sweep.md, results.json, pareto.png, main.md, ...")


def _check_resume_alone(resume: str, opts: dict, config, vary) -> None:
    """--resume continues with the sweep's stored options: any other option given beside it is refused."""

    given = [k for k, v in opts.items() if v is not None]
    given = [flag(k) for k in given] + ["--config"] * bool(config) + ["--vary"] * bool(vary)
    if given:
        raise UsageError(f"--resume {resume}: continues with the sweep's stored options; drop {', '.join(given)}")


@command(name="sweep-merge")
def sweep_merge(
    sweeps: Annotated[list[str], typer.Argument(help="Finished sweep folders, one per teacher, in column order.")],
    out_dir: Annotated[str, common("out")],
    labels: Annotated[Optional[str], typer.Option(help="Comma-separated column label per sweep (default: each "
                                                        "sweep's teacher name), e.g. 0.13B,0.5B,1B.")] = None,
    force: Force = False,
):
    """Combine sweeps of several teachers into the paper's three-teacher layout: Table 5 (main.md), Table 9
    (table9.md) and Figure 2 (icl.png), members matched by name, written into --out."""

    merge_sweeps(sweeps, str_list(labels) if labels else None, Path(out_dir), force=force)
    out.print((Path(out_dir) / PAPER_MAIN).read_text())
    out.print(f"[green]wrote[/] {escape(str(out_dir))}/{', '.join(OUTPUTS)}, merged.json")
