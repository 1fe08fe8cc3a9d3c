"""The forms a deployed projection takes, declared once (PEFT's ``tuners/lora/variants.py``: each variant one class
declaring what it stores and computes, chosen in one place). A form says how it is written in ``config.json``
(``bdlora_modules``: ``{"form": NAME, ...}``), which tensors it stores, its MACs and parameters per token, and what
makes a declaration of it inconsistent. ``costs`` (the compression rules and their report), ``integrity`` (every
folder a command reads), the metadata of both exported graphs and ``describe`` (what an exporter emits for a
module) read this registry; a folder naming a form it lacks is refused in one line naming those it has.
Standard library only (``describe`` takes a torch module without importing torch).

The PyTorch classes of the forms live in ``deployed/modeling_bdlora.py``, which ships as remote code in every model
folder and so cannot import this file; it refuses an unknown form on its own, and ``tests/test_structure.py`` holds
its ``KNOWN_FORMS`` to this registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.errors import ModelError, shown


@dataclass(frozen=True)
class Dense:
    """``y = W x + b``: the projection as trained or merged, one (out, in) weight."""

    name: str = "dense"
    module_class: str = "Linear"

    def spec(self, rank: int = 0) -> dict:
        return {"form": self.name}

    def tensors(self, module: str) -> set[str]:
        return {f"{module}.weight"}

    def macs(self, in_features: int, out_features: int, rank: int = 0) -> int:
        return in_features * out_features

    def problem(self, spec: dict, shapes: dict[str, tuple[int, ...]], module: str) -> str | None:
        return None


@dataclass(frozen=True)
class LowRank:
    """``y = B (A x) + b``: a rank-r pair (``proj_in`` (r, in), ``proj_out`` (out, r), the bias on the output)."""

    name: str = "lowrank"
    module_class: str = "LowRankLinear"

    def spec(self, rank: int = 0) -> dict:
        return {"form": self.name, "rank": int(rank)}

    def tensors(self, module: str) -> set[str]:
        return {f"{module}.proj_in.weight", f"{module}.proj_out.weight"}

    def macs(self, in_features: int, out_features: int, rank: int = 0) -> int:
        return rank * (in_features + out_features)

    def problem(self, spec: dict, shapes: dict[str, tuple[int, ...]], module: str) -> str | None:
        rank = spec.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            return f"{module} is declared lowrank with rank {shown(rank)} (a positive integer)"
        held = shapes.get(f"{module}.proj_in.weight")
        if held is not None and (len(held) != 2 or held[0] != rank):
            return f"{module} is declared lowrank with rank {rank}, but its proj_in holds {held}"
        return None


FORMS: dict[str, Dense | LowRank] = {f.name: f for f in (Dense(), LowRank())}
DENSE, LOWRANK = FORMS["dense"], FORMS["lowrank"]


def form_named(name, where: str) -> Dense | LowRank:
    """The registered form ``name``, else a one-line refusal naming ``where`` it was read and the forms there are."""
    found = FORMS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ModelError(f"{where}: unknown projection form {shown(name)} (bdlora knows {', '.join(FORMS)}); the "
                         "folder was written by a newer bdlora or edited")
    return found


def of_rank(rank: int) -> Dense | LowRank:
    """The form a projection deployed at ``rank`` takes (0: dense): what the compression rules produce."""
    return LOWRANK if rank else DENSE


def declared(spec, where: str) -> Dense | LowRank:
    """The form of one ``bdlora_modules`` entry (a JSON object with a ``form``), refused in one line otherwise."""
    if not isinstance(spec, dict):
        raise ModelError(f"{where}: {shown(spec)} is not a form declaration ({{\"form\": NAME, ...}})")
    return form_named(spec.get("form"), where)


def describe(module) -> tuple[str, int, int, int, object]:
    """(form, in features, out features, rank, bias tensor or None) of a deployed projection module, by its class
    (``module_class``); ``dense+lora`` is the bench's dense projection serving an unmerged adapter (not a form a
    folder holds). Raises TypeError for any other module."""
    cls = type(module).__name__
    if cls == LOWRANK.module_class:
        return LOWRANK.name, module.in_features, module.out_features, module.rank, module.proj_out.bias
    if cls == "DenseLoRALinear":
        base = module.base
        return "dense+lora", base.in_features, base.out_features, module.lora_rank, base.bias
    if hasattr(module, "in_features") and hasattr(module, "weight") and module.weight.dim() == 2:  # nn.Linear
        return DENSE.name, module.in_features, module.out_features, 0, module.bias
    raise TypeError(f"unsupported projection module {cls} (forms: {', '.join(FORMS)})")
