"""The LM head only where it is read: a genai folder's ``model.onnx`` computes the logits of each row's last real
position (plain generation reads nothing else), and ``model_all_logits.onnx`` beside it computes every position's
(verifying a draft's proposals, scoring a prompt's tokens); the two graphs differ by three nodes and share one
weights file (``model.onnx.data``), so the second costs no disk beyond its structure.

A 128-token prompt then runs the head once per row instead of 128 times: on Gemma 3 270M (a 262,144 x 640 head) that
is ~21 GMACs of a prefill. onnxruntime-genai reads a graph whose logits have one position (declared ``[batch, 1,
vocab]``) as such (its "pruned" logits), for prompts and decode steps alike. The row kept is the last position whose
attention mask is 1 in the call (``ArgMax`` with ``select_last_index``): the last column under left padding, each
prompt's own last token under onnxruntime-genai's right-padded batches.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from bdlora.base.runs import ALL_LOGITS_ONNX, MODEL_ONNX
from bdlora.models.runtime import DecoderSignature as Sig

NORM = "/model/norm"  # the final norm's node: its first output is what the head reads
P = "/lm_head/last_position"


def final_hidden(graph) -> str:
    """The tensor the LM head reads (the final norm's normed output)."""
    node = next((n for n in graph.node if n.name == NORM), None)
    if node is None:
        raise ValueError(f"no {NORM} node: not a decoder graph bdlora emitted")
    return node.output[0]


def last_position_head(proto) -> None:
    """Make ``proto`` (a decoder graph's structure, edited in place; its weights untouched) compute the logits of
    each row's last real position only: (batch, 1, vocab)."""
    g = proto.graph
    hidden = final_hidden(g)
    consumers = [n for n in g.node if hidden in n.input]
    # idx = argmax_last(mask) - (total - seq): each row's last position whose mask is 1, counted in this call
    # (opset 21: Shape's start/end attributes); the index is expanded to (B, 1, H) for GatherElements on axis 1
    nodes = [
        helper.make_node("ArgMax", [Sig.ATTENTION_MASK], [f"{P}/last"], f"{P}/ArgMax", axis=1, keepdims=1,
                         select_last_index=1),  # (B, 1) into the whole mask
        helper.make_node("Shape", [Sig.ATTENTION_MASK], [f"{P}/total"], f"{P}/total", start=1, end=2),
        helper.make_node("Shape", [Sig.INPUT_IDS], [f"{P}/seq"], f"{P}/seq", start=1, end=2),
        helper.make_node("Sub", [f"{P}/total", f"{P}/seq"], [f"{P}/past"], f"{P}/past"),
        helper.make_node("Sub", [f"{P}/last", f"{P}/past"], [f"{P}/in_call"], f"{P}/in_call"),
        helper.make_node("Max", [f"{P}/in_call", f"{P}/zero"], [f"{P}/row"], f"{P}/clip"),  # a pad-only row: 0
        helper.make_node("Unsqueeze", [f"{P}/row", f"{P}/axis2"], [f"{P}/row3"], f"{P}/Unsqueeze"),  # (B, 1, 1)
        helper.make_node("Shape", [hidden], [f"{P}/hidden_shape"], f"{P}/hidden_shape"),  # (B, S, H)
        helper.make_node("Mul", [f"{P}/hidden_shape", f"{P}/only_width"], [f"{P}/width"], f"{P}/width"),
        helper.make_node("Add", [f"{P}/width", f"{P}/ones_first"], [f"{P}/target"], f"{P}/target"),  # (1, 1, H)
        helper.make_node("Expand", [f"{P}/row3", f"{P}/target"], [f"{P}/index"], f"{P}/Expand"),  # (B, 1, H)
        helper.make_node("GatherElements", [hidden, f"{P}/index"], [f"{P}/hidden"], f"{P}/GatherElements", axis=1),
    ]
    g.initializer.extend([helper.make_tensor(f"{P}/zero", TensorProto.INT64, [], [0]),
                          helper.make_tensor(f"{P}/axis2", TensorProto.INT64, [1], [2]),
                          helper.make_tensor(f"{P}/only_width", TensorProto.INT64, [3], [0, 0, 1]),
                          helper.make_tensor(f"{P}/ones_first", TensorProto.INT64, [3], [1, 1, 0])])
    for n in consumers:
        n.input[:] = [f"{P}/hidden" if i == hidden else i for i in n.input]
    first = min(list(g.node).index(n) for n in consumers)
    for k, n in enumerate(nodes):
        g.node.insert(first + k, n)
    logits = next(o for o in g.output if o.name == Sig.LOGITS)
    dim = logits.type.tensor_type.shape.dim[1]
    dim.ClearField("dim_param")
    dim.dim_value = 1


def split_head(folder: Path) -> None:
    """``folder``'s model.onnx (every position's logits, weights in model.onnx.data) becomes the last-position graph,
    its original saved beside it as ``ALL_LOGITS_ONNX``; both read the one weights file (the small constants the
    saver keeps inline are in each)."""
    path = folder / MODEL_ONNX
    proto = onnx.load(str(path), load_external_data=False)
    onnx.save_model(proto, str(folder / ALL_LOGITS_ONNX))
    last_position_head(proto)
    onnx.save_model(proto, str(path))
