"""``bdlora bench``: the compressed model against its dense and LoRA forms under onnxruntime."""

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bdlora.base.errors import Checks, UsageError
from bdlora.base.io import write_json
from bdlora.base.outputs import check_out_dir, check_out_file
from bdlora.base.runs import RUNS_DIR, BenchDir
from bdlora.base.threads import from_options
from bdlora.bench.config import NO_DOMAIN, ROUNDING, BenchConfig
from bdlora.bench.target import SYNTHETIC_LORA_RANK, compressed_target, synthetic_target
from bdlora.cli import render
from bdlora.cli.app import command, out
from bdlora.cli.options import Force, Out, Report, RunsDir, from_dataclass, given, int_list, str_list
from bdlora.cli.progress import RichReporter
from bdlora.data.corpora import check_spec
from bdlora.export.settings import GenaiExportConfig

SYNTHETIC = "Synthetic mode (--model-config: the structure plan predicts, random weights)"
BENCH_PANELS = {  # bench --help: what and how wide is benched stays in the main panel
    "Timing": ("scope", "threads", "provider", "warmup", "int8", "optimize", "peers", "teacher"),
    "Quality and rounding": ("quality_tokens", "icl", "icl_examples"),
}
ROUNDING_NOTES = {  # export genai's help of each, then what it means across a bench's many folders
    "head_bits": "In bench: every int4 folder's head, the student's and the teacher's alike (the head is a third of "
                 "an int4 model's bytes at SmolLM2's size); a row whose folder declares 4 says so.",
    "int8_share": "In bench: every int4 folder rounded by a calibrated scheme (gptq).",
}


@command(options=from_dataclass(BenchConfig, skip=("opt_level", "rounding"), defaults=True, panels=BENCH_PANELS)
         + from_dataclass(GenaiExportConfig, names=ROUNDING, defaults=True, notes=ROUNDING_NOTES,
                          panels={"Quality and rounding": ("head_bits", "int8_share")}))
def bench(
    model_dir: Annotated[Optional[str], typer.Argument(help="A `bdlora compress` output (default: the latest).")]
    = None,
    model_config: Annotated[Optional[str], typer.Option(help="Synthetic mode: an HF config.json; benches the "
                                                              "structure `plan` predicts, with random weights.",
                                                         rich_help_panel=SYNTHETIC)] = None,
    budget: Annotated[Optional[float], typer.Option(help="Synthetic mode: the budget F.", rich_help_panel=SYNTHETIC)]
    = None,
    layers: Annotated[Optional[int], typer.Option(help="Synthetic mode: student layers.", rich_help_panel=SYNTHETIC)]
    = None,
    lora_rank: Annotated[Optional[int], typer.Option(help="LoRA rank of the lora variant (default: the trained "
                                                           f"rank; synthetic: {SYNTHETIC_LORA_RANK}).",
                                                     rich_help_panel=SYNTHETIC)] = None,
    also: Annotated[Optional[list[str]], typer.Option(
        "--also", help="genai runtime: another compressed folder (of the same teacher) whose compressed form joins "
                       "the same run and front at every precision. Repeatable.")] = None,
    peer: Annotated[Optional[list[str]], typer.Option(
        "--peer", help="genai runtime: a healed dense model folder (e.g. the compressed folder of a `train --method "
                       "kd-lora` run with the same data and steps) that joins the front at every precision as "
                       "peer-NAME, rounded as the teacher is; every student is compared with it at its precision. "
                       "Repeatable.")] = None,
    json_path: Report = None,
    out_dir: Out = None,
    force: Force = False,
    runs_dir: RunsDir = RUNS_DIR,
    **opts,
):
    """Time the compressed model against its dense and LoRA forms under onnxruntime (modules and whole model,
    prefill and decode; --runtime genai: in onnxruntime-genai beside its builder's dense model; llamacpp: as GGUF
    files in llama.cpp beside the teacher's), beside the MAC limits; writes bench.json, bench.md and bench.png into
    --out (default MODEL_DIR.bench)."""
    _check_own_options(model_config, budget, layers, lora_rank)  # every flag checked before the heavy imports: a
    cfg = _bench_config(opts)  # bad one is refused in a second, not after torch and onnxruntime load (13-30 s busy)
    _check_mode(cfg, model_config)
    from bdlora.bench.run import run_bench

    if json_path:
        check_out_file(json_path, force=force)
    lazy = "ort" not in cfg.runtimes and not cfg.peers  # no PyTorch or builder row needs the weights at once
    target = (synthetic_target(model_config, budget, layers, lora_rank, out_dir, runs_dir, lazy) if model_config
              else compressed_target(model_dir, lora_rank, out_dir, runs_dir))
    _not_itself(target, peer, also)
    check_out_dir(target.out, force, target.inputs)
    rep = RichReporter(out)
    deploy = None
    if cfg.deployed and target.source is not None:  # the teacher and the slices of the quality/speed front
        from bdlora.bench.genai import deployment_for

        deploy = deployment_for(target.source.path, target.report, target.tokenizer, target.model, cfg, rep,
                                also or [], peer or [])
    doc = run_bench(target.model, target.lora_rank, cfg, target.out, target.report, reporter=rep,
                    tokenizer=target.tokenizer, deploy=deploy)
    if json_path:
        write_json(json_path, doc)
    render.bench(doc)
    out.print(f"[green]wrote[/] {escape(str(target.out / BenchDir.MARKER))}, bench.md, bench.png")


def _not_itself(target, peer, also) -> None:
    """A student accepted as its own peer (or --also) put itself on the front beside itself."""
    for flag, folders in (("--peer", peer or []), ("--also", also or [])):
        for other in folders:
            if target.source is not None and Path(other).resolve() == target.source.path.resolve():
                raise UsageError(f"{flag} {other}: is the benched folder itself; give another model's folder (a "
                                 "peer: the dense model healed with the same data and steps)")


def _check_mode(cfg: BenchConfig, model_config) -> None:
    """What the options ask of the model and the data, before anything is exported."""
    if cfg.icl and model_config:
        raise UsageError("--icl: synthetic mode (--model-config) has random weights and no tokenizer to probe; give "
                         "a compressed folder")
    if cfg.speculative and model_config:
        raise UsageError("--speculative: synthetic mode (--model-config) has no teacher and no text to speculate on; "
                         "give a compressed folder (a draft of a teacher)")
    if "llamacpp" in cfg.runtimes and model_config:
        raise UsageError(f"--runtime {cfg.runtime}: llama.cpp's rows are `bdlora export gguf` files of a folder, and "
                         "synthetic mode (--model-config) has none; give a compressed folder, or time a synthetic "
                         "checkpoint's GGUF with benchmarks/decode.py")
    if cfg.eval_data not in (None, NO_DOMAIN):  # a bad corpus is refused at once
        check_spec(cfg.eval_data, "--eval-data")


def _bench_config(opts: dict) -> BenchConfig:
    """The options as a checked BenchConfig: lists parsed, export genai's rounding settings held as one object."""
    rounding = from_options(GenaiExportConfig, given({k: opts.pop(k) for k in ROUNDING}))  # export genai's, as given
    opts.update(batch_sizes=int_list(opts["batch_sizes"], "--batch-sizes"),
                seq_lens=int_list(opts["seq_lens"], "--seq-lens"),
                genai_precisions=str_list(opts["genai_precisions"]) or [],
                gguf_quants=str_list(opts["gguf_quants"]) or [])
    return from_options(BenchConfig, {**opts, "rounding": rounding}).validate()


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
