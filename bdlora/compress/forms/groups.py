"""Pruned attention groups (``forms.GROUPS``): which key/value groups an attention block keeps (each KV head with the
``heads / kv_heads`` query heads reading it, grouped-query attention's unit), what dropping the others costs in the
allocation's units, and the narrower projections (LLM-Pruner's and Minitron's head pruning: plain smaller dense
products and a smaller KV cache, which every runtime runs with nothing new).

A query head's attention output depends on its own query, key and value rows only, so dropping a set D of groups
changes the block's output by exactly ``-W_o[:, cols(D)] a[cols(D)]`` (``a`` the o projection's input, ``cols`` the
query columns of those groups). Its error is measured as a pruned MLP's (``channels``): by the o projection's output
Fisher diagonal, summed over the calibration tokens,

    e(D) = sum_{j, l in cols(D)} C_jl M_jl,    C = A^T A (o's input Gram),  M = W_o^T diag(f) W_o,

summed here over each pair of groups' column blocks, so a group, a channel and a rank compare in one knapsack.
Groups are ranked by their own block's term; e(D) of each prefix of that order is exact (cross terms included).

The kept groups' o projection is then refitted to them (``channels.prune``'s ridge least squares on the Gram): the
kept heads' outputs are exactly the source's, only o changes. The allocation prices the drop without the refit (an
upper bound). The time a smaller cache saves inside the attention op is not priced (only the four products are):
a pruned block saves more decode time than it is priced at, the more so at long contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bdlora.compress.forms.channels import drop_products, refit_columns
from bdlora.compress.forms.channels import probe_shapes as channel_probes
from bdlora.compress.forms.pruned import PrunedBlockStep
from bdlora.compress.pricing import Cost, Option
from bdlora.forms import ATTENTION_PROJECTIONS
from bdlora.forms.context import OneShotContext
from bdlora.models.budgeted.layer import DeployedModule
from bdlora.models.costs import ModuleShape, prune_decision


@dataclass
class GroupOrder:
    """One attention block's key/value groups, least important first, and ``error[n]``: the loss-weighted error of
    dropping the first ``n`` of them (``error[0] = 0``; ``len(error) = groups + 1``); ``head_dim`` and ``ratio``
    (query heads per group) say which rows and columns a group holds."""

    order: np.ndarray
    error: np.ndarray
    head_dim: int
    ratio: int

    @property
    def groups(self) -> int:
        return len(self.order)

    def kept(self, keep: int) -> torch.Tensor:
        """The indices of the ``keep`` groups kept, ascending (the source's order)."""
        return torch.from_numpy(np.sort(self.order[self.groups - keep:]).copy())

    def rows(self, keep: int, per: int) -> torch.Tensor:
        """The rows (or o's columns) of the kept groups in a projection holding ``per`` of them per group."""
        return torch.cat([torch.arange(g * per, (g + 1) * per) for g in self.kept(keep).tolist()])


def group_order(o_proj: torch.Tensor, gram: torch.Tensor, fisher: torch.Tensor | None, kv_heads: int,
                head_dim: int) -> GroupOrder:
    """The order and prefix errors of the groups of an o projection ``o_proj`` (hidden, heads * head_dim) under its
    input Gram ``gram`` and output Fisher diagonal ``fisher`` (hidden), damped as ``channels`` damps them."""
    p = drop_products(o_proj, gram, fisher)  # C * M over o's input columns
    width = p.shape[0] // kv_heads
    blocks = p.reshape(kv_heads, width, kv_heads, width).sum(dim=(1, 3))  # (groups, groups)
    order = torch.argsort(torch.diagonal(blocks), stable=True)
    s = blocks[order][:, order].cumsum(0).cumsum(1)
    error = torch.cat([torch.zeros(1, dtype=torch.float64, device=s.device), torch.diagonal(s).clamp_min(0)])
    return GroupOrder(order.cpu().numpy(), error.cpu().numpy(), head_dim, width // head_dim)


def group_options(shapes: list[ModuleShape], order: GroupOrder, cost: Cost, multiple: int | None = None) -> \
        list[Option]:
    """(keep, cost of the four narrower dense products, error) of every kept number of groups of one attention site
    (1 to all but one; with ``multiple``, only those whose o projection's input, the kept heads times their size, is
    a multiple of it: one-shot --width-multiple)."""
    keeps = range(1, order.groups)
    if multiple is not None:  # o's input columns: the kept groups times their query heads times the head size
        keeps = [k for k in keeps if (k * order.ratio * order.head_dim) % multiple == 0]
    return [(k, sum(cost(s.grouped(k, order.groups), 0) for s in shapes), float(order.error[order.groups - k]))
            for k in keeps]


def probe_shapes(shapes: list[ModuleShape], kv_heads: int) -> list[tuple[int, int]]:
    """(K, N) of the narrower products a measured table times so that any kept number of groups interpolates
    between measurements: a quarter, a half and three quarters of the groups (at least one, fewer than all)."""
    keeps = sorted({min(kv_heads - 1, max(1, round(kv_heads * q))) for q in (0.25, 0.5, 0.75)}) if kv_heads > 1 else []
    out = []
    for s in shapes:
        if ".self_attn." in s.name:
            for k in keeps:
                g = s.grouped(k, kv_heads)
                out.append((g.in_features, g.out_features))
    return list(dict.fromkeys(out))


def site_probes(shapes: list[ModuleShape], kv_heads: int, channels: bool, groups: bool) -> list[tuple[int, int]]:
    """The narrower dense products a measured table must time for MLPs keeping fewer channels (``channels``) and
    attention blocks keeping fewer of their ``kv_heads`` groups (``groups``)."""
    return [*(channel_probes(shapes) if channels else ()), *(probe_shapes(shapes, kv_heads) if groups else ())]


@torch.no_grad()
def prune(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, gram: torch.Tensor,
          order: GroupOrder, keep: int, refit: bool = True) -> tuple[torch.Tensor, ...]:
    """(q rows, k rows, v rows, o columns) of the ``keep`` groups kept, o refitted by ridge least squares on its
    input Gram (``refit``; else its columns as they are), each in its source dtype."""
    qrows = order.rows(keep, order.ratio * order.head_dim)
    kvrows = order.rows(keep, order.head_dim)
    o_kept = refit_columns(o, gram, qrows) if refit else o[:, qrows].clone()  # o's columns are q's rows
    return q[qrows].clone(), k[kvrows].clone(), v[kvrows].clone(), o_kept


# --- the one-shot's step (``forms.context``) --------------------------------------------------------------------


class GroupsStep(PrunedBlockStep):
    """Each attention block may keep fewer key/value groups (with their query heads): its options are 1 to all but
    one group, each at its four narrower dense products' cost and the exact error of dropping the others."""

    name = "groups"
    ranked_by = "o_proj"
    ranking = "ranking every attention block's key/value groups by loss-weighted output energy"

    def pricing(self, ctx: OneShotContext) -> None:
        ctx.probes += probe_shapes(ctx.shapes, ctx.kv)

    def prunes(self, ctx: OneShotContext) -> bool:
        return ctx.kv > 1

    def order(self, ctx: OneShotContext, name: str, module) -> GroupOrder:
        hd = ctx.model.model.layers[0].self_attn.head_dim
        return group_order(module.weight, ctx.calib.gram(name), ctx.calib.fisher[name], ctx.kv, hd)

    def options(self, ctx: OneShotContext, shapes: list, order: GroupOrder) -> list[tuple[int, float, float]]:
        return group_options(shapes, order, ctx.cost, ctx.cfg.dials.width_multiple)

    def pruned(self, site: str, keep: int, mods: dict, order: GroupOrder, gram) -> dict:
        return pruned_attention(site, keep, mods, order, gram)


def pruned_attention(site: str, keep: int, mods: dict, order: GroupOrder, gram) -> dict:
    """The four projections of an attention ``site`` keeping ``keep`` key/value groups (``prune``: o refitted), as
    deployed modules with their decisions; q, k and v keep their kept rows' biases."""
    names = [f"{site}.{p}" for p in ATTENTION_PROJECTIONS]
    weights = prune(*(mods[n].weight for n in names), gram, order, keep)
    rows = {"q_proj": order.rows(keep, order.ratio * order.head_dim), "k_proj": order.rows(keep, order.head_dim),
            "v_proj": order.rows(keep, order.head_dim)}
    out = {}
    for n, w in zip(names, weights):
        m = mods[n]
        bias = None if m.bias is None else m.bias.detach().clone()
        if bias is not None and n.rsplit(".", 1)[-1] in rows:
            bias = bias[rows[n.rsplit(".", 1)[-1]]].clone()
        dec = prune_decision(ModuleShape(n, m.in_features, m.out_features), keep, has_bias=bias is not None,
                             of=order.groups)
        out[n] = DeployedModule(dec, weight=w, bias=bias)
    return out


STEP = GroupsStep()
