"""Synthetic models whose weights exist one block at a time.

A synthetic model (``bench --model-config``, the whole-step probes of ``bench.whole``) has random weights: speed does
not depend on their values. At Llama-3.2-3B shapes its fp32 weights take 12.8 GB, and the bench holds three variants
of it (dense, LoRA, compressed) while the exporter holds the graph it is emitting: more than a 24 GB machine has.
Built by ``empty`` (accelerate's ``init_empty_weights``: parameters on the meta device, buffers such as the rotary
tables real), such a model holds no weight; the exporter wraps each part it emits in ``materialized``, which gives
that part's parameters seeded random values for the emission and puts them back on the meta device after, so no
more than one decoder layer, or the embedding, or the head, exists in PyTorch at a time.

The values: every parameter of two or more dimensions N(0, 0.02) (the families' own initialisation), every vector
(norm weights, biases) ones, each from a generator seeded by the parameter's qualified name, so the same model
emitted twice, or in pieces, gets the same weights (``materialized`` of the whole model gives what the pieces give).
Parameters already real (a LoRA variant's small adapter factors) are left as they are.

A model read from a folder too large to hold in fp32 (``bdlora.models.stream``) is built the same way with a
``SOURCE`` attribute: ``materialized`` then gives each parameter its value from the folder's weight files (read
as stored, bf16 kept until that part is made, then fp32) instead of a random one.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager

import torch
import torch.nn as nn
from accelerate import init_empty_weights

INIT_STD = 0.02
SOURCE = "bdlora_source"  # a model attribute: the callable (name, meta parameter) -> fp32 value of a folder's weights


def empty(build):
    """``build()``'s model with every parameter on the meta device (its buffers real): no weight memory."""
    with init_empty_weights(include_buffers=False):
        model = build()
    if hasattr(model, "tie_weights"):  # tied inside the context, the head got a meta parameter of its own
        model.tie_weights()
    return model


def is_lazy(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def random_like(p: torch.Tensor, key: str, seed: int = 0) -> torch.Tensor:
    """The value ``materialized`` gives the parameter named ``key`` (its shape, fp32)."""
    if p.dim() < 2:
        return torch.ones(p.shape)
    g = torch.Generator().manual_seed((zlib.crc32(key.encode()) + 1_000_003 * seed) % (1 << 63))
    return torch.empty(p.shape).normal_(0.0, INIT_STD, generator=g)


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") or p == "" for p in prefixes)


@contextmanager
def materialized(model: nn.Module, within: str | tuple = "", skip: str | tuple = (), seed: int = 0):
    """The meta parameters of ``model``'s modules named ``within`` or below them (all by default), less those under
    ``skip``, as seeded random values inside the block and on the meta device again after it. Each is keyed by its
    first name in ``model``, so a parameter gets the same values whichever part is made (a tied head made alone is
    the embedding's values) and a parameter shared by two modules stays shared while made. A model with a ``SOURCE``
    gets each value from it (its weight files) instead."""
    within = (within,) if isinstance(within, str) else within
    skip = (skip,) if isinstance(skip, str) else skip
    value = getattr(model, SOURCE, None) or (lambda name, p: random_like(p, name, seed))
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    made: dict[int, nn.Parameter] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for mod_name, m in model.named_modules(remove_duplicate=False):
        if not _under(mod_name, within) or (skip and _under(mod_name, skip)):
            continue
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(value(names[id(p)], p), requires_grad=False)
            m._parameters[name] = made[id(p)]
            swapped.append((m, name, p))
    try:
        yield model
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p
