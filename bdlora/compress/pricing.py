"""What a form costs and what its options are, the building blocks every form prices its choices with and the
knapsack (``allocate``) takes them in: the MAC cost of a projection dense or as a rank-r pair, the break-even rank
above which a pair is no faster (SPEC 6.3), the grid of ranks searched, and a module's (rank, cost, error) options
from its spectrum. Below the forms' steps (``compress.forms``) and the knapsack, which import it. Pure numpy."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bdlora.models.costs import ModuleShape

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


Option = tuple[object, float, float]  # (what is chosen, its cost, its error)
