"""What ``bdlora eval`` scores, behind one interface (``step``, ``score``, ``logits``, ``nll``): a PyTorch model
(``TorchLM``; a folder too large to hold in fp32 read one layer at a time, ``models.stream.StreamedLM``) or an
onnxruntime session (``OrtLM``), so the deployed graph itself is what gets scored when eval is pointed at an ONNX
folder, and a 1B-8B checkpoint is scored without its fp32 copy in memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bdlora.base.errors import ModelError
from bdlora.base.outputs import DEFAULT_STREAMING
from bdlora.base.provenance import recorded_data_settings
from bdlora.base.runs import CONFIG, MODEL_ONNX, TEACHER_JSON, ModelDir, OnnxDir, RunDir
from bdlora.data.blocks import PackedBlocks
from bdlora.data.documents import BUILTIN
from bdlora.models import sources
from bdlora.models.runtime import (
    DecoderShape,
    check_onnx_dir,
    check_signature,
    empty_past,
    run_bound,
    run_decoder,
    score_blocks,
    session,
)
from bdlora.models.tokenizer import TextTokenizer


class OrtLM:
    """An exported bdlora ONNX decoder (inputs ids/mask/positions/past K,V) under onnxruntime (no torch needed)."""

    kind = "onnx"

    def __init__(self, sess, config: dict):
        self.sess = sess
        self.config = config  # config.json as a mapping
        self.shape = DecoderShape.of(config)

    def step(self, ids, mask, pos, past):
        """Last-position logits (B, V) and the presents as onnxruntime values (IO binding): the next step's past."""
        logits, present = run_bound(self.sess, ids, mask, pos,
                                    empty_past(self.shape, ids.shape[0]) if past is None else past)
        return logits[:, -1], present

    def score(self, ids, mask, pos, past) -> np.ndarray:
        """Logits (B, n, V) of ``ids`` after the cached prefix ``past`` (left as it was: presents are new values)."""
        return run_bound(self.sess, ids, mask, pos, past)[0]

    def logits(self, ids, mask, pos, keep: int = 0) -> np.ndarray:
        out = run_decoder(self.sess, ids, mask, pos, empty_past(self.shape, ids.shape[0]))[0]
        return out[:, -keep:] if keep else out

    def nll(self, blocks: PackedBlocks, batch_size: int = 8) -> tuple[float, int]:
        nll, preds = score_blocks(self.sess, self.shape, blocks, batch_size)
        return nll, int(preds.size)


def load_eval_target(path: str | Path, onnx_file: str = MODEL_ONNX, device: str = "cpu",
                     streaming: str = DEFAULT_STREAMING):
    """(lm, tokenizer, kind, run_config or None) for a run directory, a model folder (teacher, compressed,
    exported HF) or an ONNX folder. ``run_config`` is the training options of the run the model came from.
    ``streaming`` (``models.stream.streams``): a model folder read one layer at a time (kind "torch-streamed")."""
    if str(path) in sources.PRESETS or (sources.is_gguf(str(path)) and Path(path).is_file()):
        path = sources.resolve(str(path), None, "eval")  # a teacher preset or GGUF file
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{path}: no such model folder (pass a run directory, a model folder, an ONNX folder, a "
                         f".gguf file or a preset: {', '.join(sources.PRESETS)})")
    run = RunDir(path)
    if run.started():
        from bdlora.models.load import load_run_student
        from bdlora.models.perplexity import TorchLM

        model, tok, _ = load_run_student(run, device)
        return TorchLM(model, device), tok, "run", run.data_settings()
    folder = ModelDir(path)
    provenance = folder.report().get("provenance", {}) if folder.finished() else {}
    # a run's own held-out slice, else the one its compression recorded
    run_cfg = recorded_data_settings(path, provenance)
    if run_cfg is None and (path / TEACHER_JSON).exists():
        run_cfg = {"data": BUILTIN, "teacher": BUILTIN}  # the embedded default teacher's own corpus
    if OnnxDir(path).finished() or (path / MODEL_ONNX).exists() or (path / onnx_file).exists():
        return _onnx_target(path, onnx_file, run_cfg)
    from bdlora.models import stream  # torch: only for a PyTorch folder

    if stream.streams(streaming, path):
        model, tok, _ = stream.lazy_folder_model(path)
        return stream.StreamedLM(model), tok, stream.StreamedLM.kind, run_cfg
    from bdlora.models.load import load_model_folder
    from bdlora.models.perplexity import TorchLM

    model, tok, _ = load_model_folder(path)
    return TorchLM(model.to(device), device), tok, "torch", run_cfg


def _onnx_target(path: Path, onnx_file: str, run_cfg: dict | None):
    """The graph under onnxruntime with the folder's tokenizer read by ``TextTokenizer``: no torch involved."""
    check_onnx_dir(path, onnx_file)  # graph inside the folder, config and tokenizer load, before any work
    try:
        config = json.loads((path / CONFIG).read_text())
        sess = session(path / onnx_file)
    except Exception as e:  # noqa: BLE001  a truncated/invalid graph or config is the folder's problem, not a bug
        raise ModelError(f"{path}: cannot load the ONNX model ({type(e).__name__}: {str(e).splitlines()[0][:160]})") \
            from None
    check_signature(path, DecoderShape.of(config), sess)
    return OrtLM(sess, config), TextTokenizer(path), "onnx", run_cfg
