"""Budgeted LoRA's training side (paper Sec. 3.2-3.3): ``controller``, the budget schedule and the cheapest-first
controller that sets every module's retention d; ``start``, the gated student's start (calibrated low-rank paths
and their allocation). The model it trains is ``bdlora.models.budgeted``."""
