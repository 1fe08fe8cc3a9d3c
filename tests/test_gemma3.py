"""Gemma 3 through the family table: a tiny gemma3-shaped model (GELU-gated MLP, query/key norms, four norms per
layer with ``1 + w``, scaled embeddings, sliding and full attention layers with their own rotary bases, tied head)
in both graph layouts against PyTorch beyond its window, and a tiny Gemma 3 teacher through train, compress, export
onnx/genai, eval and bench from the CLI. The real Gemma 3 270M runs the chain in test_e2e (``-m full``)."""

import json

import onnx
import pytest
import torch
from typer.testing import CliRunner

from bdlora.bench.variants import dense_variant, synthetic_model
from bdlora.cli import app
from bdlora.export.decoder import DecoderLayout, build_decoder
from bdlora.export.genai.validate import GENAI_SHAPES, graph_parity
from bdlora.export.onnx.validate import validate
from bdlora.models.runtime import session

WINDOW = 3  # shorter than every validation shape's sequence: the windowed layers' masks are exercised


def gemma3_config(vocab: int = 96, layers: int = 3, **kw) -> dict:
    """Head dim 16 (GroupQueryAttention's minimum), 4 query heads on 2 KV heads, the local layers first as in
    Gemma 3's 5:1 pattern, a query scale other than head_dim's."""
    kinds = ["sliding_attention", "full_attention", "sliding_attention"][:layers]
    return {"model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 64, "tie_word_embeddings": True, "sliding_window": WINDOW,
            "layer_types": kinds, "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}, **kw}


def _perturbed(model):
    """Gemma's norms start at weight 0 (a scale of 1 + 0): random weights, so a missing offset or a norm read from
    the wrong place shows."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _saved(proto, tmp_path, name):
    onnx.save_model(proto, str(tmp_path / f"{name}.onnx"), save_as_external_data=True, location=f"{name}.data")
    return session(tmp_path / f"{name}.onnx")


@pytest.mark.parametrize("budget", [0.0, 0.6])
def test_gemma3_graphs_equal_pytorch_beyond_the_window(budget, tmp_path):
    """Low-rank and mixed projections: the genai graph (GroupQueryAttention with separate normed q/k, each layer its
    window and rotary caches, FastGelu) and the ONNX folder's graph (plain attention, fused and unfused, left padded)
    within the validation tolerance of PyTorch at every shape, prompts longer than the window included."""
    model, _ = synthetic_model(gemma3_config(), budget, None, rank=8)
    for variant in (_perturbed(model), _perturbed(dense_variant(model))):
        proto = build_decoder(variant, DecoderLayout.genai(64))
        p = graph_parity(variant, _saved(proto, tmp_path, "g"))
        assert p["max_abs_diff"] <= p["tolerance"] and p["decode_max_abs_diff"] <= p["decode_tolerance"]
        assert {(s["batch"], s["seq"], s["past"]) for s in p["shapes"]} == set(GENAI_SHAPES)
        gqa = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
        windows = [next(a.i for a in n.attribute if a.name == "local_window_size") for n in gqa]
        assert windows == [WINDOW, -1, WINDOW]
        assert [n.input[7] for n in gqa] == ["cos_cache_sliding_attention", "cos_cache_full_attention",
                                             "cos_cache_sliding_attention"]
        ops = [n.op_type for n in proto.graph.node]
        assert ops.count("FastGelu") == 3 and ops.count("SimplifiedLayerNormalization") == 3 * (2 + 2) + 1
        for fused in (False, True):
            plain = build_decoder(variant, DecoderLayout.plain(variant.config, 17, fused))
            v = validate(variant, _saved(plain, tmp_path, f"p{fused}"))
            assert v["max_abs_diff"] <= v["tolerance"]


def test_a_mistral_sliding_window_is_the_same_window_in_both_graphs(tmp_path):
    """transformers' ``sliding_window`` W lets a query see W keys, its own included; GroupQueryAttention's
    ``local_window_size`` takes the same W (a W - 1 fails this test), as does the plain graph's mask."""
    cfg = {"model_type": "mistral", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "sliding_window": WINDOW}
    model, _ = synthetic_model(cfg, 0.6, None, rank=8)
    p = graph_parity(model, _saved(build_decoder(model, DecoderLayout.genai(64)), tmp_path, "g"))
    assert p["max_abs_diff"] <= p["tolerance"] and p["decode_max_abs_diff"] <= p["decode_tolerance"]
    v = validate(model, _saved(build_decoder(model, DecoderLayout.plain(model.config, 17)), tmp_path, "p"))
    assert v["max_abs_diff"] <= v["tolerance"]


@pytest.fixture(scope="module")
def gemma3_teacher(tiny_env, tmp_path_factory):
    """A tiny Gemma 3 (2 local layers and a global one) with the tiny tokenizer, a few seconds of pretraining on the
    tiny corpus, saved as a teacher folder."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from conftest import pretrained

    tok = tiny_env["tokenizer"]
    torch.manual_seed(0)
    cfg = gemma3_config(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, max_position_embeddings=128)
    cfg.pop("model_type")
    model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg))
    model = pretrained(model, tiny_env)
    folder = tmp_path_factory.mktemp("gemma3") / "teacher"
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_gemma3_teacher_goes_through_the_chain(tiny_env, gemma3_teacher, tmp_path):
    """train (budgeted, its three layers), compress, export onnx and genai (each validated against PyTorch before
    it is written), eval of the ONNX folder, and a one-shot compress, all from the CLI; the folders say gemma3."""
    from conftest import train_args

    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "run", "--teacher", str(gemma3_teacher),
                                           "--method", "budgeted", "--student-layers", "3", "--max-steps", "4"))
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["compress", str(tmp_path / "run"), "--out", str(tmp_path / "c"), "--json"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["model_type"] == "bdlora_gemma3_text" and cfg["layer_types"][1] == "full_attention"
    for kind, extra in (("onnx", []), ("genai", ["--precision", "int4"])):
        r = CliRunner().invoke(app, ["export", kind, str(tmp_path / "c"), "--out", str(tmp_path / kind), "--json",
                                     *extra])
        assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "onnx" / "export.json").read_text())
    assert meta["validation"]["max_abs_diff"] <= meta["validation"]["tolerance"]
    assert json.loads((tmp_path / "genai" / "genai_config.json").read_text())["model"]["type"] == "gemma3_text"
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "onnx"), "--ppl", "--report", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "e.json").read_text())["ppl"]["val_ppl"] < len(tiny_env["tokenizer"])
    from test_channels import shot

    r = shot(tiny_env, gemma3_teacher, tmp_path / "s", "--mac-ratio", "1.2")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["speedup_vs_dense"] >= 1.2


def test_a_model_whose_tokenizer_starts_with_bos_sees_it_at_the_start_of_every_block(tiny_env):
    """Gemma's tokenizer starts every text with BOS and the model is never run without it (its held-out perplexity
    in blocks of 128: 20.9 with, 160.7 without): packed blocks, documents and every corpus a tokenizer like it
    tokenises start each sequence with BOS; a tokenizer that adds none (the builtin's, SmolLM2's) keeps them as
    they were."""
    import copy

    import numpy as np
    from tokenizers.processors import TemplateProcessing

    from bdlora.data.blocks import DocumentBlocks, PackedBlocks
    from bdlora.data.documents import Corpus
    from bdlora.data.tokens import bos_first, tokenize_corpus

    stream = np.arange(100)
    b = PackedBlocks(stream, 10, bos=7)
    assert len(b) == 11 and b.get([0, 1]).tolist() == [[7, *range(0, 9)], [7, *range(9, 18)]]
    assert len(PackedBlocks(stream, 10, max_tokens=30, bos=7)) == 3 and len(PackedBlocks(stream, 10)) == 10
    docs = DocumentBlocks(np.array([5, 6, 0, 8, 9, 10, 11, 12, 0]), 4, eos=0, bos=7)
    ids, mask = docs.batch([0, 1])
    assert ids.tolist() == [[7, 5, 6, 0], [7, 8, 9, 10]] and mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    plain = tiny_env["tokenizer"]
    assert bos_first(plain) is None
    tok = copy.deepcopy(plain)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    assert bos_first(tok) == tok.bos_token_id
    corpus = Corpus(str(tiny_env["corpus"]))
    data = tokenize_corpus(corpus, tok, 0.1, tiny_env["cache"])
    assert data.bos == tok.bos_token_id and tokenize_corpus(corpus, plain, 0.1, tiny_env["cache"]).bos is None
