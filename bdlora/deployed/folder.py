"""Writing a compressed model folder and registering the bdlora architectures with transformers (SPEC 8, HF part).

A folder holds: ``config.json`` (the bdlora architecture, with ``auto_map``), ``model.safetensors``,
``modeling_bdlora.py`` (so ``trust_remote_code=True`` works without bdlora), the tokenizer,
``generation_config.json``, and ``compression.json`` (the SPEC 6.4 report plus validation perplexities, and the
SHA-256 of every weight file, checked by every later reader).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from bdlora.deployed.modeling_bdlora import FAMILIES
from bdlora.integrity import DIGEST_KEY, digests
from bdlora.io import atomic_dir, write_json
from bdlora.runs import ModelDir

MODELING_FILE = Path(__file__).with_name("modeling_bdlora.py")


def register() -> None:
    """Register the bdlora architectures with the Auto classes (run when transformers is imported)."""

    # not at module level: this runs inside the hook that fires while transformers finishes importing, and
    # modeling_bdlora imports transformers itself (see bdlora/deployed/__init__.py)

    for cfg_cls, model_cls in FAMILIES.values():
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)


def save_model_folder(model, tokenizer, out: Path, report: dict) -> Path:
    """Write the model folder atomically: an interrupted save leaves no folder that looks complete."""
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copy(MODELING_FILE, tmp / MODELING_FILE.name)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / ModelDir.MARKER, {**report, DIGEST_KEY: digests(tmp)})  # checked by every later reader
    return out
