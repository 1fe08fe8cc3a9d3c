"""Weight-only quantisation of the genai graph to MatMulNBits (onnxruntime's blockwise int4/int8 MatMul, what the
onnxruntime-genai builder emits for ``-p int4``), with onnxruntime's own quantiser.

Choices (measured on SmolLM2-135M and the builtin student, see the README):
- block size 32 along K, symmetric, ``accuracy_level`` 4 (activations quantised to int8 inside the kernel: the
  fastest CPU path);
- int4: every projection MatMul (dense weights and both low-rank factors) to 4 bits, the LM head to 8 bits (a 4-bit
  head is where greedy decoding of small models degenerates first);
- int8: every MatMul to 8 bits.
"""

from __future__ import annotations

import logging

from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4
LM_HEAD = "/lm_head/MatMul"
PRECISIONS = ("fp32", "int8", "int4")


def quantize_nbits(model, precision: str):
    """``model`` (an in-memory ``ModelProto``, weights inside) with its MatMuls as MatMulNBits; returns the new
    proto and a description of what was quantised."""

    def run(proto, bits: int, include=None, exclude=None):
        q = MatMulNBitsQuantizer(proto, bits=bits, block_size=BLOCK_SIZE, is_symmetric=True,
                                 accuracy_level=ACCURACY_LEVEL, nodes_to_include=include, nodes_to_exclude=exclude)
        q.process()
        return q.model.model

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantiser logs every node it visits at INFO on the root logger
    try:
        if precision == "int8":
            out = run(model, 8)
        elif precision == "int4":
            out = run(run(model, 4, exclude=[LM_HEAD]), 8, include=[LM_HEAD])
        else:
            raise ValueError(f"precision {precision!r}: allowed {', '.join(PRECISIONS)}")
    finally:
        root.setLevel(level)
    nodes = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    # the quantiser renames each node it replaces (``/lm_head/MatMul`` -> ``/lm_head/MatMul_Q8``)
    bits = {n.name.rsplit("_Q", 1)[0]: next(a.i for a in n.attribute if a.name == "bits") for n in nodes}
    return out, {"op": "MatMulNBits", "block_size": BLOCK_SIZE, "accuracy_level": ACCURACY_LEVEL,
                 "symmetric": True, "matmuls_quantized": len(nodes),
                 "matmuls_fp32": sum(n.op_type == "MatMul" for n in out.graph.node),
                 "lm_head_bits": bits.get(LM_HEAD, 32)}
