"""Low-rank paths that start from the teacher's weights: the activation-aware, loss-weighted spectrum of a projection
and its factors at any rank (SVD-LLM's whitening, plus a Fisher weighting of the outputs; nothing is inverted).

For a projection W (d_out x d_in) whose inputs X (N x d_in) have the Gram matrix C = X^T X, and whose outputs carry
the Fisher diagonal f (the mean squared gradient of the next-token loss with respect to each output, ``calibrate``),
the rank-r W' that changes the loss least to second order minimises ||Phi (W - W') X^T||_F with Phi = diag(f)^1/2.
With S any square root of the damped Gram (S S^T = C + delta I) and the SVD Phi W S = U diag(s) V^T the minimiser is

    W'_r = Phi^-1 U_r U_r^T Phi W        (without Phi: SVD-LLM's [W S]_r S^-1 = U_r s_r V_r^T S^-1, the same matrix)

and it loses exactly sum_{k>r} s_k^2: one decomposition gives the error at every rank, which the allocation compares
across modules. Without f (Phi = I) it is SVD-LLM's whitened SVD; with C = I and Phi = I, the plain truncated SVD.
Measured on SmolLM2-135M (no training, 8,192 calibration tokens): the output weighting alone takes a 1.5x budget
from perplexity 44.9 to 36.2 and a 1.9x budget from 104 to 57 (README). U and s come from the eigen-decomposition of
Phi W C W^T Phi (d_out x d_out) or of (Phi W S)^T (Phi W S) (d_in x d_in), whichever is smaller, in float64. The
damping (``damping`` of C's mean diagonal, ``fisher_damping`` of f's mean) makes a rank-deficient Gram or an output
that never receives gradient harmless, and when C = 0 falls back to plain SVD. The factors are split evenly,
``B = Phi^-1 U_r s_r^1/2`` and ``A = s_r^-1/2 U_r^T Phi W`` (``B A = W'_r``), the balance LoRA training prefers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdlora.compress.pricing import RANK_STEP, mac_cost, options
from bdlora.forms import LOWRANK
from bdlora.forms.context import BaseStep, Choice, OneShotContext
from bdlora.models.budgeted.layer import DeployedModule, column_signs
from bdlora.models.costs import decide_module

DAMPING = 1e-4  # of the mean diagonal of the Gram matrix (SVD-LLM's order of magnitude)
FISHER_DAMPING = 1e-2  # of the mean Fisher diagonal: outputs the loss barely reads still count a little


@dataclass
class Spectrum:
    """The spectrum of one projection: ``energy[k]`` = s_k^2 (descending; the error of dropping component k),
    ``basis`` = U (d_out x k), and the output weights ``phi`` (d_out; ones without a Fisher weighting)."""

    energy: torch.Tensor
    basis: torch.Tensor
    phi: torch.Tensor

    @property
    def max_rank(self) -> int:
        return int(self.energy.numel())

    def error(self, rank: int) -> float:
        """The (weighted) activation energy lost by truncating to ``rank``: ||Phi (W - W_r) X^T||_F^2."""
        return float(self.energy[rank:].sum())


def damped(gram: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    gram = gram.double()
    mean = float(torch.diagonal(gram).mean())
    eye = torch.eye(gram.shape[0], dtype=torch.float64, device=gram.device)  # where the Gram is (a CUDA run's)
    return gram + (damping * mean if mean > 0 else 1.0) * eye


def gram_root(gram: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """S with S S^T = C + damping (symmetric: Q diag(lambda)^1/2 Q^T)."""
    lam, q = torch.linalg.eigh(damped(gram, damping))
    return (q * lam.clamp_min(0).sqrt()) @ q.T


def output_weights(fisher: torch.Tensor | None, d_out: int, fisher_damping: float = FISHER_DAMPING,
                   device=None) -> torch.Tensor:
    """Phi's diagonal: the square root of the damped output Fisher diagonal (ones without one, on ``device``)."""
    if fisher is None:
        return torch.ones(d_out, dtype=torch.float64, device=device)
    f = fisher.double()
    mean = float(f.mean())
    return (f + (fisher_damping * mean if mean > 0 else 1.0)).sqrt()


def spectrum(weight: torch.Tensor, gram: torch.Tensor | None, damping: float = DAMPING,
             fisher: torch.Tensor | None = None, fisher_damping: float = FISHER_DAMPING,
             root: torch.Tensor | None = None) -> Spectrum:
    """The spectrum of ``weight`` (d_out x d_in) under ``gram`` (d_in x d_in; None: plain SVD) and the output Fisher
    diagonal ``fisher`` (d_out; None: unweighted). ``root`` is ``gram_root(gram)`` when the caller has it
    (projections sharing an input share it)."""
    d_out, d_in = weight.shape
    phi = output_weights(fisher, d_out, fisher_damping, weight.device)
    w = phi[:, None] * weight.detach().double()  # Phi W
    if d_out <= d_in:  # (d_out, d_out): U directly
        m = w @ w.T if gram is None else w @ damped(gram, damping) @ w.T
        ev, u = torch.linalg.eigh(m)
        ev, u = ev.flip(0).clamp_min(0), u.flip(1)
    else:  # (d_in, d_in): right vectors, then U = Phi W S V / s
        ws = w if gram is None else w @ (root if root is not None else gram_root(gram, damping))
        ev, v = torch.linalg.eigh(ws.T @ ws)
        ev, v = ev.flip(0).clamp_min(0), v.flip(1)
        keep = int((ev > ev[0] * 1e-24).sum()) if ev[0] > 0 else 0
        ev, v = ev[:keep], v[:, :keep]
        u = (ws @ v) / ev.sqrt()
    return Spectrum(ev, u * column_signs(u), phi)  # each direction's sign fixed: the same factors on every machine


def factors(weight: torch.Tensor, spec: Spectrum, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (rank, d_in), B (d_out, rank)) in float64 with ``B A = Phi^-1 U_r U_r^T Phi W``, split evenly by s^1/2."""
    if not 1 <= rank <= spec.max_rank:
        raise ValueError(f"rank {rank}: must be in [1, {spec.max_rank}] for this projection")
    u = spec.basis[:, :rank]
    half = spec.energy[:rank].sqrt().sqrt()  # s^1/2
    half = half.clamp_min(float(half[0]) * 1e-6 if half[0] > 0 else 1e-30)
    a = (u.T @ (spec.phi[:, None] * weight.detach().double())) / half[:, None]
    return a, (u * half) / spec.phi[:, None]


# --- the one-shot's step (``forms.context``) --------------------------------------------------------------------


def factored(s, mod, r: int, spectra: dict, share: bool = False):
    """Projection ``mod`` (shape ``s``) deployed at rank ``r`` (0: dense, as it is) with its decision; ``share``: a
    dense one holds ``mod``'s own weight, not a copy (the one-shot's model is never trained: at 1B the copies of its
    dense projections were 3-4 GB)."""
    bias = None if mod.bias is None else mod.bias.detach().clone()
    dec = decide_module(s, 0.0 if r else 1.0, r, 0, has_bias=bias is not None)
    if not r:
        return DeployedModule(dec, weight=mod.weight.detach() if share else mod.weight.detach().clone(), bias=bias)
    a, b = factors(mod.weight, spectra[s.name], r)
    return DeployedModule(dec, proj_in=a.to(mod.weight.dtype), proj_out=b.to(mod.weight.dtype), bias=bias)


class LowRankStep(BaseStep):
    """Each projection may become the pair of its whitened, loss-weighted truncated SVD at a rank of the grid: its
    options are the ranks' errors (the spectrum's tail energy) at their costs."""

    name = "lowrank"
    per_layer = True

    def offer(self, ctx: OneShotContext) -> None:
        ctx.reporter.stage("whitened, loss-weighted spectra of every projection")
        roots = {}
        spectra = ctx.own(self.name)
        for s in ctx.shapes:
            gram = ctx.calib.gram(s.name)
            key, wide = ctx.calib.group(s.name), s.out_features > s.in_features
            if wide and key not in roots:  # by group, not by the tensor's id: a stored Gram is read anew each time
                roots[key] = gram_root(gram)
            root = roots[key] if wide else None
            spectra[s.name] = spectrum(ctx.mods[s.name].weight, gram, fisher=ctx.calib.fisher[s.name], root=root)
            ctx.offer(s.name, rank_choices(s, spectra[s.name].energy.cpu().numpy(), ctx.cost))

    def deploy(self, ctx: OneShotContext, alloc) -> dict:
        shapes = {s.name: s for s in ctx.shapes}
        return {n: factored(shapes[n], ctx.mods[n], c.rank, ctx.own(self.name)) for n, c in alloc.by(self.name).items()
                if not alloc.gone(n)}


def rank_choices(shape, energy, cost=mac_cost, step: int = RANK_STEP) -> list[Choice]:
    """A projection's pairs at each rank of the grid below its break-even (``allocate.options``): the spectrum's
    tail energy at the rank's cost."""
    return [Choice(LOWRANK.name, c, e, rank=r) for r, c, e in options(shape, energy, step, cost)[1:]]


def rank_offers(shapes, energy: dict, cost=mac_cost) -> dict[str, list[Choice]]:
    """Every projection's ``rank_choices`` from its spectrum's energies (``energy``: name -> per-component error):
    what the training start's quality allocation offers its knapsack."""
    return {s.name: rank_choices(s, energy[s.name], cost) for s in shapes}


STEP = LowRankStep()
