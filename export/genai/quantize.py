"""Weight-only quantisation of the genai graph to MatMulNBits (onnxruntime's blockwise int4/int8 MatMul, what the
onnxruntime-genai builder emits for ``-p int4``), with onnxruntime's own quantiser.

Choices (measured on SmolLM2-135M and the builtin student, see the README):
- block size 32 along K, ``accuracy_level`` 4 (activations quantised to int8 inside the kernel: the fastest CPU
  path);
- int4: every projection MatMul (dense weights and both low-rank factors) to 4 bits, the LM head to 8 bits by
  default (a 4-bit head is where greedy decoding of small models degenerates first; ``head_bits`` 4 measures it);
- int8: every MatMul to 8 bits;
- ``method`` "rtn": round-to-nearest on a symmetric grid by onnxruntime's own quantiser (what onnxruntime-genai's
  builder does); "gptq": GPTQ against each MatMul's measured input Gram matrix on an asymmetric grid with integer
  zero points (``gptq``), the same nodes and kernel.
"""

from __future__ import annotations

import logging

from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from bdlora.export.genai.gptq import ACCURACY_LEVEL, BLOCK_SIZE, quantize_graph

LM_HEAD = "/lm_head/MatMul"
PRECISIONS = ("fp32", "int8", "int4")
METHODS = ("rtn", "gptq")
BITS = {"int8": 8, "int4": 4}


def quantize_nbits(model, precision: str, method: str = "rtn", grams: dict | None = None, head_bits: int = 8,
                   int8_share: float = 0.0):
    """``model`` (an in-memory ``ModelProto``, weights inside) with its MatMuls as MatMulNBits; returns the new
    proto and a description of what was quantised. ``grams``: the input Gram matrix of every MatMul (``method``
    gptq; ``gptq.input_grams``)."""
    if precision not in BITS:
        raise ValueError(f"precision {precision!r}: allowed {', '.join(PRECISIONS)}")
    head = 8 if precision == "int8" else head_bits
    if method == "gptq":
        out, detail = quantize_graph(model, grams, lambda name: head if name == LM_HEAD else BITS[precision],
                                     int8_share=int8_share if precision == "int4" else 0.0)
        eight = [n for n, b in detail["bits"].items() if b == 8 and n != LM_HEAD]
        return out, {**_describe(out, BLOCK_SIZE), "method": "gptq", "symmetric": False, "int8_share": int8_share,
                     "int8_matmuls": eight, "relative_output_error": detail["relative_output_error"]}

    def run(proto, bits: int, include=None, exclude=None):
        q = MatMulNBitsQuantizer(proto, bits=bits, block_size=BLOCK_SIZE, is_symmetric=True,
                                 accuracy_level=ACCURACY_LEVEL, nodes_to_include=include, nodes_to_exclude=exclude)
        q.process()
        return q.model.model

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantiser logs every node it visits at INFO on the root logger
    try:
        if precision == "int8" or head == 4:
            out = run(model, BITS[precision])
        else:
            out = run(run(model, 4, exclude=[LM_HEAD]), head, include=[LM_HEAD])
    finally:
        root.setLevel(level)
    return out, {**_describe(out, BLOCK_SIZE), "method": "rtn", "symmetric": True}


def _describe(out, block: int) -> dict:
    nodes = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    # each replaced node is renamed (``/lm_head/MatMul`` -> ``/lm_head/MatMul_Q8``)
    bits = {n.name.rsplit("_Q", 1)[0]: next(a.i for a in n.attribute if a.name == "bits") for n in nodes}
    return {"op": "MatMulNBits", "block_size": block, "accuracy_level": ACCURACY_LEVEL,
            "matmuls_quantized": len(nodes), "matmuls_fp32": sum(n.op_type == "MatMul" for n in out.graph.node),
            "lm_head_bits": bits.get(LM_HEAD, 32)}
