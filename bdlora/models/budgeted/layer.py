"""The budget-aware gated LoRA module (paper Sec. 3.1, Eq. 1; SPEC 4) and its deployment forms (Sec. 3.3; SPEC 6):

    y = d * (W x) + b + (alpha / r_max) * B((A x) * sigmoid(gate_logits))

Like PEFT's LoRA layers, ``GatedLoRALinear`` *wraps* the frozen base ``nn.Linear`` (kept as ``base_layer``). The
dense retention ``d`` is a buffer, not a parameter: only the ``BudgetController`` sets it (``set_retention``). When
d == 0 the dense product is skipped entirely (no multiply by zero): that is where training saves compute.

``to_deployed`` turns a trained module into what ships: hardened gates folded into the factors, then by d the dense
path dropped (a low-rank pair), SVD-approximated and fused with the LoRA pair, or merged into one dense Linear.
SVDs and merges run in float64 and are cast back to the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bdlora.deployed.modeling_bdlora import LowRankLinear
from bdlora.models.budgeted.config import DEFAULTS, BudgetedConfig
from bdlora.models.costs import ModuleDecision, ModuleShape, decide_module


class GatedLoRALinear(nn.Module):
    """Gated LoRA around a frozen ``nn.Linear``.

    Args:
        base_layer: the dense projection (W: d_out x d_in, optional bias); frozen in place.
        rank: r_max, the number of LoRA ranks (each with its own gate).
        alpha: LoRA scaling numerator; the low-rank path is scaled by alpha / r_max.
        gate_init: initial gate logit of every rank.
    """

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, gate_init: float = DEFAULTS.gate_init):
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
    def d(self) -> float:
        """The dense retention d in [0, 1] (set by the controller through ``set_retention``)."""
        return self._d

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

    @torch.no_grad()
    def start_from(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Start the low-rank path at ``B A`` (``a`` (r, d_in), ``b`` (d_out, r), e.g. the whitened factors of W)
        and let the frozen dense path hold the residual ``W - B A``: the module computes W x + b exactly as before
        (at d = 1), and as d falls to 0 it becomes the rank-r pair the factors describe. The gates and the
        alpha / r scale are divided out of B, so the path equals ``B A`` at the gates' initial values."""
        if a.shape != self.lora_A.shape or b.shape != self.lora_B.shape:
            raise ValueError(f"factors {tuple(a.shape)} / {tuple(b.shape)} for a module of rank {self.rank}, "
                             f"{self.in_features} -> {self.out_features}")
        g = torch.sigmoid(self.gate_logits.double())
        self.lora_A.copy_(a)
        self.lora_B.copy_(b.to(g.device).double() / (self.scaling * g))  # factors made on the CPU, a CUDA student
        self.base_layer.weight.copy_(self.base_layer.weight.double() - self.low_rank_weight())

    def low_rank_weight(self) -> torch.Tensor:
        """(d_out, d_in) float64: what the low-rank path adds, ``(alpha / r) B diag(g) A``, from the stored
        factors."""
        g = torch.sigmoid(self.gate_logits.detach().double())
        return (self.scaling * self.lora_B.detach().double() * g) @ self.lora_A.detach().double()

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

    # -- deployment (SPEC 6) ---------------------------------------------------------------------------------------

    def hardened(self, gate_threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(A', B') in float64: ranks with sigmoid(gate) >= tau_g (at least the largest gate) kept, gates and the
        scale folded into B: ``B' = (alpha / r_max) B[:, kept] diag(g[kept])``, ``A' = A[kept]`` (SPEC 6.1)."""
        g = torch.sigmoid(self.gate_logits.detach().double())  # (r,)
        kept = torch.nonzero(g >= gate_threshold).flatten()
        if kept.numel() == 0:
            kept = torch.argmax(g).reshape(1)
        a = self.lora_A.detach().double()[kept]  # (r', d_in)
        b = self.scaling * self.lora_B.detach().double()[:, kept] * g[kept]  # (d_out, r')
        return a, b

    def to_deployed(self, name: str, cfg: BudgetedConfig = DEFAULTS) -> DeployedModule:
        """The module's deployment form by its final d (SPEC 6.2-6.3): dropped, SVD-fused or merged."""
        d = self._d
        a, b = self.hardened(cfg.gate_threshold)
        bias = self.base_layer.bias
        dec = decide_module(ModuleShape(name, self.in_features, self.out_features), d, a.shape[0], self.rank, cfg,
                            bias is not None)
        dtype = self.base_layer.weight.dtype
        bias = None if bias is None else bias.detach().clone()
        w = self.base_layer.weight.detach().double()
        if dec.case == "dropped":
            return DeployedModule(dec, proj_in=a.to(dtype), proj_out=b.to(dtype), bias=bias)
        if dec.case == "svd":
            first, second = fused_svd_pair(d * w, a, b, dec.svd_rank)
            return DeployedModule(dec, proj_in=first.to(dtype), proj_out=second.to(dtype), bias=bias)
        # kept, or merged-cheaper: the exact merge d W + B' A'
        return DeployedModule(dec, weight=(d * w + b @ a).to(dtype), bias=bias)


def column_signs(u: torch.Tensor) -> torch.Tensor:
    """+1/-1 per column of ``u`` making each column's entry of largest magnitude positive (scikit-learn's
    ``svd_flip``). A singular or eigenvector is unique only up to its sign, and which sign LAPACK returns differs
    between BLAS code paths (machines with and without AVX-512 gave the same one-shot opposite factors): multiplying a
    basis and its partner by these makes the factors one machine writes the factors every machine writes, wherever the
    spectrum is not degenerate. The product of the factors does not change."""
    if u.numel() == 0:
        return torch.ones(u.shape[-1], dtype=u.dtype, device=u.device)
    peak = u.gather(0, u.abs().argmax(0, keepdim=True))[0]
    return torch.where(peak < 0, -1.0, 1.0).to(u.dtype)


def fused_svd_pair(dw: torch.Tensor, a: torch.Tensor, b: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Case 2: ``d W ~= U_k V_k`` (singular values folded into U_k), fused with the hardened LoRA pair into one
    low-rank pair: first factor ``[V_k; A']`` (k + r', d_in), second ``[U_k, B']`` (d_out, k + r'); each singular
    pair's sign fixed (``column_signs``)."""
    u, s, vh = torch.linalg.svd(dw, full_matrices=False)
    u, s, vh = u[:, :k], s[:k], vh[:k]
    signs = column_signs(u)  # (k,)
    return torch.cat([vh * signs[:, None], a]), torch.cat([u * (s * signs), b], 1)


@dataclass
class DeployedModule:
    """What a projection becomes: a dense weight, or a low-rank pair (``proj_in`` (r, d_in), ``proj_out``
    (d_out, r)); the bias, if any, stays on the output side."""

    decision: ModuleDecision
    weight: torch.Tensor | None = None  # dense: (d_out, d_in)
    proj_in: torch.Tensor | None = None  # low-rank: (r, d_in)
    proj_out: torch.Tensor | None = None  # low-rank: (d_out, r)
    bias: torch.Tensor | None = None

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors of this module in the bdlora architecture's state dict."""
        if self.weight is not None:
            out = {f"{name}.weight": self.weight}
            bias_key = f"{name}.bias"
        else:
            out = {f"{name}.proj_in.weight": self.proj_in, f"{name}.proj_out.weight": self.proj_out}
            bias_key = f"{name}.proj_out.bias"
        if self.bias is not None:
            out[bias_key] = self.bias
        return out

    def module(self) -> nn.Module:
        """A standalone torch module computing the deployed form (tests compare it with the training module)."""

        dec = self.decision
        if self.weight is not None:  # its own shape: a pruned MLP's projection is narrower than the decision's
            mod = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None)
        else:
            mod = LowRankLinear(dec.in_features, dec.out_features, dec.rank, bias=self.bias is not None)
        mod.load_state_dict({k.split(".", 1)[1]: v for k, v in self.state("m").items()})
        return mod
