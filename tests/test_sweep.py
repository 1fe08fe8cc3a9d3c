import json
import shutil

import pytest
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.reporter import Reporter
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
    for budgets, baselines, needle in [([1.5], [], "must be in [0, 1]"), ([], ["kd-foo"], "kd-foo"),
                                       ([], [], "nothing to sweep"), ([0.4, 0.4], [], "each budget once")]:
        with pytest.raises(Exception, match=needle.replace("[", r"\[").replace("]", r"\]")):
            family(budgets, baselines)


def test_sweep_runs_a_family_and_resumes_without_retraining(tiny_env, tmp_path):
    out = tmp_path / "sweep"
    # the budget drops at once with no EMA lag, so 4 steps reach the F = 0 structure; a checkpoint every 2 steps
    yaml = tmp_path / "sweep.yaml"
    yaml.write_text("decay_start: 0.0\ndecay_end: 0.0\nretention_ema: 0.0\nsave_every: 2\nmeasure_step_time: false\n")
    res = CliRunner().invoke(app, sweep_args(tiny_env, out, "--config", str(yaml), "--budgets", "0.0", "--baselines",
                                             "kd-lora", "--bench-seq-lens", "8", "--bench-repeats", "1"))
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in doc["members"]}
    assert set(rows) == {"kd-lora", "budgeted-F0"}
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
    assert [r["name"] for r in doc2["members"]] == ["kd-lora", "budgeted-F0"]
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

    from bdlora.io import write_json
    from bdlora.runs import SweepDir
    from bdlora.sweep.options import SweepOptions
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
    opts = SweepOptions(budgets=[], baselines=["kd-lora"], train={}, eval_examples=1, eval_seeds=1)
    ref = _eval_teacher(opts, sweep, [{"name": "kd-lora"}], Reporter())
    assert ref["student_init"]["source"] == str(init)
    assert ref["student_init"]["val_ppl"] != pytest.approx(ref["val_ppl"])
    assert (sweep.path / "teacher.eval.json").is_file() and (sweep.path / "student_init.eval.json").is_file()
    md = markdown({"teacher": ref, "members": []})
    assert "| teacher |" in md and "| student init |" in md
    cfg["student_init"] = cfg["teacher"]
    write_json(sweep.path / "kd-lora" / "config.json", {"config": cfg})
    assert "student_init" not in _eval_teacher(opts, sweep, [{"name": "kd-lora"}], Reporter())
