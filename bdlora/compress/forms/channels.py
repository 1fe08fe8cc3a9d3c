"""Pruned MLP channels (``forms.CHANNELS``): which intermediate channels a gated MLP keeps, what dropping the others
costs in the allocation's units, and the narrower projections (Minitron's width pruning, SliceGPT's deleted columns:
plain smaller dense products that every runtime runs at full speed).

The error of dropping a set D of channels is measured as the low-rank error is (``lowrank``): the down projection's
output change ``W_D h_D`` weighted by its output Fisher diagonal, summed over the calibration tokens,

    e(D) = sum_{j, l in D} C_jl M_jl,    C = H^T H (down's input Gram),  M = W^T diag(f) W,

so a channel and a rank compare in one knapsack. Channels are ranked by their own term ``C_jj M_jj`` (activation
energy times loss-weighted column norm: Wanda's score with the Fisher in place of a unit output weight); e(D) of
each prefix of that order is exact (cross terms included), from two cumulative sums of the permuted ``C * M``.

The kept channels' down projection is then refitted to them: ``W' = (W C_{:,S} + delta W_S) (C_SS + delta I)^-1``,
the least squares fit of the MLP's output on the calibration inputs with a ridge towards the source's own columns
(each output row's fit is independent of its Fisher weight, so one solve serves all). Gate and up rows of the kept
channels are unchanged, so their outputs are exactly the source's; only down changes. The allocation prices the
drop without the refit (an upper bound).

Why multiples of ``CHANNEL_STEP``: the down projection's K is the kept width, and MatMulNBits quantises its input in
blocks of 32; a width that is not a multiple pads its last block (work for nothing) and the int4 kernels run whole
blocks. The grid runs from 32 to the full width less 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bdlora.compress.forms.lowrank import damped, output_weights
from bdlora.compress.forms.pruned import PrunedBlockStep
from bdlora.compress.pricing import Cost, Option
from bdlora.forms import MLP_PROJECTIONS, WIDTH_MULTIPLE
from bdlora.forms.context import OneShotContext
from bdlora.models.budgeted.layer import DeployedModule
from bdlora.models.costs import ModuleShape, prune_decision

CHANNEL_STEP = WIDTH_MULTIPLE  # kept widths are multiples of the int4 block (MatMulNBits' block size along K), or
# of one-shot's --width-multiple (256: llama.cpp's K-quant rows)
REFIT_DAMPING = 1e-2  # of the kept channels' mean Gram diagonal (GPTQ's percdamp): a ridge on the refit


@dataclass
class ChannelOrder:
    """One MLP's channels, least important first, and ``error[n]``: the loss-weighted error of dropping the first
    ``n`` of them (``error[0] = 0``; ``len(error) = width + 1``)."""

    order: np.ndarray
    error: np.ndarray

    @property
    def width(self) -> int:
        return len(self.order)

    def kept(self, keep: int) -> torch.Tensor:
        """The indices of the ``keep`` channels kept, ascending (the source's order)."""
        return torch.from_numpy(np.sort(self.order[self.width - keep:]).copy())


def drop_products(w: torch.Tensor, gram: torch.Tensor, fisher: torch.Tensor | None) -> torch.Tensor:
    """``C * M`` (elementwise) over the input columns of a projection ``w`` (out, in): ``C`` its damped input Gram,
    ``M = W^T diag(f) W`` with ``f`` its output Fisher diagonal damped as ``lowrank.spectrum`` damps it (ones when
    unmeasured). Dropping a set D of input columns costs ``sum_{j, l in D}`` of it (positive semi-definite)."""
    w = w.detach().double()
    phi2 = output_weights(fisher, w.shape[0], device=w.device) ** 2
    return damped(gram) * (w.T @ (phi2[:, None] * w))


def channel_order(down: torch.Tensor, gram: torch.Tensor, fisher: torch.Tensor | None) -> ChannelOrder:
    """The order and prefix errors of a down projection ``down`` (hidden, width) under its input Gram ``gram``
    (width, width) and output Fisher diagonal ``fisher`` (hidden), damped as ``lowrank.spectrum`` damps them."""
    p = drop_products(down, gram, fisher)
    order = torch.argsort(torch.diagonal(p), stable=True)
    s = p[order][:, order].cumsum(0).cumsum(1)
    error = torch.cat([torch.zeros(1, dtype=torch.float64, device=s.device), torch.diagonal(s).clamp_min(0)])
    return ChannelOrder(order.cpu().numpy(), error.cpu().numpy())


def keep_grid(width: int, step: int = CHANNEL_STEP) -> list[int]:
    """The kept widths the allocation may choose: multiples of ``step`` below ``width``."""
    return list(range(step, width, step))


def site_options(shapes: list[ModuleShape], order: ChannelOrder, cost: Cost, step: int = CHANNEL_STEP) -> list[Option]:
    """(keep, cost of the three narrower dense products, error) of every kept width of one MLP site (multiples of
    ``step``)."""
    return [(k, sum(cost(s.narrowed(k), 0) for s in shapes), float(order.error[order.width - k]))
            for k in keep_grid(order.width, step)]


def probe_shapes(shapes: list[ModuleShape], step: int = CHANNEL_STEP) -> list[tuple[int, int]]:
    """(K, N) of the narrower dense products a measured table times so that any kept width interpolates between
    measurements: a quarter, a half and three quarters of each MLP's width, on the channel grid (``step``)."""
    out = []
    for s in shapes:
        if s.name.endswith("down_proj"):
            width, hidden = s.in_features, s.out_features
            for q in (4, 2, 4 / 3):
                k = max(step, int(width / q) // step * step)
                out += [(hidden, k), (k, hidden)]
    return list(dict.fromkeys(out))


@torch.no_grad()
def prune(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gram: torch.Tensor, kept: torch.Tensor,
          refit: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate rows, up rows, down columns) of the ``kept`` channels, down refitted by ridge least squares on the
    calibration Gram (``refit``; else its columns as they are), each in its source dtype."""
    return gate[kept].clone(), up[kept].clone(), refit_columns(down, gram, kept) if refit else down[:, kept].clone()


@torch.no_grad()
def refit_columns(w: torch.Tensor, gram: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The ``kept`` input columns of projection ``w`` (out, in) refitted to them: ridge least squares of its output
    on the calibration inputs (``gram``), towards its own columns, in its dtype."""
    c, w64 = gram.double(), w.double()
    css = c[kept][:, kept]
    delta = REFIT_DAMPING * float(torch.diagonal(css).mean().clamp_min(1e-12))
    css = css + delta * torch.eye(len(kept), dtype=torch.float64, device=css.device)
    rhs = c[kept] @ w64.T + delta * w64[:, kept].T  # (keep, out): C_{S,:} W^T + delta W_S^T
    return torch.linalg.solve(css, rhs).T.to(w.dtype).contiguous()


# --- the one-shot's step (``forms.context``) --------------------------------------------------------------------


class ChannelsStep(PrunedBlockStep):
    """Each MLP may keep fewer intermediate channels: its options are the kept widths of the channel grid, each at
    its three narrower dense products' cost and the exact error of dropping the least important channels."""

    name = "channels"
    ranked_by = "down_proj"
    ranking = "ranking every MLP's channels by loss-weighted activation energy"

    def pricing(self, ctx: OneShotContext) -> None:
        ctx.probes += probe_shapes(ctx.shapes, ctx.cfg.dials.widths)

    def order(self, ctx: OneShotContext, name: str, module) -> ChannelOrder:
        return channel_order(module.weight, ctx.calib.gram(name), ctx.calib.fisher[name])

    def options(self, ctx: OneShotContext, shapes: list, order: ChannelOrder) -> list[tuple[int, float, float]]:
        return site_options(shapes, order, ctx.cost, ctx.cfg.dials.widths)

    def pruned(self, site: str, keep: int, mods: dict, order: ChannelOrder, gram) -> dict:
        return pruned_site(site, keep, mods, order, gram)


def pruned_site(site: str, keep: int, mods: dict, order: ChannelOrder, gram) -> dict:
    """The three projections of an MLP ``site`` keeping ``keep`` channels (``prune``: down refitted), as deployed
    modules with their decisions."""
    names = [f"{site}.{p}" for p in MLP_PROJECTIONS]
    kept = order.kept(keep)
    weights = prune(*(mods[n].weight for n in names), gram, kept)
    out = {}
    for n, w in zip(names, weights):
        m = mods[n]
        bias = None if m.bias is None else m.bias.detach().clone()
        if bias is not None and not n.endswith("down_proj"):
            bias = bias[kept].clone()
        dec = prune_decision(ModuleShape(n, m.in_features, m.out_features), keep, has_bias=bias is not None)
        out[n] = DeployedModule(dec, weight=w, bias=bias)
    return out


STEP = ChannelsStep()
