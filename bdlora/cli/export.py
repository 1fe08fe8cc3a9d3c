"""``bdlora export hf``, ``bdlora export onnx`` and ``bdlora export genai``."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from bdlora.base.errors import Checks
from bdlora.base.outputs import DEFAULT_STREAMING
from bdlora.base.runs import RUNS_DIR, ModelDir
from bdlora.base.threads import from_options
from bdlora.cli import render
from bdlora.cli.app import command, err, export_app, out
from bdlora.cli.options import Force, Json, Out, RunsDir, from_dataclass, given
from bdlora.cli.progress import RichReporter
from bdlora.data.documents import BUILTIN
from bdlora.export.defaults import DEFAULT_OPSET
from bdlora.export.hf import export_hf as run_export
from bdlora.export.settings import GenaiExportConfig, GgufExportConfig
from bdlora.models import sources


def _source(model_dir: Optional[str], runs_dir: str) -> Path:
    return Path(model_dir) if model_dir else ModelDir.latest(runs_dir).path


def _named_source(model_dir: Optional[str], out_dir: Optional[str], suffix: str, rep) -> tuple[Path, Path] | None:
    """(source folder, output) of a teacher named by a word: ``builtin`` (built once into the cache), a preset or a
    .gguf file (its HF folder in the cache); the export goes beside you (``NAME`` + ``suffix``), not in the cache.
    None for a folder path (or no argument: the latest compressed folder)."""
    if model_dir == BUILTIN:
        from bdlora.models.teacher import build_builtin_teacher

        src = build_builtin_teacher(on_stage=rep.stage)
    elif model_dir is not None and sources.is_named(model_dir):
        src = Path(sources.resolve(model_dir, None, "MODEL_DIR", rep.stage))
    else:
        return None
    return src, Path(out_dir) if out_dir else Path(Path(model_dir).name.removesuffix(".gguf") + suffix)


@command(export_app, "hf")
def export_hf(
    model_dir: Annotated[Optional[str], typer.Argument(help="Compressed model folder (default: the latest).")]
    = None,
    out_dir: Out = None,
    force: Force = False,
    runs_dir: RunsDir = RUNS_DIR,
):
    """Copy a compressed model into a clean, shareable Hugging Face folder with a generated model card (--out:
    default MODEL_DIR.hf)."""

    src = _source(model_dir, runs_dir)
    dst = Path(out_dir) if out_dir else ModelDir(src).hf_out()
    run_export(src, dst, force=force)
    out.print(f"[green]wrote[/] {escape(str(dst))} (load with AutoModelForCausalLM.from_pretrained(path, "
              "trust_remote_code=True))")


@command(export_app, "onnx")
def export_onnx(
    model_dir: Annotated[Optional[str], typer.Argument(help="Model folder: a `bdlora compress` output (default: the "
                                                            "latest), any HF folder of a family bdlora adapts, a "
                                                            "teacher preset, a .gguf file or builtin.")] = None,
    out_dir: Out = None,
    opset: Annotated[int, typer.Option(help="ONNX opset (14 up to the exporter's maximum).")] = DEFAULT_OPSET,
    quantize: Annotated[Optional[str], typer.Option(help="int8: also write model_int8.onnx (dynamic weight "
                                                          "quantisation) and report its perplexity change.")] = None,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="Skip the parity check against PyTorch.")]
    = False,
    optimize: Annotated[bool, typer.Option("--optimize", help="Emit RMSNorm, residual+RMSNorm and rotary as "
                                                              "onnxruntime's fused contrib ops (faster decode; the "
                                                              "graph then needs onnxruntime).")] = False,
    streaming: Annotated[str, typer.Option(help="on: read, emit and write one layer at a time (a 1B-8B model; "
                                                "validated on its first layers); off: hold it in fp32; auto: on past "
                                                "2 GiB of fp32 weights.")] = DEFAULT_STREAMING,
    force: Force = False,
    runs_dir: RunsDir = RUNS_DIR,
    json_out: Json = False,
):
    """Export a model as an ONNX decoder with KV cache and per-module shape metadata, validated against PyTorch;
    the folder loads in optimum's ORTModelForCausalLM (bdlora.export.onnx.load_ort_model, the [optimum] extra).
    --out defaults to MODEL_DIR.onnx."""
    from bdlora.export.onnx import export_onnx_folder

    rep = RichReporter(err if json_out else out)
    if named := _named_source(model_dir, out_dir, ".onnx", rep):
        src, dst = named
    else:
        src = _source(model_dir, runs_dir)
        dst = Path(out_dir) if out_dir else ModelDir(src).onnx_out()
    info = export_onnx_folder(src, dst, opset=opset, quantize=quantize, run_validation=not no_validate, force=force,
                              reporter=rep, optimize=optimize, streaming=streaming)
    if json_out:
        print(json.dumps(info, indent=2))
        return
    render.onnx_export(info, dst)


@command(export_app, "genai", options=from_dataclass(GenaiExportConfig, defaults=True))
def export_genai(
    model_dir: Annotated[Optional[str], typer.Argument(help="Model folder: a `bdlora compress` output (default: the "
                                                            "latest), any HF folder of a family bdlora adapts, a "
                                                            "teacher preset, a .gguf file or builtin.")] = None,
    out_dir: Out = None,
    force: Force = False,
    runs_dir: RunsDir = RUNS_DIR,
    json_out: Json = False,
    **opts,
):
    """Export a model for onnxruntime-genai (og.Generator, the LLM runtime): GroupQueryAttention with a shared KV
    buffer, fused RMSNorm, each projection in its dense or low-rank form; validated against PyTorch (logits, greedy
    generation, tokenizer; quantised: perplexity change). --out defaults to MODEL_DIR.genai (-int8, -int4 for those
    precisions)."""
    settings = from_options(GenaiExportConfig, given(opts))
    settings.check(Checks()).done()  # before the exporter's imports (torch, onnx): a bad flag is refused at once
    from bdlora.export.genai import export_genai_folder

    rep = RichReporter(err if json_out else out)
    suffix = settings.suffix
    if named := _named_source(model_dir, out_dir, f".genai{suffix}", rep):
        src, dst = named
    else:
        src = _source(model_dir, runs_dir)
        dst = Path(out_dir) if out_dir else Path(str(ModelDir(src).genai_out()) + suffix)
    info = export_genai_folder(src, dst, settings, force=force, reporter=rep)
    if json_out:
        print(json.dumps(info, indent=2))
        return
    render.genai_export(info, dst)


@command(export_app, "gguf", options=from_dataclass(GgufExportConfig, defaults=True))
def export_gguf(
    model_dir: Annotated[Optional[str], typer.Argument(help="Model folder: a `bdlora compress` output of the "
                                                            "channels, groups and layers forms (default: the latest), "
                                                            "any HF folder of a family llama.cpp runs, a teacher "
                                                            "preset, a .gguf file or builtin.")] = None,
    out_dir: Out = None,
    force: Force = False,
    runs_dir: RunsDir = RUNS_DIR,
    json_out: Json = False,
    **opts,
):
    """Export a model as a GGUF file for llama.cpp, Ollama and LM Studio: a teacher as llama.cpp's converter writes
    it, a student of pruned blocks as llama.cpp's deci architecture (per-layer heads and MLP widths), written one
    tensor at a time; checked in llama.cpp (tokenizer, logits, held-out perplexity against PyTorch) with the
    [llamacpp] extra. --out defaults to MODEL_DIR.gguf-QUANT."""
    settings = from_options(GgufExportConfig, given(opts))
    settings.check(Checks()).done()  # before the exporter's imports (torch): a bad flag is refused at once
    from bdlora.export.gguf import export_gguf_folder

    rep = RichReporter(err if json_out else out)
    if named := _named_source(model_dir, out_dir, f".gguf-{settings.quant}", rep):
        src, dst = named
    else:
        src = _source(model_dir, runs_dir)
        dst = Path(out_dir) if out_dir else Path(f"{src}.gguf-{settings.quant}")
    info = export_gguf_folder(src, dst, settings, force=force, reporter=rep)
    if json_out:
        print(json.dumps(info, indent=2))
        return
    render.gguf_export(info, dst)
