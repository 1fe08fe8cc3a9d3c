"""The genai graph of a model too large to hold, written one part at a time (``export genai --streaming``).

The in-memory export holds the fp32 model, the whole fp32 graph and its rounded copy (16.6 GB for a 1B model).
Here the model is lazy (``bdlora.models.stream``: each part read from its safetensors file when emitted) and the
graph builder is a ``StreamingBuilder``: when the emitter finishes a part (the embedding, one decoder layer, the
head: ``GraphBuilder.part_done``) its weight MatMuls are rounded to MatMulNBits and every weight is appended to
``model.onnx.data``; the graph keeps nodes and references only. What is held at once is one part in fp32 and its
rounded codes, whatever the model's size.

The result is the in-memory path's graph (tested equal to 1e-5 on the same folder): round-to-nearest gives the codes
and scales of the onnxruntime kernel ``MatMulNBitsQuantizer`` calls, bit for bit (``rtn_nbits``: the same node,
``quantize.torch_rtn`` computing the kernel's float operations on slices of the weight's rows, so a 128k-vocabulary
head is never copied whole or transposed); ``affine`` rounds each part with ``quantize_graph``.
The embedding table is not written in fp32: at the end ``quantize_embedding`` points the Gather at the tied head's
codes or at an 8-bit copy read again from the weight files, rows at a time. GPTQ rounds each part against its
MatMuls' input Gram matrices measured layer by layer (``CalibratedInputs``: the calibration blocks' hidden states
carried up the lazy model, ``models.sequential``), as its reference implementation calibrates; the in-memory path
measures the same inputs on the whole fp32 graph (tested equal to 1e-5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from bdlora.base.errors import ModelError
from bdlora.base.schemes import mixed, scheme
from bdlora.export.decoder.builder import GraphBuilder, contiguous, node_bits
from bdlora.export.genai.affine import AUGMENTED
from bdlora.export.genai.gptq import ACCURACY_LEVEL, BLOCK_SIZE
from bdlora.export.genai.quantize import BITS, LM_HEAD, keep_docs, quantize_graph, torch_rtn
from bdlora.models.sequential import LayerByLayer, add_gram, layer_input_grams

INLINE_BELOW = 1024  # bytes: smaller tensors stay inside model.onnx (onnx's own external-data threshold)
ALIGN = 4096  # each external tensor starts on a page (onnxruntime may map it instead of copying)
COLUMNS = None  # output columns rounded per slice (None: ``torch_rtn``'s, about 256k weights a slice)


class ExternalData:
    """``model.onnx.data`` written as tensors come: each large tensor appended (page-aligned) and returned as a
    reference; small ones stay inline."""

    def __init__(self, path: Path):
        self.path, self.offset = Path(path), 0
        self.file = open(self.path, "wb")  # noqa: SIM115  closed by close(), after the last part

    def put(self, name: str, array: np.ndarray) -> TensorProto:
        array = contiguous(array)
        if array.nbytes < INLINE_BELOW:
            return numpy_helper.from_array(array, name)
        return self.put_chunks(name, array.dtype, array.shape, [array])

    def put_chunks(self, name: str, dtype, shape, chunks) -> TensorProto:
        """One tensor of ``shape`` whose C-order bytes are ``chunks`` (arrays) in turn."""
        pad = -self.offset % ALIGN
        self.file.write(b"\0" * pad)
        start, length = self.offset + pad, 0
        for c in chunks:
            c = np.ascontiguousarray(c, dtype=dtype)
            self.file.write(memoryview(c).cast("B"))
            length += c.nbytes
        self.offset = start + length
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=list(shape))
        for key, value in (("location", self.path.name), ("offset", start), ("length", length)):
            entry = t.external_data.add()
            entry.key, entry.value = key, str(value)
        t.data_location = TensorProto.EXTERNAL
        return t

    def externalise(self, proto) -> None:
        """Every inline initialiser of ``proto`` at least ``INLINE_BELOW`` bytes moved into the file."""
        g = proto.graph
        for i, t in enumerate(g.initializer):
            if t.data_location != TensorProto.EXTERNAL and t.HasField("raw_data") and len(t.raw_data) >= INLINE_BELOW:
                g.initializer[i].CopyFrom(self.put(t.name, numpy_helper.to_array(t)))

    def close(self) -> None:
        self.file.close()


def rtn_nbits(node, b: np.ndarray, bits: int, data: ExternalData):
    """``node`` (MatMul, weight ``b`` (K, N)) as the MatMulNBits node ``MatMulNBitsQuantizer`` makes (symmetric,
    blocks of ``BLOCK_SIZE`` along K, ``ACCURACY_LEVEL``), its codes and scales (``torch_rtn``: the kernel's, bit
    for bit, a slice of output columns at a time) written to ``data``."""
    k, n = b.shape
    kb, blob = -(-k // BLOCK_SIZE), BLOCK_SIZE * bits // 8
    codes, scales = zip(*torch_rtn(b.T, bits, COLUMNS))  # b is the (out, in) weight seen transposed
    name = node.input[1]
    q = data.put_chunks(f"{name}_Q{bits}", np.uint8, (n, kb, blob), codes)
    s = data.put_chunks(f"{name}_scales", np.float32, (n, kb), scales)
    new = helper.make_node("MatMulNBits", [node.input[0], q.name, s.name], list(node.output),
                           name=f"{node.name}_Q{bits}", domain="com.microsoft", doc_string=node.doc_string, K=k, N=n,
                           bits=bits, block_size=BLOCK_SIZE, accuracy_level=ACCURACY_LEVEL)
    return [new], [q, s]


@dataclass
class Rounding:
    """How the streamed graph's weight MatMuls are rounded: the precision's bits, the head's, 8 bits for the
    projections a folder declares wider (int4 only), by ``method`` (rtn, affine, or gptq against ``inputs``);
    ``errors``: affine's and gptq's relative output errors by node, as ``quantize_graph`` reports them."""

    precision: str
    method: str
    head_bits: int
    errors: dict = field(default_factory=dict)
    wide: list = field(default_factory=list)  # the MatMuls rounded to 8 bits because their folder declares it
    corrected: int = 0  # affine MatMuls whose offsets a correction restores
    eight: list = field(default_factory=list)  # affine: the MatMuls (the head aside) rounded to 8 bits
    inputs: CalibratedInputs | None = None  # a calibrated scheme's MatMul input Gram matrices, part by part

    def bits(self, node) -> int:
        if node.name == LM_HEAD:
            return self.head_bits if mixed(self.precision) else BITS[self.precision]
        if mixed(self.precision) and node_bits(node.doc_string) == 8:
            return 8
        return BITS[self.precision]

    def summary(self) -> dict:
        """What ``quantize_nbits`` reports of the same rounding (export.json's ``quantization``)."""
        s = scheme(self.method)
        out = {"method": s.name, "symmetric": s.symmetric, "declared_int8_matmuls": len(self.wide)}
        if s.rounds_here:
            out.update(relative_output_error=self.errors, int8_matmuls=self.eight,
                       **({} if s.calibrated else {"offset_corrections": self.corrected}))
        if self.inputs is not None:  # no --int8-share here: it ranks the whole graph (auto holds it for that)
            out.update(int8_share=0.0, calibration="layer by layer", calibration_tokens=self.inputs.tokens)
        return out

    def round(self, nodes: list, weights: dict, data: ExternalData) -> tuple[list, list]:
        """(nodes, initialisers) of one part with each MatMul over a weight in ``weights`` rounded (the weights it
        consumed removed from ``weights``)."""
        self.wide += [n.name for n in nodes if n.op_type == "MatMul" and n.input[1] in weights and n.name != LM_HEAD
                      and self.bits(n) == 8 and mixed(self.precision)]
        if not scheme(self.method).rounds_here:  # onnxruntime's round-to-nearest, slice by slice
            out, inits = [], []
            for n in nodes:
                if n.op_type == "MatMul" and n.input[1] in weights:
                    new, made = rtn_nbits(n, weights.pop(n.input[1]), self.bits(n), data)
                    out += new
                    inits += made
                else:
                    out.append(n)
            return out, inits
        used = [n.input[1] for n in nodes if n.op_type == "MatMul" and n.input[1] in weights]
        part = helper.make_model(helper.make_graph(nodes, "part", [], [], [numpy_helper.from_array(
            np.ascontiguousarray(weights.pop(w), dtype=np.float32), w) for w in used]))
        by_name = {n.name: self.bits(n) for n in nodes}
        docs = {n.name: n.doc_string for n in nodes if n.op_type == "MatMul" and n.doc_string}
        grams = self.inputs.of(nodes, used) if scheme(self.method).calibrated else None
        part, detail = quantize_graph(part, grams, lambda name: by_name.get(name), method=self.method, in_place=True)
        keep_docs(docs, part)
        self.errors.update(detail["relative_output_error"])
        self.eight += [n for n, b in detail["bits"].items() if b == 8 and n != LM_HEAD]
        self.corrected += sum(n.op_type == "MatMulNBits" and n.input[0].endswith(AUGMENTED) for n in part.graph.node)
        data.externalise(part)
        return list(part.graph.node), list(part.graph.initializer)


class CalibratedInputs:
    """The input Gram matrix of each weight MatMul of a part, as the part is rounded: the calibration ``blocks``
    (n, T) carried up the lazy ``model`` one decoder layer per part (``LayerByLayer``); a MatMul's projections are
    read from its doc string (``builder._doc``), a low-rank second factor's input is its rank-r activation, the
    head's the final norm's output."""

    def __init__(self, model, blocks: np.ndarray):
        self.runner = LayerByLayer(model, blocks)
        self.tokens = int(blocks.size)

    def of(self, nodes: list, weights: list[str]) -> dict[str, torch.Tensor]:
        matmuls = [n for n in nodes if n.op_type == "MatMul" and n.input[1] in weights]
        if not matmuls:  # the embedding's part
            return {}
        if any(n.name == LM_HEAD for n in matmuls):
            head: dict[str, torch.Tensor] = {}
            for h in self.runner.final():
                add_gram(head, LM_HEAD, h)
            return {n.input[0]: head[LM_HEAD] for n in matmuls if n.name == LM_HEAD}
        keys = {n.input[0]: _projection_input(n) for n in matmuls}
        layers = {int(k.split(".")[2]) for k in keys.values()}
        if len(layers) != 1:
            raise ModelError(f"a streamed part's MatMuls name decoder layers {sorted(layers)}: cannot calibrate it")
        grams = layer_input_grams(self.runner, layers.pop())
        return {x: grams[k] for x, k in keys.items()}


def _projection_input(node) -> str:
    """The ``layer_input_grams`` key of a weight MatMul's input: its first projection's input, or for a low-rank
    second factor (``.../lora_b/MatMul``) that projection's rank-r activation."""
    try:
        first = json.loads(node.doc_string)[0]["bdlora_module"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ModelError(f"MatMul {node.name}: names no projection (its doc string), so its input cannot be "
                         "calibrated one layer at a time (give --streaming off)") from None
    return f"{first}.proj_out" if node.name.endswith("/lora_b/MatMul") else first


@dataclass
class StreamingBuilder(GraphBuilder):
    """A ``GraphBuilder`` that keeps no weight: ``init`` holds an array until its part is done, ``part_done`` rounds
    the part's MatMuls (``rounding``; None: fp32) and writes every weight to ``data``. ``deferred``: names not
    written at all (the embedding table, which the rounded graph reads from the head's codes or its own 8-bit
    copy, made at the end): each becomes a reference-less stub with its shape."""

    data: ExternalData | None = None
    rounding: Rounding | None = None
    deferred: frozenset = frozenset()
    on_part: object = None  # called after each part is written (progress)
    pending: dict = field(default_factory=dict)
    mark: int = 0

    def init(self, name: str, array: np.ndarray) -> str:
        self.pending[name] = array  # a view of the part's tensor: no copy until it is written
        return name

    def part_done(self) -> None:
        nodes = self.nodes[self.mark:]
        if self.rounding is not None:
            nodes, made = self.rounding.round(nodes, self.pending, self.data)
            self.inits += made
        for name, array in self.pending.items():
            if name in self.deferred:
                self.inits.append(TensorProto(name=name, dims=list(array.shape),
                                              data_type=helper.np_dtype_to_tensor_dtype(array.dtype)))
            else:
                self.inits.append(self.data.put(name, array))
        self.pending.clear()
        self.nodes[self.mark:] = nodes
        self.mark = len(self.nodes)
        if self.on_part is not None:
            self.on_part()


def save_streamed(proto, path: Path) -> None:
    """The graph's structure (its weights already in the data file) at ``path``."""
    onnx.save_model(proto, str(path))
