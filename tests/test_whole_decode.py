"""The whole decode step (issue 51, item 3): what a step costs outside its projections, fitted from three synthetic
graphs, so that plan and the one-shot allocation predict the whole decode speed-up and a removed layer is priced
with its attention and norms."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from bdlora.bench.whole import Overhead, WholeStep, decode_prediction, fit, overhead_path
from bdlora.cli import app
from bdlora.export.genai import latency as lat
from bdlora.models.costs import Deployed, ModuleShape, shapes_from_config


def test_the_fit_recovers_a_known_decode_step():
    """Timings made from fixed 800 us, a layer's rest 100 us of which 60 scale with the MLP width, projections 150
    us a layer (90 at half width): the fit gives them back; noise larger than a term clamps it at zero."""
    fixed, a, m, p_full, p_half, lo, hi = 800.0, 40.0, 60.0, 150.0, 90.0, 2, 8
    t_lo = (fixed + lo * (p_full + a + m)) / 1000
    t_hi = (fixed + hi * (p_full + a + m)) / 1000
    t_half = (fixed + hi * (p_half + a + m / 2)) / 1000
    assert fit(t_lo, t_hi, t_half, lo, hi, p_full, p_half) == pytest.approx((800.0, 100.0, 60.0))
    assert fit(1.0, 1.0, 1.2, lo, hi, p_full, p_half) == (pytest.approx(1000 - 2 * 150), 0.0, 0.0)


CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 100}


def _table():
    us = {}
    for s in shapes_from_config(CONFIG):
        us[f"{s.in_features}x{s.out_features}@0"] = s.in_features * s.out_features / 100
        us[f"{s.in_features}x{s.out_features}@8"] = 8 * (s.in_features + s.out_features) / 100
    us.update({"64x128@0": 64 * 128 / 100, "128x64@0": 128 * 64 / 100})
    return lat.LatencyTable("int4", 1, us)


def test_a_removed_layer_saves_its_rest_and_a_narrower_mlp_part_of_it():
    """Teacher: fixed + L (per_layer) + every dense projection. A structure removing layer 1, keeping half the
    channels of layer 2's MLP and factoring layer 3's q at rank 8: fixed + two whole rests + one rest less half its
    width share + the chosen projections."""
    table = _table()
    o = Overhead("int4", 1, 8, fixed=1000.0, per_layer=200.0, per_width=50.0, timings_ms={})
    shapes = shapes_from_config(CONFIG)
    gone = {s.name for s in shapes if s.name.startswith("model.layers.1.")}

    def shape_of(s):
        return s.narrowed(128) if s.name.startswith("model.layers.2.mlp.") else s

    ranks = {"model.layers.3.self_attn.q_proj": 8}
    deployed = Deployed({s.name: (shape_of(s), ranks.get(s.name, 0), 0) for s in shapes if s.name not in gone})
    doc = decode_prediction(o, table, CONFIG, shapes, deployed)
    dense = sum(table.cost(s, 0) for s in shapes)
    assert doc["decode_us_teacher"] == pytest.approx(1000 + 4 * 200 + dense)
    chosen = sum(table.cost(shape_of(s), ranks.get(s.name, 0)) for s in shapes if s.name not in gone)
    assert doc["decode_us"] == pytest.approx(1000 + 200 + (200 - 25) + 200 + chosen)
    assert doc["predicted_decode_speedup"] == pytest.approx(doc["decode_us_teacher"] / doc["decode_us"])
    assert doc["decode_layers"] == 3 and doc["teacher_layers"] == 4
    # the table's own prediction carries the whole step once it has the overhead
    table.whole = WholeStep(o, CONFIG)
    pred = table.prediction(shapes, deployed)
    assert pred["predicted_decode_speedup"] == pytest.approx(doc["predicted_decode_speedup"])
    assert pred["projection_us"] == pytest.approx(chosen)
    # a student of fewer layers (plan --layers) is compared with the teacher's full depth
    two = [s for s in shapes if s.name.startswith(("model.layers.0.", "model.layers.1."))]
    doc = decode_prediction(o, table, CONFIG, two)
    assert doc["decode_us"] == pytest.approx(1000 + 2 * 200 + sum(table.cost(s, 0) for s in two))
    assert doc["decode_us_teacher"] == pytest.approx(1000 + 4 * 200 + dense)


def test_plan_measures_the_step_once_and_predicts_the_whole_decode(tiny_env, tmp_path, monkeypatch):
    """On a head-dim-16 teacher: three synthetic graphs exported and timed in onnxruntime-genai (the first plan),
    read from the cache after (the second prints no export); the JSON's predicted_decode_speedup is the ratio of
    its two whole steps."""
    from conftest import genai_teacher

    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path / "cache"))
    genai_teacher(tiny_env["tokenizer"], tmp_path / "teacher")
    argv = ["plan", "--model-config", str(tmp_path / "teacher"), "--budget", "0.4", "--lora-rank", "4",
            "--precision", "int4", "--threads", "1", "--json"]
    first = CliRunner().invoke(app, argv)
    assert first.exit_code == 0, first.output
    assert "exporting a synthetic" in first.stderr
    report = json.loads(first.stdout)
    d = report["deployed"]
    o = d["overhead"]
    assert report["predicted_decode_speedup"] == d["predicted_decode_speedup"] == pytest.approx(
        d["decode_us_teacher"] / d["decode_us"])
    assert d["decode_us_teacher"] == pytest.approx(o["fixed_us"] + 2 * o["per_layer_us"] + d["projection_us_dense"])
    assert min(o["fixed_us"], o["per_layer_us"], o["per_layer_width_us"]) >= 0 and o["head_bits"] == 8
    cfg = json.loads((tmp_path / "teacher" / "config.json").read_text())
    path = overhead_path(tmp_path / "cache", cfg, "int4", 1, 8)
    assert o["cache"] == str(path) and path.is_file()
    second = CliRunner().invoke(app, argv)
    assert second.exit_code == 0 and "exporting a synthetic" not in second.stderr
    assert json.loads(second.stdout)["predicted_decode_speedup"] == report["predicted_decode_speedup"]


def hand_overhead(cache, config: dict, precision: str, threads: int, fixed=500.0, per_layer=100.0, per_width=20.0):
    """A cached overhead with known values (so a test reads it instead of timing graphs)."""
    from bdlora.base.io import write_json

    path = overhead_path(cache, config, precision, threads, 8)
    write_json(path, {"precision": precision, "threads": threads, "head_bits": 8, "fixed": fixed,
                      "per_layer": per_layer, "per_width": per_width, "timings_ms": {}})
    return path


def test_shape_of_half_width_is_on_the_channel_grid():
    from bdlora.bench.whole import half_width

    assert half_width(CONFIG) == 128 and half_width({**CONFIG, "intermediate_size": 100}) == 32
    assert ModuleShape("model.layers.0.mlp.down_proj", 256, 64).narrowed(128).in_features == 128


LAYERS3 = [ModuleShape(f"model.layers.{i}.{p}", 32, 32) for i in range(3)
           for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]


def test_the_whole_step_budget_prices_each_layers_rest():
    """Three layers of three 32x32 projections (1,024 each) and a rest of 1,000 each outside them, fixed 2,000 per
    step: at 1.25x the whole step (total 14,216 -> 11,373, so 9,373 for the layers: 2,843 to save) removing one
    layer (error 50) saves 4,072; truncating ranks instead costs at least 93 (three rank-1 pairs save 2,880). At
    error 150 the ranks win."""
    from conftest import allocate_with

    energy = {s.name: np.ones(32) for s in LAYERS3}
    rest = {f"model.layers.{i}": (1000.0, 0.0) for i in range(3)}
    errors = {"model.layers.0": 900.0, "model.layers.1": 50.0, "model.layers.2": 800.0}
    a = allocate_with(LAYERS3, energy, 1.25, layers=errors, rest=rest, fixed=2000.0)
    assert a.removed == ["model.layers.1"] and not any(a.ranks.values())
    assert set(a.ranks) == {s.name for s in LAYERS3}  # no bookkeeping item among the projections
    kept = sum(1024 * 3 + 1000 for i in range(3) if f"model.layers.{i}" not in a.removed)
    assert 2000 + kept <= (3 * 4072 + 2000) / 1.25
    ranks = allocate_with(LAYERS3, energy, 1.25, layers={**errors, "model.layers.1": 150.0}, rest=rest, fixed=2000.0)
    assert ranks.removed == [] and sorted(ranks.ranks.values()) == [0] * 6 + [1] * 3
    with pytest.raises(Exception, match="--speedup 9: beyond reach"):
        allocate_with(LAYERS3, energy, 9.0, layers=errors, rest=rest, fixed=2000.0)


def test_a_narrower_mlp_carries_its_share_of_the_rest():
    """An MLP site's options carry the width-scaled part of its layer's rest: keeping 128 of 256 channels costs
    half of it. With m = 4,000 the site alone can meet 1.25x of the whole step by channels."""
    from bdlora.compress.forms.channels import site_options
    from bdlora.compress.pricing import mac_cost
    from conftest import allocate_with

    mlp = [ModuleShape("model.layers.0.mlp.gate_proj", 64, 256), ModuleShape("model.layers.0.mlp.up_proj", 64, 256),
           ModuleShape("model.layers.0.mlp.down_proj", 256, 64)]

    class Order:
        width = 256
        error = np.arange(257) * 0.01

    sites = {"model.layers.0.mlp": site_options(mlp, Order(), mac_cost)}
    energy = {s.name: np.ones(64) for s in mlp}
    total = 3 * 64 * 256 + 1000 + 4000  # projections, the width-independent rest, the width-scaled part
    a = allocate_with(mlp, energy, 1.25, sites=sites, lowrank=False, rest={"model.layers.0": (1000.0, 4000.0)})
    keep = a.keep["model.layers.0.mlp"]
    assert 3 * 64 * keep + 1000 + 4000 * keep / 256 <= total / 1.25
    assert 3 * 64 * (keep + 32) + 1000 + 4000 * (keep + 32) / 256 > total / 1.25  # the widest that fits


@pytest.mark.parametrize("damage", ["nan", "negative", "text", "missing", "not json"])
def test_a_damaged_overhead_is_never_used(tmp_path, damage):
    """Like the latency table's entries: a cached fit with a NaN, a negative or a non-number time, a field missing,
    or not JSON at all is refused (and so measured again), never turned into a prediction."""
    from bdlora.bench.whole import read_overhead

    path = hand_overhead(tmp_path, CONFIG, "int4", 1)
    assert read_overhead(path).per_layer == 100.0
    doc = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{")
    elif damage == "missing":
        del doc["fixed"]
        path.write_text(json.dumps(doc))
    else:
        doc["per_layer"] = {"nan": float("nan"), "negative": -1.0, "text": "fast"}[damage]
        path.write_text(json.dumps(doc))
    assert read_overhead(path) is None
