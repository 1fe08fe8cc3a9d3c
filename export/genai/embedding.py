"""The input embedding of a quantised genai graph stored once, quantised: its ``Gather`` becomes onnxruntime's
``GatherBlockQuantized``, reading either the LM head's own MatMulNBits weights (a tied head: one copy of the table
serves both, as onnxruntime-genai's builder does with ``shared_embeddings``) or its own 8-bit copy (an untied head,
or a head whose node cannot be read that way). Before this an int4 folder of SmolLM2 held the 49,152 x 576 table
twice: 113 MB in fp32 for the gather beside the head's 8-bit copy.

GatherBlockQuantized dequantises exactly as MatMulNBits does (blocks of 32 along the hidden size, the same packed
codes, scales and zero points, measured equal to 5e-7), so a tied model's embedding rows are the head's rounded rows.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from bdlora.export.genai.gptq import BLOCK_SIZE, pack, rtn

GATHER = "/model/embed_tokens/Gather"
TABLE = "model.embed_tokens.weight"
HEAD_PREFIX = "/lm_head/MatMul_Q"  # the quantised head's node: /lm_head/MatMul_Q8 or _Q4
OWN_BITS = 8  # an embedding quantised on its own (untied head)
ROWS = 8192  # table rows rounded at once (each row's blocks are its own): a 128k x 4096 table never in float64
P = "/model/embed_tokens/quantized"


def _attr(node, name):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _shareable_head(g, vocab: int, hidden: int):
    """The head's MatMulNBits node when its weights can serve the gather: a (vocab, hidden) weight in blocks of
    ``BLOCK_SIZE`` (an affine 4-bit head reads extra input columns, K > hidden: not shareable)."""
    node = next((n for n in g.node if n.op_type == "MatMulNBits" and n.name.startswith(HEAD_PREFIX)), None)
    if node is None:
        return None
    if _attr(node, "K") != hidden or _attr(node, "N") != vocab or _attr(node, "block_size") != BLOCK_SIZE:
        return None
    return node


def quantize_embedding(proto, tied: bool, table=None) -> dict:
    """Replace ``proto``'s embedding Gather (in place) by GatherBlockQuantized over the tied head's weights or an
    8-bit copy of the table; returns what was done (for export.json). ``table``: a callable giving the (vocab,
    hidden) table (a tensor, sliced by rows) where the graph holds only its shape (a streamed export)."""
    g = proto.graph
    gather = next((n for n in g.node if n.name == GATHER and n.op_type == "Gather"), None)
    inits = {t.name: t for t in g.initializer}
    if gather is None or gather.input[0] != TABLE or TABLE not in inits:
        return {"embedding": "unchanged (no fp32 table gather)"}
    vocab, hidden = (int(d) for d in inits[TABLE].dims)
    if hidden % BLOCK_SIZE:
        return {"embedding": f"fp32 (hidden size {hidden} is not a multiple of {BLOCK_SIZE})"}
    head = _shareable_head(g, vocab, hidden) if tied else None
    if head is not None:
        bits = int(_attr(head, "bits"))
        qweight, scales, zp = head.input[1], head.input[2], head.input[3] if len(head.input) > 3 else None
        how = {"embedding": f"shares the LM head's {bits}-bit weights (GatherBlockQuantized)"}
    else:
        bits = OWN_BITS
        rows = table() if table is not None else torch.from_numpy(numpy_helper.to_array(inits[TABLE]).copy())
        chunks = [pack(*rtn(rows[r:r + ROWS].to(torch.float64), bits), bits) for r in range(0, vocab, ROWS)]
        packed, sc, zpv = (np.concatenate(c) for c in zip(*chunks))
        qweight, scales, zp = f"{P}.qweight", f"{P}.scales", f"{P}.qzeros"
        g.initializer.extend([numpy_helper.from_array(packed, qweight), numpy_helper.from_array(sc, scales),
                              numpy_helper.from_array(zpv, zp)])
        how = {"embedding": f"its own {bits}-bit copy (GatherBlockQuantized)"}
    blocks = hidden // BLOCK_SIZE
    shapes = {"q": [vocab, hidden * bits // 8], "s": [vocab, blocks], "z": [vocab, -1]}
    g.initializer.extend(helper.make_tensor(f"{P}/{k}_shape", TensorProto.INT64, [2], v) for k, v in shapes.items())
    nodes = [helper.make_node("Reshape", [qweight, f"{P}/q_shape"], [f"{P}/q"], f"{P}/q"),
             helper.make_node("Reshape", [scales, f"{P}/s_shape"], [f"{P}/s"], f"{P}/s")]
    inputs = [f"{P}/q", gather.input[1], f"{P}/s"]
    if zp is not None:
        nodes.append(helper.make_node("Reshape", [zp, f"{P}/z_shape"], [f"{P}/z"], f"{P}/z"))
        inputs.append(f"{P}/z")
    nodes.append(helper.make_node("GatherBlockQuantized", inputs, list(gather.output), f"{P}/GatherBlockQuantized",
                                  domain="com.microsoft", bits=bits, block_size=BLOCK_SIZE, gather_axis=0,
                                  quantize_axis=1))
    at = list(g.node).index(gather)
    g.node.remove(gather)
    for k, n in enumerate(nodes):
        g.node.insert(at + k, n)
    if not any(i == TABLE for n in g.node for i in n.input):
        g.initializer.remove(inits[TABLE])
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {**how, "bits": bits, "fp32_bytes_saved": vocab * hidden * 4}

