"""The Budgeted LoRA model (paper Sec. 3; SPEC 4-6), in the shape of PEFT's tuners:

- ``config``: ``BudgetedConfig``, one dataclass holding every default of the method (rank, alpha, gate init,
  retention EMA, schedule, compression thresholds); the CLI reads its defaults from here.
- ``layer``: ``GatedLoRALinear`` (the gated module of Eq. 1) and its conversion to a deployed module.
- ``model``: apply to a student, save and load the gated student, compress it to the deployed architecture.

The method's training side (the budget controller, the student's start) is ``bdlora.train.budgeted``; what a module
costs and the compression rules, ``bdlora.models.costs``."""
