"""``Dials``: what an allocation over the forms is given, declared once and embedded as the ``dials`` field of the
two settings that allocate (``compress.config.OneShotConfig``: ``compress --one-shot`` and ``plan``;
``train.config.TrainConfig``: ``train --forms`` and ``--allocation quality``), as ``base.threads.ThreadPool`` is the
``pool`` of every command that runs threads. The CLI reads its fields as the commands' ``--mac-ratio``,
``--precision``, ``--quant``, ``--forms``, ``--speedup`` and ``--width-multiple`` (``cli.options.from_dataclass``
follows embedded settings, ``base.threads.from_options`` routes the flat options back), and the rules they share
are checked here, once: the dials' own ranges, a known precision and rounding, known forms that the precision and the
dial allow, a width multiple. What a command adds (one-shot needs a dial; train's dials are those of its start) is
its own settings' ``check``. Standard library only.

Where a command means a dial differently, its wording is a subclass that declares the field again with its own
docstring (``TrainDials``): the same field, the same checks, the help that command shows."""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import Checks
from bdlora.base.schemes import GENAI_PRECISIONS, quant_problem
from bdlora.forms import WIDTH_MULTIPLE, check_forms, check_width_multiple, form_names


@dataclass(frozen=True)
class Dials:
    mac_ratio: float | None = None
    """Projection-MAC speed-up of the compressed model vs the source's dense projections (e.g. 1.5)."""
    precision: str | None = None
    """Allocate by measured decode time at this precision (fp32, int8, int4: the genai exporter's nodes timed in
    onnxruntime on this machine, cached) instead of by MACs; --mac-ratio is then the projections' decode-time
    speed-up, and a low-rank pair that is no faster than its dense product at that precision is never chosen."""
    quant: str | None = None
    """--precision int8 or int4: the scheme export genai will round with (rtn, gptq, affine; default rtn). Its node
    layout is what is timed (affine's 4-bit MatMuls read block means and hold 3% more columns), and with --forms bits
    its grid measures each projection's rounding error."""
    forms: str | None = None
    """The structures the allocation chooses among, comma-separated (``bdlora.forms.ALLOCATED_FORMS``); each
    command's default is its own (None in a command whose allocation is optional: no structure)."""
    speedup: float | None = None
    """With --precision, instead of --mac-ratio: the predicted whole decode speed-up over the source's export at that
    precision (e.g. 1.3): each layer's attention, norms and activation work and the step's fixed cost are priced
    beside the projections, so a removed layer saves its whole time and a narrower MLP its share."""
    width_multiple: int | None = None
    """Every width a pruned block keeps as a projection's input (an MLP's kept channels, an attention block's kept
    heads times their size) a multiple of this (default 32, the int4 block): 256 for llama.cpp's K-quants, whose
    rows must be whole 256-blocks (export gguf --quant q4_k_m: a row that is not falls back to Q5_0 or Q8_0, larger
    and slower)."""

    @property
    def whole_step(self) -> bool:
        """Whether the budget is the whole decode step (``--speedup``, its time measured at ``--precision``) rather
        than the projections' MACs (``--mac-ratio``): the one place this is decided."""
        return self.speedup is not None

    @property
    def ratio(self) -> float | None:
        """The dial given: --mac-ratio, or --speedup."""
        return self.mac_ratio if self.mac_ratio is not None else self.speedup

    @property
    def widths(self) -> int:
        """The multiple every kept input width is on (``width_multiple``, default the int4 block)."""
        return self.width_multiple or WIDTH_MULTIPLE

    @property
    def form_names(self) -> tuple[str, ...]:
        """The forms named, in the order given (none when ``forms`` is None)."""
        return form_names(self.forms) if self.forms is not None else ()

    def check(self, c: Checks) -> Checks:
        """What every command's dials must be: ratios of at least 1, a known precision and a rounding it takes, a
        width multiple, and forms the precision and the dial allow (``forms.check_forms``)."""
        c.number("mac_ratio", self.mac_ratio, lo=1.0)
        c.number("speedup", self.speedup, lo=1.0)
        if self.precision is not None:
            c.choice("precision", self.precision, GENAI_PRECISIONS)
        quant_problem(c, self.quant, self.precision)
        check_width_multiple(c, self.width_multiple)
        if self.forms is not None:
            check_forms(c, self.forms, self.precision, self.speedup)
        return c


@dataclass(frozen=True)
class TrainDials(Dials):
    """``train``'s dials: those of the student's start (``--forms``, or ``--allocation quality``'s ranks), in the
    words ``train --help`` shows where they mean something of training's."""

    mac_ratio: float | None = None
    """With --allocation quality: the deployed projection-MAC speed-up to allocate for (default: the one the
    paper's rule gives at --budget and --lora-rank, so both rules compare at equal MACs)."""
    speedup: float | None = None
    """With --forms and --precision, instead of --mac-ratio: the predicted whole decode speed-up over the student's
    dense export at that precision (attention, norms and the LM head priced beside the projections)."""
