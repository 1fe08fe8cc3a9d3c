"""The training methods' table: what each method implies outside its own training step (a LoRA rank, the paper's
budget and compression thresholds, the dense peer of a front). Standard library only, so every layer can ask it;
the steps themselves (wrap, save, compress) are the strategy objects of ``bdlora.train.methods``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """What a training method implies outside its own training step (``bdlora.train.methods`` holds the step, the
    student's saving and its compression): asked of this table, never spelled as ``method == "budgeted"``."""

    name: str
    low_rank: bool
    """It trains low-rank paths: it has a LoRA rank and may start them from the teacher's whitened SVD."""
    gated: bool
    """The paper's method: gated paths under the budget controller (a budget F, compress thresholds, gate factors)."""
    peer: bool
    """Its compressed student keeps the teacher's shapes with the healing merged in: the dense peer of a front."""


METHOD_TABLE = {m.name: m for m in (Method("kd-full", low_rank=False, gated=False, peer=False),
                                     Method("kd-lora", low_rank=True, gated=False, peer=True),
                                     Method("budgeted", low_rank=True, gated=True, peer=False))}
METHODS = tuple(METHOD_TABLE)
GATED = next(m.name for m in METHOD_TABLE.values() if m.gated)  # the paper's method, the default
WHOLE = next(m.name for m in METHOD_TABLE.values() if not m.low_rank)  # trains every weight: a new structure healed
ADAPTED = next(m.name for m in METHOD_TABLE.values() if m.peer)  # heals through adapters merged after: the dense peer


def method_of(name: str | None) -> Method:
    """The table's entry for a recorded or chosen method name (a one-shot or unknown name: no traits at all)."""
    return METHOD_TABLE.get(name or "", Method(str(name), low_rank=False, gated=False, peer=False))
