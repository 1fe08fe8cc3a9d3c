"""Issues 77 and 90: adding an allocated form touches only its own module, the registry line and the table line. A
toy form, ``halves`` (an up projection may ship as its own weight halved, priced at half its MACs: meaningless as
compression, a probe of the plumbing), is added here as a module (the class below), its name in the registry and its
step in the one table of steps (``compress.forms.STEPS``); the one-shot's structure offers its choices to the one
knapsack, which takes them without knowing the form, and the form deploys what was chosen from its own decisions.
Nothing else in compress/ names it."""

from __future__ import annotations

import numpy as np
import torch

from bdlora import forms as registry
from bdlora.compress.config import OneShotConfig
from bdlora.compress.forms import STEPS
from bdlora.compress.forms.lowrank import factored
from bdlora.compress.oneshot import one_shot_structure
from bdlora.data.blocks import PackedBlocks
from bdlora.forms.context import BaseStep, Choice
from bdlora.forms.dials import Dials

TOY = "halves"


class HalvesStep(BaseStep):
    """Every up projection may ship halved, at half its cost, at an error that grows with its layer (so the knapsack
    takes the cheapest-error ones first)."""

    name = TOY

    def offer(self, ctx) -> None:
        for i, s in enumerate(s for s in ctx.shapes if s.name.endswith("up_proj")):
            ctx.offer(s.name, [Choice(self.name, ctx.cost(s, 0) / 2, 1e-6 * (i + 1))])

    def deploy(self, ctx, alloc) -> dict:
        shapes = {s.name: s for s in ctx.shapes}
        out = {}
        for name in alloc.by(self.name):
            dep = factored(shapes[name], ctx.mods[name], 0, {})  # the projection dense, as it is
            dep.weight = dep.weight * 0.5
            out[name] = dep
        return out


def test_a_toy_form_touches_only_its_module_the_registry_line_and_the_table_line(tiny_model, monkeypatch):
    monkeypatch.setattr(registry, "ALLOCATED_FORMS", (*registry.ALLOCATED_FORMS, TOY))  # the registry line
    monkeypatch.setitem(STEPS, TOY, HalvesStep())  # the table line (its module: the class above)

    layers = tiny_model.config.num_hidden_layers
    ups = [f"model.layers.{i}.mlp.up_proj" for i in range(layers)]
    macs = {n: m.in_features * m.out_features for n, m in tiny_model.named_modules() if n.endswith("_proj")}
    total = sum(macs.values())
    # more than one halving's saving and less than two's: the two up projections of least error go (no other form)
    ratio = total / (total - 0.75 * macs[ups[0]])
    cfg = OneShotConfig(dials=Dials(mac_ratio=ratio, forms=TOY), calib_tokens=256).validate()
    tokens = np.random.default_rng(0).integers(0, tiny_model.config.vocab_size, 4096)
    shot = one_shot_structure(tiny_model, PackedBlocks(tokens, 32), cfg)
    decisions, deployed, alloc = shot.decisions, shot.deployed, shot.allocation

    assert set(alloc.by(TOY)) == set(ups[:2]) and all(c.form == TOY for c in alloc.by(TOY).values())
    assert alloc.errors[ups[0]] == 1e-6 and not any(alloc.ranks.values()) and alloc.order == []
    mods = dict(tiny_model.named_modules())
    for name in ups[:2]:
        torch.testing.assert_close(deployed[name].weight, mods[name].weight.detach() * 0.5)
    for name in ups[2:]:
        torch.testing.assert_close(deployed[name].weight, mods[name].weight.detach())
    assert len(decisions) == len(macs)
