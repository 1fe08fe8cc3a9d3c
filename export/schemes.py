"""The quantisation schemes of the int8/int4 genai graphs, declared once (``export genai --quant``, ``bench --quant``
and ``--teacher-quant``): whether a scheme needs calibration (the input Gram matrix of every MatMul), who rounds
(onnxruntime's own quantiser or ``quantize.quantize_graph``), its grid, and which nodes it emits. Every reader asks a
``Scheme``; no other module compares a scheme's name. Imports nothing heavy, so the torch-free CLI shows them.

Adding a scheme (docs/design.md, "How to add a quantisation scheme"): one ``Scheme`` here; where it rounds in
``quantize_graph``, its branch of ``quantize._round`` keyed on these attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdlora.errors import UsageError, shown


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


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("rtn", "round-to-nearest on a symmetric grid by onnxruntime's quantiser (what onnxruntime-genai's builder "
                  "does)", rounds_here=False, symmetric=True),
    Scheme("gptq", "GPTQ against each MatMul's measured input, asymmetric grid with integer zero points",
           calibrated=True),
    Scheme("affine", "round-to-nearest on each block's own [min, max] with a float offset (the GGUF Q4_1 grid)",
           block_offsets=True),
)}
METHODS = tuple(SCHEMES)


def scheme(name, what: str = "--quant") -> Scheme:
    """The scheme ``name``, else a one-line refusal naming those there are."""
    found = SCHEMES.get(name) if isinstance(name, str) else None
    if found is None:
        raise UsageError(f"{what} {name if isinstance(name, str) else shown(name)}: unknown (allowed: "
                         f"{', '.join(METHODS)})")
    return found
