"""PEFT entry points used by the KD-LoRA baseline, quiet on every supported transformers.

peft (0.17-0.21) reads ``model.is_gradient_checkpointing`` when it wraps or loads a model; transformers 5 renamed the
property ``is_activation_checkpointing`` and warns (FutureWarning) on every read of the old name. The read is
harmless and not ours to change, so exactly that message is silenced around the two calls; any other warning passes.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

_RENAMED = r"`is_gradient_checkpointing` is deprecated"


@contextmanager
def _peft_reads_renamed_property():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_RENAMED, category=FutureWarning)
        yield


def wrap_lora(model, config=None, **settings):
    """``peft.get_peft_model(model, config)``; without ``config``, a ``peft.LoraConfig`` of ``settings`` (so peft is
    imported only when a model is wrapped, not by every command that imports the training methods)."""
    from peft import LoraConfig, get_peft_model

    with _peft_reads_renamed_property():
        return get_peft_model(model, config if config is not None else LoraConfig(**settings))


def load_adapter(model, adapter_dir: str):
    """``peft.PeftModel.from_pretrained(model, adapter_dir)``."""
    from peft import PeftModel

    with _peft_reads_renamed_property():
        return PeftModel.from_pretrained(model, adapter_dir)
