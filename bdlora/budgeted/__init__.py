"""Budgeted LoRA (paper Sec. 3; SPEC 4-6), in the shape of PEFT's tuners:

- ``config``: ``BudgetedConfig``, one dataclass holding every default of the method (rank, alpha, gate init,
  retention EMA, schedule, compression thresholds); the CLI reads its defaults from here.
- ``layer``: ``GatedLoRALinear`` (the gated module of Eq. 1) and its conversion to a deployed module.
- ``controller``: the budget schedule and the cheapest-first controller that sets every module's retention d.
- ``costs``: shapes, MAC costs, the training-compute proxy and the compression rules with their report.
- ``model``: apply to a student, save and load the gated student, compress it to the deployed architecture.
"""
