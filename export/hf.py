"""Saving and sharing the compressed student as a Hugging Face model folder (SPEC 8, HF part).

A folder holds: ``config.json`` (the bdlora architecture, with ``auto_map``), ``model.safetensors``,
``modeling_bdlora.py`` (so ``trust_remote_code=True`` works without bdlora), the tokenizer,
``generation_config.json``, and ``compression.json`` (the SPEC 6.4 report plus validation perplexities).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bdlora.errors import ModelError
from bdlora.export.card import model_card
from bdlora.integrity import check_model_folder
from bdlora.io import atomic_dir, write_json, write_text
from bdlora.runs import ModelDir, check_out_dir

MODELING_FILE = Path(__file__).with_name("modeling_bdlora.py")


def register() -> None:
    """Register the bdlora architectures with the Auto classes (called on ``import bdlora``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bdlora.export.modeling_bdlora import FAMILIES

    for cfg_cls, model_cls in FAMILIES.values():
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)


def save_model_folder(model, tokenizer, out: Path, report: dict) -> Path:
    """Write the model folder atomically: an interrupted save leaves no folder that looks complete."""
    from bdlora.integrity import DIGEST_KEY, digests

    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copy(MODELING_FILE, tmp / MODELING_FILE.name)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / ModelDir.MARKER, {**report, DIGEST_KEY: digests(tmp)})  # checked by every later reader
    return out


def export_hf(model_dir: Path, out: Path, force: bool = False) -> Path:
    """Copy a compressed model folder into a clean, shareable folder with a generated model card."""
    src = ModelDir(model_dir)
    if not src.finished():
        raise ModelError(f"{src.path}: not a bdlora model folder (needs config.json and compression.json; "
                         "run `bdlora compress` first)")
    check_out_dir(out, force, (src.path,))
    report = src.report()
    check_model_folder(src.path, report)  # never publish a damaged folder
    with atomic_dir(out) as tmp:
        for f in sorted(src.path.iterdir()):
            if f.is_file() and not f.name.startswith("."):
                shutil.copy(f, tmp / f.name)
        write_text(tmp / "README.md", model_card(report))
    return out
