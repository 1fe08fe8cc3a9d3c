"""``bdlora export onnx``: a model folder -> an ONNX folder (model.onnx [+ model_int8.onnx], config, tokenizer,
compression.json, and export.json written last), validated against PyTorch before it is published."""

from __future__ import annotations

import time
from pathlib import Path

from bdlora import SCHEMA_VERSION
from bdlora.base.errors import UsageError
from bdlora.base.io import atomic_dir, write_json
from bdlora.base.outputs import DEFAULT_STREAMING, check_out_dir
from bdlora.base.provenance import recorded_data_settings
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import MODEL_INT8_ONNX, MODEL_ONNX, OnnxDir
from bdlora.data.corpora import heldout_blocks
from bdlora.export.decoder import DecoderLayout, decoder_graph, save_graph
from bdlora.export.files import identity, write_model_files
from bdlora.export.genai.stream import ExternalData, StreamingBuilder, save_streamed
from bdlora.export.onnx.metadata import metadata_props, metadata_summary, module_table, set_metadata
from bdlora.export.onnx.quantize import quantize_int8
from bdlora.export.onnx.signature import DEFAULT_OPSET, check_opset
from bdlora.export.onnx.validate import quantized_quality, validate
from bdlora.export.preflight import check_export_inputs
from bdlora.models.load import load_model_folder
from bdlora.models.runtime import DecoderShape, session
from bdlora.models.stream import PARITY_LAYERS, PARITY_VOCAB, cut_checked, lazy_folder_model, streams
from bdlora.models.teacher import recorded_teacher

QUANTIZE = ("int8",)
FUSED_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RotaryEmbedding")


def export_decoder(model, path: Path, opset: int = DEFAULT_OPSET, fused: bool = False,
                   meta: dict[str, str] | None = None, stream: bool = False) -> dict:
    """Emit ``model``'s decoder in the plain layout (position ids, separate past/present) into ``path``, with
    onnxruntime's fused norm and rotary ops if ``fused`` and ``meta`` as its metadata; returns what was emitted:
    the number of MatMuls the shared first stages saved and (``fused``) the count of each fused op. ``stream``: each
    part's weights appended to ``<path>.data`` as it is emitted (a lazy model: ``models.stream``)."""
    check_opset(opset)
    data = ExternalData(Path(f"{path}.data")) if stream else None
    try:
        g = StreamingBuilder(opset, data=data) if stream else None
        proto, saved = decoder_graph(model, DecoderLayout.plain(model.config, opset, fused), g)
    finally:
        if data is not None:
            data.close()
    if meta:
        set_metadata(proto, meta)
    emitted: dict = {"matmuls_fused": saved}
    if fused:
        emitted["fused_ops"] = {op: sum(n.op_type == op for n in proto.graph.node) for op in FUSED_OPS}
    (save_streamed if stream else save_graph)(proto, path)
    return emitted


def cut_validation(model, folder: Path, opset: int, fused: bool) -> dict:
    """``validate`` of the plain graph of ``models.stream.cut_model(model)`` (written under ``folder``, removed
    after): a streamed export's parity on its own weights at a size whose fp32 graph and PyTorch forward fit."""
    return cut_checked(model, folder, lambda cut, path: export_decoder(cut, path, opset, fused),
                       lambda cut, path: validate(cut, session(path)))


def export_onnx_folder(model_dir: str | Path, out: str | Path, opset: int = DEFAULT_OPSET, quantize: str | None = None,
                       run_validation: bool = True, force: bool = False, reporter: Reporter = SILENT,
                       optimize: bool = False, streaming: str = DEFAULT_STREAMING) -> dict:
    """Emit (``optimize``: with onnxruntime's fused RMSNorm, residual+RMSNorm and rotary ops), validate, (optionally)
    quantise; the folder is written atomically and returned as its export.json document. ``streaming``
    (``models.stream.streams``): the model read, emitted and written one layer at a time, validated on the model cut
    to its first layers."""
    check_opset(opset)
    if quantize not in (None, *QUANTIZE):
        raise UsageError(f"--quantize {quantize}: unknown (allowed: {', '.join(QUANTIZE)})")
    model_dir, out = Path(model_dir), Path(out)
    check_out_dir(out, force, (model_dir,))
    stream = streams(streaming, model_dir, whole=quantize is not None)
    if stream and quantize:
        raise UsageError(f"--quantize {quantize} --streaming on: the dynamic int8 pass rounds the whole fp32 graph in "
                         "memory; `bdlora export genai --precision int8` streams, or give --streaming off")
    check_export_inputs(model_dir, out, 32 + (8 if quantize else 0), reference=False)  # fp32, and an int8 copy
    reporter.stage(f"loading {model_dir}" + (" lazily (each layer read from its weight files when emitted)"
                                             if stream else ""))
    model, tok, report = lazy_folder_model(model_dir) if stream else load_model_folder(model_dir)
    rows = module_table(model)
    summary = metadata_summary(model, rows, report)
    info: dict = {"schema_version": SCHEMA_VERSION, "source": str(model_dir.resolve()), "opset": opset,
                  "streamed": stream, "summary": summary}
    with atomic_dir(out) as tmp:
        reporter.stage(f"emitting the ONNX decoder (opset {opset})" + (", one layer at a time" if stream else ""))
        t0 = time.time()
        info.update(export_decoder(model, tmp / MODEL_ONNX, opset, optimize, metadata_props(rows, summary), stream))
        info["export_seconds"] = time.time() - t0
        info["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.name.startswith(MODEL_ONNX)}
        if run_validation:
            reporter.stage("validating against PyTorch" + (f" on the model's first {PARITY_LAYERS} layers and "
                                                           f"{PARITY_VOCAB:,} vocabulary rows" if stream else ""))
            info["validation"] = cut_validation(model, tmp, opset, optimize) if stream else \
                validate(model, session(tmp / MODEL_ONNX))
        write_model_files(tmp, model, tok, report)
        if quantize in QUANTIZE:
            info["int8"] = _quantize(tmp, model, tok, report, model_dir, info, reporter)
        info.update(identity(tmp))
        write_json(tmp / OnnxDir.MARKER, info)
    return info


def _quantize(tmp: Path, model, tok, report: dict | None, model_dir: Path, info: dict, reporter: Reporter) -> dict:
    reporter.stage("quantising to int8 (dynamic, weights)")
    quantize_int8(tmp / MODEL_ONNX, tmp / MODEL_INT8_ONNX)
    info["files"][MODEL_INT8_ONNX] = (tmp / MODEL_INT8_ONNX).stat().st_size
    out = {"size_ratio": info["files"][MODEL_INT8_ONNX] / info["files"][MODEL_ONNX]}
    settings = recorded_data_settings(model_dir, (report or {}).get("provenance", {}))
    if settings is None:
        return out

    blocks = heldout_blocks(settings, tok, teacher=recorded_teacher(settings))
    reporter.stage("scoring the held-out slice with fp32 and int8 graphs")
    return {**out, **quantized_quality(session(tmp / MODEL_ONNX), session(tmp / MODEL_INT8_ONNX),
                                       DecoderShape.of(model.config), blocks)}
