"""The ``bdlora`` command line (typer + rich). Commands are thin: parse, build a config, call one library
function, print a rich table or JSON. Errors become one red line on stderr (exit 2 bad usage, 1 failure)."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from bdlora.config import field_help
from bdlora.errors import BdloraError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Budgeted LoRA: distil a causal LM into a mixed dense/low-rank student that is faster.")
# Piped output (logs, CI) gets a wide console so tables are not cropped at 80 columns.
out = Console(width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
H = field_help()


def handle_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BdloraError as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:
            err.print(f"[bold red]interrupted[/]{': ' + str(e) if str(e) else ''}", highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None

    return wrapper


class RichReporter:
    """Progress bar with loss, ppl, tokens/s and ETA; stage lines for the slow set-up steps."""

    def __init__(self, console: Console):
        self.c = console
        self.progress: Progress | None = None
        self.task = None
        self.tprogress: Progress | None = None

    def stage(self, message: str) -> None:
        self._close_teacher()
        self.c.print(f"[cyan]>[/] {message}")

    def teacher_step(self, step, total, loss):
        if self.tprogress is None:
            self.tprogress = Progress(TextColumn("  teacher"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(),
                                      TimeRemainingColumn(), console=self.c)
            self.tprogress.start()
            self.ttask = self.tprogress.add_task("teacher", total=total, loss=loss)
        self.tprogress.update(self.ttask, completed=step, loss=loss)

    def _close_teacher(self):
        if self.tprogress is not None:
            self.tprogress.stop()
            self.tprogress = None

    def start(self, total_steps, start_step):
        self._close_teacher()
        self.progress = Progress(
            TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
            TextColumn("ppl {task.fields[ppl]}"), TextColumn("{task.fields[extra]}"),
            TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.c)
        self.progress.start()
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, loss="-", ppl="-",
                                           tps="-", extra="")

    def step(self, step, m):
        extra = f"dense {m['retained']:.2f}" if "retained" in m else ""
        fields = {"loss": f"{m['loss']:.3f}", "tps": f"{m['tokens_per_s']:.0f}", "extra": extra}
        if "val_ppl" in m:
            fields["ppl"] = f"{m['val_ppl']:.2f}"
        self.progress.update(self.task, completed=step, **fields)

    def evaluated(self, step, m):
        self.c.print(f"  step {step}: val ppl {m['val_ppl']:.3f}"
                     + (f", retained dense {m['retained']:.3f}" if "retained" in m else ""))

    def finish(self):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def count(self, done: int, total: int, label: str = "prompts") -> None:
        """Progress of a countable job (eval prompts); ``done`` is the increment, 0 opens the bar."""
        if self.progress is None or done == 0:
            self.finish()
            self.progress = Progress(TextColumn(f"  {label}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.c)
            self.progress.start()
            self.task = self.progress.add_task(label, total=total)
        self.progress.advance(self.task, done)
        if self.progress.tasks[0].completed >= total:
            self.finish()


# ----------------------------------------------------------------------------------------------------------------
# teacher
# ----------------------------------------------------------------------------------------------------------------


@app.command()
@handle_errors
def teacher(
    cache_dir: Annotated[Optional[str], typer.Option(help=H["cache_dir"])] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if a cached teacher exists.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the teacher report as JSON.")] = False,
):
    """Build (or show) the embedded default teacher: a BPE tokenizer and a small Mistral-style model pretrained on
    the Python standard library, cached for later runs."""
    from bdlora.teacher import build_builtin_teacher

    rep = RichReporter(err if json_out else out)
    path = build_builtin_teacher(Path(cache_dir) if cache_dir else None, force=force, on_stage=rep.stage,
                                 on_step=rep.teacher_step)
    rep._close_teacher()
    info = json.loads((path / "teacher.json").read_text())
    info["path"] = str(path)
    if json_out:
        print(json.dumps(info, indent=2))
        return
    t = Table(title="embedded default teacher")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("path", str(path))
    t.add_row("parameters", f"{info['parameters']:,}")
    t.add_row("corpus tokens (train / val)", f"{info['corpus_tokens']['train']:,} / {info['corpus_tokens']['val']:,}")
    t.add_row("pretraining tokens seen", f"{info['train_tokens_seen']:,}")
    t.add_row("validation perplexity", f"{info['val_ppl']:.2f}")
    t.add_row("unigram baseline perplexity", f"{info['unigram_ppl']:.2f}")
    t.add_row("build time", f"{info['build_seconds']:.0f} s")
    out.print(t)


# ----------------------------------------------------------------------------------------------------------------
# train
# ----------------------------------------------------------------------------------------------------------------


@app.command()
@handle_errors
def train(
    method: Annotated[Optional[str], typer.Option(help=H["method"])] = None,
    teacher: Annotated[Optional[str], typer.Option(help=H["teacher"])] = None,
    data: Annotated[Optional[str], typer.Option(help=H["data"])] = None,
    student_layers: Annotated[Optional[int], typer.Option(help=H["student_layers"])] = None,
    layer_selection: Annotated[Optional[str], typer.Option(help=H["layer_selection"])] = None,
    student_init: Annotated[Optional[str], typer.Option(help=H["student_init"])] = None,
    seq_len: Annotated[Optional[int], typer.Option(help=H["seq_len"])] = None,
    batch_size: Annotated[Optional[int], typer.Option(help=H["batch_size"])] = None,
    grad_accum: Annotated[Optional[int], typer.Option(help=H["grad_accum"])] = None,
    max_steps: Annotated[Optional[int], typer.Option(help=H["max_steps"])] = None,
    tokens: Annotated[Optional[int], typer.Option(help=H["tokens"])] = None,
    lr: Annotated[Optional[float], typer.Option(help=H["lr"])] = None,
    weight_decay: Annotated[Optional[float], typer.Option(help=H["weight_decay"])] = None,
    temperature: Annotated[Optional[float], typer.Option(help=H["temperature"])] = None,
    kd_weight: Annotated[Optional[float], typer.Option(help=H["kd_weight"])] = None,
    lora_rank: Annotated[Optional[int], typer.Option(help=H["lora_rank"])] = None,
    lora_alpha: Annotated[Optional[float], typer.Option(help=H["lora_alpha"])] = None,
    budget: Annotated[Optional[float], typer.Option(help=H["budget"])] = None,
    decay_start: Annotated[Optional[float], typer.Option(help=H["decay_start"])] = None,
    decay_end: Annotated[Optional[float], typer.Option(help=H["decay_end"])] = None,
    retention_ema: Annotated[Optional[float], typer.Option(help=H["retention_ema"])] = None,
    gate_init: Annotated[Optional[float], typer.Option(help=H["gate_init"])] = None,
    eval_every: Annotated[Optional[int], typer.Option(help=H["eval_every"])] = None,
    eval_tokens: Annotated[Optional[int], typer.Option(help=H["eval_tokens"])] = None,
    heldout_fraction: Annotated[Optional[float], typer.Option(help=H["heldout_fraction"])] = None,
    save_every: Annotated[Optional[int], typer.Option(help=H["save_every"])] = None,
    keep_last: Annotated[Optional[int], typer.Option(help=H["keep_last"])] = None,
    measure_step_time: Annotated[Optional[bool], typer.Option(help=H["measure_step_time"])] = None,
    seed: Annotated[Optional[int], typer.Option(help=H["seed"])] = None,
    device: Annotated[Optional[str], typer.Option(help=H["device"])] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help=H["out"])] = None,
    runs_dir: Annotated[Optional[str], typer.Option(help=H["runs_dir"])] = None,
    cache_dir: Annotated[Optional[str], typer.Option(help=H["cache_dir"])] = None,
    config: Annotated[Optional[str], typer.Option(help="YAML file holding any of these options; flags override.")]
    = None,
    resume: Annotated[Optional[str], typer.Option(help="Continue an unfinished run directory from its latest "
                                                        "verified checkpoint (its stored options are used).")] = None,
    nproc: Annotated[Optional[int], typer.Option(help="Data-parallel processes on this machine: re-launches this "
                                                      "command under torchrun (gloo on CPU, NCCL on GPUs).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
):
    """Distil a student from the teacher: kd-full, kd-lora or budgeted (Budgeted LoRA)."""
    cli_values = dict(locals())
    from bdlora.config import load_yaml, merge
    from bdlora.errors import RunDirError, UsageError
    from bdlora.train import train as run_train

    for k in ("config", "resume", "json_out", "nproc"):
        cli_values.pop(k)
    cli_values["out"] = cli_values.pop("out_dir")
    if nproc is not None:
        if nproc < 1:
            raise UsageError(f"--nproc {nproc}: must be >= 1")
        if "WORLD_SIZE" in os.environ:
            raise UsageError("--nproc: already running under a distributed launcher (torchrun); drop --nproc")
        raise typer.Exit(_launch_torchrun(nproc))
    if resume is not None and not Path(resume).is_dir():
        raise RunDirError(f"--resume {resume}: no such run directory")
    if resume is not None and config:
        raise UsageError(f"--resume {resume}: continues with the run's stored options; drop --config")
    cfg = merge(load_yaml(config) if config else {}, {} if resume else cli_values)
    rank0 = os.environ.get("RANK", "0") == "0"
    console = err if json_out else out
    summary = run_train(cfg, RichReporter(console) if rank0 else None, resume=resume,
                        overrides={k: v for k, v in cli_values.items() if v is not None} if resume else None)
    if not rank0:
        return
    if json_out:
        print(json.dumps(summary, indent=2))
        return
    _print_summary(summary)


def _launch_torchrun(nproc: int) -> int:
    """Run this same ``bdlora train`` command (minus --nproc) under ``torch.distributed.run``; its exit code."""
    import subprocess

    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        args.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "bdlora.cli", *args]
    err.print(f"[cyan]>[/] launching {nproc} processes: {' '.join(cmd[2:])}", highlight=False, soft_wrap=True)
    return subprocess.call(cmd)


def _print_summary(s: dict) -> None:
    t = Table(title=f"{s['method']} run: {s['run_dir']}")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("teacher val ppl", f"{s['teacher_val_ppl']:.3f}")
    if s.get("initial_student_val_ppl") is not None:
        t.add_row("student val ppl before training", f"{s['initial_student_val_ppl']:.3f}")
    t.add_row("student val ppl", f"{s['student_val_ppl']:.3f}")
    t.add_row("steps / tokens", f"{s['steps']:,} / {s['tokens']:,}")
    if s.get("world_size", 1) > 1:
        t.add_row("processes / global batch", f"{s['world_size']} / {s['global_batch']} sequences")
    t.add_row("train time", f"{s['train_seconds']:.1f} s ({s['tokens_per_s']:.0f} tok/s)")
    p = s["compute_proxy"]
    t.add_row("dense MACs/token D, LoRA L", f"{p['D']:,} / {p['L']:,}")
    t.add_row("mean retained dense d_bar", f"{p['d_bar']:.3f}")
    t.add_row("train compute proxy vs kd-full", f"lora {p['lora_vs_full']:.3f}x, budgeted {p['bud_vs_full']:.3f}x")
    if "step_time_ms" in s:
        st = s["step_time_ms"]
        t.add_row("measured step time (ms)", f"full {st['kd-full']:.1f}, lora {st['kd-lora']:.1f}, "
                  f"budgeted d=0 {st['budgeted']:.1f}")
        t.add_row("measured step ratio vs kd-full", f"lora {st['lora_vs_full']:.3f}x, budgeted "
                  f"{st['budgeted_vs_full']:.3f}x")
    if "final_retained" in s:
        zero = sum(1 for m in s["modules"] if m["d"] == 0)
        t.add_row("final retained dense / modules at zero", f"{s['final_retained']:.3f} / {zero}/{len(s['modules'])}")
    out.print(t)


# ----------------------------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------------------------


@app.command()
@handle_errors
def plan(
    model_config: Annotated[str, typer.Option(help="Hugging Face config.json (or a folder holding one).")],
    budget: Annotated[float, typer.Option(help=H["budget"])] = 0.4,
    layers: Annotated[Optional[int], typer.Option(help="Student decoder layers (default: the config's).")] = None,
    lora_rank: Annotated[int, typer.Option(help="LoRA r_max of every gated module.")] = 128,
    eps_lr: Annotated[float, typer.Option(help="d below this (and >= eps-zero) is SVD-approximated.")] = 0.7,
    eps_zero: Annotated[float, typer.Option(help="d below this drops the dense path.")] = 1e-3,
    svd_max_rank: Annotated[int, typer.Option(help="r_dense_max, the largest SVD rank of case 2.")] = 128,
    decay_start: Annotated[float, typer.Option(help=H["decay_start"])] = 0.1,
    decay_end: Annotated[float, typer.Option(help=H["decay_end"])] = 0.3,
    retention_ema: Annotated[float, typer.Option(help=H["retention_ema"])] = 0.9,
    steps: Annotated[int, typer.Option(help="Optimiser steps the schedule is simulated over.")] = 10_000,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
):
    """Predict what `compress` would produce for a budget F from a model config alone: per-module case and rank,
    MAC speed-ups vs dense and vs LoRA, parameter reduction and the training-compute proxy."""
    from bdlora.plan import plan as run_plan
    from bdlora.plan import read_model_config

    report = run_plan(read_model_config(model_config), budget, layers=layers, rank=lora_rank, eps_lr=eps_lr,
                      eps_zero=eps_zero, svd_max_rank=svd_max_rank, decay_start=decay_start, decay_end=decay_end,
                      ema=retention_ema, steps=steps)
    if json_out:
        print(json.dumps(report, indent=2))
        return
    print_compression_report(report, title=f"plan: F = {budget}")
    p = report["compute_proxy"]
    out.print(f"training-compute proxy vs kd-full: budgeted {p['bud_vs_full']:.3f}x, kd-lora "
              f"{p['lora_vs_full']:.3f}x (D = {p['D']:,}, L = {p['L']:,}, d_bar = {p['d_bar']:.3f})")


def print_compression_report(report: dict, title: str) -> None:
    """The SPEC 6.4 table: one row per module, then the totals (shared by plan and compress)."""
    t = Table(title=title)
    t.add_column("module", justify="left", min_width=22, overflow="fold")
    for col, j in (("d", "right"), ("case", "left"), ("LoRA r", "right"), ("SVD k", "right"),
                   ("MACs before", "right"), ("MACs after", "right"), ("params after", "right")):
        t.add_column(col, justify=j)
    for m in report["modules"]:
        t.add_row(m["name"].replace("model.layers.", "L"), f"{m['d']:.3f}", m["case"], str(m["lora_rank"]),
                  str(m["svd_rank"] or "-"), f"{m['macs_before']:,}", f"{m['macs_after']:,}",
                  f"{m['params_after']:,}")
    out.print(t)
    n = report["modules_total"]
    s = Table(title="totals over the replaced modules")
    s.add_column("")
    s.add_column("value", justify="right")
    s.add_row("dense kept / SVD / dropped", f"{report['dense_kept']}/{n} / {report['dense_svd']}/{n} / "
              f"{report['dense_dropped']}/{n}" + (f" ({report['merged_cheaper']} merged-cheaper)"
                                                  if report["merged_cheaper"] else ""))
    s.add_row("average LoRA rank kept", f"{report['avg_lora_rank']:.1f}")
    s.add_row("MAC speed-up vs dense", f"{report['speedup_vs_dense']:.2f}x")
    s.add_row("MAC speed-up vs LoRA", f"{report['speedup_vs_lora']:.2f}x")
    s.add_row("parameter reduction", f"{100 * report['param_reduction']:.1f}%")
    out.print(s)


# ----------------------------------------------------------------------------------------------------------------
# compress
# ----------------------------------------------------------------------------------------------------------------


@app.command()
@handle_errors
def compress(
    run_dir: Annotated[Optional[str], typer.Argument(help="A finished run (default: the latest under --runs-dir).")]
    = None,
    eps_lr: Annotated[float, typer.Option(help="d below this (and >= eps-zero) is SVD-approximated; above, merged.")]
    = 0.7,
    eps_zero: Annotated[float, typer.Option(help="d below this drops the dense path.")] = 1e-3,
    gate_threshold: Annotated[float, typer.Option(help="Ranks with sigmoid(gate) below this are pruned.")] = 0.3,
    svd_max_rank: Annotated[int, typer.Option(help="r_dense_max: the SVD rank at d = eps-lr.")] = 128,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default: RUN_DIR.compressed).")]
    = None,
    force: Annotated[bool, typer.Option(help="Replace an existing non-empty --out.")] = False,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip the held-out perplexity of both models.")] = False,
    runs_dir: Annotated[str, typer.Option(help=H["runs_dir"])] = "runs",
    json_out: Annotated[bool, typer.Option("--json", help="Print compression.json instead of tables.")] = False,
):
    """Turn a trained student into its deployment form: drop, SVD-approximate or merge each dense path (budgeted),
    merge the adapter (kd-lora) or pass through (kd-full); saved as a Hugging Face model folder."""
    from bdlora.compress import Thresholds, compress_run
    from bdlora.train import latest_run

    th = Thresholds(eps_zero=eps_zero, eps_lr=eps_lr, gate_threshold=gate_threshold, svd_max_rank=svd_max_rank)
    th.validate()
    run = Path(run_dir) if run_dir else latest_run(runs_dir)
    rep = RichReporter(err if json_out else out)
    report, folder = compress_run(run, th, out=out_dir, force=force, evaluate=not no_eval, on_stage=rep.stage)
    if json_out:
        print(json.dumps(report, indent=2))
        return
    print_compression_report(report, title=f"compress {run.name} ({report['provenance']['method']})")
    if "eval" in report:
        e = report["eval"]
        out.print(f"held-out perplexity: student {e['student_val_ppl']:.3f} -> compressed "
                  f"{e['compressed_val_ppl']:.3f} ({e['tokens']:,} tokens)")
    out.print(f"[green]wrote[/] {folder}")


# ----------------------------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------------------------

export_app = typer.Typer(no_args_is_help=True, help="Export a compressed model (hf: a shareable HF folder).")
app.add_typer(export_app, name="export")


def _latest_model_folder(runs_dir: str) -> Path:
    from bdlora.errors import RunDirError
    from bdlora.export.hf import is_model_folder

    found = [p for p in Path(runs_dir).glob("*.compressed") if is_model_folder(p)]
    if not found:
        raise RunDirError(f"no compressed model under {runs_dir}/ (run `bdlora compress` first, or pass MODEL_DIR)")
    return max(found, key=lambda p: (p / "compression.json").stat().st_mtime)


@export_app.command("hf")
@handle_errors
def export_hf_cmd(
    model_dir: Annotated[Optional[str], typer.Argument(help="Compressed model folder (default: the latest).")]
    = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default: MODEL_DIR.hf).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing non-empty --out.")] = False,
    runs_dir: Annotated[str, typer.Option(help=H["runs_dir"])] = "runs",
):
    """Copy a compressed model into a clean, shareable Hugging Face folder with a generated model card."""
    from bdlora.export.hf import export_hf

    src = Path(model_dir) if model_dir else _latest_model_folder(runs_dir)
    dst = Path(out_dir) if out_dir else src.with_name(src.name + ".hf")
    export_hf(src, dst, force=force)
    out.print(f"[green]wrote[/] {dst} (load with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True))")


@export_app.command("onnx")
@handle_errors
def export_onnx_cmd(
    model_dir: Annotated[Optional[str], typer.Argument(help="Model folder: a `bdlora compress` output (default: the "
                                                            "latest) or any HF Llama/Mistral/Qwen2 folder.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default: MODEL_DIR.onnx).")] = None,
    opset: Annotated[int, typer.Option(help="ONNX opset (14 up to the exporter's maximum).")] = 17,
    quantize: Annotated[Optional[str], typer.Option(help="int8: also write model_int8.onnx (dynamic weight "
                                                          "quantisation) and report its perplexity change.")] = None,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="Skip the parity check against PyTorch.")]
    = False,
    optimize: Annotated[bool, typer.Option("--optimize", help="Fuse RMSNorm, residual+RMSNorm and rotary subgraphs "
                                                              "into onnxruntime contrib ops (faster decode; the "
                                                              "graph then needs onnxruntime).")] = False,
    force: Annotated[bool, typer.Option(help="Replace an existing non-empty --out.")] = False,
    runs_dir: Annotated[str, typer.Option(help=H["runs_dir"])] = "runs",
    json_out: Annotated[bool, typer.Option("--json", help="Print export.json.")] = False,
):
    """Export a model as an ONNX decoder with KV cache and per-module shape metadata, validated against PyTorch;
    the folder loads in optimum's ORTModelForCausalLM (via bdlora.export.onnx.load_ort_model)."""
    from bdlora.export.onnx import export_onnx_folder

    src = Path(model_dir) if model_dir else _latest_model_folder(runs_dir)
    dst = Path(out_dir) if out_dir else src.with_name(src.name + ".onnx")
    rep = RichReporter(err if json_out else out)
    info = export_onnx_folder(src, dst, opset=opset, quantize=quantize, run_validation=not no_validate, force=force,
                              on_stage=rep.stage, optimize=optimize)
    if json_out:
        print(json.dumps(info, indent=2))
        return
    t = Table(title=f"ONNX export: {dst}")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("opset / export time", f"{opset} / {info['export_seconds']:.1f} s")
    if info.get("ort_fusions"):
        t.add_row("onnxruntime fusions", ", ".join(f"{v} {k}" for k, v in info["ort_fusions"].items()))
    for name, size in info["files"].items():
        t.add_row(name, f"{size / 1e6:.2f} MB")
    if "validation" in info:
        v = info["validation"]
        t.add_row("max |ONNX - torch| (logits, K/V)", f"{v['max_abs_diff']:.2e} (tolerance {v['tolerance']:g}, "
                  f"{len(v['shapes'])} shapes incl. left padding)")
    if "int8" in info:
        q = info["int8"]
        t.add_row("held-out ppl fp32 -> int8", f"{q['val_ppl_fp32']:.3f} -> {q['val_ppl_int8']:.3f} "
                  f"({100 * q['ppl_change']:+.2f}%)")
    s = info["summary"]
    t.add_row("modules", ", ".join(f"{v} {k}" for k, v in s["forms"].items()))
    t.add_row("MAC speed-up of the projections vs dense", f"{s['mac_speedup_vs_dense']:.2f}x")
    out.print(t)


# ----------------------------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------------------------


def _int_list(value: str, flag: str) -> list[int]:
    from bdlora.errors import UsageError

    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {value!r}: need comma-separated integers, e.g. 1,8") from None
    if not items:
        raise UsageError(f"{flag} {value!r}: empty list; give at least one value")
    return items


@app.command()
@handle_errors
def bench(
    model_dir: Annotated[Optional[str], typer.Argument(help="A `bdlora compress` output (default: the latest).")]
    = None,
    scope: Annotated[str, typer.Option(help="modules (replaced projections only), model (whole decoder) or both.")]
    = "both",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8",
    seq_lens: Annotated[str, typer.Option(help="Comma-separated prefill lengths (and decode cache lengths).")]
    = "128,512",
    decode_tokens: Annotated[int, typer.Option(help="Tokens decoded per decode measurement.")] = 64,
    threads: Annotated[Optional[int], typer.Option(help="onnxruntime intra-op threads (default: all cores).")] = None,
    provider: Annotated[str, typer.Option(help="cpu or cuda (needs onnxruntime-gpu).")] = "cpu",
    repeats: Annotated[int, typer.Option(help="Timed repeats per figure (after warm-up).")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up repeats.")] = 2,
    int8: Annotated[bool, typer.Option("--int8", help="Model scope: also time dynamic-int8 dense and compressed "
                                                      "graphs.")] = False,
    optimize: Annotated[bool, typer.Option("--optimize", help="Model scope: apply `export onnx --optimize`'s "
                                                              "fusions to every variant.")] = False,
    model_config: Annotated[Optional[str], typer.Option(help="Synthetic mode: an HF config.json; benches the "
                                                              "structure `plan` predicts, with random weights.")]
    = None,
    budget: Annotated[Optional[float], typer.Option(help="Synthetic mode: the budget F.")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Synthetic mode: student layers.")] = None,
    lora_rank: Annotated[Optional[int], typer.Option(help="LoRA rank of the lora variant (default: the trained "
                                                           "rank; synthetic: 128).")] = None,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Also write the JSON report here.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default: MODEL_DIR.bench).")]
    = None,
    force: Annotated[bool, typer.Option(help="Replace an existing non-empty --out.")] = False,
    runs_dir: Annotated[str, typer.Option(help=H["runs_dir"])] = "runs",
):
    """Time the compressed model against its dense and LoRA forms under onnxruntime (replaced modules and whole
    model, prefill and decode), beside the MAC limits; writes bench.json, bench.md and bench.png."""
    from bdlora.bench import BenchConfig, run_bench, synthetic_model
    from bdlora.errors import ModelError, UsageError
    from bdlora.export.hf import check_out_dir
    from bdlora.io import write_json

    cfg = BenchConfig(scope=scope, batch_sizes=_int_list(batch_sizes, "--batch-sizes"),
                      seq_lens=_int_list(seq_lens, "--seq-lens"), decode_tokens=decode_tokens, threads=threads,
                      provider=provider, repeats=repeats, warmup=warmup, int8=int8, optimize=optimize)
    cfg.validate()
    report = None
    if model_config:
        from bdlora.plan import read_model_config

        if budget is None:
            raise UsageError("--model-config needs --budget F (the structure to bench)")
        model, report = synthetic_model(read_model_config(model_config), budget, layers, lora_rank or 128)
        rank = lora_rank or 128
        dst = Path(out_dir) if out_dir else Path(runs_dir) / f"bench-synthetic-F{budget}"
    else:
        from bdlora.export.onnx import load_model_folder

        src = Path(model_dir) if model_dir else _latest_model_folder(runs_dir)
        if not (src / "compression.json").exists():
            raise ModelError(f"{src}: no compression.json; bench needs a `bdlora compress` output (or use "
                             "--model-config for synthetic mode)")
        model, _, report = load_model_folder(src)
        rank = lora_rank or max(1, round(report["lora_macs"] / max(1, sum(
            m["in_features"] + m["out_features"] for m in report["modules"]))))
        dst = Path(out_dir) if out_dir else src.with_name(src.name + ".bench")
    check_out_dir(dst, force, () if model_config else (src,))
    rep = RichReporter(out)
    doc = run_bench(model, rank, cfg, dst, report, on_stage=rep.stage)
    if json_path:
        write_json(json_path, doc)
    _print_bench(doc)
    out.print(f"[green]wrote[/] {dst}/bench.json, bench.md, bench.png")


def _print_bench(doc: dict) -> None:
    t = Table(title=f"bench: compressed vs dense / LoRA ({doc['thread_pool']})")
    t.add_column("scope phase shape", overflow="fold")
    for col in ("dense ms", "comp. ms", "vs dense", "MAC limit", "of limit", "vs LoRA", "outside"):
        t.add_column(col, justify="right")
    idx = {(r["scope"], r["variant"], r["phase"], r["batch"], r["seq"]): r for r in doc["results"]}
    for r in doc["results"]:
        if r["variant"] != "compressed":
            continue
        d = idx[(r["scope"], "dense", r["phase"], r["batch"], r["seq"])]
        shape = f"{r['batch']}x{r['seq']}" if r["phase"] == "prefill" else (
            f"{r['batch']}x1 @{r['seq']}" if r["scope"] == "model" else f"{r['batch']}x1")
        t.add_row(f"{r['scope']} {r['phase']} {shape}", f"{d['median_ms']:.3f}", f"{r['median_ms']:.3f}",
                  f"{r['speedup_vs_dense']:.2f}x", f"{r['mac_ratio_vs_dense']:.2f}x",
                  f"{100 * r['fraction_of_limit']:.0f}%", f"{r['speedup_vs_lora']:.2f}x",
                  f"{100 * r['share_outside_modules']:.0f}%" if "share_outside_modules" in r else "-")
    out.print(t)
    q = [r for r in doc["results"] if r["variant"] == "compressed-int8"]
    if q:
        out.print("int8 (dynamic) compressed: " + "; ".join(
            f"{r['phase']} {r['batch']}x{r['seq']} {r['median_ms']:.3f} ms, {r['speedup_vs_dense']:.2f}x vs fp32 "
            f"dense, {r.get('speedup_vs_dense_int8', float('nan')):.2f}x vs int8 dense" for r in q))


# ----------------------------------------------------------------------------------------------------------------
# eval
# ----------------------------------------------------------------------------------------------------------------


@app.command("eval")
@handle_errors
def eval_cmd(
    model_dir: Annotated[Optional[str], typer.Argument(help="A run directory, model folder (teacher, compressed, "
                                                            "exported HF) or ONNX folder (default: the latest "
                                                            "compressed model).")] = None,
    ppl: Annotated[bool, typer.Option("--ppl", help="Held-out perplexity (with neither --ppl nor --icl: both).")]
    = False,
    icl: Annotated[bool, typer.Option("--icl", help="The 19 ICL probes of SPEC 7.")] = False,
    tokens: Annotated[Optional[int], typer.Option(help="Held-out tokens scored (default: the run's eval-tokens).")]
    = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Block length for perplexity (default: the run's).")] = None,
    data: Annotated[Optional[str], typer.Option(help="Corpus for perplexity and the probe word list (default: the "
                                                     "run's corpus; builtin when unknown).")] = None,
    heldout_fraction: Annotated[Optional[float], typer.Option(help="With --data: the held-out fraction (default: "
                                                                   "the corpus' default).")] = None,
    shots: Annotated[int, typer.Option(help="Demonstrations per ICL prompt.")] = 10,
    seeds: Annotated[int, typer.Option(help="Demonstration seeds.")] = 3,
    examples: Annotated[int, typer.Option(help="Query prompts per task and seed.")] = 50,
    tasks: Annotated[Optional[str], typer.Option(help="Comma-separated subset of the 19 tasks (default: all).")]
    = None,
    onnx_file: Annotated[str, typer.Option(help="ONNX folders: which graph to score (e.g. model_int8.onnx).")]
    = "model.onnx",
    batch_size: Annotated[int, typer.Option(help="Prompts per generation batch.")] = 32,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write the eval JSON here (default: "
                                                                    "MODEL_DIR.eval.json beside the folder).")]
    = None,
    runs_dir: Annotated[str, typer.Option(help=H["runs_dir"])] = "runs",
):
    """Score a model: perplexity on the held-out slice and the 19 function-style ICL probes (10-shot, 3
    demonstration seeds, exact match; per-task mean and std, macro average)."""
    from bdlora.errors import UsageError
    from bdlora.evaluate import evaluate_target
    from bdlora.io import write_json

    for name, v in (("--shots", shots), ("--seeds", seeds), ("--examples", examples), ("--batch-size", batch_size)):
        if v < 1:
            raise UsageError(f"{name} {v}: must be >= 1")
    if shots > 64:
        raise UsageError(f"--shots {shots}: at most 64 demonstrations")
    for name, v in (("--tokens", tokens), ("--seq-len", seq_len)):
        if v is not None and v < 2:
            raise UsageError(f"{name} {v}: must be >= 2")
    if heldout_fraction is not None and not 0.0 < heldout_fraction < 1.0:
        raise UsageError(f"--heldout-fraction {heldout_fraction}: must be in (0, 1)")
    if not ppl and not icl:
        ppl = icl = True
    task_list = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else None
    if tasks is not None and not task_list:
        raise UsageError(f"--tasks {tasks!r}: empty list")
    src = Path(model_dir) if model_dir else _latest_model_folder(runs_dir)
    rep = RichReporter(out)
    doc = evaluate_target(src, ppl=ppl, icl=icl, tokens=tokens, shots=shots, seeds=seeds, examples=examples,
                          tasks=task_list, data=data, seq_len=seq_len, heldout_fraction=heldout_fraction,
                          onnx_file=onnx_file, batch_size=batch_size,
                          on_stage=rep.stage, on_progress=rep.count)
    dst = Path(json_path) if json_path else src.with_name(src.name + ".eval.json")
    write_json(dst, doc)
    _print_eval(doc)
    out.print(f"[green]wrote[/] {dst}")


def _print_eval(doc: dict) -> None:
    if "ppl" in doc:
        p = doc["ppl"]
        out.print(f"held-out perplexity: [bold]{p['val_ppl']:.3f}[/] ({p['tokens']:,} tokens of {doc['data']['data']},"
                  f" blocks of {p['seq_len']}; {doc['kind']})")
    if "icl" in doc:
        r = doc["icl"]
        t = Table(title=f"ICL probes ({r['shots']}-shot, {r['seeds']} seeds x {r['examples_per_seed']} prompts, "
                        "exact match %)")
        t.add_column("task")
        t.add_column("accuracy %", justify="right")
        t.add_column("log p(target)", justify="right")
        for name, v in r["tasks"].items():
            t.add_row(name, f"{v['mean']:.1f} ± {v['std']:.1f}", f"{v['target_logprob']:.2f}")
        m = r["macro"]
        t.add_row("[bold]ICL composite (macro)[/]", f"[bold]{m['mean']:.1f} ± {m['std']:.1f}[/]",
                  f"{m['target_logprob']:.2f}")
        out.print(t)


# ----------------------------------------------------------------------------------------------------------------
# sweep
# ----------------------------------------------------------------------------------------------------------------


def _float_list(value: str, flag: str) -> list[float]:
    from bdlora.errors import UsageError

    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {value!r}: need comma-separated numbers, e.g. 0.0,0.4,0.8") from None


@app.command()
@handle_errors
def sweep(
    budgets: Annotated[str, typer.Option(help="Comma-separated budgets F of the budgeted members.")] = "0.0,0.4",
    baselines: Annotated[str, typer.Option(help="Comma-separated baselines (kd-full, kd-lora; '' for none).")]
    = "kd-full,kd-lora",
    teacher: Annotated[Optional[str], typer.Option(help=H["teacher"])] = None,
    data: Annotated[Optional[str], typer.Option(help=H["data"])] = None,
    student_layers: Annotated[Optional[int], typer.Option(help=H["student_layers"])] = None,
    seq_len: Annotated[Optional[int], typer.Option(help=H["seq_len"])] = None,
    batch_size: Annotated[Optional[int], typer.Option(help=H["batch_size"])] = None,
    max_steps: Annotated[Optional[int], typer.Option(help=H["max_steps"])] = None,
    tokens: Annotated[Optional[int], typer.Option(help=H["tokens"])] = None,
    lr: Annotated[Optional[float], typer.Option(help=H["lr"])] = None,
    lora_rank: Annotated[Optional[int], typer.Option(help=H["lora_rank"])] = None,
    lora_alpha: Annotated[Optional[float], typer.Option(help=H["lora_alpha"])] = None,
    eval_tokens: Annotated[Optional[int], typer.Option(help=H["eval_tokens"])] = None,
    heldout_fraction: Annotated[Optional[float], typer.Option(help=H["heldout_fraction"])] = None,
    seed: Annotated[Optional[int], typer.Option(help=H["seed"])] = None,
    device: Annotated[Optional[str], typer.Option(help=H["device"])] = None,
    cache_dir: Annotated[Optional[str], typer.Option(help=H["cache_dir"])] = None,
    config: Annotated[Optional[str], typer.Option(help="YAML of any `bdlora train` option, shared by every member; "
                                                       "flags override.")] = None,
    eps_lr: Annotated[float, typer.Option(help="compress --eps-lr of every budgeted member.")] = 0.7,
    examples: Annotated[int, typer.Option(help="ICL query prompts per task and seed.")] = 50,
    seeds: Annotated[int, typer.Option(help="ICL demonstration seeds.")] = 3,
    bench: Annotated[bool, typer.Option(help="Bench each compressed member (onnxruntime, CPU).")] = True,
    bench_batch_sizes: Annotated[str, typer.Option(help="bench --batch-sizes.")] = "1",
    bench_seq_lens: Annotated[str, typer.Option(help="bench --seq-lens.")] = "128",
    bench_repeats: Annotated[int, typer.Option(help="bench --repeats.")] = 20,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Sweep folder (default: RUNS_DIR/sweep-<time>).")]
    = None,
    runs_dir: Annotated[str, typer.Option(help=H["runs_dir"])] = "runs",
    resume: Annotated[Optional[str], typer.Option(help="Finish an interrupted sweep folder (its stored options are "
                                                        "used; finished stages are skipped).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print results.json.")] = False,
):
    """Train, compress, evaluate and bench a budget family (baselines + budgeted at each F) with everything else
    fixed; writes the paper-style table (sweep.md, results.json) and a Pareto plot (pareto.png)."""
    import dataclasses

    from bdlora.config import load_yaml, merge, validate
    from bdlora.errors import UsageError
    from bdlora.sweep import SweepOptions, family, new_sweep_dir, run_sweep

    train_values = {k: v for k, v in dict(locals()).items() if k in (
        "teacher", "data", "student_layers", "seq_len", "batch_size", "max_steps", "tokens", "lr", "lora_rank",
        "lora_alpha", "eval_tokens", "heldout_fraction", "seed", "device", "cache_dir")}
    rep = RichReporter(err if json_out else out)
    if resume is not None:
        given = [k for k, v in train_values.items() if v is not None]
        if given or config:
            raise UsageError(f"--resume {resume}: continues with the sweep's stored options; drop "
                             f"{', '.join('--' + k.replace('_', '-') for k in given) or '--config'}")
        doc = run_sweep(None, Path(resume), rep, resume=True)
    else:
        cfg = merge(load_yaml(config) if config else {}, {**train_values, "runs_dir": runs_dir})
        validate(cfg)
        f = _float_list(budgets, "--budgets")
        b = [x.strip() for x in baselines.split(",") if x.strip()]
        family(f, b)
        for name, v in (("--examples", examples), ("--seeds", seeds), ("--bench-repeats", bench_repeats)):
            if v < 1:
                raise UsageError(f"{name} {v}: must be >= 1")
        train_opts = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("method", "budget", "out",
                                                                                   "extra")}
        opts = SweepOptions(budgets=f, baselines=b, train=train_opts, eps_lr=eps_lr, eval_examples=examples,
                            eval_seeds=seeds, bench=bench,
                            bench_batch_sizes=_int_list(bench_batch_sizes, "--bench-batch-sizes"),
                            bench_seq_lens=_int_list(bench_seq_lens, "--bench-seq-lens"), bench_repeats=bench_repeats)
        doc = run_sweep(opts, new_sweep_dir(runs_dir, out_dir), rep)
    if json_out:
        print(json.dumps(doc, indent=2))
        return
    from bdlora.sweep import markdown

    out.print(markdown(doc))
    out.print(f"[green]wrote[/] {doc['sweep_dir']}/sweep.md, results.json, pareto.png")


# ----------------------------------------------------------------------------------------------------------------
# serve
# ----------------------------------------------------------------------------------------------------------------


def _latest_onnx_folder(runs_dir: str) -> Path:
    from bdlora.errors import RunDirError

    found = [p for p in Path(runs_dir).glob("*.onnx") if (p / "export.json").exists()]
    if not found:
        raise RunDirError(f"no ONNX export under {runs_dir}/ (run `bdlora export onnx` first, or pass ONNX_DIR)")
    return max(found, key=lambda p: (p / "export.json").stat().st_mtime)


@app.command()
@handle_errors
def serve(
    onnx_dir: Annotated[Optional[str], typer.Argument(help="A `bdlora export onnx` folder (default: the latest).")]
    = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    max_batch: Annotated[int, typer.Option(help="Sequences decoded together (continuous batching).")] = 16,
    max_tokens: Annotated[int, typer.Option(help="Largest max_tokens a request may ask for.")] = 512,
    max_prompt_tokens: Annotated[Optional[int], typer.Option(help="Longest prompt in tokens (default: the "
                                                                  "model's context minus one).")] = None,
    max_waiting: Annotated[int, typer.Option(help="Queued requests beyond the batch before answering 429.")]
    = 1024,
    onnx_file: Annotated[str, typer.Option(help="Graph to serve (model.onnx or model_int8.onnx).")] = "model.onnx",
    model_name: Annotated[Optional[str], typer.Option(help="Model id clients send (default: the folder name).")]
    = None,
    threads: Annotated[Optional[int], typer.Option(help="onnxruntime intra-op threads (default: all cores).")]
    = None,
    drain_seconds: Annotated[int, typer.Option(help="On SIGTERM/SIGINT: seconds to let in-flight requests "
                                                    "finish.")] = 30,
    runs_dir: Annotated[str, typer.Option(help=H["runs_dir"])] = "runs",
):
    """Serve an exported ONNX model with an OpenAI-compatible API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics)."""
    from bdlora.errors import UsageError
    from bdlora.serve.app import ServeConfig, check_onnx_dir
    from bdlora.serve.app import serve as run_server

    for name, v, lo in (("--port", port, 0), ("--max-batch", max_batch, 1), ("--max-tokens", max_tokens, 1),
                        ("--max-waiting", max_waiting, 1), ("--drain-seconds", drain_seconds, 0)):
        if v < lo or (name == "--port" and v > 65535):
            raise UsageError(f"{name} {v}: must be >= {lo}" + (" and <= 65535" if name == "--port" else ""))
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise UsageError(f"--max-prompt-tokens {max_prompt_tokens}: must be >= 1")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads {threads}: must be >= 1")
    src = Path(onnx_dir) if onnx_dir else _latest_onnx_folder(runs_dir)
    check_onnx_dir(src, onnx_file)
    cfg = ServeConfig(onnx_dir=str(src), model_name=model_name or src.name, onnx_file=onnx_file,
                      max_batch=max_batch, max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                      max_waiting=max_waiting, threads=threads)
    err.print(f"[cyan]>[/] serving {src} as '{cfg.model_name}' on http://{host}:{port}/v1", highlight=False)
    run_server(cfg, host, port, drain_seconds)


@app.command()
@handle_errors
def loadtest(
    url: Annotated[str, typer.Argument(help="Server base URL, e.g. http://127.0.0.1:8000")],
    concurrency: Annotated[str, typer.Option(help="Comma-separated numbers of concurrent clients.")] = "1,16",
    requests: Annotated[int, typer.Option(help="Completed requests per concurrency level.")] = 100,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of every request.")] = 64,
    model: Annotated[Optional[str], typer.Option(help="Model id (default: the first /v1/models lists).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the requests.")] = 0.0,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Also write the results here.")] = None,
):
    """Closed-loop load test of an OpenAI-compatible /v1/completions endpoint: requests/s, tokens/s, p50/p99."""
    import httpx

    from bdlora.errors import UsageError
    from bdlora.io import write_json
    from bdlora.serve.loadtest import load_test

    levels = _int_list(concurrency, "--concurrency")
    if any(c < 1 for c in levels) or requests < 1 or max_tokens < 1:
        raise UsageError("--concurrency, --requests and --max-tokens must be >= 1")
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=10)
    except httpx.TransportError as e:
        raise UsageError(f"{url}: no server answers there ({type(e).__name__})") from None
    rows = [load_test(url, model, c, requests, max_tokens, temperature=temperature) for c in levels]
    t = Table(title=f"loadtest {url} ({rows[0]['model']}, max_tokens {max_tokens})")
    for col in ("clients", "requests", "failed", "req/s", "tok/s", "p50 ms", "p90 ms", "p99 ms"):
        t.add_column(col, justify="right")
    for r in rows:
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        t.add_row(str(r["concurrency"]), str(r["requests"]), str(r["failures"]), f"{r['requests_per_s']:.2f}",
                  f"{r['tokens_per_s']:.1f}", f(r["p50_ms"]), f(r["p90_ms"]), f(r["p99_ms"]))
    out.print(t)
    if json_path:
        write_json(json_path, {"results": rows})
    if any(r["failures"] for r in rows):
        first = next(r["first_failure"] for r in rows if r["failures"])
        err.print(f"[bold red]error:[/] some requests failed; the first: {first}", highlight=False)
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
