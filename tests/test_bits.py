"""Per-module bits (``--forms bits``): the export's rounding reproduced exactly, its error measured in the
allocation's units, the choice under a hand-made table, and a folder's declared widths kept by the int4 export."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from test_channels import healed_and_compressed, shot
from test_latency import _hand_table, _tiny_shapes
from typer.testing import CliRunner

import bdlora.export.genai.latency as lat
from bdlora.base.io import write_json
from bdlora.cli import app
from bdlora.compress.calibrate import calibrate
from bdlora.compress.forms.lowrank import FISHER_DAMPING
from bdlora.export.genai.quantize import quantize_nbits, rtn_rounded
from bdlora.models.arch import projection_modules
from bdlora.models.costs import ModuleShape
from conftest import allocate_with


@pytest.mark.parametrize("k", [96, 80])  # 80: the last block of 32 is padded, as the exporter pads it
@pytest.mark.parametrize("precision,bits", [("int4", 4), ("int8", 8)])
def test_rtn_rounded_is_the_weight_the_exported_node_multiplies_by(k, precision, bits):
    """The rounding ``--forms bits`` measures with is the default export's: an identity batch through the quantised
    MatMulNBits node returns rtn_rounded's weight (one-hot activations survive the kernel's int8 step exactly)."""
    w = np.random.default_rng(k).standard_normal((40, k)).astype(np.float32)  # (out, in)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="/m/MatMul")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, 40])],
                          [numpy_helper.from_array(w.T.copy(), "w")])
    q, _ = quantize_nbits(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), precision, "rtn")
    sess = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": np.eye(k, dtype=np.float32)})[0]
    hat = rtn_rounded(w, bits)
    np.testing.assert_allclose(y.T, hat, atol=1e-6)
    step = np.abs(w).max() / (1 << (bits - 1))
    assert 0 < np.abs(w - hat).max() <= step  # rounded, on its block's grid


def test_the_rounding_error_is_measured_token_by_token_in_the_calibration_pass(tiny_env):
    """calibrate(..., rounded=) gives each projection's error at 4 and 8 bits: sum_t sum_i (g_ti^2 + d) dy_ti^2 with
    dy the output change of the rounded weight and g the loss's gradient at the same token (d: the damping of the
    batch's mean g^2), times the tokens. Checked against swapping the weight and running the model again."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"]).eval()
    blocks = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 16))
    calib = calibrate(model, blocks, rounded=rtn_rounded)
    name = "model.layers.1.mlp.down_proj"
    mod = model.get_submodule(name)
    seen = {}
    h = mod.register_forward_hook(lambda m, i, o: seen.__setitem__("y", o))
    x = torch.from_numpy(blocks)
    logits = model(input_ids=x).logits
    seen["y"].retain_grad()
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                      reduction="sum").backward()
    g2, y = seen["y"].grad.double().square(), seen["y"].detach().double()
    g2 = g2 + FISHER_DAMPING * float(g2.mean())
    source = mod.weight.detach().clone()
    for bits in (4, 8):
        with torch.no_grad():
            mod.weight.copy_(torch.from_numpy(rtn_rounded(source.numpy(), bits)))
            model(input_ids=x)
            mod.weight.copy_(source)
        direct = float((g2 * (seen["y"].double() - y).square()).sum()) * blocks.size
        assert calib.rounding[name][bits] == pytest.approx(direct, rel=1e-5)
    h.remove()
    assert calib.rounding[name][8] < calib.rounding[name][4] / 50
    assert set(calib.rounding) == {n for n, _ in projection_modules(model)}


def test_the_allocation_buys_8_bits_where_the_error_given_back_pays_most():
    """Three 64x64 projections at 4096 MACs; c is rank 8 plus a tiny tail, so taking it to a pair frees room for
    one 8-bit projection (6000): a (gain 10) is widened, not b (gain 1); c goes to the largest rank that leaves
    the room (16: its error 16e-6 below rank 8's 24e-6)."""
    shapes = [ModuleShape(n, 64, 64) for n in "abc"]
    big, tiny = np.full(64, 100.0), np.concatenate([np.full(8, 100.0), np.full(56, 1e-6)])
    energy = {"a": big, "b": big, "c": tiny}
    alloc = allocate_with(shapes, energy, 1.0, wide={"a": (6000.0, 10.0), "b": (6000.0, 1.0)})
    assert alloc.ranks == {"a": 0, "b": 0, "c": 16} and alloc.bits == {"a": 8}
    assert alloc.errors["a"] == -10.0 and alloc.errors["c"] == pytest.approx(48 * 1e-6)
    # with no room (the same budget without c's pair) nothing is widened; without `wide` nothing can be
    assert allocate_with(shapes, {n: big for n in "abc"}, 1.0, wide={"a": (6000.0, 10.0)}).bits == {}
    assert allocate_with(shapes, energy, 1.0).bits == {}
    back = type(alloc).from_json(alloc.to_json())
    assert back == alloc and back.bits == alloc.bits
    before = {k: v for k, v in alloc.to_json().items() if k != "bits"} | {"wide": ["a"]}  # the layout before
    assert type(alloc).from_json(before).bits == {"a": 8}


def _wide_table(cache, shapes, threads=1):
    """The int8 table beside ``_hand_table``'s int4 one: every dense product 1.25x its 4-bit time."""
    us = {f"{k}x{n}@0": 1.25 * k * n / 100 for k, n in {(s.in_features, s.out_features) for s in shapes}}
    path = lat.table_path(cache, "int8", threads)
    write_json(path, {"version": lat.TABLE_VERSION, "us": us})
    return path


def tabled_shot(env, teacher, cache, out, *extra):
    """compress --one-shot --precision int4 of ``teacher`` against hand-made int4 and int8 tables in ``cache``."""
    shapes = _tiny_shapes(teacher)
    _hand_table(cache, shapes, (), teacher=teacher)
    _wide_table(cache, shapes)
    return shot({**env, "cache": cache}, teacher, out, "--precision", "int4", "--threads", "1", *extra)


@pytest.fixture(scope="module")
def widened(tiny_env, tmp_path_factory):
    """A one-shot student of a genai-shaped teacher with --forms lowrank,bits at int4 (hand-made tables)."""
    from conftest import genai_teacher

    root = tmp_path_factory.mktemp("bits")
    genai_teacher(tiny_env["tokenizer"], root / "teacher")
    r = tabled_shot(tiny_env, root / "teacher", root / "cache", root / "s", "--mac-ratio", "1.2", "--forms",
                    "lowrank,bits")
    assert r.exit_code == 0, r.output
    return root, json.loads(r.stdout), _tiny_shapes(root / "teacher")


def test_a_one_shot_with_bits_declares_its_8_bit_projections_and_prices_them_at_int8(widened):
    root, report, shapes = widened
    wide = {m["name"] for m in report["modules"] if m["bits"] == 8}
    assert wide and report["int8_modules"] == len(wide)
    assert all(m["form"] == "dense" for m in report["modules"] if m["name"] in wide)
    declared = json.loads((root / "s" / "config.json").read_text())["bdlora_modules"]
    assert {n for n, spec in declared.items() if spec.get("bits") == 8} == wide
    gains = report["provenance"]["rounding"]["error_given_back_at_8_bits"]
    assert gains.keys() == {s.name for s in shapes} and all(gains[n] > 0 for n in wide)
    doc = report["provenance"]["allocation_cost"]
    us4 = {k: v for k, v in json.loads(lat.table_path(root / "cache", "int4", 1).read_text())["us"].items()}
    four, eight = lat.LatencyTable("int4", 1, us4), lat.LatencyTable("int8", 1, {
        k: 1.25 * v for k, v in us4.items() if k.endswith("@0")})
    four.wide = eight
    by = {s.name: s for s in shapes}
    ranks = {m["name"]: m["rank"] for m in report["modules"]}
    assert doc["projection_us"] == pytest.approx(sum(four.cost(by[n], r, 8 if n in wide else 0)
                                                     for n, r in ranks.items()))
    assert doc["predicted_projection_speedup"] >= 1.2 and doc["int8_modules"] == len(wide)
    r = CliRunner().invoke(app, ["plan", str(root / "s"), "--precision", "int4", "--threads", "1", "--json"],
                           env={"BDLORA_CACHE": str(root / "cache")})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["deployed"]["projection_us"] == pytest.approx(doc["projection_us"])


def test_the_rounding_provenance_names_the_grid_the_errors_were_measured_on(widened, tiny_env):
    """--quant gptq (the nbits layout: the same hand-made tables) measures each projection's error on GPTQ's own
    asymmetric grid, and the provenance says so; the rtn run's errors, on onnxruntime's symmetric grid, differ."""
    root, report, _ = widened
    assert report["provenance"]["rounding"]["scheme"] == "rtn"
    r = tabled_shot(tiny_env, root / "teacher", root / "cache", root / "gptq", "--mac-ratio", "1.2", "--forms",
                    "lowrank,bits", "--quant", "gptq")
    assert r.exit_code == 0, r.output
    rounding = json.loads(r.stdout)["provenance"]["rounding"]
    assert rounding["scheme"] == "gptq"
    rtn, gptq = report["provenance"]["rounding"]["error_given_back_at_8_bits"], rounding["error_given_back_at_8_bits"]
    assert rtn.keys() == gptq.keys() and all(gptq[n] != pytest.approx(rtn[n], rel=1e-3) for n in rtn)


@pytest.mark.parametrize("quant", ["rtn", "affine"])  # onnxruntime's quantiser, and the graph rounded here
def test_the_int4_export_keeps_the_declared_projections_at_8_bits(widened, tmp_path, quant):
    """export genai --precision int4: each declared projection's MatMuls (its own first stage, split from the
    others reading its input; a pair's second factor) are 8-bit MatMulNBits, every other one 4-bit; the graph passes
    the export's parity check against PyTorch."""
    root, report, _ = widened
    wide = {m["name"] for m in report["modules"] if m["bits"] == 8}
    r = CliRunner().invoke(app, ["export", "genai", str(root / "s"), "--precision", "int4", "--max-ppl-change", "5",
                                 "--quant", quant, "--out", str(tmp_path / "g"), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["validation"]["parity"]["decode_max_abs_diff"] <= info["validation"]["parity"]["decode_tolerance"]
    graph = onnx.load(str(tmp_path / "g" / "model.onnx"), load_external_data=False).graph
    bits = {}
    for n in graph.node:
        if n.op_type == "MatMulNBits" and n.doc_string:
            b = {a.name: a.i for a in n.attribute}["bits"]
            for p in json.loads(n.doc_string):
                bits.setdefault(p["bdlora_module"], set()).add(b)
    assert {n for n, b in bits.items() if b == {8}} == wide
    assert all(b == {4} for n, b in bits.items() if n not in wide)
    model = onnx.load(str(tmp_path / "g" / "model.onnx"), load_external_data=False)
    rows = json.loads(next(p.value for p in model.metadata_props if p.key == "bdlora.modules"))
    assert {r["name"] for r in rows if r.get("bits") == 8} == wide  # the per-module metadata says it too
    assert info["quantization"]["declared_int8_matmuls"] == sum(
        1 for n in graph.node if n.op_type == "MatMulNBits" and n.doc_string and
        {a.name: a.i for a in n.attribute}["bits"] == 8)


def test_bits_needs_int4_and_a_declared_width_must_be_4_or_8(widened, tiny_env, tmp_path):
    root, _, _ = widened
    r = shot(tiny_env, root / "teacher", tmp_path / "x", "--mac-ratio", "1.2", "--forms", "lowrank,bits")
    assert r.exit_code == 2 and "--forms lowrank,bits: bits chooses which projections an int4 export keeps at 8 " \
        "bits; give --precision int4" in r.stderr, r.output
    assert not (tmp_path / "x").exists()
    import shutil

    shutil.copytree(root / "s", tmp_path / "edited")
    cfg_path = tmp_path / "edited" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    name = next(n for n, spec in cfg["bdlora_modules"].items() if spec.get("bits") == 8)
    cfg["bdlora_modules"][name]["bits"] = 5
    cfg_path.write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "edited")])
    assert r.exit_code != 0 and f"{name} is declared at 5 bits (4 or 8: its width in an int4 export)" in r.output


def test_a_folder_with_8_bit_projections_heals_as_a_student_and_keeps_them(tiny_env, tmp_path):
    """--forms channels,bits (no pairs: a student starts from dense projections), healed by kd-lora from the folder:
    the compressed run declares the same projections at 8 bits and counts them."""
    r = tabled_shot(tiny_env, tiny_env["teacher"], tmp_path / "cache", tmp_path / "p", "--mac-ratio", "1.3",
                    "--forms", "channels,bits")
    assert r.exit_code == 0, r.output
    declared = json.loads((tmp_path / "p" / "config.json").read_text())["bdlora_modules"]
    wide = {n: spec for n, spec in declared.items() if spec.get("bits") == 8}
    assert wide and json.loads(r.stdout)["int8_modules"] == len(wide)
    r = healed_and_compressed(tiny_env, tmp_path / "p", tmp_path, steps=2)
    healed = json.loads((tmp_path / "healed" / "config.json").read_text())["bdlora_modules"]
    assert {n: spec for n, spec in healed.items() if spec.get("bits") == 8} == wide
    assert json.loads(r.stdout)["int8_modules"] == len(wide)


def test_all_four_forms_in_one_knapsack_give_a_folder_every_reader_takes(tiny_env, tmp_path):
    """--forms lowrank,channels,layers,bits at --speedup: every 8-bit projection is dense and in a layer that stays,
    and the folder loads and scores (the int4 export of declared widths: the test above)."""
    r = tabled_shot(tiny_env, tiny_env["teacher"], tmp_path / "cache", tmp_path / "s", "--speedup", "1.2", "--forms",
                    "lowrank,channels,layers,bits")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    rows = {m["name"]: m for m in report["modules"]}
    wide = {n for n, m in rows.items() if m["bits"] == 8}
    assert wide and report["mlp_pruned"] and any(m["form"] == "lowrank" for m in rows.values())
    assert report["int8_modules"] == len(wide)
    assert all(rows[n]["form"] == "dense" and rows[n]["case"] != "removed" for n in wide)
    assert report["provenance"]["allocation_cost"]["predicted_decode_speedup"] >= 1.2
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "s"), "--ppl", "--report", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output
