"""ONNX graph pass: fuse MatMuls that share an input into one MatMul followed by a Split.

In a decoder the q/k/v projections read the same normed hidden state, and so do gate/up. Dense, these are three
(two) GEMMs; low-rank, their *first* factors are three (two) skinny GEMMs, which at decode run far below GEMM
efficiency and pay per-node overhead. Concatenating the weights of such a group along the output axis turns them
into one GEMM of the summed width, whose output is split back into the original tensors. The pass is exact (the
same products, only batched) and runs on every variant bdlora exports, so dense, LoRA and compressed graphs are
compared with the same treatment.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper


def fuse_shared_input_matmuls(model) -> int:
    """Rewrite ``model`` (onnx.ModelProto) in place; returns the number of MatMuls removed."""

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consumers = defaultdict(int)
    for n in g.node:
        for i in n.input:
            consumers[i] += 1
    groups: dict[str, list] = defaultdict(list)
    for n in g.node:
        if n.op_type == "MatMul" and n.input[1] in inits and consumers[n.input[1]] == 1:
            w = inits[n.input[1]]
            if len(w.dims) == 2:
                groups[n.input[0]].append(n)
    removed = 0
    new_nodes_after: dict[int, list] = {}
    drop = set()
    order = {id(n): k for k, n in enumerate(g.node)}
    for x, nodes in groups.items():
        if len(nodes) < 2:
            continue
        ws = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        if len({w.shape[0] for w in ws}) != 1 or len({w.dtype for w in ws}) != 1:
            continue
        base = nodes[0].name or nodes[0].output[0]
        fused_w = numpy_helper.from_array(np.concatenate(ws, axis=1), name=f"{base}_fused_weight")
        g.initializer.append(fused_w)
        for n in nodes:
            g.initializer.remove(inits.pop(n.input[1]))
        fused_out = f"{base}_fused_out"
        split_sizes = numpy_helper.from_array(np.asarray([w.shape[1] for w in ws], dtype=np.int64),
                                              name=f"{base}_fused_split")
        g.initializer.append(split_sizes)
        # keep the bdlora module tags of the members: one JSON list on the fused nodes
        tags = [json.loads(n.doc_string) for n in nodes if n.doc_string.startswith("{")]
        doc = json.dumps(tags) if tags else ""
        mm = helper.make_node("MatMul", [x, fused_w.name], [fused_out], name=f"{base}_fused", doc_string=doc)
        sp = helper.make_node("Split", [fused_out, split_sizes.name], [n.output[0] for n in nodes], axis=-1,
                              name=f"{base}_fused_split", doc_string=doc)
        first = min(order[id(n)] for n in nodes)
        new_nodes_after[first] = [mm, sp]
        drop.update(id(n) for n in nodes)
        removed += len(nodes) - 1
    if not removed:
        return 0
    rebuilt = []
    for k, n in enumerate(g.node):
        if k in new_nodes_after:
            rebuilt.extend(new_nodes_after[k])
        if id(n) not in drop:
            rebuilt.append(n)
    del g.node[:]
    g.node.extend(rebuilt)
    onnx.checker.check_model(model)
    return removed
