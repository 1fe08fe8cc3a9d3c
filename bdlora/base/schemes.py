"""The precisions a model ships at and the quantisation schemes of the int8/int4 genai graphs, declared once.
``PRECISIONS`` (``--precision``, ``export genai``, ``bench --genai-precisions``): a precision's weight bits and
which options apply at it. ``SCHEMES`` (``export genai --quant``, ``bench --quant`` and ``--teacher-quant``): whether
a scheme needs calibration (the input Gram matrix of every MatMul), who rounds (onnxruntime's own quantiser or
``quantize.quantize_graph``), its grid, and which nodes it emits. Every reader asks a ``Precision`` or a ``Scheme``;
no other module compares a precision's or a scheme's name. Imports nothing heavy, so the torch-free CLI shows them.

Adding a scheme (docs/design.md, "Adding a quantisation scheme"): one ``Scheme`` here; where it rounds in
``quantize_graph``, its branch of ``quantize._round_matmul`` keyed on these attributes; a new node layout, its
branch of ``latency.form_graph``. A leaf of the core: the core's ``--quant`` options (``compress --one-shot``,
``plan``, ``train``'s start) validate against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.base.errors import UsageError, shown


@dataclass(frozen=True)
class Precision:
    """What a model ships at (``--precision``, ``export genai``, ``bench --genai-precisions``)."""

    name: str
    bits: int
    """The projections' weight bits (32: float, nothing is rounded and no scheme applies)."""
    mixed: bool = False
    """Widths vary inside its graph: projections kept at 8 bits (``--forms bits``, a calibrated scheme's
    ``--int8-share``) and the LM head at ``--head-bits`` 8 or 4 (at int8 every weight already has 8)."""

    @property
    def rounded(self) -> bool:
        """Its weights are rounded by a scheme (int8, int4)."""
        return self.bits < 32


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", 32), Precision("int8", 8), Precision("int4", 4, mixed=True))}
GENAI_PRECISIONS = tuple(PRECISIONS)
FLOAT = next(p.name for p in PRECISIONS.values() if not p.rounded)  # the default: nothing rounded
MIXED = next(p.name for p in PRECISIONS.values() if p.mixed)  # where head bits and 8-bit projections apply
ROUNDED = tuple(p.name for p in PRECISIONS.values() if p.rounded)
WIDE = next(p.name for p in PRECISIONS.values() if p.bits == 8)  # what a mixed graph keeps some weights at


def rounded(precision: str | None) -> bool:
    """Whether ``precision`` (a name; None or one of no table: float) rounds its weights."""
    return precision in ROUNDED


def mixed(precision: str | None) -> bool:
    """Whether ``precision`` (a name) varies widths inside its graph (8-bit projections, the head's bits)."""
    return precision in PRECISIONS and PRECISIONS[precision].mixed


@dataclass(frozen=True)
class Scheme:
    name: str
    summary: str
    """What it does, for --help and the docs."""
    calibrated: bool = False
    """Rounds each MatMul against its measured input (the calibration blocks' Gram matrices)."""
    rounds_here: bool = True
    """Rounded by ``quantize.quantize_graph`` (False: by onnxruntime's MatMulNBitsQuantizer)."""
    symmetric: bool = False
    """A grid centred on zero (no zero points)."""
    block_offsets: bool = False
    """At 4 bits, a float offset per block of 32, restored by extra input columns (``[x, block means]``) in the same
    fast MatMulNBits node; at 8 bits the symmetric grid (llama.cpp's Q4_1 and Q8_0)."""

    def layout(self, precision: str) -> str:
        """The nodes each weight MatMul becomes at ``precision``, which is what the latency table times for this
        scheme (``export.genai.latency``): ``matmul`` (fp32), ``nbits`` (one MatMulNBits node) or ``nbits+means``
        (block offsets at 4 bits: the node reads ``[x, block means of x]``, made by an AveragePool and a Concat in
        front of it, and carries K/32 more columns)."""
        if not rounded(precision):
            return "matmul"
        return "nbits+means" if self.block_offsets and PRECISIONS[precision].bits == 4 else "nbits"

    def timed_as(self, precision: str) -> Scheme:
        """The scheme whose folder is timed for this one's decode cost at ``precision``: itself, or for a calibrated
        scheme the uncalibrated one emitting the same nodes (its values differ, its kernels and bytes do not), so a
        latency probe needs no calibration data."""
        if not self.calibrated:
            return self
        return next(s for s in SCHEMES.values() if not s.calibrated and s.layout(precision) == self.layout(precision))


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("rtn", "round-to-nearest on a symmetric grid by onnxruntime's quantiser (what onnxruntime-genai's builder "
                  "does)", rounds_here=False, symmetric=True),
    Scheme("gptq", "GPTQ against each MatMul's measured input, asymmetric grid with integer zero points",
           calibrated=True),
    Scheme("affine", "round-to-nearest on each block's own [min, max] with a float offset (the GGUF Q4_1 grid)",
           block_offsets=True),
)}
METHODS = tuple(SCHEMES)
DEFAULT_SCHEME = "rtn"  # what export genai, bench and the latency table use unless --quant says otherwise


def scheme(name, what: str = "--quant") -> Scheme:
    """The scheme ``name``, else a one-line refusal naming those there are."""
    found = SCHEMES.get(name) if isinstance(name, str) else None
    if found is None:
        raise UsageError(f"{what} {name if isinstance(name, str) else shown(name)}: unknown (allowed: "
                         f"{', '.join(METHODS)})")
    return found


def quant_problem(c, quant: str | None, precision: str | None) -> None:
    """Add to the ``Checks`` ``c`` what is wrong with ``--quant`` beside a latency ``--precision`` (compress
    --one-shot, plan, train's start): an unknown scheme, or one given where no int8/int4 time is measured."""
    if quant is None:
        return
    if c.choice("quant", quant, METHODS):
        c.require(rounded(precision),
                  f"--quant {quant}: names the scheme whose {'/'.join(ROUNDED)} nodes --precision times; give "
                  f"--precision {' or '.join(ROUNDED)}" + (f" (--precision {precision} rounds nothing)" if precision
                                                           else ""))
