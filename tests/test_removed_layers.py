"""Removed decoder layers (issue 51, item 2): the error of removing a layer measured in the other forms' units (the
loss-weighted update it adds to the residual stream), one exact knapsack in which a layer's alternative is to go
whole, and a shallower folder that every reader takes (the genai builder's own row included: its layers stay
uniform)."""

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_channels import benched, scored_and_exported, shot
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.compress.allocate import knapsack
from bdlora.compress.calibrate import calibrate
from bdlora.compress.forms.layers import removal_errors, renumbered
from bdlora.compress.forms.lowrank import FISHER_DAMPING
from bdlora.models.costs import ModuleShape
from bdlora.models.depth import take_layers
from conftest import allocate_with


def test_the_removal_error_is_the_loss_weighted_update_of_the_layer(tiny_model):
    """calibrate(..., residual=True) holds, per layer, sum_t u_t^2 and sum_t g_t^2 of its output, as a direct
    forward and backward pass finds them; the removal error is their damped product."""
    torch.manual_seed(0)
    x = torch.randint(0, tiny_model.config.vocab_size, (3, 16))
    calib = calibrate(tiny_model, x.numpy(), residual=True)
    layers = tiny_model.model.layers
    assert sorted(calib.residual) == list(range(len(layers)))
    seen = {}

    def keep(i):
        def hook(module, args, kwargs, out):
            out.retain_grad()
            seen[i] = ((args[0] if args else kwargs["hidden_states"]).detach(), out)
        return hook

    handles = [layer.register_forward_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        h0 = tiny_model.get_input_embeddings()(x).detach().requires_grad_()
        logits = tiny_model(inputs_embeds=h0, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                          reduction="sum").backward()
    finally:
        for h in handles:
            h.remove()
    for i, (h_in, out) in seen.items():
        u = (out.detach() - h_in).double().reshape(-1, out.shape[-1])
        g = out.grad.double().reshape(-1, out.shape[-1])
        torch.testing.assert_close(calib.residual[i][0], u.square().sum(0), rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(calib.residual[i][1], g.square().sum(0), rtol=1e-5, atol=1e-12)
        f = calib.residual[i][1]
        want = float(((f + FISHER_DAMPING * f.mean()) * calib.residual[i][0]).sum())
        assert removal_errors(calib)[f"model.layers.{i}"] == pytest.approx(want, rel=1e-12)
    assert calibrate(tiny_model, x.numpy()).residual == {}  # only when asked


@given(st.lists(st.lists(st.tuples(st.integers(1, 30_000), st.floats(0, 100)), min_size=1, max_size=3),
                min_size=2, max_size=6), st.data())
@settings(max_examples=60, deadline=None)
def test_the_knapsack_with_removable_groups_is_exact(raw, data):
    """Disjoint ranges of consecutive items that may go whole at an alternative (cost, error): the least total error
    within a 65,536 budget, as brute force over every choice finds it."""
    items = [[(k, float(c), float(e)) for k, (c, e) in enumerate(o)] for o in raw]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(items)), max_size=4))))
    groups = [(a, b, float(data.draw(st.integers(0, 20_000))), float(data.draw(st.floats(0, 200))))
              for a, b in zip(cuts, cuts[1:]) if b > a]
    in_group = {m: g for g, (a, b, _, _) in enumerate(groups) for m in range(a, b)}

    def total(choice, removed):
        cost = sum(groups[g][2] for g in removed) + sum(items[m][k][1] for m, k in enumerate(choice)
                                                       if in_group.get(m) not in removed)
        err = sum(groups[g][3] for g in removed) + sum(items[m][k][2] for m, k in enumerate(choice)
                                                      if in_group.get(m) not in removed)
        return cost, err

    best = None
    for removed in itertools.chain.from_iterable(itertools.combinations(range(len(groups)), n)
                                                 for n in range(len(groups) + 1)):
        for choice in itertools.product(*[range(len(o)) for o in items]):
            cost, err = total(choice, set(removed))
            if cost <= 65_536 and (best is None or err < best):
                best = err
    if best is None:
        with pytest.raises(Exception, match="beyond"):
            knapsack(items, 65_536, lambda c: f"beyond {c}", groups)
        return
    picked = knapsack(items, 65_536, lambda c: f"beyond {c}", groups)
    removed = {g for g, (a, b, _, _) in enumerate(groups) if picked[a] == -1}
    assert all((picked[m] == -1) == (in_group.get(m) in removed) for m in range(len(items)))
    cost, err = total([max(k, 0) for k in picked], removed)
    assert cost <= 65_536 and err == pytest.approx(best, abs=1e-9)


LAYER = [ModuleShape(f"model.layers.{i}.{p}", 32, 32) for i in range(3)
         for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]


def test_the_allocation_removes_the_layer_that_costs_least():
    """Three layers of three 32x32 projections, each spectrum losing 1 per dropped component. At 1.45x fewer MACs,
    removing the middle layer (error 5) beats truncating ranks (six rank-8 pairs at least: error 144) but not at
    error 500; with low rank off only layers go. (Exactly 1.5x does not fit: each cost is rounded up to a bucket.)"""
    energy = {s.name: np.ones(32) for s in LAYER}
    cheap = allocate_with(LAYER, energy, 1.45, layers={"model.layers.0": 900.0, "model.layers.1": 5.0,
                                                 "model.layers.2": 700.0})
    assert cheap.removed == ["model.layers.1"] and not any(cheap.ranks.values())
    assert cheap.errors["model.layers.1"] == 5.0 and cheap.gone("model.layers.1.mlp.down_proj")
    assert cheap.macs(LAYER) == 6 * 32 * 32 and cheap.mac_ratio(LAYER) == 1.5
    costly = allocate_with(LAYER, energy, 1.45, layers={f"model.layers.{i}": 500.0 for i in range(3)})
    assert costly.removed == [] and any(costly.ranks.values())
    assert sorted(costly.ranks.values()) == sorted(allocate_with(LAYER, energy, 1.45).ranks.values())
    only = allocate_with(LAYER, energy, 2.5, lowrank=False, layers={"model.layers.0": 3.0, "model.layers.1": 1.0,
                                                               "model.layers.2": 2.0})
    assert sorted(only.removed) == ["model.layers.1", "model.layers.2"] and only.mac_ratio(LAYER) == 3.0
    with pytest.raises(Exception, match="beyond reach"):
        allocate_with(LAYER, energy, 4.0, lowrank=False, layers={"model.layers.0": 1.0})
    assert renumbered({"model.layers.2.mlp.down_proj": 1, "model.layers.1.mlp": 2, "lm_head": 3}, [0, 2]) == {
        "model.layers.1.mlp.down_proj": 1}


@pytest.fixture(scope="module")
def shallow(tiny_env, tmp_path_factory):
    from conftest import genai_teacher

    root = tmp_path_factory.mktemp("layers")
    teacher = genai_teacher(tiny_env["tokenizer"], root / "teacher", seed=3, layers=4)  # 4 layers, head dim 16
    r = shot(tiny_env, root / "teacher", root / "s", "--mac-ratio", "1.3", "--forms", "layers")
    assert r.exit_code == 0, r.output
    return root, teacher, json.loads(r.stdout)


def test_a_removed_layer_leaves_a_shallower_folder_equal_to_the_source_without_it(shallow):
    """1.3x by layers alone on 4 equal layers: one layer goes (3/4 of the projection MACs is the cheapest way to
    1.3x). The folder is the source's other three layers, untouched, renumbered: its logits equal those of the
    source with that layer taken out, with and without remote code; the report's rows of the removed projections
    cost nothing."""
    from transformers import AutoModelForCausalLM

    root, teacher, report = shallow
    removed = report["provenance"]["removed_layers"]
    kept = report["provenance"]["layer_indices"]
    assert len(removed) == 1 and sorted(removed + kept) == [0, 1, 2, 3] and report["layers_removed"] == 1
    assert report["speedup_vs_dense"] == pytest.approx(4 / 3)
    cfg = json.loads((root / "s" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3
    rows = [m for m in report["modules"] if m["case"] == "removed"]
    assert len(rows) == 7 and all(m["form"] == "removed" and m["macs_after"] == 0 and m["params_after"] == 0
                                  and m["name"].startswith(f"model.layers.{removed[0]}.") for m in rows)
    x = torch.randint(0, teacher.config.vocab_size, (2, 12))
    want = take_layers(teacher, kept).eval()
    for remote in (False, True):
        got = AutoModelForCausalLM.from_pretrained(root / "s", dtype=torch.float32, trust_remote_code=remote).eval()
        with torch.no_grad():
            torch.testing.assert_close(got(x).logits, want(x).logits, rtol=0, atol=0)
    # the layer removed is the one whose update the loss weighs least, per the calibration
    errors = report["provenance"]["allocation"]["removal_errors"]
    assert min(errors, key=errors.get) == f"model.layers.{removed[0]}" and len(errors) == 4


@pytest.mark.full  # moved out of the README's test command to keep it under 8 minutes; CI runs pytest -m full
def test_every_reader_takes_a_shallower_folder(tiny_env, shallow, tmp_path):
    """eval, export onnx/genai (validated against PyTorch), and bench --runtime genai, whose own-builder row of the
    student exists (its layers are uniform), beside the teacher's."""
    root, _, report = shallow
    folder = root / "s"
    scored_and_exported(folder, report, tmp_path, genai=())
    assert json.loads((tmp_path / "o" / "config.json").read_text())["num_hidden_layers"] == 3
    doc = benched(folder, tmp_path, ort=False)
    assert {"compressed-int4", "builder-int4", "teacher-int4"} <= {p["name"] for p in doc["front"]}


def test_layers_beside_low_rank_and_channels_with_correction(tiny_env, shallow, tmp_path):
    """All three forms in one allocation, with --correct (the layers above a removed one corrected against the
    stream without it): the folder meets its ratio and loads."""
    root, _, _ = shallow
    r = shot(tiny_env, root / "teacher", tmp_path / "all", "--mac-ratio", "1.6", "--forms",
             "lowrank,channels,layers", "--correct")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["speedup_vs_dense"] >= 1.6 and report["provenance"]["correction"]["modules"] >= 0
    cfg = json.loads((tmp_path / "all" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 - report["layers_removed"]
    assert report["eval"]["compressed_val_ppl"] < 10 * report["eval"]["student_val_ppl"]


def test_plan_of_a_folder_predicts_its_whole_decode_step(shallow, tmp_path, monkeypatch):
    """plan FOLDER --precision P reads the folder's own structure (the removed layer included) and predicts its whole
    step against the source's full depth; with a hand-made table and overhead nothing is timed and the figures are
    exact: teacher = fixed + 4 (rest + a layer's dense projections), the folder = fixed + 3 of them."""
    from test_latency import _hand_table

    from bdlora.export.genai.latency import LatencyTable
    from bdlora.models.costs import shapes_from_config

    root, _, report = shallow
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path))
    config = json.loads((root / "teacher" / "config.json").read_text())
    shapes = shapes_from_config(config)
    path = _hand_table(tmp_path, shapes, (), precision="int4", threads=1, teacher=root / "teacher")
    r = CliRunner().invoke(app, ["plan", str(root / "s"), "--precision", "int4", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert "exporting a synthetic" not in r.stderr and "measuring" not in r.stderr
    doc = json.loads(r.stdout)
    table = LatencyTable("int4", 1, json.loads(path.read_text())["us"])
    layer = sum(table.cost(s, 0) for s in shapes if s.name.startswith("model.layers.0."))
    d = doc["deployed"]
    assert d["decode_layers"] == 3 and d["teacher_layers"] == 4
    assert d["decode_us_teacher"] == pytest.approx(500 + 4 * (100 + layer))  # hand_overhead's fixed and rest
    assert d["decode_us"] == pytest.approx(500 + 3 * (100 + layer))
    assert doc["predicted_decode_speedup"] == pytest.approx((500 + 4 * (100 + layer)) / (500 + 3 * (100 + layer)))
    assert doc["speedup_vs_dense"] == report["speedup_vs_dense"]
    bad = CliRunner().invoke(app, ["plan", str(tmp_path), "--precision", "int4"])
    assert bad.exit_code == 2 and "not a compressed folder" in bad.stderr


def test_speedup_allocates_for_the_whole_decode_step(tiny_env, shallow, tmp_path, monkeypatch):
    """compress --one-shot --speedup S --precision P: the allocation's budget is the whole step's (a hand-made table
    and overhead: nothing timed), and the folder's predicted whole-step speed-up meets S; --speedup without
    --precision, or beside --mac-ratio, is one line."""
    from test_latency import _hand_table

    from bdlora.models.costs import shapes_from_config

    root, _, _ = shallow
    config = json.loads((root / "teacher" / "config.json").read_text())
    _hand_table(tmp_path / "c", shapes_from_config(config), (), precision="int4", threads=1, teacher=root / "teacher")
    env = {**tiny_env, "cache": tmp_path / "c"}
    r = shot(env, root / "teacher", tmp_path / "d", "--speedup", "1.4", "--precision", "int4", "--threads", "1",
             "--forms", "lowrank,channels,layers")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    cost = report["provenance"]["allocation_cost"]
    assert report["provenance"]["speedup"] == 1.4 and report["provenance"]["mac_ratio"] is None
    assert cost["predicted_decode_speedup"] >= 1.4 - 1e-9 and "whole decode time" in r.stderr
    for extra, needle in ((("--speedup", "1.3"), "--speedup 1.3: needs --precision P"),
                          (("--speedup", "1.3", "--mac-ratio", "1.3", "--precision", "int4"), "not both")):
        bad = shot(env, root / "teacher", tmp_path / "x", *extra)
        assert bad.exit_code == 2 and needle in bad.stderr, bad.output
        assert not (tmp_path / "x").exists()


def test_pruned_mlps_above_a_removed_layer_are_declared_at_their_new_index(tiny_env, shallow, tmp_path):
    """Layers and channels together (2.5x is beyond channels alone here): every pruned MLP keeps its width at the
    index its layer has in the shallower folder, which loads and scores (the report keeps the source's numbering)."""
    root, _, _ = shallow
    r = shot(tiny_env, root / "teacher", tmp_path / "cl", "--mac-ratio", "2.5", "--forms", "channels,layers")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    kept, removed = report["provenance"]["layer_indices"], report["provenance"]["removed_layers"]
    pruned = {int(m["name"].split(".")[2]): m["channels"] for m in report["modules"]
              if m["case"] == "pruned" and m["name"].endswith("down_proj")}
    assert removed and pruned and max(pruned) > min(removed)
    sites = {k: v for k, v in json.loads((tmp_path / "cl" / "config.json").read_text())["bdlora_modules"].items()
             if k.endswith(".mlp")}
    assert sites == {f"model.layers.{kept.index(i)}.mlp": {"form": "channels", "keep": k} for i, k in pruned.items()}
    e = CliRunner().invoke(app, ["eval", str(tmp_path / "cl"), "--ppl", "--report", str(tmp_path / "e.json")])
    assert e.exit_code == 0, e.output
