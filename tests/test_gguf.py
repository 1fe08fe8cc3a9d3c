"""``bdlora export gguf`` (issue 88): a teacher as llama.cpp's converter writes it, a student of the channels,
groups and layers forms as llama.cpp's ``deci`` architecture with per-layer head counts and MLP widths, written one
tensor at a time; read back by the gguf package and by transformers' own GGUF loader (an independent reader: it
undoes the rotary permutation and the tensor names), and, where llama-cpp-python is installed (the [llamacpp] extra,
its own CI leg), loaded in llama.cpp and held to PyTorch. What llama.cpp cannot express is refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_oneshot import shot_args
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.export.gguf import export_gguf_folder, layout, writer
from bdlora.export.settings import GgufExportConfig

HAS_LLAMA_CPP = __import__("importlib").util.find_spec("llama_cpp") is not None
# the [llamacpp] CI leg sets BDLORA_REQUIRE_LLAMACPP=1: there a missing llama-cpp-python fails these tests
needs_llama_cpp = pytest.mark.skipif(not HAS_LLAMA_CPP and os.environ.get("BDLORA_REQUIRE_LLAMACPP") != "1",
                                     reason='needs llama-cpp-python: pip install -e ".[llamacpp]"')


def _read(path):
    import gguf

    r = gguf.GGUFReader(str(path))
    keys = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    tensors = {t.name: t for t in r.tensors}
    return keys, tensors


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order back to HF's (the inverse of ``writer.permuted``)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _one_shot(env, out, ratio: str):
    r = CliRunner().invoke(app, shot_args(env, out, "--mac-ratio", ratio, "--forms", "channels,groups,layers"))
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def student(tiny_env, tmp_path_factory):
    """A one-shot student of the tiny teacher over channels, groups and layers at 1.8x: narrower MLPs, attention
    blocks keeping fewer key/value groups (here layer 0 kept both, the others one)."""
    return _one_shot(tiny_env, tmp_path_factory.mktemp("gguf") / "student", "1.8")


@pytest.fixture(scope="module")
def shallow(tiny_env, tmp_path_factory):
    """The same at 3x, beyond what pruning alone reaches: layers removed, the kept ones numbered from 0."""
    return _one_shot(tiny_env, tmp_path_factory.mktemp("gguf") / "shallow", "3")


@pytest.mark.parametrize("quant", ["f16", "q8_0", "q4_0"])
def test_a_teacher_is_read_back_by_transformers_gguf_loader(tiny_env, tmp_path, quant):
    """The teacher's file, dequantised by transformers' GGUF loader, gives the teacher's logits to the rounding of
    its type (f16: 2^-11 of each weight), and every tensor has the type the converter's rules give it."""
    from transformers import AutoModelForCausalLM

    info = export_gguf_folder(tiny_env["teacher"], tmp_path / "g", GgufExportConfig(quant=quant, validate=False))
    assert info["architecture"] == "llama" and info["structure"]["tensors"] == info["file"]["tensors"]
    keys, tensors = _read(tmp_path / "g" / "model.gguf")
    assert keys["general.architecture"] == "llama" and keys["llama.block_count"] == 4
    assert keys["llama.attention.head_count"] == 4 and keys["llama.attention.head_count_kv"] == 2
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    want = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}[quant]
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == want
    assert tensors["output.weight"].tensor_type.name == ("Q8_0" if quant == "q4_0" else want)
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "g"), gguf_file="model.gguf", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32)
    x = torch.from_numpy(np.random.default_rng(0).integers(0, ref.config.vocab_size, (2, 24)))
    with torch.no_grad():
        a, b = got(x).logits, ref(x).logits
    tol = {"f16": 2e-3, "q8_0": 2e-2, "q4_0": 0.3}[quant]
    assert float((a - b).abs().max()) <= tol * float(b.abs().max())
    assert (tmp_path / "g" / "Modelfile").read_text().splitlines()[1] == "FROM ./model.gguf"
    doc = json.loads((tmp_path / "g" / "export.json").read_text())
    assert doc["quant"] == quant and doc["file"]["vocab"]["pre"] == "gpt-2"


@pytest.mark.parametrize("which", ["student", "shallow"])
def test_a_student_of_pruned_blocks_is_deci_with_per_layer_shapes(request, tmp_path, which):
    """Every layer's query heads, key/value heads and MLP width in llama.cpp's per-layer arrays, the removed layers
    gone and the rest renumbered, and each tensor the student's own weight (q and k in llama.cpp's rotary order)."""
    from safetensors.torch import load_file

    student = request.getfixturevalue(which)
    info = export_gguf_folder(student, tmp_path / "g", GgufExportConfig(quant="f16", validate=False))
    cfg = json.loads((student / "config.json").read_text())
    weights = load_file(str(student / "model.safetensors"))
    n = cfg["num_hidden_layers"]
    heads = [weights[f"model.layers.{i}.self_attn.q_proj.weight"].shape[0] // 8 for i in range(n)]
    kv = [weights[f"model.layers.{i}.self_attn.k_proj.weight"].shape[0] // 8 for i in range(n)]
    ffn = [weights[f"model.layers.{i}.mlp.down_proj.weight"].shape[1] for i in range(n)]
    assert info["architecture"] == "deci" and max(ffn) < 64
    assert n < 4 if which == "shallow" else n == 4  # 3x is beyond what pruning reaches without removing a layer
    keys, tensors = _read(tmp_path / "g" / "model.gguf")
    assert sorted({int(t.split(".")[1]) for t in tensors if t.startswith("blk.")}) == list(range(n))
    assert keys["deci.block_count"] == n and keys["deci.attention.key_length"] == 8
    assert list(keys["deci.attention.head_count"]) == heads and list(keys["deci.attention.head_count_kv"]) == kv
    assert list(keys["deci.feed_forward_length"]) == ffn
    for i in range(n):
        q = np.asarray(tensors[f"blk.{i}.attn_q.weight"].data, dtype=np.float32)
        np.testing.assert_allclose(_unpermute(q, heads[i]), weights[f"model.layers.{i}.self_attn.q_proj.weight"],
                                   atol=2e-3)
        k = np.asarray(tensors[f"blk.{i}.attn_k.weight"].data, dtype=np.float32)
        np.testing.assert_allclose(_unpermute(k, kv[i]), weights[f"model.layers.{i}.self_attn.k_proj.weight"],
                                   atol=2e-3)
        down = np.asarray(tensors[f"blk.{i}.ffn_down.weight"].data, dtype=np.float32)
        np.testing.assert_allclose(down, weights[f"model.layers.{i}.mlp.down_proj.weight"], atol=2e-3)


def test_chunks_write_the_same_bytes(tiny_env, tmp_path, monkeypatch):
    """A tensor written in row chunks (an 8B embedding never whole in fp32) is byte for byte the one written whole."""
    export_gguf_folder(tiny_env["teacher"], tmp_path / "whole", GgufExportConfig(quant="q4_0", validate=False))
    seen = []
    real = writer.chunks

    def spy(src, p):
        for c in real(src, p):
            seen.append(c.nbytes)
            yield c

    monkeypatch.setattr(writer, "CHUNK_BYTES", 32 * 4 * 4)  # four rows of 32 columns
    monkeypatch.setattr(writer, "chunks", spy)
    export_gguf_folder(tiny_env["teacher"], tmp_path / "rows", GgufExportConfig(quant="q4_0", validate=False))
    assert len(seen) > 3 * 21 and min(seen) <= 32 * 4 * 4  # the tensors were written in row chunks
    a, b = ((tmp_path / d / "model.gguf").read_bytes() for d in ("whole", "rows"))
    assert a == b


def test_low_rank_modules_are_refused_or_multiplied_out(tiny_env, tmp_path):
    """A student holding low-rank pairs: one line naming them and the forms that can be written, exit 2, nothing
    written; with --merge-lowrank each pair is its product."""
    from safetensors.torch import load_file

    shot = tmp_path / "lr"
    r = CliRunner().invoke(app, shot_args(tiny_env, shot, "--mac-ratio", "1.3", "--forms", "lowrank"))
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", "gguf", str(shot), "--no-validate", "--out", str(tmp_path / "g")])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "low-rank module(s) (model.layers." in said
    assert "--forms channels,groups,layers" in said
    assert "--merge-lowrank" in said and not (tmp_path / "g").exists()
    r = CliRunner().invoke(app, ["export", "gguf", str(shot), "--no-validate", "--merge-lowrank", "--quant", "f16",
                                 "--out", str(tmp_path / "g")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g" / "export.json").read_text())
    assert doc["merged_lowrank"] and doc["architecture"] == "llama"
    name = doc["merged_lowrank"][0]
    w = load_file(str(shot / "model.safetensors"))
    product = w[f"{name}.proj_out.weight"].double() @ w[f"{name}.proj_in.weight"].double()
    i, proj = int(name.split(".")[2]), name.rsplit(".", 1)[1]
    gguf_name = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                 "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[proj]
    _, tensors = _read(tmp_path / "g" / "model.gguf")
    got = np.asarray(tensors[f"blk.{i}.{gguf_name}.weight"].data, dtype=np.float64)
    if proj in ("q_proj", "k_proj"):
        got = _unpermute(got, 4 if proj == "q_proj" else 2)
    np.testing.assert_allclose(got, product.numpy(), atol=2e-3 * float(product.abs().max()))


@pytest.mark.parametrize("argv,needle", [
    (["--quant", "q5_k"], "--quant 'q5_k': unknown (allowed: f16, q8_0, q4_0, q4_k_m)"),
    (["--quality-tokens", "1"], "--quality-tokens 1"),
    (["--max-ppl-change", "-1"], "--max-ppl-change -1.0: must be a finite fraction"),
])
def test_bad_flags_are_one_line(tiny_env, tmp_path, argv, needle):
    r = CliRunner().invoke(app, ["export", "gguf", str(tiny_env["teacher"]), *argv, "--out", str(tmp_path / "g")])
    assert r.exit_code == 2 and needle in " ".join(r.output.split()) and not (tmp_path / "g").exists()


@pytest.mark.skipif(HAS_LLAMA_CPP, reason="without llama-cpp-python only")
def test_k_quants_without_llama_cpp_are_one_line(tiny_env, tmp_path):
    r = CliRunner().invoke(app, ["export", "gguf", str(tiny_env["teacher"]), "--quant", "q4_k_m", "--out",
                                 str(tmp_path / "g")])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "llama.cpp's own quantizer" in said and ".[llamacpp]" in said


def test_a_vocab_head_and_a_gemma3_student_are_refused():
    """A draft's narrowed head, and a Gemma 3 of pruned blocks (llama.cpp's per-layer architecture is Llama's)."""
    cfg = {"model_type": "bdlora_mistral", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 10,
           "bdlora_modules": {"lm_head": {"form": "vocab", "keep": 5}}}
    with pytest.raises(Exception, match="llama.cpp's embedding and output share one vocabulary"):
        layout.plan_layout(cfg, {})
    shapes = {"model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 96)}
    for p in ("v_proj", "o_proj"):
        shapes[f"model.layers.0.self_attn.{p}.weight"] = (32, 64)
    for p in ("gate_proj", "up_proj"):
        shapes[f"model.layers.0.mlp.{p}.weight"] = (96, 64)
    gemma = {"model_type": "bdlora_gemma3_text", "num_attention_heads": 4, "num_key_value_heads": 2,
             "hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 10}
    with pytest.raises(Exception, match="a gemma3_text student with pruned blocks: llama.cpp's per-layer"):
        layout.plan_layout(gemma, shapes)


def test_the_pre_tokenizer_is_named_as_llama_cpp_names_it(tiny_env):
    """By the hash of how the tokenizer splits llama.cpp's check text; a plain ByteLevel one (the builtin and test
    tokenizers, GPT-2's regex) is gpt-2; anything else is refused rather than guessed."""
    from tokenizers import pre_tokenizers

    from bdlora.export.gguf import vocab
    from bdlora.export.gguf.pretokenizers import PRE_TOKENIZERS

    tok = tiny_env["tokenizer"]
    assert vocab.pre_tokenizer(tok) == "gpt-2"
    assert PRE_TOKENIZERS["855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"] == "smollm"
    qwen = next(r for r, n in vocab.SPLITS.items() if n == "qwen2")
    other = tok.__class__(tokenizer_object=tok.backend_tokenizer.__class__.from_str(tok.backend_tokenizer.to_str()))
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(__import__("tokenizers").Regex(qwen), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert vocab.pre_tokenizer(other) == "qwen2"  # a Qwen2 regex over a vocabulary the hash table does not know
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    with pytest.raises(Exception, match="is not one llama.cpp implements"):
        vocab.pre_tokenizer(other)


def test_llama3_rotary_factors_are_the_converters():
    """rope_freqs.weight for a Llama 3 rotary (llama.cpp reads the scaling from it): 1 for high frequencies, the
    factor for low ones, smoothed between (the converter's formula, in float32)."""
    cfg = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    f = layout.llama3_rope_factors(cfg, 64)
    assert len(f) == 32 and f[0] == 1.0 and f[-1] == 32.0 and all(1.0 <= x <= 32.0 for x in f)
    assert f == sorted(f) and layout.llama3_rope_factors({"rope_parameters": {"rope_type": "default"}}, 64) is None


@needs_llama_cpp
@pytest.mark.parametrize("which,quant", [("teacher", "f16"), ("teacher", "q4_k_m"), ("student", "q8_0")])
def test_llama_cpp_runs_the_file_as_pytorch_runs_the_model(tiny_env, student, tmp_path, which, quant):
    """llama.cpp loads the file: its tokens of held-out lines are the tokenizer's, its logits PyTorch's (f16 within
    the stated tolerance), its held-out perplexity within --max-ppl-change of PyTorch's."""
    src = tiny_env["teacher"] if which == "teacher" else student
    info = export_gguf_folder(src, tmp_path / "g", GgufExportConfig(quant=quant, quality_tokens=512))
    v = info["validation"]
    assert v["tokenizer"]["identical"] == v["tokenizer"]["lines"] > 0 and v["tokenizer"]["differ"] == []
    assert v["logits"]["argmax_agreement"] > (0.99 if quant == "f16" else 0.8)
    assert abs(v["quality"]["ppl_change"]) <= 0.1
    if quant == "f16":
        assert v["logits"]["max_abs_diff"] <= v["logits"]["tolerance"]


@needs_llama_cpp
def test_the_decode_benchmark_times_gguf_files_beside_genai_folders(tiny_env, tmp_path):
    """benchmarks/decode.py interleaves a GGUF file (llama.cpp) with a genai folder (no time is asserted: only that
    each row is a measurement)."""
    import sys
    from pathlib import Path

    from bdlora.export.genai import export_genai_folder
    from bdlora.export.settings import GenaiExportConfig
    from conftest import genai_teacher

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import decode

    genai_teacher(tiny_env["tokenizer"], tmp_path / "t")
    tiny_env["tokenizer"].save_pretrained(tmp_path / "t")
    export_genai_folder(tmp_path / "t", tmp_path / "g", GenaiExportConfig("int4", validate=False))
    export_gguf_folder(tmp_path / "t", tmp_path / "q", GgufExportConfig(quant="q4_0", validate=False))
    decode.main(["--folders", f"genai={tmp_path / 'g'},llama={tmp_path / 'q'}", "--threads", "1", "--prompt", "8",
                 "--tokens", "4", "--repeats", "2", "--out", str(tmp_path / "d.md")])
    rows = [r.split("|")[1:-1] for r in (tmp_path / "d.md").read_text().splitlines()[2:]]
    assert [r[2].strip() for r in rows] == ["genai", "llama"] and all(float(r[3]) > 0 for r in rows)


@pytest.mark.full
@needs_llama_cpp
def test_llama_cpps_own_server_answers_a_completion_from_a_students_file(student, tmp_path):
    """The student's GGUF served by llama.cpp's OpenAI-style server (``python -m llama_cpp.server``, llama-cpp-python's
    [server] extra), as a user deploying it would: a completion comes back, greedy, of the tokens asked."""
    import subprocess
    import sys
    import time

    import httpx

    from conftest import free_port

    pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python[server]")
    export_gguf_folder(student, tmp_path / "g", GgufExportConfig(quant="f16", validate=False))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(tmp_path / "g" / "model.gguf"),
                             "--port", str(port), "--n_ctx", "128"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def main", "max_tokens": 6, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["usage"]["completion_tokens"] >= 1 and isinstance(doc["choices"][0]["text"], str)
    finally:
        proc.kill()
        proc.wait()


def _families(tiny_env, root):
    """A tiny Qwen2 with q/k/v biases (rotated otherwise than Llama's, in llama.cpp's own qwen2 architecture) and a
    Gemma 3 with perturbed norms (1 + w in llama.cpp), each a folder with the tiny tokenizer."""
    from test_gemma3 import _perturbed, gemma3_config
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    tok = tiny_env["tokenizer"]
    torch.manual_seed(2)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128, tie_word_embeddings=True,
                                        eos_token_id=tok.eos_token_id))
    with torch.no_grad():
        for layer in qwen.model.layers:
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                m.bias.normal_(0, 0.1)
    qwen.save_pretrained(root / "qwen2")
    cfg = gemma3_config(len(tok), eos_token_id=tok.eos_token_id, max_position_embeddings=128,
                        query_pre_attn_scalar=16)  # the head size: the scale llama.cpp's gemma3 uses
    cfg.pop("model_type")
    torch.manual_seed(3)
    _perturbed(Gemma3ForCausalLM(Gemma3TextConfig(**cfg))).save_pretrained(root / "gemma3")
    for name in ("qwen2", "gemma3"):
        tok.save_pretrained(root / name)
    return root


@needs_llama_cpp
def test_qwen2_and_gemma3_run_in_llama_cpp_as_in_pytorch(tiny_env, tmp_path):
    """Qwen2 in llama.cpp's qwen2 and, pruned, in deci (its biases permuted with its rows into llama.cpp's rotary
    order), Gemma 3 in gemma3: each file's f16 logits are PyTorch's."""
    root = _families(tiny_env, tmp_path)
    r = CliRunner().invoke(app, shot_args({**tiny_env, "teacher": root / "qwen2"}, root / "qwen2-student",
                                          "--mac-ratio", "1.6", "--forms", "channels,groups"))
    assert r.exit_code == 0, r.output
    for name, arch in (("qwen2", "qwen2"), ("qwen2-student", "deci"), ("gemma3", "gemma3")):
        info = export_gguf_folder(root / name, tmp_path / f"{name}.gguf", GgufExportConfig(quant="f16",
                                                                                          quality_tokens=256))
        assert info["architecture"] == arch
        v = info["validation"]
        assert v["logits"]["max_abs_diff"] <= v["logits"]["tolerance"] and v["logits"]["argmax_agreement"] > 0.99
        assert abs(v["quality"]["ppl_change"]) < 0.01, (name, v["quality"])
    cfg = json.loads((root / "gemma3" / "config.json").read_text())
    with pytest.raises(Exception, match="query_pre_attn_scalar 24: llama.cpp's gemma3 scales queries by 1/sqrt"):
        layout.plan_layout({**cfg, "query_pre_attn_scalar": 24}, {})


@needs_llama_cpp
def test_bench_times_each_folders_gguf_beside_its_genai_folder_and_scores_it_in_llama_cpp(tiny_env, tmp_path,
                                                                                            monkeypatch):
    """bench --runtime genai,llamacpp: the student's and the teacher's GGUF files timed in the same run as their
    genai folders (batch 1), scored in llama.cpp on the same held-out blocks: at q8_0 within 1% of the fp32 graph's
    perplexity, each compared with the teacher's GGUF of its type on the front."""
    from conftest import genai_teacher

    monkeypatch.setenv("BDLORA_CACHE", str(tiny_env["cache"]))
    genai_teacher(tiny_env["tokenizer"], tmp_path / "teacher", seed=3, layers=4)  # head dim 16, as genai needs
    student = _one_shot({**tiny_env, "teacher": tmp_path / "teacher"}, tmp_path / "student", "1.5")
    out = tmp_path / "bench"
    r = CliRunner().invoke(app, ["bench", str(student), "--runtime", "genai,llamacpp", "--genai-precisions", "fp32",
                                 "--gguf-quants", "q8_0", "--scope", "model", "--batch-sizes", "1", "--seq-lens", "16",
                                 "--decode-tokens", "4", "--repeats", "2", "--warmup", "0", "--no-peers",
                                 "--no-own-forms", "--quality-tokens", "512", "--eval-data", "none", "--threads", "1",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "bench.json").read_text())
    timed = {(x["scope"], x["variant"], x["phase"]) for x in doc["results"]}
    for name in ("compressed-gguf-q8_0", "teacher-gguf-q8_0"):
        assert {("llamacpp", name, "prefill"), ("llamacpp", name, "decode")} <= timed
    assert {("genai", "compressed", "decode"), ("genai", "teacher", "decode")} <= timed
    front = {p["name"]: p for p in doc["front"]}
    for model, fp32 in (("compressed", "compressed"), ("teacher", "teacher")):
        assert front[f"{model}-gguf-q8_0"]["ppl"] == pytest.approx(front[fp32]["ppl"], rel=0.01)
    assert front["compressed-gguf-q8_0"]["vs_teacher"] == "teacher-gguf-q8_0"
    md = (out / "bench.md").read_text()
    assert "llama.cpp (llama-cpp-python" in md and "onnxruntime-genai and llama.cpp" in md


@needs_llama_cpp
def test_ship_recommends_per_runtime_with_llama_cpps_rows(tiny_env, tmp_path, monkeypatch):
    """ship --gguf q8_0: the teacher's GGUF and the student's beside their genai folders in the one bench; the
    recommendation answers in each runtime against the teacher there, and overall against the teacher's fastest
    export, naming the runtime; a GGUF answer's commands end in export gguf and llama.cpp's server."""
    from test_ship import tiny_ship_args

    res = CliRunner().invoke(app, tiny_ship_args(tiny_env, tmp_path, monkeypatch, "q8_0"))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {r["row"] for r in doc["rows"]} == {"teacher-int4", "compressed-int4", "teacher-gguf-q8_0",
                                               "compressed-gguf-q8_0"}
    assert set(doc["by_runtime"]) == {"genai", "llamacpp"}
    assert doc["by_runtime"]["llamacpp"]["teacher"]["row"] == "teacher-gguf-q8_0"
    fastest = min((r for r in doc["rows"] if r["name"] == "teacher"), key=lambda r: r["ms"])
    assert doc["reference"]["row"] == fastest["row"]
    for a in doc["answers"]:
        assert a["runtime"] in ("genai", "llamacpp")
    gguf_row = next(r for r in doc["rows"] if r["row"] == "compressed-gguf-q8_0")
    assert "export gguf" in gguf_row["commands"][-2] and "llama_cpp.server" in gguf_row["commands"][-1]
    md = (tmp_path / "ship" / "recommendation.md").read_text()
    assert "In llama.cpp, against the teacher's teacher-gguf-q8_0" in md and "In onnxruntime-genai" in md


# --- plan --runtime llamacpp: the structure's decode step timed in llama.cpp (bench.llamacpp_step) ---------------


@pytest.mark.parametrize("which", ["student", "shallow"])
def test_a_planned_structure_is_the_folder_llama_cpp_would_be_given(tiny_env, request, which):
    """From the report alone (no weights), each layer's heads, key/value heads and MLP width and the tensors of the
    folder holding them: exactly the compressed folder's tensor names and shapes, removed layers dropped."""
    from bdlora.bench.llamacpp_step import structure, tensors_of
    from bdlora.models.integrity import folder_tensors

    folder = request.getfixturevalue(which)
    teacher = json.loads((tiny_env["teacher"] / "config.json").read_text())
    report = json.loads((folder / "compression.json").read_text())
    layers = structure(teacher, report["modules"])
    assert len(layers) == teacher["num_hidden_layers"]
    kept = [s for s in layers if s is not None]
    assert len(kept) == json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert {k: tuple(v) for k, v in folder_tensors(folder).items()} == tensors_of(teacher, layers)


def test_a_zero_weight_file_has_the_exports_tensors_and_only_zeros(shallow, tmp_path):
    """The stand-in file of a structure holds what ``export gguf`` writes for the real folder (every tensor's name,
    shape and type), with zero weights, ones in the norms and the stand-in vocabulary's size."""
    from bdlora.bench.llamacpp_step import stand_in_vocab
    from bdlora.export.gguf.folder import planned

    settings = GgufExportConfig(quant="q8_0", validate=False)
    export_gguf_folder(shallow, tmp_path / "real", settings)
    lay, plan, _, config = planned(shallow, settings)
    writer.write_zero_gguf(tmp_path / "zero.gguf", lay, plan, "q8_0", "zero", stand_in_vocab(config["vocab_size"]))
    _, real = _read(tmp_path / "real" / "model.gguf")
    keys, zero = _read(tmp_path / "zero.gguf")
    assert {k: (tuple(t.shape), t.tensor_type.name) for k, t in zero.items()} == \
           {k: (tuple(t.shape), t.tensor_type.name) for k, t in real.items()}
    assert keys["general.architecture"] == "deci"
    for name, t in zero.items():
        data = np.asarray(t.data)
        assert (data == 1).all() if name.endswith("norm.weight") else not data.any(), name
    import gguf

    r = gguf.GGUFReader(str(tmp_path / "zero.gguf"))
    assert len(r.fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]


def test_plan_for_llama_cpp_refuses_what_it_cannot_hold_in_one_line(tiny_env, tmp_path):
    """A low-rank student has no llama.cpp form: refused before anything is written or timed (llama.cpp need not be
    here to say so); a --gguf without --runtime llamacpp and --runtime llamacpp without --precision likewise."""
    shot = tmp_path / "lr"
    made = CliRunner().invoke(app, shot_args(tiny_env, shot, "--mac-ratio", "1.3", "--forms", "lowrank"))
    assert made.exit_code == 0, made.output
    for argv, needle in (([str(shot), "--precision", "int4", "--runtime", "llamacpp"], "no llama.cpp form"),
                         ([str(shot), "--gguf", "q4_0"], "add --runtime llamacpp"),
                         ([str(shot), "--runtime", "llamacpp"], "add --precision int4"),
                         ([str(shot), "--precision", "int4", "--runtime", "llamacpp", "--gguf", "q5_k"], "q5_k")):
        r = CliRunner().invoke(app, ["plan", *argv])
        assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, (argv, r.output)


@pytest.mark.skipif(HAS_LLAMA_CPP, reason="the refusal of a machine without llama-cpp-python")
def test_plan_for_llama_cpp_without_it_names_the_extra(student):
    r = CliRunner().invoke(app, ["plan", str(student), "--precision", "int4", "--runtime", "llamacpp"])
    assert r.exit_code == 2 and ".[llamacpp]" in r.output


@needs_llama_cpp
def test_plan_predicts_a_students_step_in_llama_cpp_and_caches_it(shallow, tmp_path, monkeypatch):
    """plan --runtime llamacpp times the teacher's shapes (llama) and the student's (deci, its removed layers gone)
    in llama.cpp at the --gguf type and predicts their ratio; a second plan reads the cached times."""
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path / "cache"))
    argv = ["plan", str(shallow), "--precision", "int4", "--runtime", "llamacpp", "--gguf", "q8_0", "--threads", "1",
            "--json"]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout[r.stdout.index("{"):])["deployed"]
    kept = json.loads((shallow / "config.json").read_text())["num_hidden_layers"]
    assert d["runtime"] == "llamacpp" and d["precision"] == "q8_0" and d["threads"] == 1
    assert d["files"]["teacher"]["arch"] == "llama" and d["files"]["student"]["arch"] == "deci"
    assert d["decode_layers"] == kept < d["teacher_layers"] == 4
    assert d["files"]["student"]["bytes"] < d["files"]["teacher"]["bytes"]
    assert 0 < d["decode_us"] and 0 < d["decode_us_teacher"]
    assert d["predicted_decode_speedup"] == pytest.approx(d["decode_us_teacher"] / d["decode_us"])
    cached = Path(d["cache"])
    assert cached.is_file()
    stamp = cached.stat().st_mtime_ns
    again = CliRunner().invoke(app, argv)
    assert again.exit_code == 0 and cached.stat().st_mtime_ns == stamp
    assert json.loads(again.stdout[again.stdout.index("{"):])["deployed"]["decode_us"] == d["decode_us"]


@pytest.mark.skipif(HAS_LLAMA_CPP, reason="without llama-cpp-python only")
def test_the_table_names_the_extra_that_would_check_the_file(tiny_env, tmp_path):
    """Without llama-cpp-python the file is written unchecked, and the table says how to get the checks: with the
    extra's name, which rich read as a style tag and dropped ("pip install -e ".""), the hint was unusable."""
    r = CliRunner().invoke(app, ["export", "gguf", str(tiny_env["teacher"]), "--out", str(tmp_path / "g")])
    assert r.exit_code == 0, r.output
    assert 'pip install -e ".[llamacpp]"' in " ".join(r.output.replace("│", " ").split())
