"""``bdlora bench``: the compressed model against its dense and LoRA forms under onnxruntime."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from bdlora.arch import check_lora_rank
from bdlora.bench.config import BenchConfig
from bdlora.cli import render
from bdlora.cli.app import command, out
from bdlora.cli.options import from_dataclass, int_list, str_list
from bdlora.cli.progress import RichReporter
from bdlora.errors import Checks, ModelError, UsageError
from bdlora.io import write_json
from bdlora.outputs import check_out_dir, check_out_file
from bdlora.plan import read_model_config
from bdlora.runs import RUNS_DIR, BenchDir, ModelDir


@command(options=from_dataclass(BenchConfig, skip=("opt_level",), defaults=True))
def bench(
    model_dir: Annotated[Optional[str], typer.Argument(help="A `bdlora compress` output (default: the latest).")]
    = None,
    model_config: Annotated[Optional[str], typer.Option(help="Synthetic mode: an HF config.json; benches the "
                                                              "structure `plan` predicts, with random weights.")]
    = None,
    budget: Annotated[Optional[float], typer.Option(help="Synthetic mode: the budget F.")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Synthetic mode: student layers.")] = None,
    lora_rank: Annotated[Optional[int], typer.Option(help="LoRA rank of the lora variant (default: the trained "
                                                           "rank; synthetic: 128).")] = None,
    also: Annotated[Optional[list[str]], typer.Option(
        "--also", help="genai runtime: another compressed folder (of the same teacher) whose compressed form joins "
                       "the same run and front at every precision. Repeatable.")] = None,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Also write the JSON report here.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default: MODEL_DIR.bench).")]
    = None,
    force: Annotated[bool, typer.Option(help="Replace an existing non-empty --out (and an existing --json file).")]
    = False,
    runs_dir: Annotated[str, typer.Option(help="Where runs live.")] = RUNS_DIR,
    **opts,
):
    """Time the compressed model against its dense and LoRA forms under onnxruntime (modules and whole model,
    prefill and decode; --runtime genai: in onnxruntime-genai beside its builder's dense model), beside the MAC
    limits; writes bench.json, bench.md and bench.png."""
    from bdlora.bench.run import run_bench

    opts["batch_sizes"] = int_list(opts["batch_sizes"], "--batch-sizes")
    opts["seq_lens"] = int_list(opts["seq_lens"], "--seq-lens")
    opts["genai_precisions"] = str_list(opts["genai_precisions"]) or []
    _check_own_options(model_config, budget, layers, lora_rank)
    cfg = BenchConfig(**opts).validate()
    if json_path:
        check_out_file(json_path, force=force)
    if model_config:
        from bdlora.bench.variants import synthetic_model

        if budget is None:
            raise UsageError("--model-config needs --budget F (the structure to bench)")
        config = read_model_config(model_config)
        rank = check_lora_rank(lora_rank or 128, config, defaulted=lora_rank is None)
        (model, report), tok, deploy = synthetic_model(config, budget, layers, rank), None, None
        dst, inputs = Path(out_dir) if out_dir else Path(runs_dir) / f"bench-synthetic-F{budget}", ()
    else:
        src, model, tok, report = _compressed(model_dir, runs_dir)
        rank = check_lora_rank(lora_rank or trained_lora_rank(report), model.config, lora_rank is None)
        dst, inputs, deploy = (Path(out_dir) if out_dir else src.bench_out()), (src.path,), None
    check_out_dir(dst, force, inputs)
    rep = RichReporter(out)
    if cfg.runtime != "ort" and not model_config:  # the teacher and the slices of the quality/speed front
        from bdlora.bench.genai import deployment_for

        deploy = deployment_for(src.path, report, tok, model, cfg, rep, also or [])
    doc = run_bench(model, rank, cfg, dst, report, reporter=rep, tokenizer=tok, deploy=deploy)
    if json_path:
        write_json(json_path, doc)
    render.bench(doc)
    out.print(f"[green]wrote[/] {dst / BenchDir.MARKER}, bench.md, bench.png")


def _compressed(model_dir: str | None, runs_dir: str):
    """(folder, model, tokenizer, compression report) of the compressed folder to bench."""
    from bdlora.models import load_model_folder

    src = ModelDir(model_dir) if model_dir else ModelDir.latest(runs_dir)
    if not src.finished():
        raise ModelError(f"{src.path}: no compression.json; bench needs a `bdlora compress` output (or use "
                         "--model-config for synthetic mode)")
    return (src, *load_model_folder(src.path))


def _check_own_options(model_config, budget, layers, lora_rank) -> None:
    """Every option's own range first, before anything is read; synthetic-mode options only in synthetic mode."""

    c = Checks()
    c.number("budget", budget, 0.0, 1.0)
    c.integer("layers", layers, lo=1)
    c.integer("lora_rank", lora_rank, lo=1)
    c.done()
    if not model_config and (budget is not None or layers is not None):
        raise UsageError(f"--{'budget' if budget is not None else 'layers'}: only with --model-config (synthetic "
                         "mode); a compressed folder has its own structure")


def trained_lora_rank(report: dict) -> int:
    """The LoRA rank the model was trained with (``compression.json``'s ``lora_rank``); folders written before it
    was recorded give it back from the LoRA MACs (sum of r (d_in + d_out) over the modules)."""
    if report.get("lora_rank"):
        return int(report["lora_rank"])
    per_rank = sum(m["in_features"] + m["out_features"] for m in report["modules"])
    return max(1, round(report["lora_macs"] / max(1, per_rank)))
