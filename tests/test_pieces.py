"""A genai folder's every-position graph run in pieces (``export.genai.pieces``, what a streamed export's held-out
check runs instead of the whole graph's session) gives the whole graph's logits and scores bit for bit, whatever the
pieces; and ``validate.structure`` ties model.onnx to that graph and to its configs, refusing either edited."""

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from bdlora.base.reporter import Reporter
from bdlora.data.blocks import PackedBlocks
from bdlora.export.genai import export_genai_folder
from bdlora.export.genai.pieces import LAYER, Pieces, first_call_feeds, score_in_pieces, split
from bdlora.export.genai.validate import PROMPTS, greedy_in_pieces, structure
from bdlora.export.onnx.validate import ExportValidationError
from bdlora.export.settings import GenaiExportConfig
from bdlora.models.runtime import DecoderShape, run_decoder, score_blocks, session
from conftest import genai_teacher


@pytest.fixture(scope="module")
def folder(tiny_env, tmp_path_factory):
    """A tiny 3-layer teacher exported to int4 (its head at 8 bits), streamed as a large model is."""
    root = tmp_path_factory.mktemp("pieces")
    genai_teacher(tiny_env["tokenizer"], root / "teacher", layers=3)
    export_genai_folder(root / "teacher", root / "int4", GenaiExportConfig("int4", streaming="on",
                                                                           max_ppl_change=10.0))
    return root / "int4"


class Counted(Reporter):
    def __init__(self):
        self.counts = []

    def count(self, done: int, total: int, label: str = "prompts") -> None:
        self.counts.append((done, total, label))


def _layers(nodes) -> list[int]:
    return sorted({int(m.group(1)) for n in nodes if (m := LAYER.match(n.name))})


@pytest.mark.parametrize("max_bytes", [1, 20_000, 2**40])
def test_pieces_cut_whole_layers_in_order_within_the_budget(folder, max_bytes):
    graph = onnx.load(str(folder / "model_all_logits.onnx"), load_external_data=False).graph
    pieces = split(graph, max_bytes)
    assert [n.name for p in pieces for n in p] == [n.name for n in graph.node]  # every node once, in order
    layers = [_layers(p) for p in pieces]
    assert sorted(x for ls in layers for x in ls) == [0, 1, 2]  # no layer in two pieces
    if max_bytes == 1:  # each unit its own piece: the mask and embedding, each layer, the final norm and head
        assert layers == [[], [0], [1], [2], []]
    if max_bytes == 2**40:
        assert len(pieces) == 1


@pytest.mark.parametrize("max_bytes", [1, 20_000])
def test_a_graph_run_in_pieces_gives_the_whole_graphs_logits(folder, max_bytes):
    shape = DecoderShape.from_folder(folder)
    pieces = Pieces(folder, max_bytes=max_bytes)
    assert len(pieces) > 1
    g = np.random.default_rng(0)
    calls = [g.integers(0, shape.vocab_size, (2, 9)), g.integers(0, shape.vocab_size, (1, 5))]
    whole = session(folder / "model_all_logits.onnx")
    for ids, got in zip(calls, pieces.run([first_call_feeds(shape, x) for x in calls])):
        feeds = first_call_feeds(shape, ids)
        want = run_decoder(whole, ids, feeds["attention_mask"], None, [a for k, a in feeds.items() if "past" in k])
        assert got["logits"].shape == (*ids.shape, shape.vocab_size)
        assert np.array_equal(got["logits"], want[0])  # the same kernels on the same inputs: bit for bit


def test_scores_in_pieces_are_the_whole_graphs(folder):
    shape = DecoderShape.from_folder(folder)
    blocks = PackedBlocks(np.random.default_rng(1).integers(0, shape.vocab_size, 11 * 16 + 1), 16)
    counted = Counted()
    nll, preds = score_in_pieces(folder, shape, blocks, batch_size=4, max_bytes=1, reporter=counted)  # 3 batches
    assert counted.counts == [(0, 5, "pieces")] + [(1, 5, "pieces")] * 5  # through 5 pieces, each counted once done
    want_nll, want_preds = score_blocks(session(folder / "model_all_logits.onnx"), shape, blocks, batch_size=4)
    assert nll == want_nll and np.array_equal(preds, want_preds) and preds.shape == (11 * 15,)


def test_structure_ties_the_last_position_graph_to_its_twin_and_configs(folder, tmp_path):
    shape = DecoderShape.from_folder(folder)
    assert structure(folder, shape) == {"identical_but_head": True, "layers": 3, "nodes": pytest.approx(
        len(onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node))}
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    proto = onnx.load(str(edited / "model.onnx"), load_external_data=False)
    t = next(t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL)
    offset = next(e for e in t.external_data if e.key == "offset")
    offset.value = str(int(offset.value) + 16)  # one weight read 16 bytes further on
    onnx.save_model(proto, str(edited / "model.onnx"))
    with pytest.raises(ExportValidationError, match="model.onnx is not model_all_logits.onnx with its last-position"):
        structure(edited, shape)
    shutil.copy(folder / "model.onnx", edited / "model.onnx")
    cfg = json.loads((edited / "genai_config.json").read_text())
    cfg["model"]["decoder"]["num_hidden_layers"] = 4
    (edited / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportValidationError, match="genai_config.json num_hidden_layers 4 but the model has 3"):
        structure(edited, shape)
    with pytest.raises(ExportValidationError, match="num_hidden_layers 4 but the graph has 3"):
        structure(folder, DecoderShape(**{**shape.__dict__, "layers": 4}))


def test_greedy_in_pieces_holds_the_graph_to_pytorchs_tokens(tiny_env, tmp_path):
    """A streamed fp32 export's generation check (the whole graph never one session): PyTorch's greedy tokens
    against the graph's argmax in pieces, teacher-forced; passed by the model the graph was exported from, refused
    for another model's."""
    tok = tiny_env["tokenizer"]
    genai_teacher(tok, tmp_path / "teacher", layers=3)
    export_genai_folder(tmp_path / "teacher", tmp_path / "fp32", GenaiExportConfig("fp32", streaming="on",
                                                                                    validate=False))
    out = greedy_in_pieces(tmp_path / "fp32", genai_teacher(tok, layers=3), tok, n=6)
    assert out["new_tokens"] == 6 and len(out["prompts"]) == len(PROMPTS) and out["all_identical"]
    with pytest.raises(ExportValidationError, match="the graph's greedy tokens differ from PyTorch's at step"):
        greedy_in_pieces(tmp_path / "fp32", genai_teacher(tok, seed=5, layers=3), tok, n=6)
