"""Removed decoder layers (``--forms layers``): what dropping a whole layer costs in the allocation's units, and the
model without it (ShortGPT's and Minitron's depth pruning: a shallower model of the same architecture, which every
runtime, onnxruntime-genai's own builder included, runs with nothing new).

A decoder layer adds an update ``u_t = h_out - h_in`` to the residual stream; removing it changes the stream at that
point by exactly ``-u_t`` (its attention and its MLP together, the MLP's input included). Its error is that change
weighted as every other form's error is (``lowrank``, ``channels``): by the Fisher diagonal ``f`` of the layer's
output (the squared gradient of the next-token loss, summed over the calibration tokens), damped as the spectra damp
it,

    e(layer) = sum_i (f_i + 0.01 mean(f)) sum_t u_ti^2,

so a removed layer, a pruned MLP and a rank-r pair compare in one knapsack. Both sums come from the same forward and
backward pass as the Gram matrices (``calibrate(..., residual=True)``). Like the other errors it is a first-order
estimate at the layer's output (how the layers above react is not modelled); a removed layer's projections cost
nothing, so the allocation prices it against the low-rank and channel forms of its seven projections together
(``allocate.knapsack``'s groups). The projection budget does not count the layer's attention, norms and KV cache,
which go with it: a removed layer saves more decode time than it is priced at.
"""

from __future__ import annotations

from bdlora.compress.forms.lowrank import output_weights
from bdlora.forms.context import BaseStep, Choice, OneShotContext


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}"


def removal_errors(calib) -> dict[str, float]:
    """``model.layers.N`` -> the loss-weighted error of removing layer N (``calib`` measured with ``residual``)."""
    out = {}
    for i, (update, fisher) in calib.residual.items():
        phi2 = output_weights(fisher, len(fisher)) ** 2
        out[layer_prefix(i)] = float((phi2 * update).sum())
    return out


def renumbered(names: dict, kept: list[int]) -> dict:
    """``names`` (keyed by the source's module names) keyed by the shallower model's: layer ``kept[j]`` becomes
    layer ``j``; entries of removed layers are dropped."""
    new = {i: j for j, i in enumerate(kept)}
    out = {}
    for name, v in names.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) in new:
            out[".".join([*parts[:2], str(new[int(parts[2])]), *parts[3:]])] = v
    return out


# --- the one-shot's step (``forms.context``) --------------------------------------------------------------------


class LayersStep(BaseStep):
    """Each decoder layer may be removed whole: one more alternative of the knapsack's group of its projections,
    at no cost and its removal error (measured on the residual stream in the calibration pass)."""

    name = "layers"

    def calibration(self, ctx: OneShotContext) -> None:
        ctx.calibration["residual"] = True

    def offer(self, ctx: OneShotContext) -> None:
        errors = removal_errors(ctx.calib)
        keep = max(errors, key=errors.get)  # a decoder keeps one layer: the one whose removal costs most is not
        for layer, error in errors.items():  # offered (a 6x draft of the 4-layer builtin teacher removed all four:
            if layer != keep:  # a division by zero)
                ctx.offer(layer, [Choice(self.name, 0.0, error)])
        ctx.facts["allocation"] = {"removal_errors": errors}


STEP = LayersStep()
