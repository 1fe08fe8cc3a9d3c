"""Budget-aware gated LoRA module (paper Sec. 3.1, Eq. 1; SPEC 4):

    y = d * (W x) + b + (alpha / r_max) * B((A x) * sigmoid(gate_logits))

Like PEFT's LoRA layers, ``GatedLoRALinear`` *wraps* the frozen base ``nn.Linear`` (kept as ``base_layer``). The
dense retention ``d`` is a buffer, not a parameter: only the ``BudgetController`` sets it (``set_retention``).
When d == 0 the dense product is skipped entirely (no multiply by zero): that is where training saves compute.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bdlora.costs import PROJECTIONS

# sigmoid(3.0) = 0.953: well above the hardening threshold tau_g = 0.3, so a fresh gate keeps its rank and the
# gates start close to plain LoRA (which has g = 1). (ours; SPEC 4 asks for a documented value)
DEFAULT_GATE_INIT = 3.0


class GatedLoRALinear(nn.Module):
    """Gated LoRA around a frozen ``nn.Linear``.

    Args:
        base_layer: the dense projection (W: d_out x d_in, optional bias); frozen in place.
        rank: r_max, the number of LoRA ranks (each with its own gate).
        alpha: LoRA scaling numerator; the low-rank path is scaled by alpha / r_max.
        gate_init: initial gate logit of every rank.
    """

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, gate_init: float = DEFAULT_GATE_INIT):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.base_layer = base_layer
        for p in self.base_layer.parameters():
            p.requires_grad_(False)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        w = base_layer.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's LoRA init; B = 0 so y starts equal to W x + b
        self.gate_logits = nn.Parameter(torch.full((rank,), float(gate_init), dtype=w.dtype, device=w.device))
        self.register_buffer("retention", torch.ones((), dtype=torch.float32, device=w.device))
        self._d = 1.0  # host copy of ``retention``: the forward branches on it without a device sync

    @property
    def dense_cost(self) -> int:
        """c_m = d_in * d_out, MACs per token of the dense path (paper Sec. 3.2)."""
        return self.in_features * self.out_features

    @property
    def lora_cost(self) -> int:
        return self.rank * (self.in_features + self.out_features)

    def set_retention(self, d: float) -> None:
        d = float(d)
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"retention must be in [0, 1], got {d}")
        self._d = d
        self.retention.fill_(d)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._d = float(self.retention)

    def gates(self) -> torch.Tensor:
        return torch.sigmoid(self.gate_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., d_in)
        low = F.linear(x, self.lora_A) * torch.sigmoid(self.gate_logits)  # (..., r)
        y = F.linear(low, self.lora_B) * self.scaling  # (..., d_out)
        if self._d > 0.0:
            dense = F.linear(x, self.base_layer.weight)  # (..., d_out); skipped entirely when d == 0
            y = y + (dense if self._d == 1.0 else dense * self._d)
        if self.base_layer.bias is not None:
            y = y + self.base_layer.bias
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}, d={self._d:g}"


def apply_budgeted_lora(model: nn.Module, rank: int, alpha: float, gate_init: float = DEFAULT_GATE_INIT,
                        target_modules: tuple[str, ...] = PROJECTIONS) -> list[str]:
    """Wrap every ``nn.Linear`` whose name ends in one of ``target_modules`` (the seven projection kinds) in a
    ``GatedLoRALinear``, freeze every other parameter, and return the wrapped names in ``named_modules()`` order
    (the controller's tie-break order)."""
    for p in model.parameters():
        p.requires_grad_(False)
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in target_modules]
    if not targets:
        raise ValueError(f"no nn.Linear named {', '.join(target_modules)} in the model")
    for name, mod in targets:
        parent_name, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child, GatedLoRALinear(mod, rank, alpha, gate_init))
    return gated_module_names(model)


def gated_modules(model: nn.Module) -> dict[str, GatedLoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, GatedLoRALinear)}


def gated_module_names(model: nn.Module) -> list[str]:
    return list(gated_modules(model))
