"""``export genai --streaming``: a model read, emitted, rounded and written one layer at a time gives the graph the
in-memory path gives (the same nodes and the same initialiser values, so the same logits), for every rounding the
streamed path takes, tied and untied heads, Qwen2's biases and a compressed student's low-rank forms; a lazy
model's layer-by-layer forward is the loaded model's; what the streamed path cannot do is refused in one line."""

import json

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import numpy_helper
from safetensors.torch import load_file, save_file
from test_gemma3 import _perturbed as perturbed
from test_gemma3 import gemma3_config
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM
from typer.testing import CliRunner

from bdlora.base.errors import ConfigError, ModelError, UsageError
from bdlora.cli import app
from bdlora.data.blocks import PackedBlocks
from bdlora.deployed.folder import save_model_folder
from bdlora.export.genai import export_genai_folder, pieces
from bdlora.export.genai.gptq import input_grams
from bdlora.export.genai.quantize import ort_rtn, torch_rtn
from bdlora.export.genai.stream import CalibratedInputs
from bdlora.export.genai.validate import last_rows, runtime_last_position
from bdlora.export.onnx import export_onnx_folder
from bdlora.export.onnx.validate import ExportValidationError
from bdlora.export.settings import GenaiExportConfig
from bdlora.models.lazy import is_lazy
from bdlora.models.load import load_model_folder
from bdlora.models.runtime import DecoderShape, empty_past, run_decoder, session
from bdlora.models.stream import lazy_folder_model, score_streamed, streamed
from conftest import compressed_student, genai_teacher

ROUNDINGS = [("int4", "rtn"), ("int8", "rtn"), ("int4", "affine"), ("fp32", "rtn")]


def _graph(folder, name="model_all_logits.onnx"):
    proto = onnx.load(str(folder / name))  # with its external data
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    nodes = [(n.op_type, list(n.input), list(n.output), sorted((a.name, onnx.helper.get_attribute_value(a))
                                                               for a in n.attribute), n.doc_string)
             for n in proto.graph.node]
    return nodes, inits


def _same_graph(a, b) -> None:
    (na, ia), (nb, ib) = _graph(a), _graph(b)
    assert na == nb
    assert ia.keys() == ib.keys()
    for k in ia:
        assert ia[k].dtype == ib[k].dtype and np.array_equal(ia[k], ib[k]), k


def _logits(folder, vocab: int):
    shape = DecoderShape.from_folder(folder)
    ids = np.random.default_rng(0).integers(0, vocab, (2, 9))
    return run_decoder(session(folder / "model_all_logits.onnx"), ids, np.ones_like(ids), None,
                       empty_past(shape, 2))


@pytest.fixture(scope="module")
def folders(tiny_env, tmp_path_factory):
    """Model folders of the families and forms the streamed path reads: an untied Mistral teacher, a tied Qwen2 with
    q/k/v biases, a compressed (mixed dense/low-rank) student, a Gemma 3."""
    root = tmp_path_factory.mktemp("stream")
    tok = tiny_env["tokenizer"]
    genai_teacher(tok, root / "mistral", layers=3)
    torch.manual_seed(2)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, tie_word_embeddings=True,
                                        eos_token_id=tok.eos_token_id))
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: give them values the graph must carry
        for layer in qwen.model.layers:
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                m.bias.normal_(0, 0.1)
    qwen.save_pretrained(root / "qwen2")
    tok.save_pretrained(root / "qwen2")
    _, student, report = compressed_student(genai_teacher(tok), [0.0, 1.0, 0.0, 0.2, 0.0, 0.9, 0.0], seed=1)
    save_model_folder(student, tok, root / "student", report)
    cfg = gemma3_config(len(tok), eos_token_id=tok.eos_token_id, max_position_embeddings=128)
    cfg.pop("model_type")
    torch.manual_seed(3)  # Gemma 3: sliding and global layers, four norms a layer, a tied head, a scaled embedding
    perturbed(Gemma3ForCausalLM(Gemma3TextConfig(**cfg))).save_pretrained(root / "gemma3")
    tok.save_pretrained(root / "gemma3")
    return root


# every family at the deployed rounding (int4 rtn) and every rounding on one family; the other nine pairs in
# pytest -m full (CI runs them), to keep the README's test command under 8 minutes on a busy machine
STREAMED = [(n, p, q) if (p, q) == ROUNDINGS[0] or n == "mistral" else pytest.param(n, p, q, marks=pytest.mark.full)
            for p, q in ROUNDINGS for n in ("mistral", "qwen2", "student", "gemma3")]


@pytest.mark.parametrize("name,precision,quant", STREAMED)
def test_a_streamed_export_is_the_in_memory_export(folders, tmp_path, monkeypatch, name, precision, quant):
    src = folders / name
    monkeypatch.setattr(pieces, "PIECE_BYTES", 1)  # the held-out check's graph run one layer per piece
    held = export_genai_folder(src, tmp_path / "held", GenaiExportConfig(precision, quant, streaming="off",
                                                                         max_ppl_change=10.0))
    streamed_ = export_genai_folder(src, tmp_path / "streamed", GenaiExportConfig(precision, quant, streaming="on",
                                                                                  max_ppl_change=10.0))
    assert not held["streamed"] and streamed_["streamed"]
    _same_graph(tmp_path / "held", tmp_path / "streamed")
    vocab = DecoderShape.from_folder(tmp_path / "held").vocab_size
    for a, b in zip(_logits(tmp_path / "held", vocab), _logits(tmp_path / "streamed", vocab)):
        assert np.abs(a - b).max() <= 1e-5
    if precision != "fp32":
        q_held, q_streamed = held["quantization"], streamed_["quantization"]
        for key in ("matmuls_quantized", "lm_head_bits", "method", "embedding", "bits", "offset_corrections"):
            assert q_held.get(key) == q_streamed.get(key), key
        v = streamed_["validation"]
        assert v["parity"]["layers"] == 2 and v["parity"]["max_abs_diff"] <= v["parity"]["tolerance"]
        # the head's slicing on the cut's padded batches and as onnxruntime-genai runs the cut; the whole model.onnx
        # tied to its every-position graph, which the held-out check runs in pieces
        assert v["parity"]["last_position"]["max_abs_diff"] <= 1e-5
        runtime = v["parity"]["runtime"]
        assert runtime["runtime"] == "onnxruntime-genai" and runtime["prompts"] == 3
        assert runtime["max_abs_diff"] <= 1e-5
        assert "last_position" not in v and v["structure"]["identical_but_head"]
        assert v["quality"]["reference"] == "pytorch-fp32-streamed" and v["quality"]["tokens"] == 512
        assert v["quality"]["rounded_graph"] == "in pieces"
        # the streamed reference is PyTorch's fp32 model, the in-memory one its fp32 graph: the same figure; the
        # rounded graph in pieces is the whole graph, to the last bit
        held512 = export_genai_folder(src, tmp_path / "held512", GenaiExportConfig(
            precision, quant, streaming="off", quality_tokens=512, max_ppl_change=10.0))["validation"]["quality"]
        assert v["quality"]["val_ppl_fp32"] == pytest.approx(held512["val_ppl_fp32"], rel=1e-4)
        assert v["quality"]["val_ppl_quantized"] == held512["val_ppl_quantized"]
    else:
        greedy = streamed_["validation"]["generator"]
        assert greedy["new_tokens"] == 8 and greedy["runtime"] == "onnxruntime, in pieces"
        assert [r["tokens"] for r in greedy["prompts"]] == [8] * len(greedy["prompts"])
        assert streamed_["validation"]["structure"]["layers"] == DecoderShape.from_folder(src).layers


def test_the_runtimes_last_position_check_fails_on_a_different_logit(folders, tmp_path):
    """``runtime_last_position`` compares what onnxruntime-genai gives with the all-logits graph's rows: exact on the
    folder as written, refused once one logit of one row moves by 1e-3."""
    export_genai_folder(folders / "mistral", tmp_path / "o", GenaiExportConfig("int4", streaming="on",
                                                                               max_ppl_change=10.0))
    shape = DecoderShape.from_folder(tmp_path / "o")
    rows = last_rows(session(tmp_path / "o" / "model_all_logits.onnx"), shape)
    assert [len(ids) for ids, _, _ in rows] == [8, 4, 6] and rows[0][1].shape == (shape.vocab_size,)
    assert runtime_last_position(tmp_path / "o", rows)["max_abs_diff"] <= 1e-5
    ids, prompt, after = rows[1]
    after = after.copy()
    after[5] += 1e-3
    with pytest.raises(ExportValidationError, match="differ from model_all_logits.onnx's by 0.001"):
        runtime_last_position(tmp_path / "o", [rows[0], (ids, prompt, after)])


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([4, 8]), st.integers(1, 70), st.integers(1, 5), st.integers(0, 31), st.integers(1, 16),
       st.integers(0, 10_000))
def test_torch_rounding_is_onnxruntimes_kernel_bit_for_bit(bits, n, blocks, short, rows, seed):
    """``torch_rtn`` (the streamed export's round-to-nearest, from the (out, in) weight) gives the codes and scales
    of onnxruntime's own kernel (``ort_rtn``, what ``MatMulNBitsQuantizer`` calls) bit for bit: any K (padded to
    whole blocks of 32), any row slicing, zero blocks (scale -0.0), blocks whose min and max have one magnitude,
    values on exact half steps of the grid (roundf's ties away from zero) and mixed magnitudes."""
    g = np.random.default_rng(seed)
    k = max(1, 32 * blocks - short)
    w = (g.standard_normal((n, k)) * g.uniform(1e-4, 2.0, (n, 1))).astype(np.float32)
    w[0, : min(k, 32)] = 0.0  # a zero block
    if n > 1:
        w[1, : min(k, 32)] = np.resize([0.5, -0.5], min(k, 32))  # |max| == |min|: the min is taken
    if n > 2:  # codes on exact ties: v / scale + 2^(bits-1) lands on x.5
        m = 1 << (bits - 1)
        w[2, : min(k, 32)] = (np.arange(min(k, 32)) % (2 * m) - m + 0.5) * np.float32(0.25) / m
        w[2, 0] = -0.25
    ((want_q, want_s),) = ort_rtn(np.ascontiguousarray(w.T), bits, n)
    got = list(torch_rtn(w, bits, rows))
    assert len(got) == -(-n // rows)
    got_q, got_s = np.concatenate([c for c, _ in got]), np.concatenate([s for _, s in got])
    assert got_q.shape == want_q.shape and np.array_equal(got_s.view(np.int32), want_s.view(np.int32))

    def codes(q):  # (n, whole blocks x 32) one code per position
        return (np.stack([q & 15, q >> 4], -1) if bits == 4 else q).reshape(n, -1)

    # every code up to K, and 0 past it; at an odd K the kernel fills the last pair's second nibble with whatever it
    # reads past the weight's end (it varies run to run; MatMulNBits never reads it): ours is the zero point
    a, b = codes(want_q), codes(got_q)
    past = k + (bits == 4 and k % 2)
    assert np.array_equal(a[:, :k], b[:, :k]) and np.array_equal(a[:, past:], b[:, past:])
    assert not b[:, past:].any() and (past == k or (b[:, k] == 8).all())


def test_torch_rounding_hands_a_non_finite_weight_to_the_kernel():
    """A weight holding NaN or infinity is rounded by onnxruntime's kernel itself (its comparisons skip a NaN)."""
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    w[3, 5], w[6, 40] = np.nan, np.inf
    (want_q, want_s), = ort_rtn(np.ascontiguousarray(w.T), 4, 8)
    (got_q, got_s), = torch_rtn(w, 4, 8)
    assert np.array_equal(want_q, got_q) and np.array_equal(want_s, got_s, equal_nan=True)


def test_a_lazy_models_forward_is_the_loaded_models(folders):
    model, _, _ = load_model_folder(folders / "student")
    lazy, _, _ = lazy_folder_model(folders / "student")
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), streamed(lazy):
        got = lazy(ids).logits
    assert is_lazy(lazy) and all(p.is_meta for p in lazy.parameters())  # nothing stays made after the forward
    with torch.no_grad():
        want = model(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0)

    class Blocks(list):
        seq_len = 12

        def get(self, rows):
            return ids.numpy()[list(rows)]

    nll, preds = score_streamed(lazy, Blocks([0, 1]), batch_size=1)
    logp = torch.log_softmax(want[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert nll == pytest.approx(float(-logp.mean()), rel=1e-6)
    assert np.array_equal(preds, want[:, :-1].argmax(-1).reshape(-1).numpy())


def test_what_the_streamed_path_cannot_read_is_refused_in_one_line(folders, tmp_path):
    with pytest.raises(ConfigError, match="--streaming on: --int8-share 0.1 ranks every MatMul's rounding error"):
        export_genai_folder(folders / "mistral", tmp_path / "g", GenaiExportConfig("int4", "gptq", streaming="on",
                                                                                      int8_share=0.1))
    with pytest.raises(ConfigError, match="--streaming .sometimes.: unknown \\(allowed: auto, on, off\\)"):
        export_genai_folder(folders / "mistral", tmp_path / "g", GenaiExportConfig(streaming="sometimes"))
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in (folders / "mistral").iterdir():
        (renamed / f.name).write_bytes(f.read_bytes())
    weights = load_file(renamed / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(weights, renamed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="model.layers.0.mlp.up_proj.weight holds NaN or infinity"):
        export_genai_folder(renamed, tmp_path / "nan", GenaiExportConfig("int4", streaming="on"))
    assert not (tmp_path / "nan").exists()
    weights["base.layers.0.mlp.up_proj.weight"] = weights.pop("model.layers.0.mlp.up_proj.weight")
    save_file(weights, renamed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="missing model.layers.0.mlp.up_proj.weight; unexpected base.layers.0"):
        lazy_folder_model(renamed)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "student", "gemma3"])
def test_gptq_read_one_layer_at_a_time_measures_the_inputs_the_whole_graph_measures(folders, tmp_path, name):
    """Every weight MatMul's input Gram matrix, carried up the lazy model one layer per part (as the streamed
    export rounds), equals the one the in-memory GPTQ measures on the whole fp32 graph under onnxruntime."""
    export_genai_folder(folders / name, tmp_path / "g", GenaiExportConfig("fp32", streaming="off", validate=False))
    proto = onnx.load(str(tmp_path / "g" / "model_all_logits.onnx"))  # as rounded: every position's head
    shape = DecoderShape.of(json.loads((folders / name / "config.json").read_text()))
    blocks = PackedBlocks(np.random.default_rng(0).integers(0, shape.vocab_size, 5 * 16), 16)
    whole = input_grams(proto, shape, blocks)
    inputs = CalibratedInputs(lazy_folder_model(folders / name)[0], blocks.get(range(len(blocks))))
    weights = {t.name for t in proto.graph.initializer}
    parts: dict = {}
    for n in proto.graph.node:
        if n.op_type == "MatMul" and n.input[1] in weights:
            parts.setdefault(n.name.split("/")[2] if "/layers." in n.name else "head", []).append(n)
    assert len(parts) == shape.layers + 1
    measured = {}
    for nodes in parts.values():  # the layers in order, then the head
        measured.update(inputs.of(nodes, [n.input[1] for n in nodes]))
    assert measured.keys() == whole.keys()
    for x, gram in whole.items():
        assert float((measured[x] - gram).abs().max()) <= 1e-5 * float(gram.abs().max()), x


@pytest.mark.parametrize("name", ["mistral", "student"])
def test_a_streamed_gptq_export_rounds_as_the_in_memory_one(folders, tmp_path, name):
    """The same graph (nodes, names, attributes) and the same rounding quality per MatMul: GPTQ's column updates
    carry a 1e-7 difference of its inputs into other codes where two roundings are equally good, so the measured
    output error of every MatMul is compared, not its bytes: each within 2% and their mean within 0.3% (a machine
    whose BLAS summed in another order, AVX2 or fewer threads on a busy machine, moved one MatMul's by 0.22%; inputs
    measured one layer off would move them by far more)."""
    runs = {}
    for mode in ("off", "on"):
        runs[mode] = export_genai_folder(folders / name, tmp_path / mode, GenaiExportConfig(
            "int4", "gptq", streaming=mode, calib_tokens=512, max_ppl_change=10))
    (na, ia), (nb, ib) = _graph(tmp_path / "off"), _graph(tmp_path / "on")
    assert [n[:4] for n in na] == [n[:4] for n in nb] and ia.keys() == ib.keys()
    held, lazy = runs["off"]["quantization"], runs["on"]["quantization"]
    assert lazy["calibration"] == "layer by layer" and lazy["calibration_tokens"] == held["calibration_tokens"]
    errors = held["relative_output_error"]
    assert lazy["relative_output_error"].keys() == errors.keys()
    for node, e in errors.items():
        assert lazy["relative_output_error"][node] == pytest.approx(e, rel=2e-2), node
    mean = np.mean(list(errors.values()))
    assert np.mean(list(lazy["relative_output_error"].values())) == pytest.approx(mean, rel=3e-3)
    assert runs["on"]["streamed"] and runs["on"]["validation"]["quality"]["reference"] == "pytorch-fp32-streamed"


def test_cli_streams_and_says_so(folders, tmp_path):
    out = tmp_path / "g"
    r = CliRunner().invoke(app, ["export", "genai", str(folders / "qwen2"), "--precision", "int4", "--streaming", "on",
                                 "--max-ppl-change", "10", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "lazily (each layer read from its weight files when emitted)" in r.output
    info = json.loads((out / "export.json").read_text())
    assert info["streamed"] and info["settings"]["streaming"] == "on"
    assert info["validation"]["parity"]["vocab_rows"] == DecoderShape.from_folder(out).vocab_size  # < 4,096 rows


@pytest.mark.parametrize("optimize", [False, True])
def test_a_streamed_onnx_export_is_the_in_memory_one(folders, tmp_path, optimize):
    src = folders / "student"
    held = export_onnx_folder(src, tmp_path / "held", optimize=optimize, streaming="off")
    streamed_ = export_onnx_folder(src, tmp_path / "streamed", optimize=optimize, streaming="on")
    (na, ia), (nb, ib) = (_graph(tmp_path / d, "model.onnx") for d in ("held", "streamed"))
    assert na == nb and ia.keys() == ib.keys() and all(np.array_equal(ia[k], ib[k]) for k in ia)
    assert not held["streamed"] and streamed_["streamed"] and "model.onnx.data" in streamed_["files"]
    v = streamed_["validation"]
    assert v["layers"] == 2 and v["max_abs_diff"] <= v["tolerance"]
    with pytest.raises(UsageError, match="--quantize int8 --streaming on: the dynamic int8 pass rounds the whole"):
        export_onnx_folder(src, tmp_path / "q", quantize="int8", streaming="on")
    r = CliRunner().invoke(app, ["export", "onnx", str(src), "--streaming", "sometimes", "--out", str(tmp_path / "c")])
    assert r.exit_code != 0 and "--streaming sometimes: unknown (allowed: auto, on, off)" in r.output
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("quant", ["rtn", "affine"])
def test_slices_of_columns_and_rows_change_nothing(folders, tmp_path, monkeypatch, quant):
    """The streamed path rounds a MatMul over slices of output columns and the embedding's own 8-bit copy over
    slices of rows (a 128k x 4096 head or table is never copied whole); slices that divide nothing evenly give the
    codes of the whole at once (the tiny models' vocabulary is otherwise one slice)."""
    import bdlora.export.genai.embedding as embedding
    import bdlora.export.genai.stream as stream

    src = folders / "mistral"
    export_genai_folder(src, tmp_path / "held", GenaiExportConfig("int4", quant, streaming="off", validate=False))
    monkeypatch.setattr(stream, "COLUMNS", 24)
    monkeypatch.setattr(embedding, "ROWS", 37)
    export_genai_folder(src, tmp_path / "streamed", GenaiExportConfig("int4", quant, streaming="on",
                                                                      validate=False))
    _same_graph(tmp_path / "held", tmp_path / "streamed")


@pytest.mark.full  # a real width (hidden 2048, MLP 8192): the large shapes stay out of the README's test command
def test_a_real_width_checkpoint_streams_to_the_in_memory_graph(tiny_env, tmp_path):
    """Llama-3.2-1B's widths at 2 layers, written by benchmarks/synthetic_checkpoint.py: the streamed int4 export
    (many column slices per MatMul) is the in-memory one, and the validated figures say what was checked."""
    import subprocess
    import sys
    from pathlib import Path

    tok = tmp_path / "tok"
    tiny_env["tokenizer"].save_pretrained(tok)
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "synthetic_checkpoint.py"
    ckpt = tmp_path / "ckpt"
    subprocess.run([sys.executable, str(script), "llama-3.2-1b", "--layers", "2", "--tokenizer", str(tok), "--out",
                    str(ckpt)], check=True, capture_output=True, timeout=600)
    settings = {"max_ppl_change": 10.0, "quality_tokens": 256}
    held = export_genai_folder(ckpt, tmp_path / "held", GenaiExportConfig("int4", streaming="off", **settings))
    streamed_ = export_genai_folder(ckpt, tmp_path / "streamed", GenaiExportConfig("int4", streaming="on",
                                                                                    **settings))
    assert not held["streamed"] and streamed_["streamed"] == (streamed_["settings"]["streaming"] == "on")
    _same_graph(tmp_path / "held", tmp_path / "streamed")
    assert streamed_["validation"]["quality"]["tokens"] == held["validation"]["quality"]["tokens"] == 256
    assert streamed_["validation"]["quality"]["val_ppl_fp32"] == pytest.approx(
        held["validation"]["quality"]["val_ppl_fp32"], rel=1e-4)


def test_sizes_measures_a_process_trees_peak_and_stops_one_past_its_limit(tmp_path):
    """benchmarks/sizes.py's sampler: a child holding 300 MB is measured at least that (its parent's share
    included), and one past the limit is stopped with its row saying so."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sizes import GIB, measure

    def hold(seconds: int) -> list[str]:  # a child holding 300 MB (every page touched) for ``seconds``
        child = f"import time; x = bytearray(300 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep({seconds})"
        return [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"]

    m = measure(hold(4), tmp_path / "a.log", 4 * GIB, 120)  # 20 samples' time: seen even on a busy machine
    assert m.code == 0 and m.peak_bytes >= 300 << 20
    stopped = measure(hold(600), tmp_path / "b.log", 200 << 20, 300)  # held until the sampler stops it
    assert stopped.code != 0 and stopped.said == "stopped past the memory limit (0.195 GiB)"


def test_the_decode_and_verify_benchmarks_run_on_a_genai_folder(folders, tmp_path):
    """benchmarks/decode.py (threads set through a view of the folder, and its own) and verify_cost.py write their
    tables with a row per folder and setting (no time is asserted: only that each figure is a measurement)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import decode
    import verify_cost

    folder = tmp_path / "g"
    export_genai_folder(folders / "mistral", folder, GenaiExportConfig("int4", validate=False))
    before = (folder / "genai_config.json").read_text()
    decode.main(["--folders", f"a={folder},b={folder}", "--threads", "1,own", "--prompt", "8", "--tokens", "4",
                 "--repeats", "2", "--out", str(tmp_path / "d.md")])
    rows = [r.split("|")[1:-1] for r in (tmp_path / "d.md").read_text().splitlines()[2:]]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("1", "a"), ("1", "b"), ("own", "a"), ("own", "b")]
    assert all(float(r[3]) > 0 for r in rows) and rows[0][5].strip() == "1.000"
    decode.main(["--folders", f"a={folder}", "--threads", "own", "--prompt", "8", "--tokens", "4", "--repeats", "1",
                 "--spinning", "both", "--out", str(tmp_path / "s.md")])  # onnxruntime-genai takes the string entry
    rows = [r.split("|")[1:-1] for r in (tmp_path / "s.md").read_text().splitlines()[2:]]
    assert [r[2].strip() for r in rows] == ["a (spinning)", "a (no spinning)"] and all(float(r[3]) > 0 for r in rows)
    assert (folder / "genai_config.json").read_text() == before  # each thread count runs a view: the folder is kept
    verify_cost.main(["--folders", f"tiny={folder}", "--widths", "2,4", "--past", "8", "--repeats", "2", "--out",
                      str(tmp_path / "v.md")])
    (row,) = (tmp_path / "v.md").read_text().splitlines()[2:]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[0] == "tiny" and float(cells[1]) > 0 and all(c.endswith("x") and float(c[:-1]) > 0 for c in cells[2:])


@pytest.mark.parametrize("name,icl", [("mistral", True), ("student", True), ("gemma3", False)])
def test_eval_read_one_layer_at_a_time_scores_what_eval_in_memory_scores(folders, tiny_env, tmp_path, name, icl):
    # (the tiny Gemma 3's ICL prompts pass its 3-token sliding window, whose cache transformers cannot roll back:
    # in memory as well; its perplexity is scored here)
    docs = {}
    probes = ["--examples", "3", "--seeds", "1", "--shots", "2", "--tasks", "capitalize,next_item"]
    probes = probes if icl else ["--ppl"]
    for mode in ("off", "on"):
        r = CliRunner().invoke(app, ["eval", str(folders / name), "--streaming", mode, "--data",
                                     str(tiny_env["corpus"]), "--heldout-fraction", "0.1", "--seq-len", "32",
                                     "--tokens", "256", *probes,
                                     "--no-vs-teacher", "--report", str(tmp_path / f"{mode}.json")])
        assert r.exit_code == 0, (mode, r.output)
        docs[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    held, lazy = docs["off"], docs["on"]
    assert held["kind"] == "torch" and lazy["kind"] == "torch-streamed"
    assert lazy["ppl"]["predicted_tokens"] == held["ppl"]["predicted_tokens"] == 8 * 31
    assert lazy["ppl"]["mean_nll"] == pytest.approx(held["ppl"]["mean_nll"], rel=1e-5)
    assert ("icl" in lazy) == icl
    for task, v in held.get("icl", {}).get("tasks", {}).items():
        assert lazy["icl"]["tasks"][task]["mean"] == v["mean"]
        assert lazy["icl"]["tasks"][task]["target_logprob"] == pytest.approx(v["target_logprob"], abs=1e-4)
    assert lazy.get("icl", {}).get("sample") == held.get("icl", {}).get("sample")


def test_eval_refuses_an_unknown_streaming_mode(folders):
    r = CliRunner().invoke(app, ["eval", str(folders / "mistral"), "--streaming", "sometimes"])
    assert r.exit_code != 0 and "--streaming 'sometimes': unknown (allowed: auto, on, off)" in r.output


@pytest.mark.parametrize("precision", ["int4", "int8", "fp32"])
def test_a_synthetic_timing_model_is_written_one_layer_at_a_time_as_in_memory(tmp_path, precision):
    """The timing probes' random models (``bench.whole``, ``plan --speculative``'s full-depth target) are written by
    the streamed writer: the in-memory writer's graph, node for node and weight for weight, without the fp32 graph
    (a full-depth 8B one is 32 GB)."""
    from bdlora.bench.genai import _stand_in_tokenizer
    from bdlora.bench.whole import _dense_model
    from bdlora.export.genai.folder import deployment, write_genai_files

    config = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_theta": 10000.0}
    settings = GenaiExportConfig(context_length=64, validate=False).at(precision)
    model = _dense_model(config, 2, 96)  # an MLP narrowed to 96 channels, as the probes narrow it
    assert is_lazy(model)
    deployment(model, _stand_in_tokenizer(), tmp_path / "streamed", settings)
    (tmp_path / "held").mkdir()
    write_genai_files(_dense_model(config, 2, 96), _stand_in_tokenizer(), tmp_path / "held", settings)
    _same_graph(tmp_path / "streamed", tmp_path / "held")
    assert (tmp_path / "streamed" / "model.onnx.data").is_file() and is_lazy(model)  # nothing kept made
