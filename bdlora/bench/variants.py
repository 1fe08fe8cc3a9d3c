"""The variants ``bdlora bench`` times, all of one architecture and exported by the same code:

    dense       every projection a dense Linear (the merged student: low-rank pairs multiplied out)
    lora        dense plus an unmerged low-rank adapter of the trained rank (how a LoRA student is served unmerged);
                its base is ``W - B A`` so its logits equal the dense variant's
    compressed  the model as compressed
    floor       (model scope only, a control) every projection at rank 1: what the rest of the model costs

plus the replaced projections alone (the modules scope: ``export_projection_stack``) and the synthetic model of a
budget.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import onnx
import torch
import torch.nn as nn

from bdlora.base.errors import ModelError, UsageError
from bdlora.deployed.modeling_bdlora import BDLORA_CLASSES, DenseLoRALinear, LowRankLinear
from bdlora.export.decoder import build_projection_stack
from bdlora.forms import DENSE, LOWRANK, describe
from bdlora.models.arch import projection_modules, set_module
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.models.costs import deployed_form
from bdlora.models.families import family as table_family
from bdlora.models.families import with_layers
from bdlora.models.lazy import empty
from bdlora.train.plan import plan


def _dense_weight(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The effective (out, in) weight and the bias of a projection of any form."""
    form, _, _, _, bias = describe(m)
    if form == LOWRANK.name:
        return m.proj_out.weight @ m.proj_in.weight, bias
    if form == DENSE.name:
        return m.weight, bias
    return m.base.weight + m.lora_B @ m.lora_A, bias  # dense+lora


@torch.no_grad()
def dense_variant(model: nn.Module) -> nn.Module:
    """Every projection as one dense Linear holding its effective weight (low-rank pairs multiplied out)."""
    out = copy.deepcopy(model)
    for name, m in projection_modules(out):
        w, b = _dense_weight(m)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device)  # meta stays meta (lazy)
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
        set_module(out, name, lin)
    return out.eval()


@torch.no_grad()
def lora_variant(model: nn.Module, rank: int, seed: int = 0) -> nn.Module:
    """Dense base plus an unmerged rank-``rank`` adapter, with base = W_eff - B A so the function is unchanged."""
    g = torch.Generator().manual_seed(seed)
    out = dense_variant(model)
    for name, m in projection_modules(out):
        a = torch.randn(rank, m.in_features, generator=g) / math.sqrt(m.in_features)
        b = torch.randn(m.out_features, rank, generator=g) * 0.01
        base = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.weight.device)
        if not m.weight.is_meta:  # a lazy model's base gets random values when emitted (bdlora.models.lazy)
            base.weight.copy_(m.weight - b @ a)
        if m.bias is not None:
            base.bias.copy_(m.bias)
        set_module(out, name, DenseLoRALinear(base, a, b))
    return out.eval()


@torch.no_grad()
def floor_variant(model: nn.Module) -> nn.Module:
    """Control: every projection at rank 1, so the projections cost ~nothing and what remains is attention, norms,
    rotary, the LM head and graph overhead."""
    out = copy.deepcopy(model)
    for name, m in projection_modules(out):
        w, b = _dense_weight(m)
        lr = LowRankLinear(w.shape[1], w.shape[0], 1, bias=b is not None)
        set_module(out, name, lr)
    return out.eval()


def export_projection_stack(model: nn.Module, path: Path) -> None:
    """The replaced projections alone (the paper's measure; ``build_projection_stack``) into ``path``."""
    onnx.save(build_projection_stack(model), str(path))


def synthetic_model(config: dict, budget: float, layers: int | None, rank: int, seed: int = 0, lazy: bool = False,
                    **plan_kw):
    """A compressed-architecture model with random weights in the structure ``plan`` predicts for F; ``lazy``: built
    without weights, which the exporter gives it one layer at a time (``bdlora.models.lazy``: what lets a 3B model's
    variants be exported on a 24 GB machine; only the genai graphs can be made of it)."""

    report = plan(config, BudgetedConfig(budget=budget, rank=rank, **plan_kw), layers=layers)
    try:
        family = table_family(config["model_type"], "--model-config: synthetic bench of model_type").model_type
    except UsageError as e:
        raise ModelError(str(e)) from None
    cfg_cls, model_cls = BDLORA_CLASSES[family]
    modules = {m["name"]: deployed_form(m["rank"]) for m in report["modules"]}
    base = {k: v for k, v in (config if layers is None else with_layers(config, layers)).items()
            if k not in ("model_type", "architectures", "auto_map")}
    torch.manual_seed(seed)
    cfg = cfg_cls(bdlora_modules=modules, bdlora={"base_model_type": family, "budget": budget}, **base)
    model = empty(lambda: model_cls(cfg)) if lazy else model_cls(cfg)
    return model.eval(), report
