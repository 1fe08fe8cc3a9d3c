"""Writing a compressed model folder and registering the bdlora architectures with transformers (SPEC 8, HF part).

A folder holds: ``config.json`` (the bdlora architecture, with ``auto_map``), ``model.safetensors``,
``modeling_bdlora.py`` (so ``trust_remote_code=True`` works without bdlora), the tokenizer,
``generation_config.json``, and ``compression.json`` (the SPEC 6.4 report plus validation perplexities, and the
SHA-256 of every weight file, checked by every later reader).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import SAFE_WEIGHTS_NAME

from bdlora.base.errors import ModelError
from bdlora.base.io import atomic_dir, stream_tensors, write_json
from bdlora.base.runs import ModelDir
from bdlora.deployed.modeling_bdlora import BDLORA_CLASSES
from bdlora.forms import FORMS, describe
from bdlora.models.arch import PROJECTIONS, base_model, block_of, family_of, unsupported
from bdlora.models.integrity import DIGEST_KEY, TOKENIZER_KEY, digests, tokenizer_digests

MODELING_FILE = Path(__file__).with_name("modeling_bdlora.py")


def register() -> None:
    """Register the bdlora architectures with the Auto classes (idempotent; run when ``bdlora.deployed`` is
    imported)."""
    for cfg_cls, model_cls in BDLORA_CLASSES.values():
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)


def check_architecture(model, what: str) -> None:
    """Refuse a model outside the supported families, or one whose layers lack a projection (as ``nn.Linear`` or a
    bdlora low-rank pair)."""
    if family_of(model) is None:
        raise ModelError(unsupported(what, getattr(getattr(model, "config", None), "model_type",
                                                   type(model).__name__)))
    for i, layer in enumerate(base_model(model).model.layers):
        for name in PROJECTIONS:
            mod = getattr(getattr(layer, block_of(name)), name, None)
            if not isinstance(mod, torch.nn.Module) or _form(mod) not in FORMS:
                raise ModelError(f"{what}: layer {i} has no nn.Linear '{name}' (expected the seven projections "
                                 f"{', '.join(PROJECTIONS)})")


def saved_tensors(model) -> dict:
    """The tensors ``save_pretrained`` writes, by name, in the state dict's order: a tied tensor once (under its
    first name)."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _form(module) -> str | None:
    try:
        return describe(module)[0]
    except TypeError:
        return None


def save_model_folder(model, tokenizer, out: Path, report: dict, value=None) -> Path:
    """Write the model folder atomically: an interrupted save leaves no folder that looks complete. ``value``: the
    model's weights are on the meta device (``models.lazy``) and ``value(name, meta tensor)`` gives each when it is
    written (``saved_tensors``' names, one tensor in memory at a time); otherwise transformers writes them."""
    with atomic_dir(out) as tmp:
        if value is None:
            model.save_pretrained(tmp, safe_serialization=True)
        else:
            model.config.save_pretrained(tmp)
            if model.can_generate():
                model.generation_config.save_pretrained(tmp)
            stream_tensors(tmp / SAFE_WEIGHTS_NAME, saved_tensors(model), value, metadata={"format": "pt"})
        shutil.copy(MODELING_FILE, tmp / MODELING_FILE.name)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / ModelDir.MARKER, {**report, DIGEST_KEY: digests(tmp),  # checked by every later reader
                                           TOKENIZER_KEY: tokenizer_digests(tmp)})
    return out
