"""What ``compress --one-shot`` knows while the chosen forms measure, offer and deploy (``OneShotContext``), and the
protocol each allocated form's module implements (``Step``): PEFT's tuner variants' shape (each form carries its own
behaviour; the one-shot dispatches to it by name, ``compress.oneshot.step``).

The one-shot calls, for every chosen form in ``ALLOCATED_FORMS`` order:

1. ``pricing(ctx)`` before the cost table is measured: the products it must hold (``ctx.probes``) and the options
   it is asked for (``ctx.table_options``);
2. ``calibration(ctx)`` once the table exists: what the one calibration pass must measure (``ctx.calibration``);
3. ``offer(ctx)`` after calibration: its candidates at each site, typed (``Choice``: cost, error, what it does to
   the site), in ``ctx.offers``, the one thing the knapsack reads;
4. ``deploy(ctx, alloc)`` after the knapsack: the modules it builds from its own decisions (``alloc.by(name)``:
   {site: Choice}) as {projection: DeployedModule} (and the LM head, when it changes it, as {HEAD: {"spec": its
   declaration, "state": its tensors}}), and
   ``finish(ctx, alloc, deployed)`` once every form has deployed (what a form changes on others' modules, and the
   facts it records in the folder's provenance).

Standard library only: the forms' modules bring torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Choice:
    """One option a form offers at a site of the model: what it costs (the budget's unit: MACs or measured decode
    time), what it loses (the loss-weighted error, every form's on one scale), and what it does to the site's
    structure, which the allocation reports without knowing the form (``compress.allocate.Allocation``); the form
    that offered it deploys it (``Allocation.by(form)``). The site says how it competes (``compress.allocate``):

    - a projection (``model.layers.N.mlp.down_proj``): an alternative to its dense form (``rank``: a rank-r pair;
      ``bits``: the width it ships at in an int4 export);
    - a block (``model.layers.N.mlp``, ``model.layers.N.self_attn``): an alternative to its projections' own
      choices (``keep``: the channels or key/value groups it keeps);
    - a decoder layer (``model.layers.N``): an alternative to everything in it (it goes: cost 0);
    - the LM head (``forms.HEAD``): each offering form's choices, its first the head as it is, are factors of one
      product (``keep``: tokens kept; ``bits``: its width), priced as the first form's choice scaled by the others'
      cost ratios to their own first."""

    form: str
    cost: float
    error: float
    rank: int = 0
    keep: int = 0
    bits: int = 0


@dataclass
class OneShotContext:
    """One one-shot compression's state. ``names``: the forms chosen (``--forms``); ``shapes``: every projection
    (``ModuleShape``), ``mods``: {name: module}; ``config``: the model's config as a dict; ``table``: the measured
    decode-time table (None: MACs price the forms); ``offers``: every form's choices by site (``Choice``), the one
    input of the knapsack; ``state``: what a form keeps between its own stages, under its name."""

    model: Any
    cfg: Any  # OneShotConfig
    reporter: Any
    names: tuple[str, ...]
    shapes: list
    mods: dict
    kv: int
    config: dict
    table: Any = None
    calib: Any = None
    probes: list = field(default_factory=list)  # (K, N) dense products the table must measure
    table_options: dict = field(default_factory=dict)  # more of ``cost_model``'s keywords
    calibration: dict = field(default_factory=dict)  # ``calibrate``'s keywords
    offers: dict = field(default_factory=dict)  # site -> [Choice]
    state: dict = field(default_factory=dict)  # form -> what it keeps between its stages
    facts: dict = field(default_factory=dict)  # the provenance the forms record

    def offer(self, site: str, choices) -> None:
        """Add ``choices`` (``Choice``) at ``site``, after those other forms offered there."""
        self.offers.setdefault(site, []).extend(choices)

    def own(self, form: str) -> dict:
        """What form ``form`` keeps between its stages (its spectra, its candidates' orders)."""
        return self.state.setdefault(form, {})

    def has(self, name: str) -> bool:
        return name in self.names

    def cost(self, shape, rank: int) -> float:
        """A form's cost: its measured decode time, or its MACs without a table."""
        if self.table is not None:
            return self.table.cost(shape, rank)
        return float(shape.lora_cost(rank) if rank else shape.dense_cost)


class Step(Protocol):
    """An allocated form's behaviour in the one-shot (see the module docstring for when each is called).
    ``per_layer``: its ``offer`` and ``deploy`` read the projections' weights, site by site; for a source read one
    layer at a time (``compress.streamed``) each is called once per decoder layer, on a context and an allocation
    narrowed to that layer's projections and sites, while that layer's weights exist."""

    name: str
    per_layer: bool

    def pricing(self, ctx: OneShotContext) -> None: ...

    def calibration(self, ctx: OneShotContext) -> None: ...

    def offer(self, ctx: OneShotContext) -> None: ...

    def deploy(self, ctx: OneShotContext, alloc) -> dict: ...

    def finish(self, ctx: OneShotContext, alloc, deployed: dict) -> None: ...


class BaseStep:
    """A step that does nothing at every stage (a form overrides what it needs)."""

    name = ""
    per_layer = False

    def pricing(self, ctx: OneShotContext) -> None:
        return None

    def calibration(self, ctx: OneShotContext) -> None:
        return None

    def offer(self, ctx: OneShotContext) -> None:
        return None

    def deploy(self, ctx: OneShotContext, alloc) -> dict:
        return {}

    def finish(self, ctx: OneShotContext, alloc, deployed: dict) -> None:
        return None
