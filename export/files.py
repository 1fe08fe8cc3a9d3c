"""What every exported folder (ONNX, genai) holds beside its graph, written by one function, so ``eval``, ``serve``
and ``bench`` read either kind the same way."""

from __future__ import annotations

from pathlib import Path

from bdlora.base.io import sha256, write_json
from bdlora.base.runs import CONFIG, ModelDir
from bdlora.models.integrity import CONFIG_KEY, TOKENIZER_KEY, tokenizer_digests


def write_model_files(folder: Path, model, tokenizer, report: dict | None) -> None:
    """config.json (+ generation_config.json), the tokenizer's files and, for a compressed model, its report
    (compression.json) into ``folder``."""
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if report is not None:
        write_json(folder / ModelDir.MARKER, report)


def identity(folder: Path) -> dict:
    """What export.json records of the folder's own files, checked by every reader (``runtime.check_onnx_dir``):
    the SHA-256 of the tokenizer files it was validated with, and of config.json (the graph's shapes are fixed at
    export: an edited groups declaration served every completion a 500)."""
    return {TOKENIZER_KEY: tokenizer_digests(folder), CONFIG_KEY: sha256(folder / CONFIG)}
