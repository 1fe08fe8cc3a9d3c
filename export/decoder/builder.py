"""Graph emission primitives shared by every decoder graph bdlora writes: a ``GraphBuilder`` that accumulates nodes
and initialisers, a ``Projection`` (one projection in its deployed form) and ``emit_group``, which emits the
projections that read one input as ONE first-stage MatMul over their concatenated dense weights and first low-rank
factors, a Split, then each low-rank piece's second factor.

Why one shared first MatMul: in a decoder q/k/v read the same normed state, and so do gate/up. Dense, these are three
(two) GEMMs; low-rank, their first factors are three (two) skinny GEMMs that at decode run far below GEMM efficiency
and pay per-node overhead. One GEMM of the summed width, split after, computes the same products in one node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
from onnx import helper, numpy_helper

from bdlora.forms import DENSE, LOWRANK, describe


@dataclass
class Projection:
    """One projection as deployed: ``y = x W^T + (x A^T) B^T + b`` with any of the parts absent."""

    name: str
    out_features: int
    weight: np.ndarray | None = None  # (out, in) dense part
    lora_a: np.ndarray | None = None  # (r, in) first low-rank factor
    lora_b: np.ndarray | None = None  # (out, r) second low-rank factor
    bias: np.ndarray | None = None
    form: str = "dense"
    rank: int = 0
    bits: int = 0  # declared wider than an int4 export's 4 bits (``bdlora_modules``' "bits"; 0: the precision's)

    @classmethod
    def of(cls, name: str, m: nn.Module, bits: int = 0) -> Projection:
        def f(t):
            return None if t is None else t.detach().float().cpu().numpy()

        try:  # how each form is emitted: its tensors as the dense and low-rank parts of one projection
            form, _, out, rank, bias = describe(m)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
        if form == LOWRANK.name:
            return cls(name, out, lora_a=f(m.proj_in.weight), lora_b=f(m.proj_out.weight), bias=f(bias),
                       form=form, rank=rank, bits=bits)
        if form == DENSE.name:
            return cls(name, out, weight=f(m.weight), bias=f(bias), bits=bits)
        return cls(name, out, weight=f(m.base.weight), lora_a=f(m.lora_A), lora_b=f(m.lora_B), bias=f(bias),
                   form=form, rank=rank)  # dense+lora: the bench's unmerged adapter

    def first_stage(self) -> list[np.ndarray]:
        """The (in, k) column blocks this projection adds to its group's shared first MatMul."""
        return [w.T for w in (self.weight, self.lora_a) if w is not None]


def contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` in C order. A projection's weights arrive as (out, in) rows seen transposed; torch's blocked
    transpose copies them ~6x faster than numpy's (a 1B model's emission spent 9 s here)."""
    if array.flags.c_contiguous or array.ndim != 2 or not array.flags.writeable:
        return np.ascontiguousarray(array)
    return torch.from_numpy(array).contiguous().numpy()


@dataclass
class GraphBuilder:
    """Accumulates nodes and initialisers; names follow onnxruntime-genai's builder (``/model/layers.N/...``).
    ``fused`` counts the MatMuls the shared first stages saved (one per first-stage block beyond the first)."""

    opset: int
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    fused: int = 0
    consts: set = field(default_factory=set)

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(contiguous(array), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "", doc: str = "",
             outputs: list[str] | None = None, **attrs) -> list[str]:
        outs = outputs or [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain or None, doc_string=doc,
                                           **attrs))
        return outs

    def one(self, *args, **kwargs) -> str:
        return self.node(*args, **kwargs)[0]

    def part_done(self) -> None:
        """The emitter finished a part (the embedding, a decoder layer, the head): nothing to do when the graph is
        held whole (``export.genai.stream.StreamingBuilder`` rounds and writes the part here)."""

    def const(self, name: str, values, dtype=np.int64) -> str:
        """An initialiser of small constants (shapes, axes), named once however often it is asked for."""
        if name not in self.consts:
            self.consts.add(name)
            self.init(name, np.asarray(values, dtype))
        return name

    def reduce_mean(self, x: str, name: str) -> str:
        """Mean over the last axis, kept: the axes are an attribute before opset 18 and an input from it."""
        if self.opset >= 18:
            return self.one("ReduceMean", [x, self.const("/model/constants/axes/-1", [-1])], name, keepdims=1)
        return self.one("ReduceMean", [x], name, axes=[-1], keepdims=1)


def _doc(projs: list[Projection]) -> str:
    return json.dumps([{"bdlora_module": p.name, "form": p.form, "rank": p.rank,
                        **({"bits": p.bits} if p.bits else {})} for p in projs])


def node_bits(doc: str) -> int:
    """The bits a MatMul's projections are declared at (its ``doc_string``, written by ``_doc``; 0: none)."""
    try:
        return max((int(p.get("bits") or 0) for p in json.loads(doc)), default=0) if doc else 0
    except (ValueError, TypeError, AttributeError):
        return 0


def emit_group(g: GraphBuilder, x: str, projs: list[Projection], scope: str) -> list[str]:
    """Outputs of projections sharing the input ``x``: one MatMul over every first-stage block, a Split, then each
    low-rank piece's second factor, the dense and low-rank parts added, then the bias. Projections declared at
    different bits get one first-stage MatMul per width (a MatMulNBits node has one)."""
    if len({p.bits for p in projs}) > 1:
        outs = {}
        for bits in dict.fromkeys(p.bits for p in projs):
            part = [p for p in projs if p.bits == bits]
            outs.update(zip((p.name for p in part), emit_group(g, x, part, scope)))
        return [outs[p.name] for p in projs]
    blocks = [b for p in projs for b in p.first_stage()]
    g.fused += len(blocks) - 1
    first = f"{scope}/{'_'.join(p.name.rsplit('.', 1)[-1].removesuffix('_proj') for p in projs)}_in"
    # the transposed blocks concatenate in their own (column) order; ``init`` copies them to C order once (an
    # ``astype`` copy before it cost a 1B export 0.9 s)
    w = g.init(f"{first}.weight", np.concatenate(blocks, axis=1).astype(np.float32, copy=False))
    y = g.one("MatMul", [x, w], f"{first}/MatMul", doc=_doc(projs))
    sizes = [b.shape[1] for b in blocks]
    pieces = [y] if len(blocks) == 1 else g.node(
        "Split", [y, g.init(f"{first}.split", np.array(sizes, np.int64))], f"{first}/Split", n_out=len(blocks),
        axis=-1)
    outs, i = [], 0
    for p in projs:
        pname = f"{scope}/{p.name.rsplit('.', 1)[-1]}"
        dense = pieces[i] if p.weight is not None else None
        i += p.weight is not None
        out = dense
        if p.lora_a is not None:
            h = pieces[i]
            i += 1
            wb = g.init(f"{pname}.lora_b", p.lora_b.T.astype(np.float32, copy=False))
            low = g.one("MatMul", [h, wb], f"{pname}/lora_b/MatMul", doc=_doc([p]))
            out = low if dense is None else g.one("Add", [dense, low], f"{pname}/lora/Add")
        if p.bias is not None:
            out = g.one("Add", [out, g.init(f"{pname}.bias", p.bias.astype(np.float32))], f"{pname}/bias/Add")
        outs.append(out)
    return outs


def emit_packed_qkv(g: GraphBuilder, x: str, projs: list[Projection], scope: str) -> str:
    """q, k, v packed on the last axis (GroupQueryAttention's input). All-dense q/k/v (with their biases) stay one
    MatMul (+ one Add), as onnxruntime-genai's builder emits them."""
    if all(p.form == DENSE.name for p in projs) and len({p.bits for p in projs}) == 1:
        g.fused += len(projs) - 1
        w = g.init(f"{scope}/qkv_proj.weight", np.concatenate([p.weight.T for p in projs], axis=1))
        y = g.one("MatMul", [x, w], f"{scope}/qkv_proj/MatMul", doc=_doc(projs))
        if any(p.bias is not None for p in projs):
            b = np.concatenate([p.bias if p.bias is not None else np.zeros(p.out_features, np.float32)
                                for p in projs])
            y = g.one("Add", [y, g.init(f"{scope}/qkv_proj.bias", b.astype(np.float32))], f"{scope}/qkv_proj/Add")
        return y
    q, k, v = emit_group(g, x, projs, scope)
    return g.one("Concat", [q, k, v], f"{scope}/qkv/Concat", axis=-1)
