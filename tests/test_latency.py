"""Allocation by deployed latency (issue 40, item 2): the measured decode-time table of projection forms (its graphs,
its cache, its interpolation), the allocation taking it as its cost (a pair that does not pay at the precision is
never chosen), ``compress --one-shot --precision`` and ``plan --precision`` reading it from the cache."""

import json
import math

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_oneshot import shot_args
from typer.testing import CliRunner

import bdlora.export.genai.latency as lat
from bdlora.base import load
from bdlora.base.io import write_json
from bdlora.cli import app
from bdlora.compress.allocate import BUCKETS
from bdlora.compress.pricing import options
from bdlora.models.costs import ModuleShape
from conftest import allocate_with

AGREE = load.agree  # the real check (the conftest takes every test's repeats as agreeing)


def test_form_graphs_compute_the_forms_the_exporter_emits():
    """One copy of a dense int4 form is a single MatMulNBits (blocks of 32, accuracy level 4, uint8 zero points),
    a pair is two chained; both run in onnxruntime and give (1, N)."""
    dense = lat.form_graph(96, 40, 0, "int4", 3)
    assert [n.op_type for n in dense.graph.node] == ["MatMulNBits"] * 3
    attrs = {a.name: a.i for a in dense.graph.node[0].attribute}
    assert attrs == {"K": 96, "N": 40, "bits": 4, "block_size": 32, "accuracy_level": 4}
    pair = lat.form_graph(96, 40, 8, "int8", 2)
    assert [n.op_type for n in pair.graph.node] == ["MatMulNBits"] * 4
    assert [n.op_type for n in lat.form_graph(96, 40, 8, "fp32", 1).graph.node] == ["MatMul", "MatMul"]
    for proto in (dense, pair):
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        ys = sess.run(None, {"x": np.ones((1, 96), np.float32)})
        assert all(y.shape == (1, 40) and np.isfinite(y).all() for y in ys)


def test_rank_grid_and_interpolation():
    s = ModuleShape("m", 576, 1536)  # MAC break-even 419
    assert lat.grid(s) == [1, 8, 16, 32, 64, 128, 256, 418]
    t = lat.LatencyTable("int4", 2, {"576x1536@0": 100.0, "576x1536@8": 20.0, "576x1536@16": 30.0,
                                     "576x1536@1": 12.0})
    assert t.cost(s, 0) == 100.0 and t.cost(s, 8) == 20.0 and t.cost(s, 12) == pytest.approx(25.0)
    assert t.cost(s, 20) == pytest.approx(35.0)  # past the last measured rank: along the last segment
    assert t.pays(s) == 71  # 30 + 1.25 (r - 16) < 100 up to r = 71
    t.us["576x1536@16"] = 200.0
    assert t.pays(s) == 11  # 20 + 22.5 (r - 8) < 100 up to r = 11


def test_forms_timed_on_a_busy_machine_are_cached_unclean_and_measured_again_when_quiet(tmp_path, monkeypatch):
    """Issue 89: a table measured while other processes held more than BUSY_CORES (before the timings, or on average
    over them: a job may start between) is used, cached marked unclean with the load it was measured under, reused
    while the machine stays busy, and measured again by the first quiet run; its prediction says it is unclean. The
    real load readers (the conftest's stand-ins undone) read /proc/stat, this process's own time left out."""
    monkeypatch.undo()
    value = load.others_busy(0.05)
    assert value is None or value >= 0.0
    mark = load.load_mark()
    assert mark is None or load.others_since(mark) >= 0.0
    calls = []
    monkeypatch.setattr(lat, "measure_form", lambda k, n, r, p, t, layout: calls.append(r) or (1.0 + r, True))
    a = [ModuleShape("q", 64, 64)]
    seen = []
    rep = type("R", (), {"stage": lambda self, m: seen.append(m), "count": lambda self, *a: None})()
    forms = 1 + len(lat.grid(a[0]))
    for before, during in ((1.5, 0.0), (0.0, 1.5)):
        monkeypatch.setattr(load, "others_busy", lambda seconds=0.5, b=before: b)
        monkeypatch.setattr(load, "others_since", lambda m, d=during: d)
        t = lat.latency_table(a, "int8", 1, tmp_path / str(before), rep)
        doc = json.loads(t.path.read_text())
        assert t.us["64x64@0"] == 1.0 and len(doc["unclean"]) == forms and doc["load"]["others_cores_before"] == before
        assert t.unclean and f"{forms} of the {forms} int8 forms timed on a busy machine" in t.unclean
        assert t.prediction(a)["measured_clean"] is False and str(t.path) in t.prediction(a)["measurement"]
    assert sum("other processes using 1.5 cores" in m and "marked unclean" in m for m in seen) == 2
    cache = tmp_path / "1.5"
    assert len(calls) == 2 * forms
    monkeypatch.setattr(load, "others_busy", lambda seconds=0.5: 1.5)
    again = lat.latency_table(a, "int8", 1, cache, rep)  # still busy: reused as it is, still unclean
    assert len(calls) == 2 * forms and again.unclean
    monkeypatch.setattr(load, "others_busy", lambda seconds=0.5: 0.2)
    monkeypatch.setattr(load, "others_since", lambda m: 0.1)
    quiet = lat.latency_table(a, "int8", 1, cache, rep)  # quiet: measured again, and clean
    assert len(calls) == 3 * forms and quiet.unclean is None and quiet.prediction(a)["measured_clean"] is True
    assert json.loads(quiet.path.read_text())["unclean"] == []
    assert any(f"{forms} form(s) were measured unclean (on a busy machine, or with repeats that disagreed); "
               "measuring them again" in m for m in seen)
    lat.latency_table(a, "int8", 1, cache, rep)
    assert len(calls) == 3 * forms  # a clean table is read, not measured


def test_forms_whose_repeats_disagree_are_timed_once_more_then_marked_unclean(tmp_path, monkeypatch):
    """A form whose repeats disagree (``agree``) is timed a second time; if they disagree again it is marked
    unclean, and the table with it."""
    monkeypatch.setattr(load, "agree", AGREE)
    assert load.agree([10.0, 10.5, 11.0, 30.0, 40.0]) and not load.agree([10.0, *range(20, 29)])
    outcomes = {}

    def measure(k, n, r, p, t, layout, results=outcomes):
        results.setdefault(r, [])
        results[r].append(r)
        return 1.0 + r, r == 0 or len(results[r]) == 2  # rank 0 agrees at once, the rest the second time

    monkeypatch.setattr(lat, "measure_form", measure)
    a = [ModuleShape("q", 64, 64)]
    t = lat.latency_table(a, "int8", 1, tmp_path)
    assert outcomes[0] == [0] and all(len(v) == 2 for r, v in outcomes.items() if r)
    assert t.unclean is None and json.loads(t.path.read_text())["unclean"] == []
    monkeypatch.setattr(lat, "measure_form", lambda k, n, r, p, t, layout: (1.0 + r, r != 8))
    t = lat.latency_table([ModuleShape("k", 64, 32)], "int8", 1, tmp_path)
    assert json.loads(t.path.read_text())["unclean"] == ["64x32@8"]
    assert t.unclean.startswith("1 of the ") and t.noisy() == t.unclean


def test_a_form_is_timed_alone_at_the_median_of_its_repeats(monkeypatch):
    """measure_form times the one-copy graph, then the many-copy graph, each at the median of its repeats: a spell
    of other work inflates a few repeats and the median passes over them (the minimum, a lucky run with the weights
    in cache, priced narrower products too cheap at 1B); a graph whose repeats disagree is said to."""
    monkeypatch.setattr(load, "agree", AGREE)
    copies = int(min(lat.MAX_COPIES, max(lat.MIN_COPIES, -(-lat.STREAM_BYTES // lat.form_bytes(64, 64, 0, "fp32")))))
    slow = {1: 50.0, copies: 400.0}
    calls = {1: 0, copies: 0}

    def run_us(sess, feed):
        c = len(sess.get_outputs())
        calls[c] += 1
        return slow[c] if calls[c] % 5 == 0 else {1: 10.0, copies: 73.0}[c]  # every fifth repeat beside a job

    monkeypatch.setattr(lat, "_run_us", run_us)
    us, consistent = lat.measure_form(64, 64, 0, "fp32", 1)
    assert us == pytest.approx((73.0 - 10.0) / (copies - 1)) and consistent
    assert calls == {1: lat.REPEATS, copies: lat.REPEATS}


def test_the_table_is_measured_once_per_form_and_cached(tmp_path, monkeypatch):
    calls = []
    real = lat.measure_form

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(lat, "measure_form", counted)
    a = [ModuleShape("q", 64, 64)]
    t1 = lat.latency_table(a, "int8", 1, tmp_path)
    assert len(calls) == 1 + len(lat.grid(a[0])) and all(v > 0 for v in t1.us.values())
    assert t1.path.parent == tmp_path / "latency" and t1.path.is_file()
    t2 = lat.latency_table(a + [ModuleShape("k", 64, 32)], "int8", 1, tmp_path)  # only the new shape is measured
    assert len(calls) == 2 + len(lat.grid(a[0])) + len(lat.grid(ModuleShape("k", 64, 32)))
    assert t2.us["64x64@0"] == t1.us["64x64@0"]
    lat.latency_table(a, "int8", 1, tmp_path)
    assert len(calls) == 2 + len(lat.grid(a[0])) + len(lat.grid(ModuleShape("k", 64, 32)))
    t2.path.write_text("{not json")  # a damaged cache is measured again, not trusted
    lat.latency_table(a, "int8", 1, tmp_path)
    assert len(calls) == 3 + 2 * len(lat.grid(a[0])) + len(lat.grid(ModuleShape("k", 64, 32)))
    with pytest.raises(Exception, match="--precision int3: must be one of fp32, int8, int4"):
        lat.latency_table(a, "int3", 1, tmp_path)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([32, 48, 64]), st.sampled_from([16, 32, 64]), st.integers(0, 10_000),
                          st.floats(0.2, 3.0)), min_size=1, max_size=5), st.floats(1.0, 2.5))
def test_allocation_by_a_measured_cost_meets_it_and_never_picks_a_pair_slower_than_dense(mods, ratio):
    """With any per-form cost (a fixed per-node part that MACs do not see, scaled per module), the allocation meets
    the cost budget, picks no pair that costs at least the dense form, and is the least error within the budget."""
    import itertools

    shapes = [ModuleShape(f"m{i}", a, b) for i, (a, b, _, _) in enumerate(mods)]
    fixed = {s.name: f for s, (_, _, _, f) in zip(shapes, mods)}

    def cost(s, r):
        return s.dense_cost / 1000 if r == 0 else fixed[s.name] + s.lora_cost(r) / 1000

    spectra = {s.name: np.sort(np.random.default_rng(seed).exponential(1.0, min(s.in_features, s.out_features)))
               [::-1] for s, (_, _, seed, _) in zip(shapes, mods)}
    target = sum(cost(s, 0) for s in shapes) / ratio
    try:
        alloc = allocate_with(shapes, spectra, ratio, cost=cost)
    except Exception as e:  # noqa: BLE001
        assert "beyond reach" in str(e)
        return
    assert sum(cost(s, alloc.ranks[s.name]) for s in shapes) <= target * (1 + 1e-12)
    assert alloc.cost_ratio(shapes, cost) >= ratio * (1 - 1e-12)
    for s in shapes:
        r = alloc.ranks[s.name]
        assert r == 0 or cost(s, r) < cost(s, 0)
    total, slack = sum(alloc.errors.values()), target * (1 - len(shapes) / BUCKETS)
    for combo in itertools.islice(itertools.product(*[options(s, spectra[s.name], cost=cost) for s in shapes]),
                                  100_000):
        if sum(c for _, c, _ in combo) <= slack:
            assert total <= sum(e for _, _, e in combo) * (1 + 1e-9) + 1e-12


def _hand_table(cache, shapes, slow_pairs: tuple[tuple[int, int], ...], threads=1, precision="int4", teacher=None,
                pruned: bool = False):
    """A cached table with known values: dense K N / 100 us; a pair 0.5 + r (K + N) / 100 us, except the shapes in
    ``slow_pairs``, whose pairs cost twice the dense product (they never pay). With ``teacher`` (a folder), the
    half-width MLP products and the decode step's overhead (``test_whole_decode.hand_overhead``) too, so plan and
    the one-shot allocation time nothing; ``pruned``: the narrower products of pruned MLPs and attention blocks too
    (forms timed in a plan process, where the tests' quiet machine is not set, would be unclean on a busy one, and
    nothing is refused on those)."""
    from bdlora.bench.whole import half_width

    us = {}
    for k, n in {(s.in_features, s.out_features) for s in shapes}:
        us[f"{k}x{n}@0"] = k * n / 100
        for r in lat.grid(ModuleShape("", k, n)):
            us[f"{k}x{n}@{r}"] = 2 * k * n / 100 if (k, n) in slow_pairs else 0.5 + r * (k + n) / 100
    if teacher is not None:
        from test_whole_decode import hand_overhead
        from transformers import AutoConfig

        from bdlora.compress.forms.groups import site_probes

        config = AutoConfig.from_pretrained(teacher).to_dict()
        hidden, half = config["hidden_size"], half_width(config)
        us.update({f"{hidden}x{half}@0": hidden * half / 100, f"{half}x{hidden}@0": hidden * half / 100})
        kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])  # channels and groups read
        us.update({f"{k}x{n}@0": k * n / 100 for k, n in site_probes(shapes, kv, pruned, pruned)})
        hand_overhead(cache, config, precision, threads)
    path = lat.table_path(cache, precision, threads)
    write_json(path, {"version": lat.TABLE_VERSION, "us": us})
    return path


def _tiny_shapes(teacher):
    from transformers import AutoConfig

    from bdlora.models.costs import shapes_from_config

    return shapes_from_config(AutoConfig.from_pretrained(teacher).to_dict())


def test_one_shot_at_a_precision_allocates_by_the_cached_decode_times(tiny_env, tmp_path):
    """compress --one-shot --precision int4 reads the table from the cache (nothing is measured), keeps dense every
    projection whose pair does not pay there (the MLP's down projection here), and meets the decode-time ratio."""
    cache = tmp_path / "cache"
    shapes = _tiny_shapes(tiny_env["teacher"])
    down = next(s for s in shapes if s.name.endswith("down_proj"))
    path = _hand_table(cache, shapes, ((down.in_features, down.out_features),), teacher=tiny_env["teacher"])
    before = path.read_text()
    env = {**tiny_env, "cache": cache}
    res = CliRunner().invoke(app, shot_args(env, tmp_path / "s", "--mac-ratio", "1.3", "--forms", "lowrank",
                                            "--precision", "int4", "--threads", "1", "--json"))
    assert res.exit_code == 0, res.output
    assert path.read_text() == before  # every form came from the cache
    report = json.loads(res.stdout)
    doc = report["provenance"]["allocation_cost"]
    assert doc["precision"] == "int4" and doc["threads"] == 1 and doc["table"] == str(path)
    assert doc["predicted_projection_speedup"] >= 1.3
    table = lat.LatencyTable("int4", 1, json.loads(before)["us"])
    by_name = {s.name: s for s in shapes}
    chosen = {m["name"]: (m["rank"] if m["form"] == "lowrank" else 0) for m in report["modules"]}
    assert doc["projection_us"] == pytest.approx(sum(table.cost(by_name[n], r) for n, r in chosen.items()))
    assert doc["projection_us_dense"] == pytest.approx(sum(table.cost(s, 0) for s in shapes))
    assert all(r == 0 for n, r in chosen.items() if n.endswith("down_proj"))
    assert any(r > 0 for r in chosen.values())
    assert (tmp_path / "s" / "compression.json").is_file()


def test_plan_predicts_the_deployed_projection_speedup_from_the_table(tiny_env, tmp_path, monkeypatch):
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path))
    shapes = _tiny_shapes(tiny_env["teacher"])
    path = _hand_table(tmp_path, shapes, (), precision="int8", threads=1, teacher=tiny_env["teacher"])
    res = CliRunner().invoke(app, ["plan", "--model-config", str(tiny_env["teacher"]), "--budget", "0.4",
                                   "--lora-rank", "4", "--precision", "int8", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    d = report["deployed"]
    table = lat.LatencyTable("int8", 1, json.loads(path.read_text())["us"])
    by_name = {s.name: s for s in shapes}
    chosen = sum(table.cost(by_name[m["name"]], m["rank"] if m["form"] == "lowrank" else 0)
                 for m in report["modules"])
    assert d["projection_us"] == pytest.approx(chosen)
    assert d["predicted_projection_speedup"] == pytest.approx(sum(table.cost(s, 0) for s in shapes) / chosen)
    res = CliRunner().invoke(app, ["plan", "--model-config", str(tiny_env["teacher"]), "--precision", "int3"])
    assert res.exit_code == 2 and "--precision 'int3': unknown (allowed: fp32, int8, int4)" in res.stderr
    res = CliRunner().invoke(app, shot_args(tiny_env, tmp_path / "x", "--mac-ratio", "1.3", "--precision", "fp16"))
    assert res.exit_code == 2 and "--precision 'fp16': unknown (allowed: fp32, int8, int4)" in res.stderr
    assert not (tmp_path / "x").exists()


def test_bench_sets_the_prediction_beside_the_measured_speedup():
    """The student's decode at P is predicted as the teacher's measured decode at P minus the projection time the
    allocation saved (its table); the measured speed-up comes from the same front."""
    from bdlora.bench.front import predicted_vs_measured, prediction_line

    points = [{"name": "teacher-int4", "ms": 6.0}, {"name": "compressed-int4", "ms": 5.0},
              {"name": "teacher", "ms": 20.0}, {"name": "compressed", "ms": 15.0}]
    cost = {"precision": "int4", "threads": 2, "projection_us_dense": 3000.0, "projection_us": 1500.0,
            "predicted_projection_speedup": 2.0}
    p = predicted_vs_measured(points, cost)
    assert p["predicted_student_ms"] == pytest.approx(4.5) and p["predicted_speedup"] == pytest.approx(6.0 / 4.5)
    assert p["measured_speedup"] == pytest.approx(1.2)
    assert p["relative_error"] == pytest.approx((6.0 / 4.5) / 1.2 - 1)
    assert "1.33x faster decode than the teacher's int4 export" in prediction_line(p) and "measured 1.20x" in \
        prediction_line(p)
    assert predicted_vs_measured(points, {**cost, "precision": "int8"}) is None  # no int8 rows on this front
    assert predicted_vs_measured(points, {**cost, "precision": "fp32"})["measured_speedup"] == pytest.approx(20 / 15)
    # a prediction made in one scheme's nodes says so when the bench rounded either side another way
    same = predicted_vs_measured(points, {**cost, "scheme": "affine"}, ("affine", "affine"))
    assert same["predicted_scheme"] == "affine" and "not the same graphs" not in prediction_line(same)
    mixed = predicted_vs_measured(points, cost, ("gptq", "affine"))  # a folder from before: rtn's nodes
    assert mixed["measured_schemes"] == {"student": "gptq", "teacher": "affine"}
    assert "predicted in rtn's nodes, measured with the student rounded by gptq and the teacher by affine: not the " \
           "same graphs" in prediction_line(mixed)
    assert "not the same" not in prediction_line(predicted_vs_measured(points, cost, ("gptq", "rtn")))  # rtn's nodes


def test_train_at_a_precision_starts_from_the_allocation_by_decode_time(tiny_env, tmp_path):
    """train --precision int4 allocates the budgeted student's start by the cached decode-time table (nothing is
    measured): the projection whose pair never pays there keeps its dense path, the others get the ranks the
    measured-cost allocation gives; without --allocation quality and --mac-ratio it is refused in one line."""
    from bdlora.base.errors import usable_cores
    from bdlora.base.runs import RunDir
    from bdlora.compress.start import LowRankStart
    from conftest import train_args

    cache = tiny_env["cache"]
    shapes = _tiny_shapes(tiny_env["teacher"])
    down = next(s for s in shapes if s.name.endswith("down_proj"))
    path = _hand_table(cache, shapes, ((down.in_features, down.out_features),), threads=usable_cores())
    before = path.read_text()
    res = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "r", "--method", "budgeted", "--allocation",
                                             "quality", "--mac-ratio", "1.3", "--precision", "int4", "--max-steps",
                                             "2", "--json"))
    assert res.exit_code == 0, res.output
    assert path.read_text() == before  # every form came from the cache
    start = LowRankStart.load(tmp_path / "r" / "lora_start.json", tmp_path / "r" / "lora_start.safetensors")
    removed = set(start.allocation.order)
    assert removed and not any(n.endswith("down_proj") for n in removed)
    assert RunDir(tmp_path / "r").config()["precision"] == "int4"
    bad = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "x", "--method", "budgeted", "--precision", "int4"))
    assert bad.exit_code == 2 and "--precision int4: allocates a budgeted student's start by decode time" in bad.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("damage", ["nan", "inf", "zero", "negative", "text", "bool", "bad key", "deep"])
def test_a_damaged_latency_table_is_measured_again_never_used(tiny_env, tmp_path, monkeypatch, damage):
    """Issue 53, case 6: NaN in a cached table made plan print ``predicted_projection_speedup: NaN`` with exit 0,
    zeros a ZeroDivisionError, deep nesting a RecursionError. Damaged entries are dropped and measured again (here
    by a stand-in for the timing, which this test is not about) and the table is rewritten whole."""
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path))
    remeasured = []

    def fake(k, n, rank, precision, threads, layout="nbits"):
        remeasured.append(f"{k}x{n}@{rank}")
        return (k * n / 100 if rank == 0 else 0.5 + rank * (k + n) / 100), True

    monkeypatch.setattr(lat, "measure_form", fake)
    shapes = _tiny_shapes(tiny_env["teacher"])
    path = _hand_table(tmp_path, shapes, (), precision="int8", threads=1, teacher=tiny_env["teacher"])
    good = json.loads(path.read_text())
    victim = sorted(good["us"])[0]
    values = {"nan": float("nan"), "inf": float("inf"), "zero": 0, "negative": -3.0, "text": "fast", "bool": True}
    if damage == "deep":
        path.write_text('{"us": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif damage == "bad key":
        path.write_text(json.dumps({**good, "us": {**good["us"], "64x64@-1": 1.0, "q_proj": 2.0}}))
    else:
        path.write_text(json.dumps({**good, "us": {**good["us"], victim: values[damage]}}))
    res = CliRunner().invoke(app, ["plan", "--model-config", str(tiny_env["teacher"]), "--budget", "0.4",
                                   "--lora-rank", "4", "--precision", "int8", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    speedup = json.loads(res.stdout)["deployed"]["predicted_projection_speedup"]
    assert math.isfinite(speedup) and speedup > 0
    if damage == "deep":
        assert sorted(remeasured) == sorted(good["us"])
    elif damage == "bad key":
        assert remeasured == []  # the valid entries were all there
    else:
        assert remeasured == [victim]
    rewritten = json.loads(path.read_text())["us"]
    if damage != "bad key":
        assert rewritten == pytest.approx(good["us"])


def test_a_table_measured_on_more_threads_than_cores_is_refused(tiny_env, tmp_path, monkeypatch):
    """Issue 53, minor: ``plan``/``compress --precision int8 --threads 64`` on 2 cores was accepted and the table
    measured so cached as if it were real (bench refused the same value)."""
    from bdlora.base.errors import usable_cores

    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path))
    many = str(usable_cores() + 1)
    for argv in (["plan", "--model-config", str(tiny_env["teacher"]), "--precision", "int8", "--threads", many],
                 shot_args(tiny_env, tmp_path / "s", "--mac-ratio", "1.3", "--precision", "int8", "--threads", many)):
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 2 and f"--threads {many}: " in res.stderr and "cores" in res.stderr, res.output
    assert not (tmp_path / "latency").exists() and not (tmp_path / "s").exists()


def _matmuls(k: int, n: int, rank: int, seed: int = 0):
    """A fp32 graph of one form as the decoder holds it (activations (1, S, K); dense or the pair K -> rank -> N),
    weights with an offset so that the affine grid's block offsets are not zero."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    dims = [(k, n)] if rank == 0 else [(k, rank), (rank, n)]
    inits = [numpy_helper.from_array((rng.standard_normal(d) * 0.1 + 0.05).astype(np.float32), f"W{i}")
             for i, d in enumerate(dims)]
    names = ["x", *(f"h{i}" for i in range(len(dims) - 1)), "y"]
    nodes = [helper.make_node("MatMul", [names[i], f"W{i}"], [names[i + 1]], name=f"/m{i}/MatMul")
             for i in range(len(dims))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), [numpy_helper.to_array(w) for w in inits]


@pytest.mark.parametrize("quant", ["rtn", "affine"])
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("rank", [0, 8, 32])
def test_each_scheme_is_timed_in_the_nodes_its_export_writes(quant, precision, rank):
    """The latency table times a form in its scheme's node layout: the same op sequence and MatMulNBits widths as
    ``quantize_nbits`` writes for that form (affine at int4: an AveragePool and a Concat before every MatMul whose
    K blocks divide, K/32 more columns; a rank-8 second factor keeps the plain node), and ``LatencyTable.rounded``
    rounds as the written graph computes (one-hot rows read its weights back, to 1e-6)."""
    from bdlora.base.schemes import SCHEMES
    from bdlora.export.genai.quantize import quantize_nbits

    proto, weights = _matmuls(96, 40, rank)
    written, _ = quantize_nbits(proto, precision, quant)
    timed = lat.form_graph(96, 40, rank, precision, 1, layout=SCHEMES[quant].layout(precision))

    def layout(p):
        return [(n.op_type, next((a.i for a in n.attribute if a.name == "K"), None)) for n in p.graph.node]

    assert layout(timed) == layout(written)
    assert sum(op == "AveragePool" for op, _ in layout(written)) == (
        (1 + (rank == 32) if rank else 1) if quant == "affine" and precision == "int4" else 0)
    sess = ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
    table = lat.LatencyTable(precision, 1, scheme=quant)
    if rank == 0:  # one-hot rows: the graph's weights, as rounded
        got = sess.run(None, {"x": np.eye(96, dtype=np.float32)[None]})[0][0]
        assert np.abs(got - table.rounded(weights[0].T, lat.BITS[precision]).T).max() < 1e-6
    timed_sess = ort.InferenceSession(timed.SerializeToString(), providers=["CPUExecutionProvider"])
    ys = timed_sess.run(None, {i.name: np.ones(i.shape, np.float32) for i in timed_sess.get_inputs()})
    assert [y.shape[-1] for y in ys] == [40]


def test_a_schemes_table_is_its_own_cache_and_calibrated_schemes_time_their_uncalibrated_twin(tmp_path, monkeypatch):
    """affine at int4 is measured in its own layout and cached apart; at int8 (the plain symmetric node) it shares
    round-to-nearest's table; gptq is timed as round-to-nearest (the same nodes, no calibration needed)."""
    from bdlora.base.schemes import SCHEMES

    assert SCHEMES["gptq"].timed_as("int4").name == "rtn" and SCHEMES["affine"].timed_as("int4").name == "affine"
    assert [SCHEMES[q].layout("int4") for q in ("rtn", "gptq", "affine")] == ["nbits", "nbits", "nbits+means"]
    assert {SCHEMES[q].layout("int8") for q in SCHEMES} == {"nbits"} and SCHEMES["affine"].layout("fp32") == "matmul"
    seen = []
    monkeypatch.setattr(lat, "measure_form", lambda k, n, r, p, t, layout: seen.append((p, layout)) or (1.0 + r, True))
    shapes = [ModuleShape("q", 64, 64)]
    plain = lat.latency_table(shapes, "int4", 1, tmp_path, ranks=False)
    means = lat.latency_table(shapes, "int4", 1, tmp_path, ranks=False, quant="affine")
    assert seen == [("int4", "nbits"), ("int4", "nbits+means")] and plain.path != means.path
    assert means.scheme == "affine" and "nbits-means" in means.path.name
    assert lat.latency_table(shapes, "int4", 1, tmp_path, ranks=False, quant="gptq").path == plain.path
    assert lat.latency_table(shapes, "int8", 1, tmp_path, ranks=False, quant="affine").path == \
        lat.latency_table(shapes, "int8", 1, tmp_path, ranks=False).path
    assert len(seen) == 3  # gptq at int4 read rtn's cache; int8 measured once for both schemes


def test_quant_beside_a_latency_precision_is_checked_in_one_line_and_named_in_the_output(tiny_env, tmp_path,
                                                                                       monkeypatch):
    """``--quant`` on plan, compress --one-shot and train: an unknown scheme, or one without --precision int8/int4,
    is refused in one line before any work; a one-shot's default folder names it; plan --quant affine prices the
    structure in affine's node layout and says so."""
    from bdlora.base.runs import one_shot_out

    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path))
    cfg = str(tiny_env["teacher"])
    for argv, needle in (
            (["plan", "--model-config", cfg, "--quant", "affine"], "--quant affine: names the scheme"),
            (["plan", "--model-config", cfg, "--precision", "fp32", "--quant", "gptq"], "--precision fp32 rounds"),
            (shot_args(tiny_env, tmp_path / "s", "--mac-ratio", "1.3", "--precision", "int4", "--quant", "q4k"),
             "--quant 'q4k': unknown (allowed: rtn, gptq, affine)"),
            (["train", "--teacher", cfg, "--quant", "affine", "--out", str(tmp_path / "t")], "--quant affine: names")):
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "latency").exists() and not (tmp_path / "s").exists() and not (tmp_path / "t").exists()
    assert one_shot_out("smollm2-135m", 1.3, "runs", "int4", "channels", True, "affine").name == \
        "smollm2-135m.oneshot-int4-affine-channels-decode-1.3x.compressed"
    from bdlora.forms import ONE_SHOT_FORMS, named_forms  # the default forms leave the default name as it was

    names = [one_shot_out("smollm2-135m", 1.2, "runs", None, named_forms(f)).name for f in (ONE_SHOT_FORMS, "lowrank")]
    assert names == ["smollm2-135m.oneshot-1.2x.compressed", "smollm2-135m.oneshot-lowrank-1.2x.compressed"]
    from conftest import tiny_config

    tiny_config(320, layers=2, hidden=64).save_pretrained(tmp_path / "genai")  # head dim 16: GroupQueryAttention's
    res = CliRunner().invoke(app, ["plan", "--model-config", str(tmp_path / "genai"), "--budget", "0.4",
                                   "--lora-rank", "4", "--precision", "int4", "--quant", "affine", "--threads", "1",
                                   "--json"])
    assert res.exit_code == 0, res.output
    deployed = json.loads(res.stdout)["deployed"]
    assert (deployed["scheme"], deployed["layout"]) == ("affine", "nbits+means")
    assert "int4-nbits-means-t1-" in deployed["table"] and deployed["predicted_decode_speedup"] > 0
