import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.deployed.folder import save_model_folder
from bdlora.export.onnx import export_onnx_folder, load_ort_model
from bdlora.export.onnx.validate import TOLERANCE
from bdlora.models.load import load_model_folder
from bdlora.models.runtime import DecoderShape, DecoderSignature, greedy_generate, session
from conftest import compressed_student

D_MIXED = [0.0, 1.0, 0.0, 0.2, 0.0, 0.9, 0.0]


def _compressed_folder(tiny_model, tiny_env, path, d_values):
    _, model, report = compressed_student(tiny_model, d_values, seed=1)
    return save_model_folder(model, tiny_env["tokenizer"], path, report), report


@pytest.fixture(scope="module")
def mixed_export(tiny_env, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("onnx")
    teacher = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32)
    folder, report = _compressed_folder(teacher, tiny_env, root / "mixed", D_MIXED)
    info = export_onnx_folder(folder, root / "mixed.onnx", quantize="int8")
    return folder, root / "mixed.onnx", report, info


@pytest.mark.parametrize("kind", ["dense", "lowrank"])
def test_parity_dense_and_lowrank(tiny_env, tiny_model, tmp_path, kind):
    if kind == "dense":
        folder = tiny_env["teacher"]  # a plain HF Mistral folder (GQA 4/2)
    else:
        folder, _ = _compressed_folder(tiny_model, tiny_env, tmp_path / "lr", [0.0])
    info = export_onnx_folder(folder, tmp_path / "out")
    v = info["validation"]
    assert v["max_abs_diff"] <= TOLERANCE
    assert {(s["batch"], s["seq"], s["past"]) for s in v["shapes"]} >= {(1, 1, 0), (2, 1, 5), (3, 4, 3)}
    assert any(s["left_pad"] for s in v["shapes"])
    forms = set(info["summary"]["forms"])
    assert forms == ({"dense"} if kind == "dense" else {"lowrank"})


def test_mixed_parity_and_signature(mixed_export):
    _, onnx_dir, _, info = mixed_export
    assert info["validation"]["max_abs_diff"] <= TOLERANCE
    sess = session(onnx_dir / "model.onnx")
    ins = [(i.name, i.shape) for i in sess.get_inputs()]
    outs = [(o.name, o.shape) for o in sess.get_outputs()]
    assert ins[:3] == [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "total"]),
                       ("position_ids", ["batch", "seq"])]
    assert ins[3] == ("past_key_values.0.key", ["batch", 2, "past", 8])  # GQA: 2 KV heads, head dim 32/4
    assert outs[0][0] == "logits" and outs[1] == ("present.0.key", ["batch", 2, "total", 8])
    assert len(ins) == 3 + 2 * 4 and len(outs) == 1 + 2 * 4
    sig = DecoderSignature(4)  # the one declaration every exporter and caller reads
    assert [n for n, _ in ins] == sig.inputs and [n for n, _ in outs] == sig.outputs
    assert DecoderSignature.of_inputs([n for n, _ in ins]) == sig
    shapes = dict(ins + outs)
    assert all(shapes[n][axis] == dim for n, axes in sig.dynamic_axes().items() for axis, dim in axes.items())


def test_metadata_equals_compression_report(mixed_export):
    _, onnx_dir, report, _ = mixed_export
    meta = session(onnx_dir / "model.onnx").get_modelmeta().custom_metadata_map
    rows = json.loads(meta["bdlora.modules"])
    assert [r["name"] for r in rows] == [m["name"] for m in report["modules"]]
    for r, m in zip(rows, report["modules"]):
        assert r["form"] == m["form"] and r["rank"] == m["rank"]
        assert r["macs_per_token"] == m["macs_after"] and r["parameters"] == m["params_after"]
        assert (r["in_features"], r["out_features"]) == (m["in_features"], m["out_features"])
    summary = json.loads(meta["bdlora.summary"])
    assert summary["base_model_type"] == "mistral" and summary["budget"] == 0.4
    assert summary["speedup_vs_dense"] == report["speedup_vs_dense"]
    assert summary["dense_dropped"] == report["dense_dropped"]
    assert meta["bdlora.version"]
    import onnx

    names = set()
    for n in onnx.load(str(onnx_dir / "model.onnx")).graph.node:
        if "bdlora_module" in n.doc_string:  # one tag, or a list of tags on a fused q/k/v or gate/up MatMul
            tags = json.loads(n.doc_string)
            names.update(t["bdlora_module"] for t in (tags if isinstance(tags, list) else [tags]))
    assert names == {r["name"] for r in rows}
    assert mixed_export[3]["matmuls_fused"] > 0
    # metadata survives quantisation
    qmeta = session(onnx_dir / "model_int8.onnx").get_modelmeta().custom_metadata_map
    assert qmeta["bdlora.modules"] == meta["bdlora.modules"]


def test_hand_greedy_equals_torch(mixed_export, tiny_env):
    folder, onnx_dir, _, _ = mixed_export
    model, tok, _ = load_model_folder(folder)
    one = tok(["red green blue cyan magenta"], return_tensors="pt", return_token_type_ids=False)
    ref_one = model.generate(**one, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    shape = DecoderShape.of(model.config)
    hand = greedy_generate(session(onnx_dir / "model.onnx"), shape, one["input_ids"].numpy(), 10)
    np.testing.assert_array_equal(hand, ref_one.numpy())


@pytest.mark.optimum
def test_optimum_greedy_equals_torch(mixed_export, tiny_env):
    folder, onnx_dir, _, _ = mixed_export
    model, tok, _ = load_model_folder(folder)
    tok.padding_side = "left"
    enc = tok(["alpha beta gamma", "red green blue cyan magenta"], return_tensors="pt", padding=True,
              return_token_type_ids=False)
    ref = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    ort_model = load_ort_model(onnx_dir)
    assert ort_model.num_key_value_heads == 2  # the GQA fix: optimum alone would size the cache with 4 heads
    got = ort_model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(got, ref)


def test_optimum_missing_is_one_line_naming_the_extra(mixed_export, monkeypatch):
    import sys

    from bdlora.base.errors import UsageError

    _, onnx_dir, _, _ = mixed_export
    monkeypatch.setitem(sys.modules, "optimum.onnxruntime", None)  # what an environment without the extra sees
    with pytest.raises(UsageError) as e:
        load_ort_model(onnx_dir)
    msg = str(e.value)
    assert "\n" not in msg and 'pip install "bdlora[optimum]"' in msg


def test_optimized_export_fuses_norms_and_rotary_and_stays_exact(mixed_export, tmp_path):
    import onnx
    from onnx import numpy_helper

    folder, plain_dir, _, plain_info = mixed_export
    info = export_onnx_folder(folder, tmp_path / "opt.onnx", optimize=True, quantize="int8")
    layers = 4
    # per layer: q and k rotary, one residual+norm pair fused per norm after the first; the first norm stays plain
    assert info["fused_ops"] == {"RotaryEmbedding": 2 * layers, "SkipSimplifiedLayerNormalization": 2 * layers,
                                 "SimplifiedLayerNormalization": 1}
    assert info["validation"]["max_abs_diff"] <= TOLERANCE  # the same parity check as the plain export
    m = onnx.load(str(tmp_path / "opt.onnx" / "model.onnx"))
    assert {p.key for p in m.metadata_props} >= {"bdlora.modules", "bdlora.summary", "bdlora.version"}
    plain = onnx.load(str(plain_dir / "model.onnx"))
    assert sum(1 for n in m.graph.node if n.doc_string) == sum(1 for n in plain.graph.node if n.doc_string)
    caches = {n.input[2] for n in m.graph.node if n.op_type == "RotaryEmbedding"}
    for init in m.graph.initializer:
        if init.name in caches:  # the model's own RoPE over its positions
            assert numpy_helper.to_array(init).shape == (128, 4)
    model, tok, _ = load_model_folder(folder)
    one = tok(["red green blue cyan magenta"], return_tensors="pt", return_token_type_ids=False)
    ref = model.generate(**one, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    shape = DecoderShape.of(model.config)
    hand = greedy_generate(session(tmp_path / "opt.onnx" / "model.onnx"), shape, one["input_ids"].numpy(), 10)
    np.testing.assert_array_equal(hand, ref.numpy())
    hand8 = greedy_generate(session(tmp_path / "opt.onnx" / "model_int8.onnx"), shape,
                            one["input_ids"].numpy(), 10)  # int8 quantisation of the fused graph runs
    assert hand8.shape == hand.shape


def test_run_to_int8_export_reports_heldout_figures(tiny_env, tmp_path):
    """train -> compress -> export onnx --quantize int8 through the CLI; the int8 change is scored on the run's
    held-out slice, and the fp32 graph's perplexity equals the compressed torch model's."""
    from conftest import train_args

    run = tmp_path / "run"
    r = CliRunner().invoke(app, [*train_args(tiny_env, run), "--method", "budgeted", "--max-steps", "6",
                                 "--budget", "0.0", "--retention-ema", "0"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["compress", str(run), "--svd-max-rank", "8"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", "onnx", str(tmp_path / "run.compressed"), "--quantize", "int8", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    q = info["int8"]
    assert q["tokens"] == 512 and 0.5 <= q["argmax_agreement"] <= 1.0
    compressed_ppl = json.loads((tmp_path / "run.compressed" / "compression.json").read_text())["eval"][
        "compressed_val_ppl"]
    assert q["val_ppl_fp32"] == pytest.approx(compressed_ppl, rel=1e-4)
    assert abs(q["ppl_change"]) < 0.5
    assert (tmp_path / "run.compressed.onnx" / "model_int8.onnx").exists()


def test_cli_export_onnx_bad_input(mixed_export, tmp_path):
    folder = mixed_export[0]
    (tmp_path / "notamodel").mkdir()
    r = CliRunner().invoke(app, ["export", "onnx", str(tmp_path / "notamodel"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "not a model folder" in r.stderr
    r = CliRunner().invoke(app, ["export", "onnx", str(folder), "--out", str(tmp_path / "o"), "--opset", "9"])
    assert r.exit_code == 2 and "--opset 9: the exporter supports opsets 14.." in r.stderr
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("x")
    r = CliRunner().invoke(app, ["export", "onnx", str(folder), "--out", str(tmp_path / "taken")])
    assert r.exit_code == 2 and "exists and is not empty" in r.stderr
    r = CliRunner().invoke(app, ["export", "onnx", str(folder), "--out", str(tmp_path / "o"), "--quantize", "int4"])
    assert r.exit_code == 2 and "--quantize int4: unknown (allowed: int8)" in r.stderr


def test_validation_refuses_a_graph_that_computes_something_else(tiny_env, tmp_path):
    """The bound is rounding-sized: a graph whose weights differ from the model's by 0.1% in one projection is
    refused, both at the 1e-4 bound and at a model whose bound is NOISE_FACTOR x its large fp32 error (the huge
    residual stream of the second one drowns any change to a block's output, so its LM head is the one changed)."""
    from transformers import AutoModelForCausalLM

    from bdlora.export.onnx.validate import ExportValidationError, validate

    for name, scale in (("small", 1.0), ("big", 2e4)):
        m = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32)
        with torch.no_grad():
            m.model.embed_tokens.weight.mul_(scale)
            m.lm_head.weight.mul_(30 if scale > 1 else 1)
        m.save_pretrained(tmp_path / name)
        tiny_env["tokenizer"].save_pretrained(tmp_path / name)
        info = export_onnx_folder(tmp_path / name, tmp_path / f"{name}.onnx")["validation"]
        assert (info["tolerance"] > TOLERANCE) == (scale > 1)
        sess = session(tmp_path / f"{name}.onnx" / "model.onnx")
        changed = m.lm_head if scale > 1 else m.model.layers[1].mlp.down_proj
        with torch.no_grad():
            changed.weight.mul_(1.001)
        with pytest.raises(ExportValidationError, match="differs from PyTorch by") as e:
            validate(m.eval(), sess)
        worst = float(str(e.value).split("by ")[1].split(" ")[0])
        assert worst > 3 * info["tolerance"], (name, worst, info)  # well past the bound, not at its edge


def test_max_abs_diff_never_drops_a_nan():
    from bdlora.export.onnx.validate import max_abs_diff

    a = np.zeros((2, 3), np.float32)
    b = a.copy()
    assert max_abs_diff(a, b) == 0.0
    b[1, 2] = np.nan
    assert max_abs_diff(a, b) == float("inf")  # python's max() would have kept the finite value
    b[1, 2] = 0.5
    assert max_abs_diff(a, b) == 0.5


def test_validation_bound_follows_torchs_own_fp32_error(tiny_env, tmp_path):
    """On the tiny models fp32 rounding is far below 1e-4, so the bound stays 1e-4; a model whose own fp32 forward
    strays further from float64 (scaled up here, like SmolLM2's 17,000-sized activations) gets NOISE_FACTOR x that
    error."""
    from transformers import AutoModelForCausalLM

    from bdlora.export.onnx.validate import NOISE_FACTOR

    v = export_onnx_folder(tiny_env["teacher"], tmp_path / "a")["validation"]
    assert v["tolerance"] == TOLERANCE and 0 < v["torch_fp32_vs_fp64"] < TOLERANCE / NOISE_FACTOR
    m = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32)
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(2e4)  # a huge residual stream: the RMSNorms keep the function sane
        m.lm_head.weight.mul_(30)
    m.save_pretrained(tmp_path / "big")
    tiny_env["tokenizer"].save_pretrained(tmp_path / "big")
    v = export_onnx_folder(tmp_path / "big", tmp_path / "b")["validation"]
    assert v["tolerance"] == pytest.approx(NOISE_FACTOR * v["torch_fp32_vs_fp64"]) and v["tolerance"] > TOLERANCE
    assert v["noise_factor"] == NOISE_FACTOR
    from bdlora.cli import render
    from bdlora.cli.app import out

    with out.capture() as shown:
        render.onnx_export(json.loads((tmp_path / "b" / "export.json").read_text()), tmp_path / "b")
    assert f"= {NOISE_FACTOR:g} x torch's own fp32 error" in shown.get()  # the table names the factor applied
    assert v["max_abs_diff"] <= v["tolerance"]


def test_the_float64_reference_is_the_model_itself_and_leaves_it_as_it_was():
    """Parity measures PyTorch's own fp32 error against the model's float64 forward (``in_float64``: the model
    converted in place, no twin beside it); after the block every weight and buffer is bit for bit what it was, in
    its own dtype, and eager attention is eager again (SDPA inside, where eager float64 turns padded rows to NaN)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bdlora.export.onnx.validate import in_float64

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="eager", tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        fp32 = model(ids).logits
        with in_float64(model) as m:
            assert m is model and all(p.dtype == torch.float64 for p in model.parameters())
            assert model.config._attn_implementation == "sdpa"
            fp64 = model(ids).logits
    assert fp64.dtype == torch.float64 and 0 < float((fp64 - fp32.double()).abs().max()) < 1e-5
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers
    assert model.config._attn_implementation == "eager" and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fp32)
