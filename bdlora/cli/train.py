"""``bdlora teacher`` and ``bdlora train`` (and the torchrun relaunch of ``train --nproc``)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bdlora.base.errors import UsageError
from bdlora.base.reporter import SILENT
from bdlora.base.runs import TEACHER_JSON, RunDir
from bdlora.base.settings import field_docs
from bdlora.cli import render
from bdlora.cli.app import command, err, out
from bdlora.cli.compress import cost_model
from bdlora.cli.options import TRAIN_PANELS, Force, Json, from_dataclass
from bdlora.cli.progress import RichReporter
from bdlora.data.documents import BUILTIN
from bdlora.train.config import TrainConfig, defaults_help, merge
from bdlora.train.option_files import load_yaml

H = field_docs(TrainConfig)


@command()
def teacher(
    preset: Annotated[Optional[str], typer.Option(help="A pretrained teacher to materialise instead of the builtin "
                                                       "one: a preset (smollm2-135m, gemma3-270m) or a .gguf "
                                                       "file.")] = None,
    data: Annotated[str, typer.Option(help="With --preset: the corpus its held-out perplexity is measured on.")]
    = BUILTIN,
    cache_dir: Annotated[Optional[str], typer.Option(help=H["cache_dir"])] = None,
    force: Force = False,
    json_out: Json = False,
):
    """Build (or show) the embedded default teacher (a BPE tokenizer and a small Mistral-style model pretrained on
    the Python standard library), or with --preset materialise a pretrained one into the cache as a Hugging Face
    folder; prints its folder, parameter count and held-out perplexity."""
    from bdlora.models.teacher import build_builtin_teacher, describe_pretrained

    rep = RichReporter(err if json_out else out)
    cache = Path(cache_dir) if cache_dir else None
    if preset is not None:
        if force:
            raise UsageError("--force rebuilds the builtin teacher; a materialised preset is removed by deleting "
                             "its folder")
        info = describe_pretrained(preset, cache, on_stage=rep.stage, data=data)
    else:
        path = build_builtin_teacher(cache, force=force, on_stage=rep.stage, on_step=rep.teacher_step)
        info = {**json.loads((path / TEACHER_JSON).read_text()), "path": str(path)}
    rep.finish()
    if json_out:
        print(json.dumps(info, indent=2))
        return
    render.teacher(info)


@command(options=from_dataclass(TrainConfig, skip=("defaulted",), notes=defaults_help(), panels=TRAIN_PANELS))
def train(
    config: Annotated[Optional[str], typer.Option(help="YAML file holding any of these options, or a recipe "
                                                       "shipped with bdlora (paper: the paper's full budget); flags "
                                                       "override.")]
    = None,
    resume: Annotated[Optional[str], typer.Option(help="Continue an unfinished run directory from its latest "
                                                        "verified checkpoint (its stored options are used).")] = None,
    nproc: Annotated[Optional[int], typer.Option(help="Data-parallel processes on this machine: re-launches this "
                                                      "command under torchrun (gloo on CPU, NCCL on GPUs).")] = None,
    like: Annotated[Optional[str], typer.Option(help="A run directory whose teacher, data, steps, batch, sequence "
                                                     "length, depth and seed this run copies (flags override): the "
                                                     "healed dense peer of a budgeted run is `--like RUN --method "
                                                     "kd-lora`.")] = None,
    json_out: Json = False,
    **opts,
):
    """Distil a student from the teacher: kd-full, kd-lora or budgeted (Budgeted LoRA), into the run directory --out
    (default RUNS_DIR/<time>-<method>)."""
    if nproc is not None:
        if nproc < 1:
            raise UsageError(f"--nproc {nproc}: must be a positive integer")
        if "WORLD_SIZE" in os.environ:
            raise UsageError("--nproc: already running under a distributed launcher (torchrun); drop --nproc")
        raise typer.Exit(_launch_torchrun(nproc))
    if resume is not None:
        if like:
            raise UsageError(f"--resume {resume}: continues with the run's stored options; drop --like")
        RunDir(resume).require_resumable()
        if config:
            raise UsageError(f"--resume {resume}: continues with the run's stored options; drop --config")
    base = {**(load_yaml(config) if config else {}), **(like_run(like) if like else {})}
    cfg = merge(base, {} if resume else opts)
    if resume is None:  # a bad option is refused before the training stack is imported (6 s before, 1 s now)
        cfg.validate()
    from bdlora.train.loop import train as run_train

    rank0 = os.environ.get("RANK", "0") == "0"
    rep = RichReporter(err if json_out else out) if rank0 else None
    cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else None
    summary = run_train(cfg, rep, resume=resume,
                        overrides={k: v for k, v in opts.items() if v is not None} if resume else None,
                        cost_model=cost_model(cfg.dials.precision, None, cache, rep or SILENT, cfg.dials.quant))
    if not rank0:
        return
    if json_out:
        print(json.dumps(summary, indent=2))
        return
    render.train_summary(summary)


LIKE_KEYS = ("teacher", "data", "heldout_fraction", "seq_len", "batch_size", "grad_accum", "max_steps", "seed",
             "student_layers", "eval_tokens", "eval_every", "cache_dir")  # what "the same data and steps" means


def like_run(run: str) -> dict:
    """The options of ``LIKE_KEYS`` that run directory ``run`` was started with (``train --like``)."""
    r = RunDir(run)
    if not r.started():
        raise UsageError(f"--like {run}: not a bdlora run directory (no run config.json)")
    stored = r.config()
    return {k: stored[k] for k in LIKE_KEYS if stored.get(k) is not None}


def _launch_torchrun(nproc: int) -> int:
    """Run this same ``bdlora train`` command (minus --nproc) under ``torch.distributed.run``; its exit code."""
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
    err.print(f"[cyan]>[/] launching {nproc} processes: {escape(' '.join(cmd[2:]))}", highlight=False, soft_wrap=True)
    return subprocess.call(cmd)
