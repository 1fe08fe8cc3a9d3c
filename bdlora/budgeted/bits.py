"""Per-module bits (``--forms bits``): which projections an int4 export keeps at 8 bits, chosen by the same
allocation as every other form instead of a separate share (``export genai --int8-share``).

The quality cost is measured in the allocation's own units (``lowrank``): the output error of rounding a weight W
to b bits, ``||Phi (W - Q_b(W)) S||_F^2`` with S S^T the damped input Gram matrix and Phi the damped output Fisher
weights of the calibration pass, Q_b the export's own rounding (``rounded``, given by the caller: the latency
table's ``rounded``, onnxruntime's blockwise round-to-nearest, what ``export genai`` writes by default). The time
cost is the int8 table's for the projection's dense product.

What is chosen, and what is assumed: a projection kept dense may ship at 8 bits, costing the 8-bit time and giving
back ``e4 - e8`` of error. Every other option (a low-rank pair, a narrower pruned MLP) ships at 4 bits and is taken
to lose what its dense weight loses at 4 bits: its factors are not rounded at every candidate rank to measure theirs.
That is a constant per projection, so it never changes which 4-bit option wins; it only prices the 8-bit one. A
removed layer is priced by its removal error alone (the rounding it no longer suffers is not credited).
"""

from __future__ import annotations

import numpy as np
import torch

from bdlora.budgeted.costs import ModuleShape
from bdlora.budgeted.lowrank import DAMPING, damped, output_weights
from bdlora.forms import WIDE_BITS

NARROW_BITS = 4


def rounding_error(weight: torch.Tensor, rounded, gram: torch.Tensor, fisher: torch.Tensor | None,
                   damping: float = DAMPING) -> float:
    """``||Phi (W - W_hat) S||_F^2`` of ``weight`` (out, in) against ``rounded`` (the same shape: W as the export
    rounds it), in the units of ``lowrank.Spectrum.energy``."""
    w = weight.detach().double()
    diff = output_weights(fisher, w.shape[0])[:, None] * (w - torch.as_tensor(np.asarray(rounded)).double())
    return float(((diff @ damped(gram, damping)) * diff).sum())


def wide_options(shapes: list[ModuleShape], weights: dict, calib, table) -> dict[str, tuple[float, float]]:
    """Projection -> (its dense product's time at 8 bits, the error 8 bits give back: e4 - e8, never below 0) for
    every one of ``shapes``; ``weights``: name -> its (out, in) weight; ``calib``: the calibration (Gram matrices,
    Fisher diagonals); ``table``: the int4 latency table with its int8 one (``cost(shape, 0, 8)``, ``rounded``)."""
    out = {}
    for s in shapes:
        w = weights[s.name].detach()
        errors = [rounding_error(w, table.rounded(w.float().numpy(), b), calib.gram(s.name), calib.fisher.get(s.name))
                  for b in (NARROW_BITS, WIDE_BITS)]
        out[s.name] = (float(table.cost(s, 0, WIDE_BITS)), max(errors[0] - errors[1], 0.0))
    return out
