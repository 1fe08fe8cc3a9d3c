"""The KV-cache argument of a transformers forward, on every supported release.

transformers 5.24 renamed a causal LM's ``past_key_values`` (forward argument and output field) to ``cache``: the
old argument still works but warns on every call (FutureWarning, "will be removed in version 5.40.0"), which a
``bdlora eval`` showed its users. 4.57, which the ``[optimum]`` extra resolves, knows only ``past_key_values``. The
name is read from the model's own forward signature (transformers' deprecation decorator keeps the wrapped
signature), so each release gets the argument it declares.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect

import torch.nn as nn
from packaging.version import Version

RENAMED_IN = Version("5.24")  # the first transformers release whose forward takes ``cache``


@functools.cache
def _argument(forward) -> str:
    params = inspect.signature(forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    # a wrapper taking **kwargs (PEFT's PeftModelForCausalLM) hands them to a model of the installed release
    installed = Version(importlib.metadata.version("transformers"))
    return "cache" if installed >= RENAMED_IN else "past_key_values"


def cache_argument(model: nn.Module) -> str:
    """``"cache"`` or ``"past_key_values"``: the name ``model``'s forward takes its KV cache by."""
    return _argument(type(model).forward)


def returned_cache(out):
    """The KV cache a forward returned (``out.cache`` from 5.24 on, ``out.past_key_values`` before)."""
    found = getattr(out, "cache", None)
    return found if found is not None else out.past_key_values
