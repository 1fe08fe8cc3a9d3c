"""Each allocated form's one-shot step (``forms.context.Step``: what it offers the knapsack, what it deploys from the
choices taken), one module per form, and the one table that leads from a form's name to its step (PEFT's
``register_peft_method``: explicit, so a reader and the import graph can follow it). The registry of what the forms
are and how a folder declares them (``bdlora.forms``) stays below, standard library only, where light commands read
it; adding a form is its module here, its line in ``STEPS`` and its name in the registry's ``ALLOCATED_FORMS``."""

from __future__ import annotations

from bdlora.compress.forms import bits, channels, groups, layers, lowrank, vocab

STEPS = {step.name: step for step in (lowrank.STEP, channels.STEP, groups.STEP, layers.STEP, bits.STEP, vocab.STEP)}
