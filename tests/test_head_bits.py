"""The LM head in the knapsack (``--forms bits --speedup S`` at int4): its rounding error measured on the logits, its
two widths priced against the whole decode step, the choice declared by the folder (``bdlora_head_bits``), kept by
every int4 export unless ``--head-bits`` says otherwise, and counted by plan's prediction."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from test_bits import _wide_table
from test_channels import shot
from test_latency import _hand_table, _tiny_shapes
from test_whole_decode import LAYERS3, hand_overhead
from typer.testing import CliRunner

import bdlora.compress.calibrate as cal
import bdlora.export.genai.latency as lat
from bdlora.base.io import read_json, write_json
from bdlora.cli import app
from bdlora.compress.allocate import Allocation
from bdlora.compress.forms.lowrank import FISHER_DAMPING
from bdlora.export.genai.quantize import rtn_rounded
from bdlora.export.settings import GenaiExportConfig
from bdlora.forms import HEAD, HEAD_BITS
from conftest import allocate_with

HEAD_X = 10.0  # the hand-made int8 head costs this many times its int4 time (so buying 4 bits pays at once)


def test_the_head_rounding_error_is_measured_on_the_logits(tiny_env, monkeypatch):
    """calibrate(..., head=True): the head's error at b bits is sum_t sum_v (g_tv^2 + d) ((W - Q_b W) h_t)_v^2 times
    the tokens (g: the loss's gradient at the logits, h: the head's input), as a projection's; the projections'
    errors are those of a calibration without the head, and the chunked products sum to the same."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"]).eval()
    blocks = np.random.default_rng(0).integers(0, model.config.vocab_size, (3, 16))
    calib = cal.calibrate(model, blocks, rounded=rtn_rounded, head=True)
    alone = cal.calibrate(model, blocks, rounded=rtn_rounded)
    assert {n: e for n, e in calib.rounding.items() if n != HEAD} == alone.rounding
    head = model.get_output_embeddings()
    seen = {}
    hooks = [head.register_forward_hook(lambda m, i, o: seen.update(h=i[0].detach(), y=o)),
             head.register_full_backward_hook(lambda m, gi, go: seen.update(g=go[0].detach()))]
    x = torch.from_numpy(blocks)
    emb = model.get_input_embeddings()
    hooks.append(emb.register_forward_hook(lambda m, i, o: o.detach().requires_grad_()))
    logits = model(input_ids=x).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                      reduction="sum").backward()
    for h in hooks:
        h.remove()
    g2 = seen["g"].double().square()
    g2 = g2 + FISHER_DAMPING * float(g2.mean())
    w = head.weight.detach()
    for bits in (4, 8):
        delta = (w - torch.from_numpy(rtn_rounded(w.numpy(), bits))).double()
        direct = float((g2 * (seen["h"].double() @ delta.T).square()).sum()) * blocks.size
        assert calib.rounding[HEAD][bits] == pytest.approx(direct, rel=1e-5)
    assert 0 < calib.rounding[HEAD][8] < calib.rounding[HEAD][4] / 50
    monkeypatch.setattr(cal, "HEAD_CHUNK", 5)  # 16 tokens a block: chunks that split blocks
    chunked = cal.calibrate(model, blocks, rounded=rtn_rounded, head=True)
    # the same sums up to fp32 rounding of products of other shapes (6e-9 relative on one machine, 0 on another); a
    # chunk missed or counted twice would move them by a whole chunk's share (percents)
    assert chunked.rounding[HEAD] == pytest.approx(calib.rounding[HEAD], rel=1e-6)


def test_the_allocation_buys_the_4_bit_head_where_it_costs_least_error():
    """LAYERS3 (three layers of three 32x32 projections, rests of 1,000, fixed 2,000 of which the 8-bit head is
    1,500): at 1.05x the whole step (14,216 -> 13,539: 677 to save) a 4-bit head (800: saves 700) at error 1 beats
    every truncation (rank-1 pairs save 960 each, at error >= 31); at error 1e6 the pairs win and the head stays at
    8 bits. The fixed part's total is unchanged by the head's item (the same beyond-reach line)."""
    energy = {s.name: np.ones(32) for s in LAYERS3}
    rest = {f"model.layers.{i}": (1000.0, 0.0) for i in range(3)}
    cheap = allocate_with(LAYERS3, energy, 1.05, rest=rest, fixed=2000.0, head=(1500.0, 800.0, 1.0))
    assert cheap.head == (0, 4) and not any(cheap.ranks.values()) and cheap.errors[HEAD] == 1.0
    dear = allocate_with(LAYERS3, energy, 1.05, rest=rest, fixed=2000.0, head=(1500.0, 800.0, 1e6))
    assert dear.head == (0, 8) and sum(r > 0 for r in dear.ranks.values()) == 1 and dear.errors[HEAD] == 0.0
    back = Allocation.from_json(cheap.to_json())
    assert back == cheap and back.head == cheap.head and back.bits == cheap.bits
    # a start recorded before the head was read from the choices (its fields head_bits and head_keep) reads back
    before = {k: v for k, v in cheap.to_json().items() if k not in ("bits", "head")} | {"wide": [], "head_bits": 4,
                                                                                      "head_keep": 0}
    assert Allocation.from_json(before).head == (0, 4) and Allocation.from_json(before) == cheap
    assert allocate_with(LAYERS3, energy, 1.05, rest=rest, fixed=2000.0).head == (0, 0)  # not offered: not chosen
    with pytest.raises(ValueError, match="whole decode step"):
        allocate_with(LAYERS3, energy, 1.05, head=(1500.0, 800.0, 1.0))
    # 14,216 / (cheapest) with the head at 4 bits: the line counts the head's saving
    with pytest.raises(Exception, match=r"--speedup 9: beyond reach; the cheapest form of every layer gives "):
        allocate_with(LAYERS3, energy, 9.0, rest=rest, fixed=2000.0, head=(1500.0, 800.0, 1.0))


def test_an_export_takes_the_declared_head_width_unless_told():
    s = GenaiExportConfig("int4")
    assert s.resolved({HEAD_BITS: 4}).head_bits == 4 and s.resolved({}).head_bits == 8
    assert GenaiExportConfig("int4", head_bits=8).resolved({HEAD_BITS: 4}).head_bits == 8  # --head-bits wins
    assert GenaiExportConfig("int8").resolved({HEAD_BITS: 4}).head_bits == 8  # every MatMul is 8 bits at int8


def head_tables(cache, teacher, threads: int = 1) -> dict:
    """Hand-made int4 and int8 tables (and overhead) for ``teacher`` in which the head's 8-bit product costs
    ``HEAD_X`` times its 4-bit one, within a fixed part twice that: only the head can buy a speed-up of --forms bits.
    Returns the teacher's config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(teacher).to_dict()
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = _tiny_shapes(teacher)
    for path, us in ((_hand_table(cache, shapes, (), threads=threads, teacher=teacher), hidden * vocab / 100),
                     (_wide_table(cache, shapes, threads), HEAD_X * hidden * vocab / 100)):
        doc = read_json(path)
        doc["us"][f"{hidden}x{vocab}@0"] = us
        write_json(path, doc)
    hand_overhead(cache, config, "int4", threads, fixed=2 * HEAD_X * hidden * vocab / 100)
    return config


@pytest.fixture(scope="module")
def headed(tiny_env, tmp_path_factory):
    """A one-shot of a genai-shaped teacher with --forms bits --speedup 1.2 at int4 (``head_tables``)."""
    from conftest import genai_teacher

    root = tmp_path_factory.mktemp("head")
    genai_teacher(tiny_env["tokenizer"], root / "teacher")
    config = head_tables(root / "cache", root / "teacher")
    r = shot({**tiny_env, "cache": root / "cache"}, root / "teacher", root / "s", "--precision", "int4", "--threads",
             "1", "--speedup", "1.2", "--forms", "bits")
    assert r.exit_code == 0, r.output
    return root, json.loads(r.stdout), config


def test_a_one_shot_declares_its_4_bit_head_and_predicts_the_step_with_it(headed):
    root, report, config = headed
    prov = report["provenance"]
    assert prov["head_bits"] == 4 and prov["rounding"]["lm_head"]["bits"] == 4
    assert read_json(root / "s" / "config.json")[HEAD_BITS] == 4
    t4 = config["hidden_size"] * config["vocab_size"] / 100
    assert prov["rounding"]["lm_head"]["us_at_4_bits"] == pytest.approx(t4)
    assert prov["rounding"]["lm_head"]["us_at_8_bits"] == pytest.approx(HEAD_X * t4)
    assert prov["rounding"]["lm_head"]["error_added_at_4_bits"] > 0
    doc = prov["allocation_cost"]
    assert doc["head_bits"] == 4 and doc["predicted_decode_speedup"] >= 1.2
    wide = sum(m["bits"] == 8 for m in report["modules"])  # the slack the head leaves widens projections
    us4 = read_json(lat.table_path(root / "cache", "int4", 1))["us"]
    projections = sum(us4[f"{s.in_features}x{s.out_features}@0"] for s in _tiny_shapes(root / "teacher"))
    assert doc["decode_us_teacher"] - doc["decode_us"] == pytest.approx(
        (HEAD_X - 1) * t4 - (doc["projection_us"] - projections))
    assert doc.get("int8_modules", 0) == wide
    r = CliRunner().invoke(app, ["plan", str(root / "s"), "--precision", "int4", "--threads", "1", "--json"],
                           env={"BDLORA_CACHE": str(root / "cache")})
    assert r.exit_code == 0, r.output
    planned = json.loads(r.stdout)
    assert planned["predicted_decode_speedup"] == pytest.approx(doc["predicted_decode_speedup"])


def _head_bits(folder) -> int:
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    return next({a.name: a.i for a in n.attribute}["bits"] for n in graph.node
                if n.op_type == "MatMulNBits" and n.name.startswith("/lm_head/"))


@pytest.mark.parametrize("given", [None, 8])
def test_the_int4_export_ships_the_declared_head_unless_head_bits_says(headed, tmp_path, given):
    root, _, _ = headed
    told = ["--head-bits", str(given)] if given else []
    r = CliRunner().invoke(app, ["export", "genai", str(root / "s"), "--precision", "int4", "--max-ppl-change", "5",
                                 "--out", str(tmp_path / "g"), "--json", *told])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["quantization"]["lm_head_bits"] == _head_bits(tmp_path / "g") == (given or 4)
    assert info["settings"]["head_bits"] == (given or 4)


def test_a_declared_head_width_must_be_4_or_8(headed, tmp_path):
    root, _, _ = headed
    shutil.copytree(root / "s", tmp_path / "edited")
    cfg = read_json(tmp_path / "edited" / "config.json")
    cfg[HEAD_BITS] = 5
    (tmp_path / "edited" / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "edited")])
    assert r.exit_code != 0 and "bdlora_head_bits is 5 (4 or 8: the LM head's width in an int4 export)" in r.output


def test_train_forms_bits_starts_from_the_4_bit_head_and_its_compressed_folder_keeps_it(tiny_env, tmp_path):
    """train --method kd-lora --forms bits --precision int4 --speedup 1.2: the structure declares the 4-bit head,
    the healed student keeps the declaration through compress, and its int4 export ships it."""
    from bdlora.base.errors import usable_cores
    from conftest import genai_teacher, train_args

    genai_teacher(tiny_env["tokenizer"], tmp_path / "teacher", seed=3, layers=4)
    head_tables(tmp_path / "c", tmp_path / "teacher", threads=usable_cores())
    env = {**tiny_env, "teacher": tmp_path / "teacher", "cache": tmp_path / "c"}
    r = CliRunner().invoke(app, train_args(env, tmp_path / "run", "--method", "kd-lora", "--student-layers", "4",
                                           "--max-steps", "2", "--calib-tokens", "512", "--forms", "bits",
                                           "--precision", "int4", "--speedup", "1.2"))
    assert r.exit_code == 0, r.output
    assert read_json(tmp_path / "run" / "structure" / "config.json")[HEAD_BITS] == 4
    r = CliRunner().invoke(app, ["compress", str(tmp_path / "run"), "--out", str(tmp_path / "healed"), "--json"])
    assert r.exit_code == 0, r.output
    assert read_json(tmp_path / "healed" / "config.json")[HEAD_BITS] == 4
    r = CliRunner().invoke(app, ["export", "genai", str(tmp_path / "healed"), "--precision", "int4",
                                 "--max-ppl-change", "5", "--out", str(tmp_path / "g"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["quantization"]["lm_head_bits"] == _head_bits(tmp_path / "g") == 4


def test_bench_ships_each_int4_row_with_its_own_head_and_says_so(headed, tmp_path):
    """bench --runtime genai at int4: the student's rows ship the declared 4-bit head, the teacher's the default 8,
    and the bench's notes say the student's head is rounding; --head-bits 8 puts every row at 8 and says nothing."""
    root, _, _ = headed
    common = ["--runtime", "genai", "--genai-precisions", "int4", "--batch-sizes", "1", "--seq-lens", "16",
              "--decode-tokens", "2", "--repeats", "1", "--warmup", "0", "--no-peers", "--quality-tokens", "0"]
    r = CliRunner().invoke(app, ["bench", str(root / "s"), *common, "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    notes = read_json(tmp_path / "b" / "bench.json").get("genai_notes") or {}
    # the student's forms (compressed, its merged dense form, its LoRA form) carry its declaration; the teacher not
    assert set(notes) == {"compressed-int4", "dense-int4", "lora-int4"}
    assert all(why.startswith("LM head at 4 bits") for why in notes.values())
    r = CliRunner().invoke(app, ["bench", str(root / "s"), *common, "--head-bits", "8", "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    assert not read_json(tmp_path / "c" / "bench.json").get("genai_notes")
