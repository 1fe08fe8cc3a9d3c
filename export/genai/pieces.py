"""A decoder graph run in consecutive pieces, one onnxruntime session at a time, so a check of a large model holds
one piece's prepacked weights instead of the whole graph's (an 8B int4 session: 6.4 GiB).

The graph's nodes are cut at layer boundaries into pieces of at most ``PIECE_BYTES`` of weights (a layer larger than
that is a piece of its own). Each piece is a graph of its own nodes whose initialisers still point into the folder's
one weights file (``model.onnx.data``, read by onnxruntime from where it lies: nothing is copied or written); its
inputs are what earlier pieces made (the hidden state, the residual, the attention mask's lengths), its outputs what
later pieces read. Every call's tensors are carried from piece to piece, so each piece's session serves all the
calls before the next opens. The kernels and their inputs are the whole graph's, and so are the logits: equal to
the whole graph's bit for bit on the 1B shape and in the tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from bdlora.base.memory import release_freed_memory
from bdlora.base.reporter import SILENT, Reporter
from bdlora.base.runs import ALL_LOGITS_ONNX
from bdlora.models.runtime import DecoderShape, empty_past, session
from bdlora.models.runtime import DecoderSignature as Sig
from bdlora.models.scoring import score_batches, score_logits

PIECE_BYTES = 512 * 2**20  # weights per piece: at 8B (5.1 GB of int4 weights) ten pieces, each session under 1 GiB
LAYER = re.compile(r"/model/layers\.(\d+)/")


def _weight_bytes(t: TensorProto) -> int:
    if t.data_location == TensorProto.EXTERNAL:
        return next((int(e.value) for e in t.external_data if e.key == "length"), 0)
    return len(t.raw_data)


def _units(nodes) -> list[list]:
    """The nodes in runs that belong together: everything before the first layer, each layer, what follows the
    last (the final norm and the head). A layer's first node (its input norm) reads the layer before: no cut
    inside a layer, so no weight-sized tensor (a reshaped table) ever crosses between pieces."""
    units: list[list] = []
    key = object()
    for n in nodes:
        m = LAYER.match(n.name)
        k = int(m.group(1)) if m else ("before" if not units or key == "before" else "after")
        if k != key:
            units.append([])
            key = k
        units[-1].append(n)
    return units


def split(graph, max_bytes: int = PIECE_BYTES) -> list[list]:
    """``graph``'s nodes (in their topological order) cut into pieces of at most ``max_bytes`` of weights, whole
    layers each."""
    sizes = {t.name: _weight_bytes(t) for t in graph.initializer}
    pieces: list[list] = [[]]
    held = 0
    for unit in _units(graph.node):
        size = sum(sizes.get(i, 0) for n in unit for i in set(n.input))
        if pieces[-1] and held + size > max_bytes:
            pieces.append([])
            held = 0
        pieces[-1].extend(unit)
        held += size
    return pieces


class Pieces:
    """``folder``'s ``graph`` (by default the every-position graph) as pieces of ``max_bytes`` (by default
    ``PIECE_BYTES``; ``split``), each made into a session only while it runs (``run``)."""

    def __init__(self, folder: Path, graph: str = ALL_LOGITS_ONNX, max_bytes: int | None = None):
        self.folder = Path(folder)
        self.proto = onnx.load(str(self.folder / graph), load_external_data=False)  # the structure only
        g = self.proto.graph
        self.pieces = split(g, max_bytes or PIECE_BYTES)
        self.initializers = {t.name: t for t in g.initializer}
        self.graph_inputs = {i.name: i for i in g.input}
        self.later: list[set[str]] = []  # what the pieces after each one read
        read: set[str] = set()
        for nodes in reversed(self.pieces):
            self.later.insert(0, set(read))
            read.update(i for n in nodes for i in n.input if i)

    def __len__(self) -> int:
        return len(self.pieces)

    def _session(self, k: int, tensors: dict[str, np.ndarray], wanted: set[str]):
        nodes = self.pieces[k]
        made = [o for n in nodes for o in n.output if o]
        inside = set(made)
        inputs = list(dict.fromkeys(i for n in nodes for i in n.input
                                    if i and i not in self.initializers and i not in inside))
        outputs = [o for o in made if o in self.later[k] or o in wanted]
        declared = [self.graph_inputs.get(i) or helper.make_tensor_value_info(
            i, helper.np_dtype_to_tensor_dtype(tensors[i].dtype), [None] * tensors[i].ndim) for i in inputs]
        used = {i for n in nodes for i in n.input}
        graph = helper.make_graph(nodes, f"piece{k}", declared, [onnx.ValueInfoProto(name=o) for o in outputs],
                                  [t for name, t in self.initializers.items() if name in used])
        model = helper.make_model(graph, opset_imports=self.proto.opset_import, ir_version=self.proto.ir_version)
        # the weights read from the folder's data file, where the whole graph reads them
        return session(model.SerializeToString(), weights_dir=self.folder), inputs, outputs

    def run(self, calls: list[dict[str, np.ndarray]], wanted: tuple[str, ...] = (Sig.LOGITS,),
            on_piece=None) -> Iterator[dict]:
        """Each call's ``wanted`` outputs ({name: array}), in the calls' order: ``calls`` are the whole graph's
        feeds, every call taken through each piece before the next piece's session opens (the last piece's yields
        as it goes, so a caller can consume large logits one call at a time). ``on_piece()`` after each piece."""
        keep = set(wanted)
        tensors = [dict(c) for c in calls]
        if not tensors:
            return
        for k in range(len(self.pieces)):
            sess, inputs, outputs = self._session(k, tensors[0], keep)
            last = k == len(self.pieces) - 1
            for i, held in enumerate(tensors):
                held.update(zip(outputs, sess.run(outputs, {n: held[n] for n in inputs})))
                tensors[i] = {n: a for n, a in held.items() if n in self.later[k] or n in keep}
                if last:
                    yield {w: tensors[i].pop(w) for w in wanted}
            del sess
            release_freed_memory()
            if on_piece is not None:
                on_piece()


def first_call_feeds(shape: DecoderShape, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The genai layout's feeds of a call from an empty cache: ids (B, T), a mask of ones, zero-length pasts."""
    b, t = ids.shape
    values = [ids.astype(np.int64), np.ones((b, t), np.int64), *empty_past(shape, b)]
    return dict(zip(Sig(shape.layers, position_ids=False).inputs, values, strict=True))


def score_in_pieces(folder: Path, shape: DecoderShape, blocks, batch_size: int = 8, max_bytes: int | None = None,
                    reporter: Reporter = SILENT) -> tuple[float, np.ndarray]:
    """``runtime.score_blocks`` of ``folder``'s every-position graph run in pieces (of ``max_bytes``, by default
    ``PIECE_BYTES``; ``reporter`` counts them): the same batches (``scoring.score_batches``), the same figures."""
    xs = list(score_batches(blocks, shape.vocab_size, batch_size))
    graph = Pieces(folder, max_bytes=max_bytes)
    reporter.count(0, len(graph), "pieces")
    out = graph.run([first_call_feeds(shape, x) for x in xs], (Sig.LOGITS,),
                    on_piece=lambda: reporter.count(1, len(graph), "pieces"))
    scores = score_logits(lambda x: next(out)[Sig.LOGITS], blocks, shape.vocab_size, batch_size, "the ONNX graph")
    next(out, None)  # past the last call's logits: the last piece's session closes (and is counted) now
    return scores
