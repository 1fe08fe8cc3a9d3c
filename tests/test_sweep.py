import json
import shutil

import pytest
from typer.testing import CliRunner

from bdlora.base.reporter import Reporter
from bdlora.cli import app
from bdlora.sweep.options import family


def sweep_args(env, out, *extra):
    return ["sweep", "--teacher", str(env["teacher"]), "--data", str(env["corpus"]), "--cache-dir", str(env["cache"]),
            "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "512", "--heldout-fraction", "0.1",
            "--lora-rank", "4", "--lora-alpha", "8", "--max-steps", "4", "--lr", "3e-3", "--examples", "2",
            "--seeds", "2", "--out", str(out), *extra]


def test_family_members_and_bad_input():
    assert [m.name for m in family([0.0, 0.4], ["kd-full", "kd-lora"])] == [
        "kd-full", "kd-lora", "budgeted-F0", "budgeted-F0.4"]
    assert family([0.4], [])[0].budget == 0.4
    shot = family([], [], one_shot=[1.5])
    assert [(m.name, m.method, m.settings) for m in shot] == [("one-shot-1.5x", "one-shot", {"mac_ratio": 1.5})]
    for ratios, needle in [([0.5], "--one-shot 0.5: a projection-MAC ratio must be >= 1"),
                           ([2.0, 2.0], "each ratio once")]:
        with pytest.raises(Exception, match=needle):
            family([], [], one_shot=ratios)
    for budgets, baselines, needle in [([1.5], [], "must be in [0, 1]"), ([], ["kd-foo"], "kd-foo"),
                                       ([], [], "nothing to sweep"), ([0.4, 0.4], [], "each budget once")]:
        with pytest.raises(Exception, match=needle.replace("[", r"\[").replace("]", r"\]")):
            family(budgets, baselines)


@pytest.mark.full  # moved out of the README's test command to keep it under 8 minutes; CI runs pytest -m full
def test_sweep_runs_a_family_and_resumes_without_retraining(tiny_env, tmp_path):
    out = tmp_path / "sweep"
    # the budget drops at once with no EMA lag, so 4 steps reach the F = 0 structure; a checkpoint every 2 steps
    yaml = tmp_path / "sweep.yaml"
    # the paper's removal rule, so F = 0 means every dense path dropped
    # and the teacher's top-k targets cached (--kd-topk): the second member to train reads the first one's
    yaml.write_text("decay_start: 0.0\ndecay_end: 0.0\nretention_ema: 0.0\nsave_every: 2\nmeasure_step_time: false\n"
                    "allocation: cost\nkd_topk: 24\n")
    res = CliRunner().invoke(app, sweep_args(tiny_env, out, "--config", str(yaml), "--budgets", "0.0", "--baselines",
                                             "kd-lora", "--one-shot", "1.5", "--bench-seq-lens", "8",
                                             "--bench-repeats", "1"))
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in doc["members"]}
    assert set(rows) == {"kd-lora", "budgeted-F0", "one-shot-1.5x"}
    shot = rows["one-shot-1.5x"]  # the teacher compressed without training, measured like the trained members
    assert shot["method"] == "one-shot" and shot["mac_speedup_vs_dense"] >= 1.5 and shot["val_ppl"] > 1.0
    assert (out / "one-shot-1.5x.compressed" / "compression.json").is_file() and "model_decode" in shot["measured"]
    f0, lora = rows["budgeted-F0"], rows["kd-lora"]
    comp = json.loads((out / "budgeted-F0.compressed" / "compression.json").read_text())
    assert f0["mac_speedup_vs_dense"] == comp["speedup_vs_dense"] > 1.0 and f0["dense_kept"] == 0
    assert lora["mac_speedup_vs_dense"] == pytest.approx(1.0) and lora["train_compute_proxy"] < 1.0
    assert f0["train_compute_proxy"] < lora["train_compute_proxy"]
    ev = json.loads((out / "budgeted-F0.eval.json").read_text())
    assert f0["val_ppl"] == ev["ppl"]["val_ppl"] and len(ev["icl"]["tasks"]) == 19
    assert f0["measured"]["modules_prefill"]["speedup_vs_dense"] > 0 and "model_decode" in f0["measured"]
    assert doc["teacher"]["val_ppl"] > 0 and (out / "pareto.png").stat().st_size > 0
    assert "| budgeted-F0 |" in (out / "sweep.md").read_text()
    cached = [json.loads((out / m / "summary.json").read_text())["kd_topk"] for m in ("kd-lora", "budgeted-F0")]
    assert sorted(c["sequences_computed"] for c in cached) == [0, 4 * 4]  # 4 steps of 4 sequences, computed once

    # half-finish the family: kd-lora's training stopped after its step-2 checkpoint, F0 lost its eval and bench
    f0_summary = (out / "budgeted-F0" / "summary.json").stat().st_mtime_ns
    for p in ("kd-lora/summary.json", "budgeted-F0.eval.json", "results.json"):
        (out / p).unlink()
    for p in ("kd-lora/student", "kd-lora.compressed", "budgeted-F0.bench"):
        shutil.rmtree(out / p)
    assert (out / "kd-lora" / "checkpoints" / "step-00000002").is_dir()
    res = CliRunner().invoke(app, ["sweep", "--resume", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "budgeted-F0" / "summary.json").stat().st_mtime_ns == f0_summary  # not retrained
    assert json.loads((out / "kd-lora" / "summary.json").read_text())["resumed_from"] == 2
    doc2 = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in doc2["members"]] == ["kd-lora", "budgeted-F0", "one-shot-1.5x"]
    assert {r["name"]: r["val_ppl"] for r in doc2["members"]}["budgeted-F0"] == pytest.approx(f0["val_ppl"])

    res = CliRunner().invoke(app, ["sweep", "--resume", str(out), "--lr", "1e-3"])
    assert res.exit_code == 2 and "--lr" in res.output
    res = CliRunner().invoke(app, sweep_args(tiny_env, out))
    assert res.exit_code == 2 and "not empty" in res.output


def test_reference_rows_are_the_teacher_and_the_student_init_when_they_differ(tiny_env, tmp_path):
    """The paper's Figure 2 line is the model the students were initialised from; with --student-init other than
    the teacher both are evaluated once (resumable) and both rows appear in sweep.md."""
    import torch
    from transformers import AutoModelForCausalLM

    from bdlora.base.io import write_json
    from bdlora.base.runs import SweepDir
    from bdlora.sweep.options import SweepConfig
    from bdlora.sweep.report import markdown
    from bdlora.sweep.run import _eval_teacher

    init = tmp_path / "init"
    m = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32)
    with torch.no_grad():
        m.lm_head.weight.mul_(0.5)  # a different model with the same tokenizer
    m.save_pretrained(init)
    tiny_env["tokenizer"].save_pretrained(init)
    sweep = SweepDir(tmp_path / "sweep")
    cfg = {"teacher": str(tiny_env["teacher"]), "student_init": str(init), "data": str(tiny_env["corpus"]),
           "seq_len": 32, "eval_tokens": 256, "heldout_fraction": 0.1, "cache_dir": str(tiny_env["cache"])}
    write_json(sweep.path / "kd-lora" / "config.json", {"config": cfg})
    opts = SweepConfig(budgets=[], baselines=["kd-lora"], train={}, eval_examples=1, eval_seeds=1)
    ref = _eval_teacher(opts, sweep, [{"name": "kd-lora"}], Reporter())
    assert ref["student_init"]["source"] == str(init)
    assert ref["student_init"]["val_ppl"] != pytest.approx(ref["val_ppl"])
    assert (sweep.path / "teacher.eval.json").is_file() and (sweep.path / "student_init.eval.json").is_file()
    md = markdown({"teacher": ref, "members": []})
    assert "| teacher |" in md and "| student init |" in md
    cfg["student_init"] = cfg["teacher"]
    write_json(sweep.path / "kd-lora" / "config.json", {"config": cfg})
    assert "student_init" not in _eval_teacher(opts, sweep, [{"name": "kd-lora"}], Reporter())


def test_vary_axes_parse_type_and_refuse():
    from bdlora.base.errors import UsageError
    from bdlora.sweep.vary import grid, label, parse_axis

    ax = parse_axis("temperature,kd-weight=1:0.3,2:0.5")
    assert ax == {"options": ["temperature", "kd_weight"], "values": [[1.0, 0.3], [2.0, 0.5]]}
    assert parse_axis("--lora-rank=16,32")["values"] == [[16], [32]]
    assert parse_axis("student_layers=none,2")["values"] == [[None], [2]]
    axes = [ax, parse_axis("eps_lr=0.5,0.9"), parse_axis("layer_selection=mixed,scratch")]
    train = grid(axes, compress=False)
    assert len(train) == 4 and train[1] == {"temperature": 1.0, "kd_weight": 0.3, "layer_selection": "scratch"}
    assert grid(axes, compress=True) == [{"eps_lr": 0.5}, {"eps_lr": 0.9}]
    assert label(train[1]) == "+temperature=1+kd_weight=0.3+layer_selection=scratch"
    for spec, needle in [("budget=0.1", "--budgets"), ("teacher=a,b", "sweep-merge"), ("foo=1", "unknown option"),
                         ("lora_rank=a", "not an integer"), ("temperature=nan", "not a number"),
                         ("temperature", "expected OPTION=V1,V2"), ("temperature,eps_lr=1:0.5", "own --vary"),
                         ("lora_rank=4,4", "each value once"), ("temperature,kd_weight=1,2", "separate them")]:
        with pytest.raises(UsageError, match=needle):
            parse_axis(spec)
    with pytest.raises(UsageError, match="more than one --vary"):
        family([0.0], [], [parse_axis("temperature=1,2"), parse_axis("temperature=3")])
    members = family([0.0], ["kd-lora"], axes[:2])
    # the compress-time axis multiplies only the budgeted members; both thresholds share one training run
    assert [m.name for m in members] == [
        "kd-lora+temperature=1+kd_weight=0.3", "kd-lora+temperature=2+kd_weight=0.5",
        "budgeted-F0+temperature=1+kd_weight=0.3+eps_lr=0.5", "budgeted-F0+temperature=1+kd_weight=0.3+eps_lr=0.9",
        "budgeted-F0+temperature=2+kd_weight=0.5+eps_lr=0.5", "budgeted-F0+temperature=2+kd_weight=0.5+eps_lr=0.9"]
    assert members[2].run == members[3].run == "budgeted-F0+temperature=1+kd_weight=0.3"


def _icl_doc(tasks: dict, ppl: float) -> dict:
    from bdlora.eval.icl import composite

    c = composite(tasks.values())
    return {"val_ppl": ppl, "icl_composite": c["mean"], "icl_composite_std": c["std"], "icl_target_logprob": -1.0,
            "icl_tasks": tasks}


def test_paper_tables_and_merge_layout(tmp_path):
    """table9.md / main.md from known rows: exact cells, the composite's ± is the mean of the task stds, a merged
    layout has one column per member x teacher, and unfinished or ambiguous inputs are refused."""
    from bdlora.base.errors import UsageError
    from bdlora.base.io import write_json
    from bdlora.sweep.paper import main_table, merge_sweeps, table9

    def row(name, method, budget, tasks, ppl, mac):
        return {"name": name, "method": method, "budget": budget, "settings": {}, **_icl_doc(tasks, ppl),
                "train_compute_proxy": 0.38, "mac_speedup_vs_dense": mac, "param_reduction": 0.802,
                "measured": {"model_decode": {"speedup_vs_dense": 1.5}}}

    t = {"a": {"mean": 10.0, "std": 1.0}, "b": {"mean": 20.0, "std": 3.0}}
    doc = {"options": {"train": {"teacher": "/ckpt/teacher-0.5b"}}, "teacher": _icl_doc(t, 16.0),
           "members": [row("kd-full", "kd-full", None, t, 18.26, 1.0),
                       row("budgeted-F0", "budgeted", 0.0, {"a": {"mean": 4.0, "std": 0.5},
                                                            "b": {"mean": 6.0, "std": 1.5}}, 25.13, 4.05)]}
    md = table9([("0.5B", doc)])
    assert "| a | 10.0 ± 1.0 | 10.0 ± 1.0 | 4.0 ± 0.5 |" in md
    assert "| **ICL composite (macro)** | **15.0 ± 2.0** | **15.0 ± 2.0** | **5.0 ± 1.0** |" in md
    main = main_table([("0.5B", doc)])
    assert "| F = 0 | 25.13 | 5.0 ± 1.0 | 0.38x | 4.05x | 80.2% | 1.50x |" in main
    assert main.index("*Baselines*") < main.index("KD Full") < main.index("*Budgeted LoRA*") < main.index("F = 0 |")

    dirs = []
    for i in range(2):
        d = tmp_path / f"sweep{i}"
        write_json(d / "results.json", {**doc, "members": [{**r, "val_ppl": r["val_ppl"] + i}
                                                           for r in doc["members"]]})
        dirs.append(str(d))
    merge_sweeps(dirs, ["0.13B", "1B"], tmp_path / "merged")
    merged = (tmp_path / "merged" / "main.md").read_text()
    assert "| Method | PPL 0.13B | PPL 1B | ICL % 0.13B | ICL % 1B |" in merged
    assert "| F = 0 | 25.13 | 26.13 |" in merged
    assert "| task | teacher 0.13B | teacher 1B | kd-full 0.13B | kd-full 1B | budgeted-F0 0.13B | budgeted-F0 1B |" \
        in (tmp_path / "merged" / "table9.md").read_text()
    assert (tmp_path / "merged" / "icl.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UsageError, match="not empty"):
        merge_sweeps(dirs, ["0.13B", "1B"], tmp_path / "merged")
    with pytest.raises(UsageError, match="share the label"):
        merge_sweeps(dirs, None, tmp_path / "m2")
    with pytest.raises(UsageError, match="2 sweep"):
        merge_sweeps(dirs, ["x"], tmp_path / "m2")
    with pytest.raises(UsageError, match="not a finished sweep"):
        merge_sweeps([str(tmp_path)], None, tmp_path / "m2")
    with pytest.raises(UsageError, match="no such folder"):
        merge_sweeps([str(tmp_path / "nowhere")], None, tmp_path / "m2")
    assert not (tmp_path / "m2").exists()


def test_vary_grid_runs_resumes_and_renders_the_paper_outputs(tiny_env, tmp_path):
    out = tmp_path / "grid"
    yaml = tmp_path / "grid.yaml"
    # the budget drops at once but the EMA lags, so the low-rank paths learn while the dense paths fade (with no lag
    # every projection is zero from the first step and, B starting at zero, no gradient reaches any parameter)
    yaml.write_text("decay_start: 0.0\ndecay_end: 0.0\nretention_ema: 0.5\nmeasure_step_time: false\n")
    args = sweep_args(tiny_env, out, "--budgets", "0.0", "--baselines", "", "--no-bench", "--config", str(yaml),
                      "--vary", "temperature,kd_weight=1:0.3,2:0.5", "--vary", "eps_lr=0.5,0.9")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in doc["members"]]
    assert names == ["budgeted-F0+temperature=1+kd_weight=0.3+eps_lr=0.5",
                     "budgeted-F0+temperature=1+kd_weight=0.3+eps_lr=0.9",
                     "budgeted-F0+temperature=2+kd_weight=0.5+eps_lr=0.5",
                     "budgeted-F0+temperature=2+kd_weight=0.5+eps_lr=0.9"]
    runs = sorted(p.name for p in out.iterdir() if (p / "summary.json").is_file())
    assert runs == ["budgeted-F0+temperature=1+kd_weight=0.3", "budgeted-F0+temperature=2+kd_weight=0.5"]
    cfg = json.loads((out / runs[0] / "config.json").read_text())["config"]
    assert (cfg["temperature"], cfg["kd_weight"]) == (1.0, 0.3)
    ppl = [r["student_val_ppl"] for r in doc["members"]]
    assert ppl[0] == ppl[1] != ppl[2] == ppl[3]  # one training per train point, and the settings matter
    for r in doc["members"]:
        comp = json.loads((out / f"{r['name']}.compressed" / "compression.json").read_text())
        assert comp["thresholds"]["eps_lr"] == r["settings"]["eps_lr"]
        ev = json.loads((out / f"{r['name']}.eval.json").read_text())
        assert r["icl_tasks"]["capitalize"]["mean"] == ev["icl"]["tasks"]["capitalize"]["mean"]
    t9 = (out / "table9.md").read_text()
    assert t9.count("\n| ") == 1 + 19 + 1 and all(f" {n} |" in t9.splitlines()[2] for n in names)
    assert "| F = 0, temperature=1, kd_weight=0.3, eps_lr=0.5 |" in (out / "main.md").read_text()
    assert "| member | temperature | kd_weight | eps_lr |" in (out / "sweep.md").read_text()
    assert (out / "icl.png").read_bytes()[:4] == b"\x89PNG"

    # interrupted: the outputs, one member's eval and another's compressed model are gone; nothing retrains
    stamps = {r: (out / r / "summary.json").stat().st_mtime_ns for r in runs}
    before = (out / "table9.md").read_text()
    for p in ("results.json", "table9.md", "main.md", "icl.png", f"{names[1]}.eval.json"):
        (out / p).unlink()
    shutil.rmtree(out / f"{names[2]}.compressed")
    res = CliRunner().invoke(app, ["sweep", "--resume", str(out)])
    assert res.exit_code == 0, res.output
    assert {r: (out / r / "summary.json").stat().st_mtime_ns for r in runs} == stamps
    assert (out / "table9.md").read_text() == before
    res = CliRunner().invoke(app, ["sweep", "--resume", str(out), "--vary", "lora_rank=2,4"])
    assert res.exit_code == 2 and "drop --vary" in res.output


def test_vary_refuses_a_bad_grid_point_before_training(tiny_env, tmp_path):
    out = tmp_path / "bad"
    res = CliRunner().invoke(app, sweep_args(tiny_env, out, "--budgets", "0.0", "--baselines", "", "--vary",
                                             "kd_weight=0.5,1.5"))
    assert res.exit_code == 2 and "budgeted-F0+kd_weight=1.5" in res.output and "--kd-weight 1.5" in res.output
    assert not out.exists()
    res = CliRunner().invoke(app, sweep_args(tiny_env, out, "--vary", "budget=0.1,0.2"))
    assert res.exit_code == 2 and "--budgets" in res.output and not out.exists()


def test_documented_ablation_commands_define_the_papers_grids():
    """Every command line of the ablation table in docs/commands.md parses against the sweep's own options and
    defines the grid of its paper table (members counted, training runs counted)."""
    import re
    import shlex
    from pathlib import Path

    import typer

    from bdlora.cli.options import float_list, str_list
    from bdlora.sweep.vary import parse_axis

    doc = (Path(__file__).parent.parent / "docs" / "commands.md").read_text()
    commands = re.findall(r"^\| [^|]+ \| `(bdlora sweep [^`]+)` \|", doc, flags=re.M)
    params = {o for p in typer.main.get_command(app).commands["sweep"].params for o in p.opts}
    expected = [(8, 8), (4, 4), (6, 6), (4, 4), (4, 4), (3, 3), (18, 2)]  # (members, training runs)
    assert len(commands) == len(expected)
    for line, (n_members, n_runs) in zip(commands, expected):
        args = shlex.split(line)[2:]
        flags = dict(zip(args[::2], args[1::2]))
        assert all(a in params for a in args[::2]), line
        varies = [parse_axis(v) for k, v in zip(args[::2], args[1::2]) if k == "--vary"]
        members = family(float_list(flags["--budgets"], "--budgets") or [], str_list(flags["--baselines"]) or [],
                         varies)
        assert (len(members), len({m.run for m in members})) == (n_members, n_runs), line


@pytest.mark.full  # 50 s: sweep --front exports and benches a family and the teacher's exports
def test_sweep_front_puts_the_whole_family_and_the_teachers_exports_on_one_front(tiny_env, tmp_path):
    """Issue 40: ``sweep --front`` times every member (here two one-shot students of a head-dim-16 teacher) beside the
    teacher's own exports at every precision in one onnxruntime-genai run; the points carry member names, each is
    on the front or dominated, and sweep.md tables them; --resume keeps the finished front."""
    from conftest import genai_teacher

    genai_teacher(tiny_env["tokenizer"], tmp_path / "teacher")
    env = {**tiny_env, "teacher": tmp_path / "teacher"}
    out = tmp_path / "sweep"
    res = CliRunner().invoke(app, sweep_args(env, out, "--budgets", "", "--baselines", "kd-lora", "--one-shot",
                                             "1.2,1.5", "--no-bench", "--front", "--bench-seq-lens", "8",
                                             "--bench-repeats", "1"))
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    names = {p["name"] for p in doc["front"]["points"]}
    assert {f"{m}{p}" for m in ("one-shot-1.2x", "one-shot-1.5x", "teacher", "peer-kd-lora")
            for p in ("", "-int8", "-int4")} <= names, names
    # the kd-lora baseline is the healed dense peer every student is compared with at its precision
    assert all(p["vs_peer"] == f"peer-kd-lora{p['name'][len('one-shot-1.5x'):]}" for p in doc["front"]["points"]
               if p["name"].startswith("one-shot-1.5x"))
    assert not any(n.startswith("compressed") for n in names)  # the first member's rows carry its name
    for p in doc["front"]["points"]:
        assert p["front"] in (True, False) and (p["dominated_by"] is None) == p["front"]
        assert p["dominated_by"] is None or p["dominated_by"] in names
    assert (out / "front.png").stat().st_size > 10_000 and (out / "front.bench" / "bench.json").is_file()
    assert "Quality/speed front" in (out / "sweep.md").read_text() and "| one-shot-1.5x-int4 |" in (
        out / "sweep.md").read_text()
    stamp = (out / "front.bench" / "bench.json").stat().st_mtime_ns
    (out / "results.json").unlink()
    res = CliRunner().invoke(app, ["sweep", "--resume", str(out)])
    assert res.exit_code == 0 and "front.bench: done before, verified and kept" in res.output, res.output
    assert (out / "front.bench" / "bench.json").stat().st_mtime_ns == stamp


def test_a_sweep_resumes_by_its_ledger_as_ship_does(tiny_env, tmp_path):
    """sweep's steps are kept by ship's ledger (pipeline.ledger): an untouched sweep keeps every step; a same-size edit
    in a member's folder (no reader's check sees it; its recorded digest does) makes that member again and its eval,
    which read it; a sweep folder written before steps.json resumes keeping every whole step and records them; a torn
    evaluation is made again alone."""
    out = tmp_path / "sweep"
    res = CliRunner().invoke(app, sweep_args(tiny_env, out, "--budgets", "", "--baselines", "", "--one-shot", "1.5",
                                             "--no-bench", "--examples", "1", "--seeds", "1"))
    assert res.exit_code == 0, res.output
    ledger = json.loads((out / "steps.json").read_text())["steps"]
    assert set(ledger) == {"one-shot-1.5x.compressed", "one-shot-1.5x.eval.json", "teacher.eval.json"}
    assert ledger["one-shot-1.5x.eval.json"]["reads"]["one-shot-1.5x.compressed"] == \
        ledger["one-shot-1.5x.compressed"]["output"]

    def again() -> str:
        r = CliRunner().invoke(app, ["sweep", "--resume", str(out)])
        assert r.exit_code == 0, r.output
        return r.output

    said = again()
    kept = ": done before, verified and kept"
    assert f"one-shot-1.5x.compressed{kept} (compress --one-shot)" in said and f"one-shot-1.5x.eval.json{kept}" in said
    assert f"teacher.eval.json{kept}" in said
    f = out / "one-shot-1.5x.compressed" / "generation_config.json"
    f.write_text(f.read_text().replace("\"use_cache\": true", "\"use_cache\": 1   "))
    said = again()
    assert "one-shot-1.5x.compressed: made again: a file in it changed after it finished" in said
    assert "one-shot-1.5x.eval.json: made again: one-shot-1.5x.compressed was made again" in said
    assert f"teacher.eval.json{kept}" in said
    (out / "steps.json").unlink()
    said = again()
    assert said.count(kept) == 3 and "made again" not in said
    assert json.loads((out / "steps.json").read_text())["steps"].keys() == ledger.keys()
    (out / "one-shot-1.5x.eval.json").write_text("{")  # a torn evaluation: made again, nothing else
    said = again()
    assert "one-shot-1.5x.eval.json: made again: damaged" in said and said.count(kept) == 2
