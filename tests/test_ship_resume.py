"""``ship``'s steps as a dependency chain (issue 78, cases 1-4, 6, 7, 8, 16): a rerun keeps a step only when its
output passes the readers' checks and its recorded digest and nothing it read changed; a damaged or missing step is
made again and so is every step that read it; a step folder that is a symbolic link is refused; settings a later
step would refuse are refused before the first; a step's process ends with ship.

The steps' commands are replaced by a runner that writes real outputs (a model folder through ``save_model_folder``,
with its recorded digests; a bench.json), so each case runs in seconds; the reach check (a real ``plan`` run) is
tested on its own below."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bdlora.base.argv import Invocation
from bdlora.base.errors import ConfigError, UsageError
from bdlora.base.threads import from_options
from bdlora.cli.spell import spell
from bdlora.pipeline.ledger import STEPS_FILE
from bdlora.ship import run as ship_run
from bdlora.ship.config import ShipConfig

CFG = dict(schemes="rtn", speedups="1.2", draft_speedup=0.0, eval_data="none", repeats=1, decode_tokens=4,
           seq_len=32, threads=1)


class Runner:
    """Writes each step's output as its command would (a compressed model folder, a bench), and records which ran;
    ``variant`` changes what a student step writes (a rebuilt student that differs from the first)."""

    def __init__(self, env):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(env["teacher"])
        self.tok = env["tokenizer"]
        self.ran: list[str] = []
        self.variant = 0

    def __call__(self, step, folder, reporter):
        from bdlora.deployed.folder import save_model_folder

        self.ran.append(step.name)
        out = folder / step.name
        if step.name == "bench":
            out.mkdir()
            rows = [{"name": "teacher-int4", "ms": 10.0, "ppl": 20.0, "ppl_unseen": None},
                    {"name": "compressed-int4", "ms": 8.0, "ppl": 21.0 + self.variant, "ppl_unseen": None}]
            (out / "bench.json").write_text(json.dumps({"front": rows, "unseen_data": None, "speculative": {}}))
            return
        if self.variant:
            with __import__("torch").no_grad():
                self.model.lm_head.weight.mul_(1.01)
        save_model_folder(self.model, self.tok, out, {"source": "test", "variant": self.variant})


@pytest.fixture
def ship(tiny_env, tmp_path, monkeypatch):
    monkeypatch.setattr(ship_run, "check_reach", lambda *a, **k: {})  # a real plan run: its own test below
    runner = Runner(tiny_env)
    folder = tmp_path / "ship"

    def again(**kw):
        runner.ran.clear()
        cfg = from_options(ShipConfig, {**CFG, "data": str(tiny_env["corpus"]), **kw})
        return ship_run.run_ship(str(tiny_env["teacher"]), cfg, folder, spell, runner=runner)

    first = again()
    assert runner.ran == ["student-1.2", "bench"] and first["steps_run_seconds"].keys() == {"student-1.2", "bench"}
    return folder, runner, again


def test_an_untouched_ship_is_verified_and_kept_whole(ship):
    folder, runner, again = ship
    record = json.loads((folder / STEPS_FILE).read_text())["steps"]
    assert record["bench"]["reads"].keys() == {"teacher", "student-1.2"}
    assert record["bench"]["reads"]["student-1.2"] == record["student-1.2"]["output"]
    again()
    assert runner.ran == []


def test_a_ledger_written_before_settings_files_resumes(ship):
    """steps.json of a ship run before steps were given settings files records each step's command line: a step whose
    line is the one its settings spell is kept (and recorded anew), one whose line differs is made again."""
    folder, runner, again = ship
    path = folder / STEPS_FILE
    ledger = json.loads(path.read_text())
    for step in ledger["steps"].values():
        values = step.pop("invocation")
        step["command"] = spell(Invocation(tuple(values["command"]), values["values"]))
    student = ledger["steps"]["student-1.2"]["command"]
    assert student[0] == "compress" and student[2] == "--one-shot" and student[-2:] == ["--out", str(folder /
                                                                                                  "student-1.2")]
    path.write_text(json.dumps(ledger))
    again()
    assert runner.ran == []
    assert all("invocation" in s for s in json.loads(path.read_text())["steps"].values())
    ledger = json.loads(path.read_text())
    old = ledger["steps"]["bench"].pop("invocation")
    ledger["steps"]["bench"]["command"] = [*spell(Invocation(tuple(old["command"]), old["values"])),
                                           "--repeats", "3"]
    path.write_text(json.dumps(ledger))
    again()
    assert runner.ran == ["bench"]


def test_a_student_with_truncated_weights_is_made_again_and_so_is_the_bench(ship):
    """Case 1: it was "done before, kept" and the recommendation rewritten from the damaged folder."""
    folder, runner, again = ship
    weights = folder / "student-1.2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    again()
    assert runner.ran == ["student-1.2", "bench"]


def test_a_rebuilt_student_is_measured_again(ship):
    """Case 2: a deleted student was rebuilt (differently) while the bench of the old one was kept."""
    folder, runner, again = ship
    shutil.rmtree(folder / "student-1.2")
    runner.variant = 1
    result = again()
    assert runner.ran == ["student-1.2", "bench"]
    assert next(r for r in result["rows"] if r["row"] == "compressed-int4")["ppl"] == 22.0


def test_a_file_changed_in_a_kept_step_is_found_by_its_digest(ship):
    """A same-size edit the readers cannot see (generation_config.json) still differs from the recorded digest."""
    folder, runner, again = ship
    f = folder / "student-1.2" / "generation_config.json"
    f.write_text(f.read_text().replace("\"use_cache\": true", "\"use_cache\": 1   "))
    again()
    assert runner.ran == ["student-1.2", "bench"]


@pytest.mark.parametrize("lost", ["bench/bench.json", "student-1.2/compression.json"])
def test_a_step_whose_last_file_was_deleted_is_made_again_instead_of_refused(ship, lost):
    """Case 4: "--out ... exists and is not empty (use --force)" on every rerun: it could never finish."""
    folder, runner, again = ship
    (folder / lost).unlink()
    again()
    assert runner.ran == (["bench"] if lost.startswith("bench") else ["student-1.2", "bench"])


def test_a_step_folder_replaced_by_a_symbolic_link_is_refused(ship, tiny_env):
    """Case 3: a link to another model was accepted and measured."""
    folder, runner, again = ship
    shutil.rmtree(folder / "student-1.2")
    (folder / "student-1.2").symlink_to(tiny_env["teacher"])
    with pytest.raises(UsageError, match=r"student-1.2: is a symbolic link \(to .*teacher\)"):
        again()
    assert runner.ran == [] and (tiny_env["teacher"] / "config.json").is_file()  # the link's target untouched


def test_a_link_inside_a_step_folder_is_refused(ship, tiny_env):
    folder, runner, again = ship
    weights = folder / "student-1.2" / "tokenizer.json"
    weights.unlink()
    weights.symlink_to(tiny_env["teacher"] / "tokenizer.json")
    with pytest.raises(UsageError, match="tokenizer.json: is a symbolic link"):
        again()


def test_a_damaged_record_verifies_every_step_afresh(ship):
    folder, runner, again = ship
    (folder / STEPS_FILE).write_text("{not json")
    again()
    assert runner.ran == []
    assert json.loads((folder / STEPS_FILE).read_text())["steps"].keys() == {"student-1.2", "bench"}


@pytest.mark.parametrize("kw,needle", [
    ({"speedups": "1.25,1.2500001"}, "1.25, 1.2500001 would all be student-1.25"),  # case 6
    ({"forms": "channels,vocab"}, "--forms channels,vocab: vocab is the draft's head"),  # case 16
])
def test_settings_a_step_would_trip_on_are_refused_by_the_config(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        from_options(ShipConfig, kw).check(__import__("bdlora.base.errors", fromlist=["Checks"]).Checks()).done()


@pytest.mark.parametrize("kw,needle", [
    ({"seq_len": 100000}, "--seq-len 100000 (+ --decode-tokens 4): above the 128 positions"),
    ({"eval_data": "builtin", "data": "builtin"}, "--eval-data builtin: builtin is in --data builtin"),
    ({"heal_steps": 2, "heal_seq_len": 4096}, "--heal-seq-len 4096: above the teacher's context of 128"),
])
def test_settings_are_checked_against_the_teacher_before_the_first_step(tiny_env, tmp_path, monkeypatch, kw, needle):
    """Case 7: --seq-len 100000 and the data pair train refuses failed at bench or train after earlier steps ran."""
    def runner(*a):
        raise AssertionError("no step may run")

    with pytest.raises(ConfigError) as e:
        cfg = from_options(ShipConfig, {**CFG, "data": str(tiny_env["corpus"]), **kw})
        ship_run.run_ship(str(tiny_env["teacher"]), cfg, tmp_path / "ship", spell, runner=runner)
    assert needle in str(e.value)
    assert not (tmp_path / "ship").exists()  # issue 89, case 2: a refusal left ship.json, refusing the rerun
    if "seq_len" in kw:  # the corrected rerun proceeds to its first step (the reach check is tested below)
        monkeypatch.setattr(ship_run, "check_reach", lambda *a: None)
        cfg = from_options(ShipConfig, {**CFG, "data": str(tiny_env["corpus"])})

        class FirstStep(Exception):
            pass

        def first(*a):
            raise FirstStep

        with pytest.raises(FirstStep):
            ship_run.run_ship(str(tiny_env["teacher"]), cfg, tmp_path / "ship", spell, runner=first)


@pytest.mark.slow
def test_a_speedup_beyond_reach_is_refused_by_plan_before_any_step(tiny_env, tmp_path, monkeypatch):
    """Case 7: --speedups 1.5 ran the teacher's exports and failed at the student ("beyond reach; 1.42x")."""
    from test_latency import _hand_table, _tiny_shapes

    from conftest import genai_teacher

    teacher = tmp_path / "teacher"
    genai_teacher(tiny_env["tokenizer"], teacher, seed=3, layers=4)
    _hand_table(tmp_path / "cache", _tiny_shapes(teacher), (), threads=1, teacher=teacher, pruned=True)
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path / "cache"))

    def runner(*a):
        raise AssertionError("no step may run")

    cfg = from_options(ShipConfig, {**CFG, "data": str(tiny_env["corpus"]), "speedups": "1.2,4", "seq_len": 64})
    with pytest.raises(UsageError, match=r"--speedups: plan refuses it rounded by rtn before any step runs "
                                         r"\(--speedup 4: beyond reach; the cheapest form of every layer gives "
                                         r"[0-9.]+x less decode time"):
        ship_run.run_ship(str(teacher), cfg, tmp_path / "ship", spell, runner=runner)


@pytest.mark.parametrize("start", [
    "from bdlora.ship.run import spawn; p = spawn(SLEEP)",  # a ship step
    "import subprocess; from bdlora.base.children import dying_with_this_process; "  # a bench timing worker
    "p = subprocess.Popen(SLEEP, preexec_fn=dying_with_this_process())",
])
def test_a_steps_process_ends_when_ship_is_killed(tmp_path, start):
    """Case 8: after ``kill -9`` of ship the running step lived on under PID 1, holding its output's claim; the
    bench's timing workers are started the same way."""
    script = ("import sys, time; SLEEP = [sys.executable, '-c', 'import time; time.sleep(120)']; "
              f"{start}; print(p.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.1)
    alive = _running(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_the_rebuild_commands_name_each_step_once_in_the_users_words(ship, tiny_env):
    """Case 17: the student's compress was printed twice in one && chain; the teacher's export named bdlora's cache
    folder instead of `builtin`."""
    folder, runner, again = ship
    result = again()
    for answer in result["answers"]:
        assert len(answer["commands"]) == len(set(answer["commands"])), answer["commands"]
    row = next(r for r in result["rows"] if r["row"] == "compressed-int4")
    assert [c.split()[1] for c in row["commands"]] == ["compress", "export"]
    teacher = next(r for r in result["rows"] if r["row"] == "teacher-int4")["commands"][0]
    assert teacher.startswith(f"bdlora export genai {tiny_env['teacher']} --precision int4 --quant rtn")
    cfg = ShipConfig(schemes="rtn,affine")
    assert [spell(s.invocation)[:3] for s in ship_run.teacher_steps("builtin", cfg, folder)] == [
        ["export", "genai", "builtin"]] * 2


def test_reach_is_checked_for_every_scheme_a_student_may_be_rounded_by():
    """The quickstart's --speedups 1.25 was reached with rtn's node times and beyond reach (1.23x) with affine's, the
    scheme the teacher's exports then chose: every candidate scheme is checked."""
    from bdlora.ship.preflight import reach_checks, reach_quants

    assert reach_quants(ShipConfig(schemes="rtn,affine")) == ["rtn", "affine"]
    # gptq's nodes are rtn's (timed as rtn: the same costs, the same reach): the default's three schemes, two checks
    assert reach_quants(ShipConfig()) == ["rtn", "affine"]
    assert reach_quants(ShipConfig(schemes="gptq,affine,rtn")) == ["gptq", "affine"]
    assert reach_quants(ShipConfig(schemes="rtn,affine", student_quant="gptq")) == ["gptq"]
    assert reach_quants(ShipConfig(precision="fp32")) == [None]
    lines = reach_checks("builtin", ShipConfig(speedups="1.1,1.3", draft_speedup=3.0), "affine")
    assert [o for o, _ in lines] == ["--speedups", "--draft-speedup"]
    assert lines[0][1].values["speedup"] == "1.3" and lines[1][1].values["quant"] == "affine"
