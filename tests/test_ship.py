"""``bdlora ship``: its settings refused in one line, the resume contract, the recommendation's choice per tolerance,
and the whole command on a tiny teacher, run twice (the second run redoes nothing)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from bdlora.base.errors import Checks, ConfigError, UsageError
from bdlora.base.threads import ThreadPool, from_options
from bdlora.cli import app
from bdlora.cli.spell import spell
from bdlora.ship.config import ShipConfig
from bdlora.ship.recommend import recommend
from bdlora.ship.run import record, start


@pytest.mark.parametrize("field,value,needle", [
    ("speedups", "1.2,fast", "--speedups '1.2,fast': 'fast' is not a number"),
    ("speedups", "0.5", "--speedups '0.5': 0.5 is below 1"),
    ("speedups", "1.2,1.2", "a value is given twice"),
    ("schemes", "rtn,rtx", "--schemes 'rtn,rtx': unknown scheme 'rtx' (allowed: rtn, gptq, affine"),
    ("precision", "int3", "--precision 'int3': unknown (allowed: fp32, int8, int4)"),
    ("draft_speedup", 0.5, "--draft-speedup 0.5: 0 (no draft) or at least 1"),
    ("forms", "channels,chanels", "--forms 'chanels': allowed"),
    ("tolerances", "-1", "--tolerances '-1': -1 is below 0"),
    ("heal_steps", -3, "--heal-steps -3"),
    ("heal_time_budget", "soon", "--heal-time-budget soon: a positive duration such as 90s, 60m or 1.5h"),
    ("heal_time_budget", "0m", "--heal-time-budget 0m: a positive duration"),
])
def test_bad_settings_are_named(field, value, needle):
    with pytest.raises(ConfigError) as e:
        from_options(ShipConfig, {field: value}).check(Checks()).done()
    assert needle in str(e.value), str(e.value)


def test_heal_steps_and_a_heal_time_budget_are_one_choice():
    with pytest.raises(ConfigError, match="--heal-time-budget 20m: sets each heal's steps itself; drop --heal-steps"):
        ShipConfig(heal_steps=5, heal_time_budget="20m").check(Checks()).done()
    assert ShipConfig(heal_time_budget="20m").heals and ShipConfig(heal_steps=1).heals and not ShipConfig().heals


def test_under_a_heal_time_budget_the_peer_gets_the_most_steps_any_candidate_took(tmp_path):
    """Each candidate's heal gets train --time-budget (no --max-steps); the dense peer, built after them, gets the
    largest step count their summaries record, so it is never healed less than a student it is compared with."""
    from bdlora.base.io import write_json
    from bdlora.ship.run import heal_steps, peer_step_count

    cfg = ShipConfig(heal_time_budget="20m", data="builtin:1,prose:1")
    made = ["student-1.25", "draft"]
    for name, layers in (("teacher", 30), ("student-1.25", 30), ("draft", 15)):
        write_json(tmp_path / name / "config.json", {"num_hidden_layers": layers, **SHAPE})
    steps = heal_steps("smollm2-135m", str(tmp_path / "teacher"), cfg, tmp_path, made)
    assert [s.name for s in steps] == ["heal-student-1.25", "healed-student-1.25", "heal-draft", "healed-draft"]
    heal = steps[0].invocation.values
    assert heal["time_budget"] == "20m" and "max_steps" not in heal
    assert heal["student_layers"] == "30" and steps[2].invocation.values["method"] == "kd-full"
    for name, taken in (("student-1.25", 212), ("draft", 348)):
        write_json(tmp_path / f"heal-{name}" / "summary.json", {"steps": taken})
    assert peer_step_count(cfg, tmp_path, made) == 348
    peer = heal_steps("smollm2-135m", str(tmp_path / "teacher"), cfg, tmp_path, made, peer_steps=348)
    assert [s.name for s in peer] == ["heal-dense", "healed-dense"]
    values = peer[0].invocation.values
    assert values["max_steps"] == "348" and "time_budget" not in values
    assert "student_init" not in values and values["data"] == "builtin:1,prose:1"
    assert peer_step_count(ShipConfig(heal_steps=7), tmp_path, made) == 7


SHAPE = {"num_attention_heads": 4, "hidden_size": 64, "vocab_size": 128}  # what a decoder's config must say


def _command_of(argv: list[str]):
    """The click command ``bdlora ARGV`` runs, and the arguments it is given."""
    import typer.main

    cmd = typer.main.get_command(app)
    while getattr(cmd, "commands", None) and argv and argv[0] in cmd.commands:
        cmd, argv = cmd.commands[argv[0]], argv[1:]
    return cmd, argv


def test_every_step_is_a_settings_file_its_command_reads(tmp_path):
    """Each step's settings are generated from its command's settings dataclass (a renamed field fails when the step
    is built): every step's settings file of a ship with every option set is read by the real command, as is the
    line it is spelled as for people; those lines are the ones a ship folder written before settings files records
    (so it resumes instead of redoing them)."""
    from bdlora.base.io import write_json
    from bdlora.ship.preflight import reach_checks
    from bdlora.ship.run import bench_step, heal_steps, student_steps, teacher_steps

    cfg = ShipConfig(pool=ThreadPool(2), heal_steps=3, eval_data="prose", quality_tokens=512, schemes="rtn,affine",
                     gguf="none")
    for name in ("teacher", "student-1.25", "student-1.5", "draft"):
        write_json(tmp_path / name / "config.json", {"num_hidden_layers": 4, **SHAPE})
    made = ["student-1.25", "student-1.5", "draft"]
    steps = [*teacher_steps("t", cfg, tmp_path), *student_steps("t", cfg, tmp_path, "affine"),
             *heal_steps("t", str(tmp_path / "teacher"), cfg, tmp_path, made),
             *heal_steps("t", str(tmp_path / "teacher"), cfg, tmp_path, made, peer_steps=3),
             bench_step(cfg, tmp_path, made, "affine", "affine")]
    invocations = [s.invocation for s in steps] + [plan for _, plan in reach_checks("t", cfg, "affine")]
    assert len(invocations) == 2 + 3 + 8 + 1 + 2
    for i, inv in enumerate(invocations):
        cmd, args = _command_of(spell(inv))
        by_line = cmd.make_context(inv.command[-1], list(args)).params  # an unknown flag or a bad value: refused
        write_json(tmp_path / f"{i}.json", inv.to_json())
        by_file = cmd.make_context(inv.command[-1], ["--settings-file", str(tmp_path / f"{i}.json")]).params
        assert {**by_file, "settings_file": None} == by_line, inv
    with pytest.raises(Exception, match="--speed-up") as refused:  # typer's own click: its NoSuchOption
        _command_of(["compress", "t", "--speed-up", "2"])[0].make_context("bdlora", ["t", "--speed-up", "2"])
    assert type(refused.value).__name__ == "NoSuchOption"
    d = str(tmp_path)
    argv = [spell(s.invocation) for s in steps]
    assert argv[0] == ["export", "genai", "t", "--precision", "int4", "--quant", "rtn", "--max-ppl-change",
                       "1000", "--out", f"{d}/teacher-rtn", "--threads", "2"]
    assert argv[2] == ["compress", "t", "--one-shot", "--precision", "int4", "--data", "builtin", "--no-eval",
                       "--quant", "affine", "--threads", "2", "--forms", "channels,groups", "--speedup", "1.25",
                       "--out", f"{d}/student-1.25"]
    assert argv[5] == ["train", "--teacher", "t", "--student-init", f"{d}/student-1.25", "--student-layers", "4",
                       "--method", "kd-lora", "--data", "builtin", "--max-steps", "3", "--batch-size", "4",
                       "--seq-len", "128", "--out", f"{d}/heal-student-1.25"]
    assert argv[-1] == ["bench", f"{d}/healed-draft", "--runtime", "genai", "--genai-precisions", "int4",
                        "--scope", "model", "--batch-sizes", "1", "--seq-lens", "128", "--decode-tokens", "64",
                        "--repeats", "10", "--no-peers", "--no-own-forms", "--out", f"{d}/bench",
                        "--threads", "2",
                        "--also", f"{d}/healed-student-1.25", "--also", f"{d}/healed-student-1.5",
                        "--peer", f"{d}/healed-dense", "--quant", "affine", "--teacher-quant", "affine",
                        "--speculative", "--no-fixed-widths", "--eval-data", "prose",
                        "--quality-tokens", "512"]
    with_gguf = spell(bench_step(dataclasses.replace(cfg, gguf="q4_k_m"), tmp_path, made, "affine", "affine")
                      .invocation)
    assert with_gguf[2:7] == ["--runtime", "genai,llamacpp", "--genai-precisions", "int4", "--gguf-quants"]
    assert with_gguf[7] == "q4_k_m"
    cmd, args = _command_of(with_gguf)
    cmd.make_context("bdlora", list(args))
    wide = student_steps("t", dataclasses.replace(cfg, width_multiple=256), tmp_path, "affine")
    assert spell(wide[0].invocation)[-4:] == ["--width-multiple", "256", "--out", f"{d}/student-1.25"]
    assert "width_multiple" not in wide[-1].invocation.values  # the draft keeps the default grid
    assert spell(reach_checks("t", dataclasses.replace(cfg, width_multiple=256), "affine")[0][1])[-3:-1] == [
        "--width-multiple", "256"]


def test_a_setting_no_settings_field_has_is_refused_when_the_step_is_built():
    from bdlora.base.argv import option_values
    from bdlora.compress.config import OneShotConfig

    assert option_values(OneShotConfig, speedup=1.5, threads=None, forms="channels", width_multiple=256,
                         correct=False) == {"speedup": "1.5", "forms": "channels", "width_multiple": "256",
                                            "correct": False}
    with pytest.raises(TypeError, match="--speed-up"):
        option_values(OneShotConfig, speed_up=1.5)


def test_student_quant_needs_a_rounded_precision():
    with pytest.raises(ConfigError, match="--student-quant gptq: --precision fp32 rounds nothing"):
        ShipConfig(precision="fp32", student_quant="gptq").check(Checks()).done()


def test_a_ship_folder_resumes_only_the_settings_it_holds(tmp_path):
    folder = tmp_path / "ship"
    assert start("builtin", ShipConfig(), folder) is False
    assert not folder.exists()  # a check writes nothing: the record comes once every check has passed
    record("builtin", ShipConfig(), folder)
    assert start("builtin", ShipConfig(), folder) is True
    with pytest.raises(UsageError, match=r"--speedups '1.25,1.5' \(given '1.3'\)"):
        start("builtin", ShipConfig(speedups="1.3"), folder)
    with pytest.raises(UsageError, match="model 'builtin' \\(given 'smollm2-135m'\\)"):
        start("smollm2-135m", ShipConfig(), folder)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="is not a ship folder"):
        start("builtin", ShipConfig(), tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def _bench(folder, rows, identical=None):
    (folder / "bench").mkdir(parents=True)
    front = [{"name": n, "ms": ms, "ppl": p, "ppl_unseen": u} for n, ms, p, u in rows]
    spec = {"int4": {"summary": {k: {"identical": v} for k, v in (identical or {}).items()}}}
    (folder / "bench" / "bench.json").write_text(json.dumps({"front": front, "unseen_data": "fortunes",
                                                             "speculative": spec}))
    (folder / "ship.json").write_text(json.dumps({"model": "t", "options": {}}))


COMMANDS = {"student-1.25": "bdlora compress t --one-shot --speedup 1.25 --out D/student-1.25",
            "draft": "bdlora compress t --one-shot --speedup 4 --out D/draft",
            "bench": "bdlora bench D/draft --also D/student-1.25 --out D/bench"}
TEACHER = "bdlora export genai T --precision int4 --quant affine --out D/teacher-affine"


def test_each_tolerance_gets_the_fastest_row_within_it_on_every_domain(tmp_path):
    """Held-out and unseen both bound a row: student-1.25 is +4% held-out but +30% unseen, so it answers no
    tolerance up to 10%; the draft's own row (fast, far worse) never qualifies; prompt lookup has the teacher's
    quality and is faster, so it is the +0% answer; the dense and LoRA forms of the bench's model are not rows."""
    _bench(tmp_path, [("teacher-int4", 10.0, 20.0, 50.0), ("spec-lookup-int4", 8.0, 20.0, 50.0),
                      ("spec-draft-int4", 12.0, 20.0, 50.0), ("compressed-int4", 2.0, 90.0, 400.0),
                      ("student-1.25-int4", 7.0, 20.8, 65.0), ("dense-int4", 1.0, 19.0, 49.0),
                      ("teacher-int8", 5.0, 19.0, 49.0)], identical={"lookup": False, "draft": True})
    cfg = ShipConfig(tolerances="0,5,40")
    r = recommend(tmp_path, cfg, COMMANDS, "affine", {"rtn": 21.0, "affine": 20.0}, TEACHER, "D/teacher-affine", None,
                  spell, "draft")
    assert [a["row"] for a in r["answers"]] == ["spec-lookup-int4", "spec-lookup-int4", "student-1.25-int4"]
    assert r["answers"][0]["speedup"] == pytest.approx(10 / 8)
    assert "not token-identical to plain decoding" in r["answers"][0]["what"]  # as benched, not assumed
    assert "token-identical to plain decoding in the bench" in next(
        row["what"] for row in r["rows"] if row["row"] == "spec-draft-int4")
    assert r["answers"][2]["ppl_unseen_vs_teacher"] == pytest.approx(0.3)
    assert r["answers"][0]["commands"] == [TEACHER, "bdlora serve D/teacher-affine --runtime genai --prompt-lookup"]
    assert r["answers"][2]["commands"][0] == COMMANDS["student-1.25"]
    assert {row["row"] for row in r["rows"]} == {"teacher-int4", "spec-lookup-int4", "spec-draft-int4",
                                                 "compressed-int4", "student-1.25-int4"}
    assert (tmp_path / "ship.png").stat().st_size > 0 and "| +0% |" in (tmp_path / "recommendation.md").read_text()


def test_the_teachers_own_export_when_nothing_beats_it(tmp_path):
    _bench(tmp_path, [("teacher-int4", 10.0, 20.0, 50.0), ("spec-lookup-int4", 11.0, 20.0, 50.0),
                      ("student-1.25-int4", 9.0, 25.0, 60.0)])
    r = recommend(tmp_path, ShipConfig(tolerances="0,10"), COMMANDS, "affine", {}, TEACHER, "D/teacher-affine", None,
                  spell, "draft")
    assert all(a["teacher_own"] and a["speedup"] == 1.0 for a in r["answers"])
    assert "**the teacher's own export**: nothing beats it" in (tmp_path / "recommendation.md").read_text()


def test_with_llama_cpps_rows_each_runtime_is_answered_and_overall_against_the_fastest_teacher(tmp_path):
    """The teacher's genai int4 (10 ms) and its Q4_K_M GGUF (12 ms) each answer their own runtime's tolerances; the
    overall answer is against the faster of them (genai), and picks llama.cpp's student where it is fastest within
    the tolerance there; the GGUF answer's commands export the folder with export gguf and serve it in llama.cpp."""
    _bench(tmp_path, [("teacher-int4", 10.0, 20.0, 50.0), ("student-1.25-int4", 8.0, 20.5, 51.0),
                      ("teacher-gguf-q4_k_m", 12.0, 19.8, 49.5), ("student-1.25-gguf-q4_k_m", 7.5, 20.1, 50.2),
                      ("compressed-gguf-q4_k_m", 4.0, 60.0, 200.0)])
    cfg = ShipConfig(tolerances="0,1,5", draft_speedup=0)
    r = recommend(tmp_path, cfg, COMMANDS, "affine", {}, TEACHER, "D/teacher-affine", "T", spell, "draft")
    assert r["reference"]["row"] == "teacher-int4"
    assert [(a["row"], a["runtime"]) for a in r["answers"]] == [
        ("teacher-int4", "genai"), ("student-1.25-gguf-q4_k_m", "llamacpp"), ("student-1.25-gguf-q4_k_m", "llamacpp")]
    assert r["answers"][1]["speedup"] == pytest.approx(10 / 7.5)
    llama = r["by_runtime"]["llamacpp"]["answers"]
    assert [a["row"] for a in llama] == ["teacher-gguf-q4_k_m", "teacher-gguf-q4_k_m", "student-1.25-gguf-q4_k_m"]
    assert llama[2]["speedup"] == pytest.approx(12 / 7.5)  # +1.5% over the teacher's GGUF: within 5%, not 1%
    assert llama[2]["ppl_vs_teacher"] == pytest.approx(20.1 / 19.8 - 1)
    assert [a["row"] for a in r["by_runtime"]["genai"]["answers"]] == ["teacher-int4", "teacher-int4",
                                                                       "student-1.25-int4"]
    cmds = r["answers"][1]["commands"]
    assert cmds[0] == COMMANDS["student-1.25"]
    assert cmds[1] == (f"bdlora export gguf {tmp_path}/student-1.25 --quant q4_k_m --merge-lowrank --out "
                       f"{tmp_path}/student-1.25.gguf-q4_k_m")
    assert cmds[-1].startswith("python -m llama_cpp.server --model ") and cmds[-1].endswith("model.gguf")
    teacher_gguf = next(row for row in r["rows"] if row["row"] == "teacher-gguf-q4_k_m")
    assert teacher_gguf["commands"][0].startswith("bdlora export gguf T --quant q4_k_m")
    md = (tmp_path / "recommendation.md").read_text()
    assert "In llama.cpp, against the teacher's teacher-gguf-q4_k_m (12.00 ms/token)" in md
    assert "| +1% | student-1.25 in llama.cpp (Q4_K_M) | llama.cpp | 1.33x |" in md


def tiny_ship_args(tiny_env, tmp_path, monkeypatch, gguf: str) -> list[str]:
    """The ship line of a tiny genai-shaped teacher (hand-made latency tables: nothing timed for the allocation), one
    student at 1.2x, no draft, llama.cpp's rows at ``gguf`` (none: without them)."""
    from test_latency import _hand_table, _tiny_shapes

    from conftest import genai_teacher

    teacher = tmp_path / "teacher"
    genai_teacher(tiny_env["tokenizer"], teacher, seed=3, layers=4)
    _hand_table(tmp_path / "cache", _tiny_shapes(teacher), (), threads=1, teacher=teacher)
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path / "cache"))
    return ["ship", str(teacher), "--data", str(tiny_env["corpus"]), "--eval-data", "none", "--schemes", "rtn",
            "--speedups", "1.2", "--draft-speedup", "0", "--threads", "1", "--repeats", "1", "--decode-tokens", "4",
            "--quality-tokens", "256", "--seq-len", "64", "--gguf", gguf, "--out", str(tmp_path / "ship"), "--json"]


@pytest.mark.slow
def test_ship_runs_every_step_then_resumes_without_redoing_any(tiny_env, tmp_path, monkeypatch):
    """A tiny genai-shaped teacher (hand-made latency tables: nothing timed for the allocation), one student, no
    draft: the teacher's export, the student, one bench, the recommendation; the same command again runs no step."""
    args = tiny_ship_args(tiny_env, tmp_path, monkeypatch, "none")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    first = json.loads(res.stdout)
    assert list(first["steps_run_seconds"]) == ["student-1.2", "bench"]
    assert [a["tolerance_percent"] for a in first["answers"]] == [0, 1, 5, 10]
    assert {r["row"] for r in first["rows"]} == {"teacher-int4", "compressed-int4"}
    assert first["teacher_scheme"] == "rtn"
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    second = json.loads(again.stdout)
    assert second["steps_run_seconds"] == {} and second["answers"] == first["answers"]


@pytest.mark.full
def test_ship_heals_every_folder_and_the_dense_peer_and_speculates_with_the_draft(tiny_env, tmp_path, monkeypatch):
    """--heal-steps: every made folder and the dense teacher healed with the same steps (train, then compress), the
    healed draft speculating for the teacher's export beside prompt lookup, the healed dense teacher as the peer."""
    from test_latency import _hand_table, _tiny_shapes

    from conftest import genai_teacher

    teacher = tmp_path / "teacher"
    genai_teacher(tiny_env["tokenizer"], teacher, seed=3, layers=4)
    _hand_table(tmp_path / "cache", _tiny_shapes(teacher), (), threads=1, teacher=teacher)
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path / "cache"))
    args = ["ship", str(teacher), "--data", str(tiny_env["corpus"]), "--eval-data", "none", "--schemes", "rtn",
            "--speedups", "1.2", "--draft-speedup", "1.5", "--heal-steps", "2", "--threads", "1", "--repeats", "1",
            "--decode-tokens", "4", "--quality-tokens", "256", "--seq-len", "64", "--gguf", "none",
            "--out", str(tmp_path / "ship"), "--json"]  # llama.cpp's rows have their own test: none where installed
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert list(r["steps_run_seconds"]) == ["student-1.2", "draft", "heal-student-1.2", "healed-student-1.2",
                                            "heal-draft", "healed-draft", "heal-dense", "healed-dense", "bench"]
    assert {row["row"] for row in r["rows"]} == {"teacher-int4", "spec-lookup-int4", "spec-draft-int4",
                                                 "compressed-int4", "healed-student-1.2-int4",
                                                 "peer-healed-dense-int4"}
    draft = next(row for row in r["rows"] if row["row"] == "spec-draft-int4")
    assert draft["ppl_vs_teacher"] == 0.0  # speculation is the teacher's own output
    again = CliRunner().invoke(app, args)  # every step, heals and their runs included, verified and kept
    assert again.exit_code == 0 and json.loads(again.stdout)["steps_run_seconds"] == {}, again.output
