"""What ``compress --one-shot`` knows while the chosen forms measure, offer and deploy (``OneShotContext``), and the
protocol each allocated form's module implements (``Step``): PEFT's tuner variants' shape (each form carries its own
behaviour; the one-shot dispatches to it by name, ``compress.oneshot.step``).

The one-shot calls, for every chosen form in ``ALLOCATED_FORMS`` order:

1. ``pricing(ctx)`` before the cost table is measured: the products it must hold (``ctx.probes``) and the options
   it is asked for (``ctx.table_options``);
2. ``calibration(ctx)`` once the table exists: what the one calibration pass must measure (``ctx.calibration``);
3. ``offer(ctx)`` after calibration: its candidates, ordered, and what each costs and loses, put where the
   knapsack reads them (``energy``/``spectra``, ``sites``, ``layers``, ``wide``, ``head``);
4. ``deploy(ctx, alloc)`` after the knapsack: the modules it builds ({projection: DeployedModule}), and
   ``finish(ctx, alloc, deployed)`` once every form has deployed (what a form changes on others' modules, and the
   facts it records in the folder's provenance).

Standard library only: the forms' modules bring torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class OneShotContext:
    """One one-shot compression's state. ``names``: the forms chosen (``--forms``); ``shapes``: every projection
    (``ModuleShape``), ``mods``: {name: module}; ``config``: the model's config as a dict; ``table``: the measured
    decode-time table (None: MACs price the forms)."""

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
    energy: dict = field(default_factory=dict)  # projection -> per-component error (low rank)
    spectra: dict = field(default_factory=dict)
    lowrank: bool = False
    orders: dict = field(default_factory=dict)  # site -> its candidates' order (channels, groups)
    sites: dict = field(default_factory=dict)  # site -> [(keep,), cost, error] options
    layers: dict | None = None  # model.layers.N -> its removal error
    wide: dict | None = None  # projection -> (8-bit time, error given back)
    head_bits: tuple | None = None  # the LM head's (8-bit time, 4-bit time, error 4 bits add) (bits)
    head_vocab: list | None = None  # the LM head's kept vocabularies: [(keep, cost, error)] (vocab)
    head_module: dict | None = None  # what the head deploys as: {"spec": ..., "state": {...}} (vocab)
    facts: dict = field(default_factory=dict)  # the provenance the forms record

    def has(self, name: str) -> bool:
        return name in self.names

    def cost(self, shape, rank: int) -> float:
        """A form's cost: its measured decode time, or its MACs without a table."""
        if self.table is not None:
            return self.table.cost(shape, rank)
        return float(shape.lora_cost(rank) if rank else shape.dense_cost)


class Step(Protocol):
    """An allocated form's behaviour in the one-shot (see the module docstring for when each is called)."""

    name: str

    def pricing(self, ctx: OneShotContext) -> None: ...

    def calibration(self, ctx: OneShotContext) -> None: ...

    def offer(self, ctx: OneShotContext) -> None: ...

    def deploy(self, ctx: OneShotContext, alloc) -> dict: ...

    def finish(self, ctx: OneShotContext, alloc, deployed: dict) -> None: ...


class BaseStep:
    """A step that does nothing at every stage (a form overrides what it needs)."""

    name = ""

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
