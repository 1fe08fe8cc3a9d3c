"""``bdlora.models.lazy``: synthetic models built without weights, which the exporter makes one layer at a time. A
lazily emitted graph is the graph of the same model with every weight made at once (nodes and initializers
identical), its logits equal PyTorch's, nothing stays materialized after the export, and the bench's variants of a
lazy model stay lazy."""

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from bdlora.bench.variants import dense_variant, lora_variant, synthetic_model
from bdlora.export.decoder import DecoderLayout, build_decoder
from bdlora.export.genai.validate import graph_parity
from bdlora.export.onnx.validate import TOLERANCE
from bdlora.models.lazy import INIT_STD, is_lazy, materialized, random_like
from bdlora.models.runtime import session


def _config(family: str) -> dict:
    return {"model_type": family, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": family == "qwen2", "rope_theta": 10000.0}


def _initializers(proto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}


def _nodes(proto) -> list:
    return [(n.op_type, list(n.input), list(n.output)) for n in proto.graph.node]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_lazy_model_emits_the_graph_of_its_materialized_twin(family, tmp_path):
    model, _ = synthetic_model(_config(family), 0.6, None, rank=8, lazy=True)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    assert meta and len(meta) == len(list(model.parameters())), "built without a single weight"
    lazy = build_decoder(model, DecoderLayout.genai(64))
    assert all(p.is_meta for p in model.parameters()), "nothing stays materialized after the export"
    with materialized(model):
        assert not is_lazy(model)
        if family == "qwen2":  # a tied head stays tied while made
            assert model.lm_head.weight is model.model.embed_tokens.weight
        whole = build_decoder(model, DecoderLayout.genai(64))
        a, b = _initializers(lazy), _initializers(whole)  # before saving moves them to the external file
        onnx.save_model(lazy, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data")
        parity = graph_parity(model, session(tmp_path / "m.onnx"))
    assert parity["max_abs_diff"] <= TOLERANCE and parity["decode_max_abs_diff"] <= TOLERANCE
    assert _nodes(lazy) == _nodes(whole)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert is_lazy(model)


def test_the_exporter_makes_one_layer_at_a_time(monkeypatch):
    """While layer i is emitted only its weights exist: every other layer, the embedding and the head are on the meta
    device (what keeps a 3B export within memory); a tied head made alone gets the embedding's values."""
    import bdlora.export.decoder.graph as graph

    model, _ = synthetic_model(_config("qwen2"), 0.6, None, rank=8, lazy=True)
    seen, emit = [], graph._layer

    def checked(g, layout, i, layer, *rest):
        real = [j for j, x in enumerate(model.model.layers) if not is_lazy(x)]
        seen.append((i, real, model.model.embed_tokens.weight.is_meta, model.lm_head.weight.is_meta))
        return emit(g, layout, i, layer, *rest)

    monkeypatch.setattr(graph, "_layer", checked)
    build_decoder(model, DecoderLayout.genai(64))
    assert seen == [(0, [0], True, True), (1, [1], True, True), (2, [2], True, True)]
    with materialized(model, "lm_head"):
        head = model.lm_head.weight.clone()
        assert model.model.embed_tokens.weight.is_meta
    with materialized(model, "model.embed_tokens"):
        assert torch.equal(head, model.model.embed_tokens.weight)


def test_the_bench_variants_of_a_lazy_model_stay_lazy(tmp_path):
    model, _ = synthetic_model(_config("llama"), 0.6, None, rank=8, lazy=True)
    dense = dense_variant(model)
    assert all(p.is_meta for p in dense.parameters())
    lora = lora_variant(model, 4)
    real = sorted(n.rsplit(".", 1)[1] for n, p in lora.named_parameters() if not p.is_meta)
    assert real == ["lora_A"] * 21 + ["lora_B"] * 21  # only the adapters (3 layers x 7 projections)
    for variant in (dense, lora):
        proto = build_decoder(variant, DecoderLayout.genai(64))
        onnx.save_model(proto, str(tmp_path / "v.onnx"), save_as_external_data=True, location="v.data")
        with materialized(variant):
            parity = graph_parity(variant, session(tmp_path / "v.onnx"))
        assert parity["max_abs_diff"] <= TOLERANCE


def test_materialized_values_are_seeded_by_name():
    w = torch.empty(256, 64, device="meta")
    a, b = random_like(w, "model.layers.0.mlp.up_proj.weight"), random_like(w, "model.layers.1.mlp.up_proj.weight")
    assert a.shape == (256, 64) and a.dtype == torch.float32
    assert torch.equal(a, random_like(w, "model.layers.0.mlp.up_proj.weight"))
    assert not torch.equal(a, b) and not torch.equal(a, random_like(w, "model.layers.0.mlp.up_proj.weight", seed=1))
    assert abs(a.std().item() - INIT_STD) < 0.002 and abs(a.mean().item()) < 0.001
    assert torch.equal(random_like(torch.empty(64, device="meta"), "model.norm.weight"), torch.ones(64))
