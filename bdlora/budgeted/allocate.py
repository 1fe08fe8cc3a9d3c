"""Where a MAC budget hurts least: per-module ranks, and which projections stay dense, chosen from a measured quality
cost (``--allocation quality``) instead of the paper's cheapest-first order (``--allocation cost``).

Each projection may stay dense (d_in d_out MACs per token) or become a rank-r pair (r (d_in + d_out) MACs), r a
rank of ``rank_grid`` (1, 2, 4, then multiples of ``RANK_STEP``) below the break-even rank (a pair at or above it
would not be faster: SPEC 6.3). Its cost at rank r is the *loss-weighted truncation error* of its spectrum
(``lowrank``): the activation energy it loses with every output weighted by its Fisher diagonal (the mean squared
gradient of the next-token loss, measured on the calibration tokens), so errors compare in the loss's own units
across modules and layers. The raw activation energy does not (SmolLM2's late layers carry 100x larger activations
without mattering 100x more): allocated by it, a 1.5x budget measured perplexity 461; by the Fisher-weighted error
44.9; with one uniform rank 116 (SmolLM2-135M, no training, whitened factors without the output weighting; README).

The allocation is the exact solution of that knapsack (least total error under the MAC budget, by dynamic programming
over the budget); the modules it takes out of their dense form, ordered by error per MAC saved, give the removal
order the budget controller walks during training (``BudgetController(scores=...)``). Pure numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bdlora.budgeted.costs import ModuleShape
from bdlora.errors import UsageError

RANK_STEP = 8  # ranks above 8 are multiples of 8 (GEMM kernels run them at full speed; the search stays small)


def break_even(shape: ModuleShape) -> int:
    """The smallest rank whose pair costs at least the dense product (SPEC 6.3's "never slower than dense")."""
    i, o = shape.in_features, shape.out_features
    return -(-i * o // (i + o))


def rank_grid(limit: int, step: int = RANK_STEP) -> list[int]:
    """Candidate ranks below ``limit``: 1, 2, 4, ... up to ``step``, then multiples of ``step``."""
    small = [1 << k for k in range(step.bit_length()) if (1 << k) < step]
    return [r for r in small + list(range(step, limit, step)) if r < limit]


Cost = Callable[[ModuleShape, int], float]  # (module, rank; 0 = dense) -> what the budget counts


def mac_cost(shape: ModuleShape, rank: int) -> float:
    return float(shape.lora_cost(rank) if rank else shape.dense_cost)


def options(shape: ModuleShape, energy: np.ndarray, step: int = RANK_STEP,
            cost: Cost = mac_cost) -> list[tuple[int, float, float]]:
    """(rank, cost, error) of every form of one module: dense (rank 0, error 0) and each rank of ``rank_grid``
    below break-even, within the spectrum and cheaper than dense by ``cost`` (with a measured cost a pair may not pay
    at any rank: the module then stays dense); ``energy`` is the per-component error (descending importance)."""
    w = np.clip(np.asarray(energy, dtype=np.float64), 0.0, None)
    tail = np.concatenate([np.cumsum(w[::-1])[::-1], [0.0]])  # tail[r] = error at rank r
    dense = cost(shape, 0)
    out = [(0, dense, 0.0)]
    for r in rank_grid(min(break_even(shape), len(w) + 1), step):
        c = cost(shape, r)
        if c < dense:
            out.append((r, c, float(tail[r])))
    return out


@dataclass
class Allocation:
    """Per-module ranks (0: stays dense), the order modules leave their dense form in (the controller's removal
    score: position in ``order``), and the predicted error of each chosen form."""

    ranks: dict[str, int]
    order: list[str]
    errors: dict[str, float] = field(default_factory=dict)

    def macs(self, shapes: list[ModuleShape]) -> int:
        return sum(s.lora_cost(self.ranks[s.name]) if self.ranks.get(s.name) else s.dense_cost for s in shapes)

    def mac_ratio(self, shapes: list[ModuleShape]) -> float:
        return sum(s.dense_cost for s in shapes) / self.macs(shapes)

    def cost_ratio(self, shapes: list[ModuleShape], cost: Cost) -> float:
        """The projections' speed-up by ``cost`` (dense total over the chosen forms' total)."""
        return sum(cost(s, 0) for s in shapes) / sum(cost(s, self.ranks.get(s.name, 0)) for s in shapes)

    def scores(self, names: list[str]) -> list[float]:
        """Removal scores for ``BudgetController``: the dropped modules first, in allocation order."""
        pos = {n: i for i, n in enumerate(self.order)}
        return [float(pos.get(n, len(pos) + i)) for i, n in enumerate(names)]

    def to_json(self) -> dict:
        return {"ranks": self.ranks, "order": self.order, "errors": self.errors}

    @classmethod
    def from_json(cls, doc: dict) -> Allocation:
        return cls({k: int(v) for k, v in doc["ranks"].items()}, list(doc["order"]),
                   {k: float(v) for k, v in doc.get("errors", {}).items()})


BUCKETS = 1 << 16  # the MAC budget's resolution in the allocation (module costs are rounded up to 1/65536 of it)


def allocate(shapes: list[ModuleShape], energy: dict[str, np.ndarray], mac_ratio: float,
             step: int = RANK_STEP, cost: Cost = mac_cost, unit_name: str = "MAC") -> Allocation:
    """The per-module forms meeting ``sum cost <= dense total / mac_ratio`` with the least total error (``cost``:
    MACs by default, or measured decode time): a knapsack solved exactly by dynamic programming over the budget in
    ``BUCKETS`` steps (each module's cost rounded up, so the result always meets the budget; at most one bucket per
    module is left unspent). The removal order puts the modules that leave their dense form first, cheapest error
    per unit of cost saved first. Deterministic."""
    dense = sum(cost(s, 0) for s in shapes)
    target = dense / mac_ratio
    opts = [options(s, energy[s.name], step, cost) for s in shapes]
    cheapest = sum(min(c for _, c, _ in o) for o in opts)
    if cheapest > target:
        raise UsageError(f"--mac-ratio {mac_ratio:g}: beyond reach; the cheapest form of every projection gives "
                         f"{dense / cheapest:.2f}x fewer projection {unit_name}s")
    unit = target / BUCKETS
    best = np.zeros(BUCKETS + 1)  # best[b]: least error of the modules so far within b buckets
    choice = np.zeros((len(shapes), BUCKETS + 1), dtype=np.int16)
    for m, o in enumerate(opts):
        new = np.full(BUCKETS + 1, np.inf)
        for k, (_, macs, err) in enumerate(o):
            need = int(np.ceil(macs / unit - 1e-9))
            if need > BUCKETS:
                continue
            cand = np.full(BUCKETS + 1, np.inf)
            cand[need:] = best[: BUCKETS + 1 - need] + err
            better = cand < new  # ties keep the earlier option: dense first, then the larger rank
            new[better], choice[m, better] = cand[better], k
        best = new
    picked, b = [], BUCKETS
    for m in range(len(shapes) - 1, -1, -1):
        k = int(choice[m, b])
        picked.append(k)
        b -= int(np.ceil(opts[m][k][1] / unit - 1e-9))
    picked.reverse()
    ranks = {s.name: o[k][0] for s, o, k in zip(shapes, opts, picked)}
    errors = {s.name: o[k][2] for s, o, k in zip(shapes, opts, picked)}
    saved = {s.name: o[0][1] - o[k][1] for s, o, k in zip(shapes, opts, picked)}
    order = sorted((n for n, r in ranks.items() if r), key=lambda n: (errors[n] / saved[n], n))
    return Allocation(ranks, order, errors)
