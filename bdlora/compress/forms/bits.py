"""Per-module bits (``--forms bits``): which projections an int4 export keeps at 8 bits, chosen by the same
allocation as every other form instead of a separate share (``export genai --int8-share``).

The quality cost is each projection's rounding error at 4 and at 8 bits, measured in the calibration pass
(``calibrate(..., rounded=...)``): the output change of its weight rounded by the export's own kernel (the latency
table's ``rounded``: onnxruntime's blockwise round-to-nearest, what ``export genai`` writes by default), weighted
token by token by the loss's squared gradient there, on the scale of the other forms' errors (``calibrate``'s
``_rounding_hooks`` says why token by token). The time cost is the int8 table's for the projection's dense product.

What is chosen, and what is assumed: a projection kept dense may ship at 8 bits, costing the 8-bit time and giving
back ``e4 - e8`` of error. Every other option (a low-rank pair, a narrower pruned MLP) ships at 4 bits and is taken
to lose what its dense weight loses at 4 bits: its factors are not rounded at every candidate rank to measure theirs.
That is a constant per projection, so it never changes which 4-bit option wins; it only prices the 8-bit one. A
removed layer is priced by its removal error alone (the rounding it no longer suffers is not credited).

The LM head (``head_option``): when the budget is the whole decode step (``--speedup``), the head is one more
site, shipping at 8 bits (the export's default: the teacher's int4 export is timed so) or at 4, for the time the
4-bit product saves (its (hidden, vocabulary) product timed at both widths, as every projection is) and the error
its rounding adds (``e4 - e8``, measured on the logits as the projections' are on their outputs). At small models
the head is a large share of the bytes a decode step reads (SmolLM2: 28 MB at 8 bits beside 53 MB of projections at
4; Gemma 3 270M: 168 MB beside 50), so it is the cheapest time there is when its rounding error allows.
"""

from __future__ import annotations

from bdlora.forms import HEAD, WIDE_BITS
from bdlora.forms.context import BaseStep, Choice, OneShotContext
from bdlora.models.costs import ModuleShape

NARROW_BITS = 4


def wide_options(shapes: list[ModuleShape], calib, table) -> dict[str, tuple[float, float]]:
    """Projection -> (its dense product's time at 8 bits, the error 8 bits give back: e4 - e8, never below 0) for
    every one of ``shapes``; ``calib``: a calibration with rounding errors (``calibrate(..., rounded=...)``);
    ``table``: the int4 latency table with its int8 one (``cost(shape, 0, 8)``)."""
    return {s.name: (float(table.cost(s, 0, WIDE_BITS)),
                     max(calib.rounding[s.name][NARROW_BITS] - calib.rounding[s.name][WIDE_BITS], 0.0))
            for s in shapes}


def head_shape(config: dict) -> ModuleShape:
    """The LM head's product, (hidden) -> (vocabulary), as the latency table times it."""
    return ModuleShape(HEAD, int(config["hidden_size"]), int(config["vocab_size"]))


def head_option(config: dict, calib, table) -> tuple[float, float, float]:
    """The LM head's (time at 8 bits, time at 4 bits, the error 4 bits add: ``e4 - e8``, never below 0) in an int4
    export; ``calib``: a calibration with the head's rounding errors (``calibrate(..., head=True)``); ``table``: the
    int4 latency table with its int8 one, both holding the head's product (``head_shape``)."""
    s, e = head_shape(config), calib.rounding[HEAD]
    return (float(table.cost(s, 0, WIDE_BITS)), float(table.cost(s, 0, NARROW_BITS)),
            max(e[NARROW_BITS] - e[WIDE_BITS], 0.0))


# --- the one-shot's step (``forms.context``) --------------------------------------------------------------------


class BitsStep(BaseStep):
    """Each projection kept dense may ship at 8 bits in an int4 export, and with ``--speedup`` the LM head at 4 or
    8: options priced by the int8 and int4 tables at the rounding errors measured in the calibration pass."""

    name = "bits"

    def pricing(self, ctx: OneShotContext) -> None:
        ctx.table_options["wide"] = True
        if ctx.cfg.dials.whole_step:  # the LM head's width is bought against the whole step only
            ctx.table_options["head"] = True

    def calibration(self, ctx: OneShotContext) -> None:
        ctx.calibration["rounded"] = ctx.table.rounded
        ctx.calibration["head"] = ctx.cfg.dials.whole_step

    def offer(self, ctx: OneShotContext) -> None:
        own = ctx.own(self.name)
        own["wide"] = wide_options(ctx.shapes, ctx.calib, ctx.table)
        for name, (time, given_back) in own["wide"].items():
            ctx.offer(name, [Choice(self.name, time, -given_back, bits=WIDE_BITS)])
        if ctx.cfg.dials.whole_step:
            eight, four, added = own["head"] = head_option(ctx.config, ctx.calib, ctx.table)
            ctx.offer(HEAD, [Choice(self.name, eight, 0.0, bits=WIDE_BITS), Choice(self.name, four, added,
                                                                                   bits=NARROW_BITS)])

    def deploy(self, ctx: OneShotContext, alloc) -> dict:
        """Its record of the LM head (its bits, where it chose them); the projections' bits are set in ``finish``,
        on whichever form deployed them."""
        choice = alloc.by(self.name).get(HEAD)
        return {HEAD: {"bits": choice.bits}} if choice else {}

    def finish(self, ctx: OneShotContext, alloc, deployed: dict) -> None:
        mine, own = alloc.by(self.name), ctx.own(self.name)
        for name, dep in deployed.items():
            dep.decision.bits = mine[name].bits if name in mine else 0
        head = own.get("head")
        bits = mine[HEAD].bits if HEAD in mine else 0
        ctx.facts["rounding"] = {
            "scheme": ctx.table.scheme, "error_given_back_at_8_bits": {n: g for n, (_, g) in own["wide"].items()},
            **({"lm_head": {"us_at_8_bits": head[0], "us_at_4_bits": head[1], "error_added_at_4_bits": head[2],
                            "bits": bits}} if head else {})}
        if head:
            ctx.facts["head_bits"] = bits


STEP = BitsStep()
