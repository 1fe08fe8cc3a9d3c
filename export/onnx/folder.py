"""``bdlora export onnx``: a model folder -> an ONNX folder (model.onnx [+ model_int8.onnx], config, tokenizer,
compression.json, and export.json written last), validated against PyTorch before it is published."""

from __future__ import annotations

import math
import time
from pathlib import Path

from bdlora import SCHEMA_VERSION
from bdlora.corpora import heldout_blocks
from bdlora.errors import UsageError
from bdlora.export.onnx.metadata import add_metadata, metadata_summary, module_table
from bdlora.export.onnx.optimize import optimize_graph
from bdlora.export.onnx.quantize import quantize_int8
from bdlora.export.onnx.signature import DEFAULT_OPSET, check_opset
from bdlora.export.onnx.trace import export_decoder
from bdlora.export.onnx.validate import validate
from bdlora.io import atomic_dir, write_json
from bdlora.models import load_model_folder
from bdlora.outputs import check_out_dir
from bdlora.reporter import SILENT, Reporter
from bdlora.runs import MODEL_INT8_ONNX, MODEL_ONNX, ModelDir, OnnxDir, source_run
from bdlora.runtime import DecoderShape, score_blocks, session

QUANTIZE = ("int8",)


def export_onnx_folder(model_dir: str | Path, out: str | Path, opset: int = DEFAULT_OPSET, quantize: str | None = None,
                       run_validation: bool = True, force: bool = False, reporter: Reporter = SILENT,
                       optimize: bool = False) -> dict:
    """Export, (optionally) fuse with onnxruntime's optimizer, add metadata, validate, (optionally) quantise; the
    folder is written atomically and returned as its export.json document."""
    check_opset(opset)
    if quantize not in (None, *QUANTIZE):
        raise UsageError(f"--quantize {quantize}: unknown (allowed: {', '.join(QUANTIZE)})")
    model_dir, out = Path(model_dir), Path(out)
    check_out_dir(out, force, (model_dir,))
    reporter.stage(f"loading {model_dir}")
    model, tok, report = load_model_folder(model_dir)
    rows = module_table(model)
    summary = metadata_summary(model, rows, report)
    info: dict = {"schema_version": SCHEMA_VERSION, "source": str(model_dir.resolve()), "opset": opset,
                  "summary": summary}
    with atomic_dir(out) as tmp:
        reporter.stage(f"exporting to ONNX (opset {opset})")
        t0 = time.time()
        info["matmuls_fused"] = export_decoder(model, tmp / MODEL_ONNX, opset)
        if optimize:
            reporter.stage("fusing RMSNorm / residual / rotary subgraphs (onnxruntime transformer optimizer)")
            info["ort_fusions"] = optimize_graph(tmp / MODEL_ONNX, model)
        add_metadata(tmp / MODEL_ONNX, rows, summary)
        info["export_seconds"] = time.time() - t0
        info["files"] = {"model.onnx": (tmp / MODEL_ONNX).stat().st_size}
        if run_validation:
            reporter.stage("validating against PyTorch")
            info["validation"] = validate(model, session(tmp / MODEL_ONNX))
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if report is not None:
            write_json(tmp / ModelDir.MARKER, report)
        if quantize == "int8":
            info["int8"] = _quantize(tmp, model, tok, report, model_dir, info, reporter)
        write_json(tmp / OnnxDir.MARKER, info)
    return info


def _quantize(tmp: Path, model, tok, report: dict | None, model_dir: Path, info: dict, reporter: Reporter) -> dict:
    reporter.stage("quantising to int8 (dynamic, weights)")
    quantize_int8(tmp / MODEL_ONNX, tmp / MODEL_INT8_ONNX)
    info["files"][MODEL_INT8_ONNX] = (tmp / MODEL_INT8_ONNX).stat().st_size
    out = {"size_ratio": info["files"][MODEL_INT8_ONNX] / info["files"][MODEL_ONNX]}
    run = source_run(model_dir, (report or {}).get("provenance", {}))
    if run is None:
        return out

    blocks = heldout_blocks(run.config(), tok)
    reporter.stage("scoring the held-out slice with fp32 and int8 graphs")
    shape = DecoderShape.of(model.config)
    nll32, arg32 = score_blocks(session(tmp / MODEL_ONNX), shape, blocks)
    nll8, arg8 = score_blocks(session(tmp / MODEL_INT8_ONNX), shape, blocks)
    return {**out, "val_ppl_fp32": math.exp(nll32), "val_ppl_int8": math.exp(nll8),
            "argmax_agreement": float((arg32 == arg8).mean()), "ppl_change": math.exp(nll8) / math.exp(nll32) - 1.0,
            "tokens": len(blocks) * blocks.seq_len}
