"""``bdlora export genai``: the onnxruntime-genai graph (GroupQueryAttention, fused RMSNorm, shared-input first
factors) against PyTorch for every projection form and base family, the folder through ``og.Generator``, the
runtime's tokenizer, int8/int4 quality and its refusal threshold, and the CLI's errors."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from bdlora.base.errors import Checks, ConfigError, usable_cores
from bdlora.base.runs import row_name
from bdlora.base.threads import ThreadPool
from bdlora.bench.variants import dense_variant, lora_variant, synthetic_model
from bdlora.cli import app
from bdlora.deployed.folder import save_model_folder
from bdlora.export.decoder import DecoderLayout, build_decoder
from bdlora.export.genai import export_genai_folder
from bdlora.export.genai.validate import GENAI_SHAPES, graph_parity
from bdlora.export.onnx.validate import TOLERANCE, ExportValidationError
from bdlora.export.settings import GenaiExportConfig
from bdlora.models.load import load_model_folder
from bdlora.models.runtime import DecoderSignature, session
from conftest import compressed_student

D_MIXED = [0.0, 1.0, 0.0, 0.2, 0.0, 0.9, 0.0]


def _config(family: str, **kw) -> dict:
    base = {"model_type": family, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": family == "qwen2", "rope_theta": 10000.0}
    return {**base, **kw}


def _session(model, tmp_path, name="m"):
    proto = build_decoder(model, DecoderLayout.genai(64))
    onnx.save_model(proto, str(tmp_path / f"{name}.onnx"), save_as_external_data=True, location=f"{name}.data")
    return proto, session(tmp_path / f"{name}.onnx")


@pytest.mark.parametrize("family", ["mistral", "llama", "qwen2"])
@pytest.mark.parametrize("budget", [0.0, 0.6])
def test_graph_parity_every_form_and_family(family, budget, tmp_path):
    """Low-rank, mixed, dense and dense+LoRA projections, GQA 4/2, Qwen2's q/k/v biases and tied head: logits and
    present K/V within 1e-4 of PyTorch at every shape GQA takes, and over 6 decode steps fed back."""
    model, _ = synthetic_model(_config(family), budget, None, rank=8)
    for variant in (model, dense_variant(model), lora_variant(model, 4)):
        proto, sess = _session(variant, tmp_path)
        p = graph_parity(variant, sess)
        assert p["max_abs_diff"] <= TOLERANCE and p["decode_max_abs_diff"] <= TOLERANCE
        assert {(s["batch"], s["seq"], s["past"]) for s in p["shapes"]} == set(GENAI_SHAPES)
        ops = [n.op_type for n in proto.graph.node]
        assert ops.count("GroupQueryAttention") == 2 and ops.count("SkipSimplifiedLayerNormalization") == 4
        assert "Transpose" not in ops and "Softmax" not in ops  # attention and rotary live inside GQA


def test_shared_input_first_factors_are_one_matmul(tmp_path):
    """F = 0: every projection low-rank. q/k/v read one MatMul (their three first factors), gate/up another, o and
    down one each: 4 first-stage MatMuls + 7 second factors per layer, plus the LM head."""
    model, _ = synthetic_model(_config("mistral"), 0.0, None, rank=8)
    proto, _ = _session(model, tmp_path)
    names = [n.name for n in proto.graph.node if n.op_type == "MatMul"]
    firsts = [n for n in names if n.endswith("_in/MatMul")]
    assert len(firsts) == 2 * 4 and len(names) == 2 * (4 + 7) + 1
    assert "/model/layers.0/self_attn/q_k_v_in/MatMul" in firsts and "/model/layers.0/mlp/gate_up_in/MatMul" in firsts
    dense, _ = _session(dense_variant(model), tmp_path, "d")
    assert sum(n.op_type == "MatMul" for n in dense.graph.node) == 2 * 4 + 1  # qkv packed, gate+up fused, o, down


@pytest.fixture(scope="module")
def mixed_folder(tiny_env, tmp_path_factory):
    """A mixed compressed student of a 2-layer, hidden-64 teacher (head dim 16: GroupQueryAttention's minimum)."""
    from conftest import genai_teacher

    root = tmp_path_factory.mktemp("genai")
    teacher = genai_teacher(tiny_env["tokenizer"])
    _, model, report = compressed_student(teacher, D_MIXED, seed=1)
    return save_model_folder(model, tiny_env["tokenizer"], root / "mixed", report), root


def test_the_genai_graph_and_its_config_follow_the_decoder_signature(mixed_folder, tmp_path):
    """Names come from DecoderSignature (without position_ids: the genai attention derives them from the mask),
    and genai_config.json's templates name exactly the graph's cache inputs and outputs."""
    folder, _ = mixed_folder
    out = tmp_path / "g"
    export_genai_folder(folder, out, GenaiExportConfig(validate=False))
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    sig = DecoderSignature(2, position_ids=False)
    assert [i.name for i in graph.input] == sig.inputs and [o.name for o in graph.output] == sig.outputs
    assert DecoderSignature.of_inputs([i.name for i in graph.input]) == sig
    dec = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert [dec["inputs"]["past_key_names"] % i for i in range(2)] == [sig.past(i, "key") for i in range(2)]
    assert [dec["outputs"]["present_value_names"] % i for i in range(2)] == [sig.present(i, "value") for i in range(2)]
    assert dec["inputs"]["input_ids"] == sig.INPUT_IDS and dec["outputs"]["logits"] == sig.LOGITS


def test_export_folder_generates_like_torch(mixed_folder):
    """The folder loads in onnxruntime-genai; og.Generator's greedy tokens equal PyTorch's for every prompt; the
    runtime's tokenizer encodes and decodes like the model's; the module table rides in the graph."""
    import onnxruntime_genai as og

    folder, root = mixed_folder
    info = export_genai_folder(folder, root / "fp32")
    v = info["validation"]
    assert v["parity"]["max_abs_diff"] <= TOLERANCE
    assert v["generator"]["new_tokens"] == 32 and len(v["generator"]["prompts"]) == 4
    assert v["tokenizer"]["identical"]
    cfg = json.loads((root / "fp32" / "genai_config.json").read_text())
    assert cfg["model"]["type"] == "mistral" and cfg["search"]["past_present_share_buffer"] is True
    assert cfg["model"]["decoder"]["num_key_value_heads"] == 2 and cfg["model"]["decoder"]["head_size"] == 16
    meta = {p.key: p.value for p in onnx.load(str(root / "fp32" / "model.onnx"), load_external_data=False)
            .metadata_props}
    rows = json.loads(meta["bdlora.modules"])
    assert len(rows) == 2 * 7 and {r["form"] for r in rows} == set(info["summary"]["forms"])
    assert sorted(p.name for p in (root / "fp32").iterdir()) == [
        "compression.json", "config.json", "export.json", "genai_config.json", "generation_config.json", "model.onnx",
        "model.onnx.data", "model_all_logits.onnx", "tokenizer.json", "tokenizer_config.json"]
    assert v["last_position"]["max_abs_diff"] <= 1e-5  # the head on the last position only: the twin's last row
    last = onnx.load(str(root / "fp32" / "model.onnx"), load_external_data=False).graph.output[0]
    assert [d.dim_value or d.dim_param for d in last.type.tensor_type.shape.dim][:2] == ["batch_size", 1]
    assert info["files"]["model_all_logits.onnx"] < info["files"]["model.onnx.data"] / 10  # structure, no weights
    # the runtime itself, as a user drives it: greedy 10 tokens, decoded by its tokenizer
    m = og.Model(str(root / "fp32"))
    tok = og.Tokenizer(m)
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=20, do_sample=False)
    gen = og.Generator(m, params)
    gen.append_tokens(tok.encode("one two three"))
    while not gen.is_done():
        gen.generate_next_token()
    assert isinstance(tok.decode(gen.get_sequence(0)), str) and len(gen.get_sequence(0)) == 20


# int8 in pytest -m full (CI runs it): the README's test command keeps the deployed precision, int4, under 8 minutes
@pytest.mark.parametrize("precision,bits", [pytest.param("int8", 8, marks=pytest.mark.full), ("int4", 4)])
def test_quantized_export_reports_quality(mixed_folder, precision, bits):
    folder, root = mixed_folder
    info = export_genai_folder(folder, root / precision, GenaiExportConfig(precision))
    q, quant = info["validation"]["quality"], info["quantization"]
    assert quant["op"] == "MatMulNBits" and quant["lm_head_bits"] == 8 and quant["matmuls_fp32"] == 0
    assert quant["matmuls_quantized"] == sum(1 for n in onnx.load(str(root / precision / "model.onnx"),
                                                                     load_external_data=False).graph.node
                                             if n.op_type == "MatMulNBits")
    bit_set = {a.i for n in onnx.load(str(root / precision / "model.onnx"), load_external_data=False).graph.node
               if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bit_set == ({8} if precision == "int8" else {4, 8})
    assert 0.5 <= q["argmax_agreement"] <= 1.0 and q["tokens"] > 0
    assert q["ppl_change"] == pytest.approx(q["val_ppl_quantized"] / q["val_ppl_fp32"] - 1)
    assert not (root / precision / "fp32").exists()  # the fp32 reference graph served validation only


def test_the_quality_check_scores_as_many_tokens_as_asked_and_says_so(mixed_folder):
    """Issue 76: 256 blocks through both graphs ran past 22 minutes at 1B; --quality-tokens bounds the check to the
    first blocks of the same slice, and export.json records how many were scored."""
    folder, root = mixed_folder
    whole = export_genai_folder(folder, root / "q-all", GenaiExportConfig("int4"))["validation"]["quality"]
    cut = export_genai_folder(folder, root / "q-cut", GenaiExportConfig("int4", quality_tokens=256))
    q = cut["validation"]["quality"]
    assert whole["tokens"] > 256 and q["tokens"] == 256 and cut["settings"]["quality_tokens"] == 256
    with pytest.raises(ConfigError, match="--quality-tokens 256: scores a rounded graph against fp32"):
        GenaiExportConfig("fp32", quality_tokens=256).check(Checks()).done()


def test_quality_threshold_refuses_and_writes_nothing(tiny_env, tmp_path):
    """A student trained on the tiny corpus (so rounding costs it perplexity on that corpus's held-out slice) at int4
    with a 4-bit head, against a gate of 0.1%: refused in one line, and neither the folder nor its temporary twin is
    left."""
    from conftest import genai_teacher, pretrained, train_args

    pretrained(genai_teacher(tiny_env["tokenizer"]), tiny_env).save_pretrained(tmp_path / "teacher")
    tiny_env["tokenizer"].save_pretrained(tmp_path / "teacher")
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "run", "--teacher", str(tmp_path / "teacher"),
                                           "--method", "budgeted", "--student-layers", "2", "--max-steps", "4"))
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["compress", str(tmp_path / "run"), "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", "genai", str(tmp_path / "c"), "--precision", "int4", "--head-bits", "4",
                                 "--max-ppl-change", "0.001", "--out", str(tmp_path / "refused")])
    assert r.exit_code != 0 and "above --max-ppl-change 0.001" in r.output, r.output
    assert not (tmp_path / "refused").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".refused")]


def test_head_dim_gqa_cannot_take_is_one_line(tiny_env, tmp_path):
    r = CliRunner().invoke(app, ["export", "genai", str(tiny_env["teacher"]), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "head dim 8: onnxruntime's GroupQueryAttention" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_cli_export_genai(mixed_folder, tmp_path):
    folder, _ = mixed_folder
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--out", str(tmp_path / "g"), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["runtime"] == "onnxruntime-genai"
    # every phase's wall time, and every check the folder's validation ran among them (fp32: the generator's)
    assert list(info["seconds"]) == ["load", "export", "parity", "last_position", "tokenizer", "generator"]
    assert all(x >= 0 for x in info["seconds"].values()) and info["seconds"]["export"] == info["export_seconds"]
    # onnxruntime-genai runs a folder without a thread count on one thread: the export writes this machine's cores
    session_options = json.loads((tmp_path / "g" / "genai_config.json").read_text())["model"]["decoder"][
        "session_options"]
    assert session_options["intra_op_num_threads"] == usable_cores()
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--out", str(tmp_path / "t0"), "--threads", "0",
                                 "--no-validate"])
    assert r.exit_code == 0, r.output
    assert "intra_op_num_threads" not in json.loads((tmp_path / "t0" / "genai_config.json").read_text())["model"][
        "decoder"]["session_options"]
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--out", str(tmp_path / "o"), "--threads", "-2"])
    assert r.exit_code == 2 and "--threads -2: must be in [0, 512]" in r.stderr
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--out", str(tmp_path / "o"), "--precision", "int3"])
    assert r.exit_code == 2 and "--precision 'int3': unknown (allowed: fp32, int8, int4)" in r.stderr
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--out", str(tmp_path / "o"), "--context-length",
                                 "100000"])
    assert r.exit_code == 2 and "--context-length 100000: must be in [1, 128]" in r.stderr
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--out", str(tmp_path / "g")])
    assert r.exit_code == 2 and "exists and is not empty" in r.stderr
    assert not (tmp_path / "o").exists()


def test_generator_divergence_beyond_a_tie_is_an_error(mixed_folder, tmp_path):
    """The greedy check can fail: a graph whose LM head was perturbed generates other tokens, and the export says
    at which step and by what margin."""
    from bdlora.export.genai.validate import generator_greedy
    from bdlora.models.load import load_model_folder

    folder, root = mixed_folder
    export_genai_folder(folder, tmp_path / "g", GenaiExportConfig(validate=False))
    model, tok, _ = load_model_folder(folder)
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    with pytest.raises(ExportValidationError, match="og.Generator's greedy tokens differ from PyTorch's at step"):
        generator_greedy(tmp_path / "g", model, tok)
    assert np.isfinite(model.lm_head.weight.sum().item())


@pytest.mark.full  # moved out of the README's test command to keep it under 8 minutes; CI runs pytest -m full
def test_bench_genai_synthetic_with_builder_peers(tmp_path):
    """Synthetic mode through the CLI: every variant at fp32 and int4 through og.Generator, and the builder's own
    dense conversions as peer rows, with the ratios the report is made of."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**_config("llama"), "architectures": ["LlamaForCausalLM"]}))
    r = CliRunner().invoke(app, ["bench", "--model-config", str(cfg), "--budget", "0.0", "--lora-rank", "8",
                                 "--runtime", "genai", "--genai-precisions", "fp32,int4", "--batch-sizes", "1",
                                 "--seq-lens", "16", "--decode-tokens", "4", "--repeats", "2", "--warmup", "0",
                                 "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    variants = {x["variant"] for x in doc["results"]}
    assert variants == {"dense", "lora", "compressed", "dense-int4", "lora-int4", "compressed-int4", "builder-fp32",
                        "builder-int4"}, (variants, doc.get("genai_notes"))
    assert {x["scope"] for x in doc["results"]} == {"genai"}
    assert {(x["phase"], x["batch"], x["seq"]) for x in doc["results"]} == {("prefill", 1, 16), ("decode", 1, 16)}
    for x in doc["results"]:
        assert x["repeats"] == 2 and x["median_ms"] > 0
        if x["variant"] == "compressed":
            assert x["speedup_vs_builder"] > 0 and x["mac_ratio_vs_dense"] > 1 and "speedup_vs_lora" in x
        if x["variant"] == "compressed-int4":
            assert x["speedup_vs_builder"] > 0 and x["speedup_vs_dense_int4"] > 0
    md = (tmp_path / "b" / "bench.md").read_text()
    assert "onnxruntime-genai (og.Generator" in md and "| int4 | decode | 1x1 (cache 16) |" in md
    builder_cfg = json.loads((tmp_path / "b" / "graphs" / "genai-builder-fp32" / "genai_config.json").read_text())
    assert builder_cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] == doc["threads"]


def test_bench_genai_without_fp32_compares_at_the_precision_it_was_given(tmp_path):
    """--genai-precisions int8,int4 (no fp32 dense to divide by): the report still comes out, each quantised student
    beside the dense graph at its own precision and its MAC limit (a KeyError traceback before)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**_config("llama"), "architectures": ["LlamaForCausalLM"]}))
    r = CliRunner().invoke(app, ["bench", "--model-config", str(cfg), "--budget", "0.0", "--lora-rank", "8",
                                 "--runtime", "genai", "--genai-precisions", "int8,int4", "--no-peers",
                                 "--batch-sizes", "1", "--seq-lens", "16", "--decode-tokens", "2", "--repeats", "2",
                                 "--warmup", "0", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert {x["variant"] for x in doc["results"]} == {"dense-int8", "lora-int8", "compressed-int8", "dense-int4",
                                                      "lora-int4", "compressed-int4"}
    for x in doc["results"]:
        if x["variant"].startswith("compressed"):
            p = x["variant"].split("-")[1]
            assert x[f"speedup_vs_dense_{p}"] > 0 and x["mac_ratio_vs_dense"] > 1 and "speedup_vs_dense" not in x
    assert "| int4 | decode | 1x1 (cache 16) |" in (tmp_path / "b" / "bench.md").read_text()


def test_bench_genai_on_a_compressed_folder_and_bad_options(mixed_folder, tmp_path):
    folder, _ = mixed_folder
    r = CliRunner().invoke(app, ["bench", str(folder), "--runtime", "genai", "--no-peers", "--batch-sizes", "1",
                                 "--seq-lens", "8", "--decode-tokens", "2", "--repeats", "1", "--warmup", "0",
                                 "--genai-precisions", "fp32", "--quality-tokens", "0", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert {x["variant"] for x in doc["results"]} == {"dense", "lora", "compressed"}
    tok = json.loads((tmp_path / "b" / "graphs" / "genai-compressed" / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|endoftext|>"  # the model's own tokenizer, not the synthetic stand-in
    # --no-own-forms (ship's bench): the model's own dense and LoRA forms are neither exported nor timed, and the
    # compressed row keeps its MAC ratios (from the projection shapes)
    r = CliRunner().invoke(app, ["bench", str(folder), "--runtime", "genai", "--no-own-forms", "--batch-sizes", "1",
                                 "--seq-lens", "8", "--decode-tokens", "2", "--repeats", "1", "--warmup", "0",
                                 "--genai-precisions", "fp32", "--quality-tokens", "0", "--out", str(tmp_path / "n")])
    assert r.exit_code == 0, r.output
    lean = json.loads((tmp_path / "n" / "bench.json").read_text())
    assert {x["variant"] for x in lean["results"]} == {"compressed"}
    assert sorted(p.name for p in (tmp_path / "n" / "graphs").glob("genai-*") if p.is_dir()) == [
        "genai-compressed"]
    assert lean["mac_per_token_modules"] == doc["mac_per_token_modules"]
    assert lean["results"][0]["mac_ratio_vs_dense"] == pytest.approx(
        next(x for x in doc["results"] if x["variant"] == "compressed")["mac_ratio_vs_dense"])
    assert "no builder row of the model's dense form" in lean["genai_notes"]["builder"]
    for args, needle in ((["--runtime", "tvm"], "--runtime 'tvm': unknown (allowed: ort, genai, llamacpp, both, all)"),
                         (["--no-own-forms"], "--no-own-forms: leaves the dense and LoRA rows out of the genai bench"),
                         (["--genai-precisions", "fp32,int3"], "--genai-precisions 'int3': unknown"),
                         (["--runtime", "genai", "--provider", "cuda"], "--provider")):
        r = CliRunner().invoke(app, ["bench", str(folder), *args, "--out", str(tmp_path / "x")])
        assert r.exit_code == 2 and needle in r.stderr, (args, r.stderr)
        assert not (tmp_path / "x").exists()


# bench's default precisions, all three, in pytest -m full (CI runs it); fp32 and int4 (the builder's two) in the
# README's test command, to keep it under 8 minutes on a busy machine
@pytest.mark.parametrize("precisions", ["fp32,int4", pytest.param("fp32,int8,int4", marks=pytest.mark.full)])
def test_bench_puts_the_student_and_its_teachers_exports_on_one_front(tiny_env, tmp_path, monkeypatch, precisions):
    """Issue 40: a one-shot student of a (head dim 16) teacher, benched in onnxruntime-genai at fp32, int8 and int4
    beside the teacher exported the same way and by onnxruntime-genai's builder: every folder timed and scored on the
    same held-out slice, every point marked on the front or dominated, the plot written."""
    shown = precisions.split(",")
    suffixes = [f"-{p}" if p != "fp32" else "" for p in shown]
    from conftest import genai_teacher

    genai_teacher(tiny_env["tokenizer"], tmp_path / "teacher")
    for ratio, name in (("1.4", "s"), ("1.2", "other")):
        r = CliRunner().invoke(app, ["compress", str(tmp_path / "teacher"), "--one-shot", "--mac-ratio", ratio,
                                     "--data", str(tiny_env["corpus"]), "--cache-dir", str(tiny_env["cache"]),
                                     "--seq-len", "32", "--calib-tokens", "512", "--eval-tokens", "512",
                                     "--heldout-fraction", "0.1", "--no-eval", "--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
    import bdlora.bench.speculative as spec

    for name, value in (("SPEC_PROMPTS", 2), ("SPEC_PROMPT_TOKENS", 16), ("SPEC_NEW_TOKENS", 8), ("SPEC_REPEATS", 1),
                        ("SPEC_WARMUP", 0), ("SPEC_KS", (1, 2))):
        monkeypatch.setattr(spec, name, value)  # a short speculative run of the same code
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "s"), "--runtime", "genai", "--batch-sizes", "1",
                                 "--seq-lens", "16", "--decode-tokens", "2", "--repeats", "2", "--warmup", "0",
                                 "--quality-tokens", "512", "--also", str(tmp_path / "other"), "--icl",
                                 "--icl-examples", "1", "--speculative", "--genai-precisions", precisions,
                                 "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    # --speculative: the teacher's export at each precision with the student's as its draft, and prompt lookup;
    # every token the teacher's own; on the front with the teacher's perplexity
    assert sorted(doc["speculative"]) == sorted(shown)
    for p in shown:
        s = doc["speculative"][p]
        assert {r["config"] for r in s["rows"]} == {"plain", "draft-k1", "draft-k2", "draft", "lookup-k2", "lookup"}
        assert all(r["identical"] and r["tokens"] == 16 for r in s["rows"])
        assert s["summary"]["draft-k2"]["tokens_per_target_call"] > 1.0 or s["summary"]["draft-k2"]["acceptance"] == 0
        teacher = row_name("teacher", p)
        assert doc["quality"][f"spec-draft-{p}"]["ppl"] == doc["quality"][teacher]["ppl"]
    assert "speculative decoding, teacher int4" in r.output
    # --icl: the student's, the other student's and the teacher's rows at every precision carry an ICL composite;
    # dense/lora compute the student's function and the builder's graphs have no plain twin
    with_icl = {k for k, v in doc["quality"].items() if "icl" in v}
    assert with_icl == {f"{n}{p}" for n in ("compressed", "other", "teacher") for p in suffixes}
    assert all(0.0 <= doc["quality"][k]["icl"] <= 100.0 and doc["quality"][k]["icl_examples"] == 1 for k in with_icl)
    assert "| ICL |" in (tmp_path / "b" / "bench.md").read_text()
    names = {p["name"] for p in doc["front"]}
    assert {f"{n}{p}" for n in ("teacher", "compressed", "other") for p in suffixes} | {
        "teacher-builder-fp32", "teacher-builder-int4"} <= names, (names, doc.get("genai_notes"))
    q = doc["quality"]
    assert q["teacher"]["tokens"] == 512 and all(v["ppl"] > 1 for v in q.values())
    # the teacher's fp32 graph (ours and the builder's) compute the same model: the same perplexity
    assert q["teacher-builder-fp32"]["ppl"] == pytest.approx(q["teacher"]["ppl"], rel=1e-3)
    for p in doc["front"]:
        assert p["front"] in (True, False) and (p["dominated_by"] is None) == p["front"]
    assert any(p["front"] for p in doc["front"])
    assert (tmp_path / "b" / "bench_front.png").stat().st_size > 10_000
    assert "Quality/speed front" in (tmp_path / "b" / "bench.md").read_text() and "quality/speed front" in r.output


def test_export_genai_gptq_is_calibrated_on_the_training_split_and_runs_in_the_same_kernel(mixed_folder, tmp_path):
    """--quant gptq through the CLI: every MatMul a MatMulNBits with integer zero points and accuracy level 4 (the
    round-to-nearest kernel), validated against the fp32 graph; --int8-share moves some to 8 bits; bad values refused
    in one line before anything is written."""
    folder, _ = mixed_folder
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--precision", "int4", "--quant", "gptq",
                                 "--calib-tokens", "1024", "--int8-share", "0.3", "--max-ppl-change", "1",
                                 "--out", str(tmp_path / "g"), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    q = info["quantization"]
    assert q["method"] == "gptq" and q["calibration_tokens"] == 1024 and q["matmuls_fp32"] == 0
    assert q["int8_matmuls"] and q["lm_head_bits"] == 8
    assert info["validation"]["quality"]["ppl_change"] < 1
    graph = onnx.load(str(tmp_path / "g" / "model.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all({a.name: a.i for a in n.attribute}["accuracy_level"] == 4 for n in nbits)
    zero_points = {i.name: i for i in graph.initializer}
    assert all(zero_points[n.input[3]].data_type == onnx.TensorProto.UINT8 for n in nbits)  # the fast kernel's
    for args, needle in ((["--quant", "hqq"], "--quant 'hqq': unknown (allowed: rtn, gptq, affine)"),
                         (["--int8-share", "0.5"], "--int8-share 0.5: is chosen by a calibrated scheme's measured "
                                                   "errors (give --quant gptq)"),
                         (["--int8-share", "1.5", "--quant", "gptq"], "--int8-share 1.5: must be in [0, 1]"),
                         (["--head-bits", "2"], "--head-bits 2: unknown (allowed: 4, 8)")):
        r = CliRunner().invoke(app, ["export", "genai", str(folder), "--precision", "int4", *args, "--out",
                                     str(tmp_path / "x")])
        assert r.exit_code == 2 and needle in r.stderr, (args, r.output)
        assert not (tmp_path / "x").exists()


def test_export_genai_affine_keeps_every_matmul_in_the_fast_kernel(mixed_folder, tmp_path):
    """--quant affine through the CLI (no calibration): every weight MatMul one MatMulNBits with integer zero points
    and accuracy level 4; those whose blocks divide K read [x, block means of x] (the offsets), the rest and the
    8-bit head do not; validated against the fp32 graph; the default folder name says the method."""
    folder, _ = mixed_folder
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--precision", "int4", "--quant", "affine",
                                 "--max-ppl-change", "1", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    out = Path(str(folder) + ".genai-int4-affine")
    q = info["quantization"]
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    inits = {i.name: i for i in graph.initializer}
    assert q["method"] == "affine" and q["matmuls_fp32"] == 0 and len(nbits) == q["matmuls_quantized"]
    k_of = {n.name: {a.name: a.i for a in n.attribute}["K"] for n in nbits}
    carried = [n for n in nbits if n.input[0].endswith("/with_blockmeans")]
    assert len(carried) == q["offset_corrections"] > 0
    assert all(k_of[n.name] % 33 == 0 for n in carried)  # K + K/32 columns
    assert all(inits[n.input[3]].data_type == onnx.TensorProto.UINT8 for n in nbits)
    assert all({a.name: a.i for a in n.attribute}["accuracy_level"] == 4 for n in nbits)
    assert abs(info["validation"]["quality"]["ppl_change"]) < 1


@pytest.mark.full  # moved out of the README's test command to keep it under 8 minutes; CI runs pytest -m full
def test_builder_rows_are_left_out_when_the_builder_would_take_an_mlp_for_the_lm_head(tmp_path):
    """onnxruntime-genai's builder takes every Linear with vocab_size outputs for the LM head. For a model whose MLP
    is as wide as its vocabulary (the builtin teacher: 1024 and 1024) its graph runs but computes something else;
    bench leaves those rows out with the reason. The builder is run once here too: the day it gets this right, this
    test says so and the guard can go."""
    import subprocess
    import sys

    from transformers import MistralForCausalLM

    from bdlora.bench.genai import _stand_in_tokenizer, builder_misreads, run_builder
    from conftest import tiny_config

    cfg = tiny_config(128, layers=1, hidden=64, intermediate_size=128)
    assert "intermediate_size is also 128" in builder_misreads(cfg)
    assert builder_misreads(tiny_config(128, layers=1, hidden=64, intermediate_size=192)) is None
    assert "query width is also 256" in builder_misreads(tiny_config(256, layers=1, hidden=64, head_dim=64))
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    _stand_in_tokenizer().save_pretrained(tmp_path / "hf")
    note = run_builder(tmp_path / "hf", tmp_path / "skipped", "fp32", 1, tmp_path / "cache")
    assert note == builder_misreads(cfg) and not (tmp_path / "skipped").exists()
    # the builder itself, on the same folder (run_builder would have refused): the logits come from layer 0's MLP
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tmp_path / "hf"), "-o",
                    str(tmp_path / "out"), "-p", "fp32", "-e", "cpu", "-c", str(tmp_path / "cache")],
                   check=True, capture_output=True)
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    head = next(n for n in graph.node if "logits" in n.output)
    assert head.input[0].startswith("/model/layers.0/"), head.input


@pytest.mark.parametrize("quant,head_bits", [("rtn", 8), ("affine", 8), ("affine", 4)])
def test_the_plain_twin_of_a_quantised_genai_graph_computes_the_same_logits(mixed_folder, quant, head_bits):
    """bench --icl probes each row on its plain-layout twin: the same weights rounded the same way, only the attention
    op differs, so on what both layouts take (batch 1, no padding, a prompt then decode steps) the logits agree to
    fp32 rounding (far below what int4 itself moves them)."""
    import onnxruntime as ort

    from bdlora.export.genai.folder import plain_graph, rounded, tied_head
    from bdlora.export.genai.quantize import LM_HEAD
    from bdlora.models.runtime import DecoderShape, empty_past, run_decoder

    folder, _ = mixed_folder
    model, _, _ = load_model_folder(folder)
    shape = DecoderShape.of(model.config)
    genai, _ = rounded(build_decoder(model, DecoderLayout.genai(64)), GenaiExportConfig("int4", quant, head_bits),
                       shape, tied=tied_head(model.config))
    twin = plain_graph(model, GenaiExportConfig("int4", quant, head_bits))
    for proto in (genai, twin):  # bench --head-bits: the LM head at those bits in both layouts
        head = next(n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.name.startswith(LM_HEAD))
        assert next(a.i for a in head.attribute if a.name == "bits") == head_bits
    fp32 = plain_graph(model, GenaiExportConfig())
    sessions = [ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"])
                for p in (genai, twin, fp32)]
    ids = np.random.default_rng(3).integers(0, shape.vocab_size, (1, 7))
    outs = []
    for sess in sessions:
        past, logits = empty_past(shape, 1), []
        for t0, t1 in ((0, 5), (5, 6), (6, 7)):
            res = run_decoder(sess, ids[:, t0:t1], np.ones((1, t1), np.int64), np.arange(t0, t1)[None], past)
            logits.append(res[0])
            past = res[1:]
        outs.append(np.concatenate(logits, 1))
    assert np.abs(outs[0] - outs[1]).max() < 1e-3
    assert np.abs(outs[1] - outs[2]).max() > 20 * np.abs(outs[0] - outs[1]).max()  # int4 moved them; the twin didn't


def test_bench_teacher_quant_rounds_the_teachers_folders_its_own_way(mixed_folder, tmp_path):
    """bench --teacher-quant: the teacher's int4 folder rounded by its method (affine: MatMulNBits reading
    [x, block means of x]), every other model's by --quant (gptq: the plain integer-grid nodes, calibrated); a bad
    method is refused in one line before anything is written."""
    from bdlora.bench.config import BenchConfig
    from bdlora.bench.genai import export_variants
    from bdlora.data.blocks import PackedBlocks

    folder, _ = mixed_folder
    model, tok, _ = load_model_folder(folder)
    gptq = GenaiExportConfig(quant="gptq")
    cfg = BenchConfig(rounding=gptq, teacher_quant="affine")
    assert (cfg.quant_of("teacher"), cfg.quant_of("compressed"), BenchConfig(rounding=gptq).quant_of("teacher")) == \
        ("affine", "gptq", "gptq")
    calib = PackedBlocks(np.random.default_rng(0).integers(0, model.config.vocab_size, 512), 32)
    folders, _ = export_variants({"teacher": model, "compressed": model}, tok, ["int4"], tmp_path, ThreadPool(1),
                                 False, settings=cfg.settings_for, calibration=calib)
    reads = {}
    for key in ("teacher-int4", "compressed-int4"):
        graph = onnx.load(str(folders[key] / "model.onnx"), load_external_data=False).graph
        reads[key] = {n.input[0].endswith("/with_blockmeans") for n in graph.node if n.op_type == "MatMulNBits"}
    assert reads == {"teacher-int4": {True, False}, "compressed-int4": {False}}  # the 8-bit head reads x itself
    r = CliRunner().invoke(app, ["bench", str(folder), "--runtime", "genai", "--teacher-quant", "hqq",
                                 "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and "--teacher-quant 'hqq'" in r.stderr and not (tmp_path / "b").exists(), r.output


def test_a_foreign_tokenizer_in_a_genai_folder_is_refused_by_every_reader(mixed_folder, tiny_env, tmp_path):
    """Issue 53, case 5: export.json records the tokenizer the folder was validated with; its reader (serve
    --runtime genai, through runtime.check_onnx_dir) refuses another one copied in (a smaller vocabulary: it loaded
    and ran)."""
    from bdlora.base.errors import ModelError
    from bdlora.models.runtime import check_onnx_dir
    from conftest import put_foreign_tokenizer

    folder, _ = mixed_folder
    out = tmp_path / "g"
    export_genai_folder(folder, out, GenaiExportConfig(validate=False))
    check_onnx_dir(out, "model.onnx", "genai")  # its own tokenizer passes
    put_foreign_tokenizer(out, tiny_env["corpus"])
    with pytest.raises(ModelError, match="its tokenizer \\(tokenizer.json\\) differs from the one recorded in "
                                         "export.json"):
        check_onnx_dir(out, "model.onnx", "genai")
    res = CliRunner().invoke(app, ["serve", str(out), "--runtime", "genai", "--port", "9"])
    assert res.exit_code == 2 and "differs from the one recorded in export.json" in res.stderr


def test_one_settings_object_checks_every_option_and_says_every_problem_at_once():
    """GenaiExportConfig is what export genai builds and the bench holds: every bad value and every option that
    does nothing at its precision refused together; the bench derives each row's settings from its own flags (the
    teacher rounded its way, --int8-share only where a calibrated scheme chooses it)."""
    from bdlora.base.errors import Checks, ConfigError
    from bdlora.bench.config import BenchConfig
    from bdlora.export.settings import DEFAULT

    with pytest.raises(ConfigError) as e:
        GenaiExportConfig("int8", "rtn", head_bits=4, int8_share=0.2, pool=ThreadPool(513), max_ppl_change=-1).check(
            Checks()).done()
    problems = e.value.problems
    assert len(problems) == 4 and problems[0].startswith("--head-bits 4: sets the LM head's bits of an int4 graph")
    assert any(p.startswith("--int8-share 0.2: is chosen by a calibrated scheme") for p in problems)
    assert any(p.startswith("--threads 513: must be") for p in problems)
    assert any(p.startswith("--max-ppl-change -1: must be a finite fraction") for p in problems)
    assert GenaiExportConfig("int4", "gptq").suffix == "-int4-gptq" and DEFAULT.suffix == ""
    assert GenaiExportConfig("int4", "gptq", 4, 0.1).at("fp32") == DEFAULT
    cfg = BenchConfig(runtime="genai", rounding=GenaiExportConfig(quant="gptq", head_bits=4, int8_share=0.1),
                      teacher_quant="affine").validate()
    student, teacher = cfg.settings_for("compressed", "int4"), cfg.settings_for("teacher", "int4")
    assert (student.quant, student.head_bits, student.int8_share, student.validate) == ("gptq", 4, 0.1, False)
    assert (teacher.quant, teacher.head_bits, teacher.int8_share) == ("affine", 4, 0.0)
    int8 = cfg.settings_for("compressed", "int8")  # the head's width is each model's (8 at int8, whatever it says)
    assert int8.head_bits is None and int8.resolved({"bdlora_head_bits": 4}).head_bits == 8
    assert cfg.settings_for("teacher", "fp32") == \
        GenaiExportConfig(validate=False)
    r = CliRunner().invoke(app, ["bench", "--runtime", "genai", "--int8-share", "0.1"])
    assert r.exit_code == 2 and "--int8-share 0.1: is chosen by a calibrated scheme" in r.output


@pytest.mark.parametrize("family,shared", [("qwen2", True), ("mistral", False)])
def test_quantised_export_stores_the_embedding_once(family, shared):
    """int4: the embedding's fp32 table is gone; a tied head's MatMulNBits weights serve the gather too
    (GatherBlockQuantized), an untied model gets its own 8-bit table; the logits stay within the rounding the
    embedding adds (each gathered row within one 8-bit step of the table's)."""
    import onnxruntime as ort

    from bdlora.export.genai.embedding import TABLE
    from bdlora.export.genai.folder import rounded
    from bdlora.export.genai.quantize import quantize_nbits
    from bdlora.models.runtime import DecoderShape, empty_past, run_decoder

    model, _ = synthetic_model(_config(family, vocab_size=256), 0.6, None, rank=8)
    shape = DecoderShape.of(model.config)
    proto = build_decoder(model, DecoderLayout.genai(64))
    once, info = rounded(proto, GenaiExportConfig("int4").resolved(model.config), shape, tied=shared)
    table, _ = quantize_nbits(proto, "int4")
    assert TABLE not in {t.name for t in once.graph.initializer} and TABLE in {t.name for t in table.graph.initializer}
    (gbq,) = [n for n in once.graph.node if n.op_type == "GatherBlockQuantized"]
    reshaped = next(n for n in once.graph.node if n.output[0] == gbq.input[0])
    head = next(n for n in once.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("/lm_head/"))
    assert (reshaped.input[0] == head.input[1]) == shared and info["bits"] == 8  # the 8-bit head's own codes
    held = [sum(len(t.raw_data) for t in p.graph.initializer) for p in (table, once)]
    saved = held[0] - held[1]
    assert saved >= 256 * 64 * 4 * (0.99 if shared else 0.70)  # the fp32 table (less an 8-bit copy when untied)
    once.graph.output.append(onnx.helper.make_tensor_value_info(gbq.output[0], onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(once.SerializeToString())
    table_rows = model.model.embed_tokens.weight.detach().numpy()
    step = (table_rows.max(1) - table_rows.min(1)).max() / 255  # an 8-bit grid's step over the widest block
    for start in range(0, 256, 32):  # GroupQueryAttention's rotary table holds 64 positions
        ids = np.arange(start, start + 32)[None]
        rows = run_decoder(sess, ids, np.ones_like(ids), None, empty_past(shape, 1))[-1][0]
        assert np.abs(rows - table_rows[start : start + 32]).max() <= step  # each row: the table's, rounded


def test_no_spin_writes_the_threads_to_sleep_and_onnxruntime_genai_takes_it(tiny_env, tmp_path):
    """export genai --no-spin: genai_config.json's session options carry onnxruntime's allow_spinning entry as a
    string (onnxruntime-genai passes unknown string options to onnxruntime; a number is refused), and the folder
    loads and generates."""
    import onnxruntime_genai as og

    from conftest import genai_teacher

    genai_teacher(tiny_env["tokenizer"], tmp_path / "t")
    tiny_env["tokenizer"].save_pretrained(tmp_path / "t")
    r = CliRunner().invoke(app, ["export", "genai", str(tmp_path / "t"), "--no-spin", "--no-validate", "--threads",
                                 "1", "--out", str(tmp_path / "g")])
    assert r.exit_code == 0, r.output
    options = json.loads((tmp_path / "g" / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert options["session.intra_op.allow_spinning"] == "0" and options["intra_op_num_threads"] == 1
    model = og.Model(str(tmp_path / "g"))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=8)
    gen = og.Generator(model, params)
    gen.append_tokens([[1, 2, 3]])
    gen.generate_next_token()
    assert len(gen.get_sequence(0)) == 4


def _spm_folder(tmp_path, unigram: bool = False) -> tuple[Path, object]:
    """A SentencePiece-style tokenizer (spaces normalised to ▁, decoded back) whose runs of ▁ are also added tokens
    with normalized=True, as ``own_tokenizer_rules`` gives Gemma 3's user-defined pieces, saved as a genai folder
    would hold it (tokenizer files, a genai_config.json)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from bdlora.base.io import write_json
    from bdlora.export.genai.config import base_type_of, genai_config

    s = "\u2581"
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [s * n for n in range(1, 6)] + list("abcdefx")
    if unigram:
        model = models.Unigram([(p, -float(len(p) == 1)) for p in pieces], unk_id=3, byte_fallback=False)
    else:
        model = models.BPE({p: i for i, p in enumerate(pieces)}, [(s, s), (s * 2, s * 2), (s * 2, s), (s * 4, s)],
                           unk_token="<unk>", fuse_unk=True)
    raw = Tokenizer(model)
    raw.normalizer = normalizers.Replace(" ", s)
    raw.decoder = decoders.Sequence([decoders.Replace(s, " "), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.backend_tokenizer.add_tokens([AddedToken(s * n, normalized=True, special=False) for n in range(2, 6)]
                                     + [AddedToken("<new>", normalized=False, special=False)])
    folder = tmp_path / ("unigram" if unigram else "bpe")
    tok.save_pretrained(folder)
    conf = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**conf, "tokenizer_class": "GemmaTokenizer"}))
    cfg = LlamaConfig(vocab_size=len(pieces) + 1, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=32, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    write_json(folder / "genai_config.json", genai_config(cfg, base_type_of(cfg), 64))
    return folder, tok


def test_a_genai_folder_keeps_user_defined_pieces_as_vocabulary_pieces_onnxruntime_genai_decodes(tmp_path):
    """onnxruntime-genai (ort-extensions) decodes an added token literally and never matches a normalized one, so
    Gemma 3's runs of spaces, added tokens for SentencePiece's matching, decoded as '▁▁def' (the CI failure of
    test_gemma3_preset_through_the_chain). The genai folder drops each such entry whose content is the vocabulary's
    piece of the same id: the runtime then decodes every id of the model's tokenizer to its text, and onnxruntime-
    genai and the tokenizers library (which serve and eval read a genai folder with) encode alike."""
    import onnxruntime_genai as og
    from tokenizers import Tokenizer

    from bdlora.export.genai.tokenizer import readable_by_genai

    folder, tok = _spm_folder(tmp_path)
    assert tok("     a", add_special_tokens=False)["input_ids"] == [8, 9]  # the added ▁▁▁▁▁, matched whole
    assert readable_by_genai(folder) == {
        "dropped_added_tokens": 4, "id_range": [5, 8],
        "why": "onnxruntime-genai never matches normalized added tokens and decodes added tokens literally; each is "
               "kept as the vocabulary piece of the same id"}
    spec = json.loads((folder / "tokenizer.json").read_text())
    kept = {t["content"] for t in spec["added_tokens"]}
    assert {"<pad>", "<eos>", "<bos>", "<unk>", "<new>"} <= kept and not any(c.startswith("\u2581") for c in kept)
    assert readable_by_genai(folder) is None  # nothing left to drop: the file is not rewritten
    runtime, fast = og.Tokenizer(og.Config(str(folder))), Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ["     a", "  a b", "ab  cx", "x     ", "a  b   c    d     e      f"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert runtime.decode(np.array(ids, dtype=np.int32)) == tok.decode(ids) == text
        assert [int(i) for i in runtime.encode(text)] == fast.encode(text, add_special_tokens=False).ids


def test_a_unigram_vocabularys_added_pieces_are_dropped_the_same_way(tmp_path):
    """A Unigram vocabulary (a list of [piece, score]) is matched by id as a BPE one (a dict) is."""
    from bdlora.export.genai.tokenizer import readable_by_genai

    folder, _ = _spm_folder(tmp_path, unigram=True)
    assert readable_by_genai(folder)["id_range"] == [5, 8]
    assert readable_by_genai(tmp_path / "nowhere") is None
