"""Multi-process training (torchrun, gloo on CPU) and fault-tolerant runs (checksummed checkpoints, kill -9 and
resume bit-identical)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from bdlora.cli import app
from conftest import train_args

# the budget drops at once with no EMA lag, so a few steps already move every retention
FAST_BUDGET = ["--decay-start", "0.0", "--decay-end", "0.5", "--retention-ema", "0.0"]


def student_tensors(run: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run / "student").rglob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    assert out
    return out


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "bdlora.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.full  # moved out of the README's test command to keep it under 8 minutes; CI runs pytest -m full
@pytest.mark.parametrize("method", ["budgeted", "kd-full", "kd-lora"])
def test_two_gloo_processes_equal_one_process_with_the_same_global_batch(tiny_env, tmp_path, method):
    # --tokens is a global budget: 512 tokens = 4 steps of 4 x 32 on one process, and on two processes of 2 x 32 each
    common = ["--method", method, "--tokens", "512", "--eval-every", "4", "--save-every", "2", *FAST_BUDGET]
    one = tmp_path / "one"
    res = CliRunner().invoke(app, train_args(tiny_env, one, *common))  # --batch-size 4, one process
    assert res.exit_code == 0, res.output
    two = tmp_path / "two"
    args = train_args(tiny_env, two, *common)
    args[args.index("--batch-size") + 1] = "2"  # 2 processes x 2 sequences = the same global batch of 4
    p = cli(*args, "--nproc", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    s1 = json.loads((one / "summary.json").read_text())
    s2 = json.loads((two / "summary.json").read_text())
    assert s2["world_size"] == 2 and s2["global_batch"] == 4 == s1["global_batch"]
    assert s2["tokens"] == s1["tokens"] == 512 and s2["steps"] == s1["steps"] == 4
    a, b = student_tensors(one), student_tensors(two)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=k)
    assert s2["student_val_ppl"] == pytest.approx(s1["student_val_ppl"], rel=1e-4)
    if method == "budgeted":  # the controller ran identically (checked every step on both ranks)
        assert [m["d"] for m in s1["modules"]] == [m["d"] for m in s2["modules"]]
    if method != "kd-full":  # the whitened start: one calibration on rank 0, loaded by rank 1, equal to one process's
        f1, f2 = (load_file(str(r / "lora_start.safetensors")) for r in (one, two))
        assert f1.keys() == f2.keys() and all(torch.equal(f1[k], f2[k]) for k in f1)
    assert not (two / "metrics.jsonl").read_text().count('"step": 1,') > 1  # only rank 0 logged
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-00000002"]


def _diverge_worker(rank, world, port, q):
    import torch.distributed as dist

    from bdlora.train.distributed import DistEnv, check_same_retentions

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = DistEnv(rank, world, rank)
    try:
        check_same_retentions(env, [0.5, 0.25], 1)
        check_same_retentions(env, [0.5, 0.25 + 0.1 * rank], 2)
        q.put((rank, "no error"))
    except Exception as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_controller_divergence_across_ranks_fails_loudly():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_diverge_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    for r in (0, 1):
        assert results[r].startswith("TrainingError: step 2: the budget controller diverged"), results


@pytest.mark.full  # moved out of the README's test command to keep it under 8 minutes; CI runs pytest -m full
def test_kill_9_then_resume_is_bit_identical(tiny_env, tmp_path):
    common = ["--method", "budgeted", "--max-steps", "40", "--eval-every", "20", "--save-every", "3",
              "--keep-last", "2", *FAST_BUDGET]
    ref = tmp_path / "ref"
    p = cli(*train_args(tiny_env, ref, *common))
    assert p.returncode == 0, p.stderr[-3000:]

    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "bdlora.cli", *train_args(tiny_env, run, *common)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step-00000006" / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "summary.json").exists() and proc.returncode == -signal.SIGKILL
    p = cli("train", "--resume", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] >= 6
    a, b = student_tensors(ref), student_tensors(run)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))  # no duplicated or missing log lines after the resume


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tiny_env, tmp_path):
    common = ["--method", "kd-lora", "--max-steps", "6", "--save-every", "2", "--keep-last", "3"]
    ref = tmp_path / "ref"
    assert CliRunner().invoke(app, train_args(tiny_env, ref, *common)).exit_code == 0
    run = tmp_path / "run"
    assert CliRunner().invoke(app, train_args(tiny_env, run, *common)).exit_code == 0
    # make it an unfinished run whose newest checkpoint is torn
    (run / "summary.json").unlink()
    import shutil

    shutil.rmtree(run / "student")
    latest = run / "checkpoints" / "step-00000004" / "trainable.safetensors"
    data = bytearray(latest.read_bytes())
    data[-8:] = b"\x00" * 8
    latest.write_bytes(bytes(data))
    from bdlora.train.checkpoint import latest_checkpoint

    with pytest.warns(UserWarning, match="step-00000004 is corrupt"):
        assert latest_checkpoint(run).name == "step-00000002"
    res = CliRunner().invoke(app, ["train", "--resume", str(run)])
    assert res.exit_code == 0, res.output
    assert "step-00000004 is corrupt" in res.output and "at step 2" in res.output
    a, b = student_tensors(ref), student_tensors(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_incompatible_options_and_accepts_compatible_ones(tiny_env, tmp_path):
    run = tmp_path / "run"
    res = CliRunner().invoke(app, train_args(tiny_env, run, "--method", "budgeted", "--max-steps", "4",
                                             "--save-every", "2"))
    assert res.exit_code == 0
    (run / "summary.json").unlink()
    # what the run resolved is stored beside its options, typed (RunFacts), and a resume must match its processes
    from bdlora.base.runs import RunDir, RunFacts

    doc = json.loads((run / "config.json").read_text())
    facts = RunDir(run).facts()
    assert facts.world_size == 1 and facts.teacher_path == str(tiny_env["teacher"].resolve())
    teacher_layers = json.loads((tiny_env["teacher"] / "config.json").read_text())["num_hidden_layers"]
    assert facts.teacher_layers == teacher_layers and len(facts.layer_indices) == doc["config"]["student_layers"]
    assert all(0 <= i < teacher_layers for i in facts.layer_indices) and facts.data_tokens["train"] > 0
    assert set(doc["run"]) == {f for f in RunFacts.__dataclass_fields__} and "extra" not in doc["config"]
    assert RunDir(run).data_settings()["source_path"] == facts.teacher_path
    legacy = {**doc, "config": {**doc["config"], "extra": {**doc["run"], "world_size": 2}}}
    del legacy["run"]  # a run written before RunFacts: the same facts among its options
    (run / "config.json").write_text(json.dumps(legacy))
    assert RunDir(run).facts().world_size == 2
    res = CliRunner().invoke(app, ["train", "--resume", str(run)])
    assert res.exit_code == 2 and "the run was trained on 2 process(es), this launch has 1" in res.output
    (run / "config.json").write_text(json.dumps(doc))
    for extra, needle in [(["--method", "kd-full"], "--method kd-full: this run was started with --method budgeted"),
                          (["--teacher", str(tmp_path)], "--teacher"), (["--lora-rank", "8"], "--lora-rank 8")]:
        res = CliRunner().invoke(app, ["train", "--resume", str(run), *extra])
        assert res.exit_code == 2 and needle in res.output, res.output
    res = CliRunner().invoke(app, ["train", "--resume", str(run), "--method", "budgeted", "--eval-every", "1",
                                   "--keep-last", "1"])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 2


def _unfinished_run(tiny_env, run):
    """A kd-lora run with checkpoints at steps 2 and 4, turned back into one that can be resumed."""
    import shutil

    common = ["--method", "kd-lora", "--max-steps", "6", "--save-every", "2", "--keep-last", "3"]
    assert CliRunner().invoke(app, train_args(tiny_env, run, *common)).exit_code == 0
    (run / "summary.json").unlink()
    shutil.rmtree(run / "student")
    shutil.rmtree(run / "checkpoints" / "step-00000006", ignore_errors=True)
    return run


def test_resume_survives_a_torn_log_line_and_refuses_damaged_run_files_in_one_line(tiny_env, tmp_path):
    run = _unfinished_run(tiny_env, tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.2')  # a crash mid-append
    res = CliRunner().invoke(app, ["train", "--resume", str(run)])
    assert res.exit_code == 0, res.output
    assert "dropped a partial last line" in res.output
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6  # no duplicate or torn record

    for name, damage, needle in [
        ("state", lambda r: (r / "checkpoints" / "step-00000004" / "state.json").write_text("{}"),
         "step-00000004 is corrupt"),
        ("config", lambda r: (r / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    ]:
        run = _unfinished_run(tiny_env, tmp_path / name)
        damage(run)
        res = CliRunner().invoke(app, ["train", "--resume", str(run)])
        if name == "state":  # the damaged newest checkpoint is skipped with a warning; the run resumes from step 2
            assert res.exit_code == 0 and needle in res.output and "at step 2" in res.output, res.output
        else:
            assert res.exit_code == 2 and needle in res.stderr and res.stderr.strip().count("\n") == 0, res.output


def _edit_checkpoint(run, edit_tensors=None, **state):
    """Edit step-00000004 as a user could (checksums recomputed, so only the contents say what is wrong)."""
    from safetensors.torch import load_file, save_file

    from bdlora.base.io import sha256

    ckpt = run / "checkpoints" / "step-00000004"
    if edit_tensors is not None:
        tensors = load_file(ckpt / "trainable.safetensors")
        edit_tensors(tensors)
        save_file(tensors, ckpt / "trainable.safetensors")
    doc = json.loads((ckpt / "state.json").read_text())
    doc.update(state)
    doc["files"] = {name: sha256(ckpt / name) for name in doc["files"]}
    (ckpt / "state.json").write_text(json.dumps(doc))
    return ckpt


def test_edited_checkpoints_are_refused_in_one_line_or_passed_over(tiny_env, tmp_path):
    """Issue 44 case 8: a checkpoint edited by hand with its checksums updated. A tensor of the wrong shape or one
    the run does not train is refused in one line (it was a RuntimeError / KeyError traceback); a state.json step
    that is not the one its folder names ("abc", -5, 1000000: a TypeError, or a summary with negative tokens/s) makes
    the checkpoint corrupt, so the resume falls back to the previous one."""
    import torch

    def reshape(t):
        name = next(iter(t))
        t[name] = torch.zeros(3, 5)

    def extra(t):
        t["not.a.parameter"] = torch.zeros(2)

    for name, tensors, needle in [("shape", reshape, "has shape (3, 5), the run's is"),
                                  ("extra", extra, "unknown tensor not.a.parameter")]:
        run = _unfinished_run(tiny_env, tmp_path / name)
        _edit_checkpoint(run, tensors)
        res = CliRunner().invoke(app, ["train", "--resume", str(run)])
        assert res.exit_code == 2 and needle in res.stderr, res.output
        assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.output
    for step in ("abc", -5, 1_000_000):
        run = _unfinished_run(tiny_env, tmp_path / f"step{step}")
        _edit_checkpoint(run, step=step)
        res = CliRunner().invoke(app, ["train", "--resume", str(run)])
        assert res.exit_code == 0, res.output
        assert f"state.json records step {str(step)!r}, not the folder's" in res.output and "at step 2" in res.output
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 6 and summary["tokens_per_s"] > 0 and summary["student_val_ppl"] > 0
    run = _unfinished_run(tiny_env, tmp_path / "renamed")
    ckpt = _edit_checkpoint(run, step=1_000_000)
    ckpt.rename(run / "checkpoints" / "step-01000000")
    res = CliRunner().invoke(app, ["train", "--resume", str(run)])
    assert res.exit_code == 2 and "records step 1000000, outside this run's 1..6" in res.stderr, res.output


def test_checkpoint_rotation_removes_only_its_own_checkpoints(tiny_env, tmp_path):
    """Issue 44 case 6: a finished run placed under another run's checkpoints/ as step-00000000-myrun was deleted
    by that run's rotation. The rotation removes only folders named step-NNNNNNNN holding a state.json, and train
    refuses an --out inside another run in the first place."""
    import shutil

    run = _unfinished_run(tiny_env, tmp_path / "run")
    other = run / "checkpoints" / "step-00000000-myrun"
    res = CliRunner().invoke(app, train_args(tiny_env, other, "--max-steps", "1"))
    assert res.exit_code == 2 and f"is inside the model/run folder {run}" in res.stderr, res.output
    assert CliRunner().invoke(app, train_args(tiny_env, tmp_path / "mine", "--max-steps", "1")).exit_code == 0
    shutil.copytree(tmp_path / "mine", other)
    (run / "checkpoints" / "step-00000001").mkdir()  # no state.json: not a checkpoint bdlora wrote
    (run / "checkpoints" / "step-00000001" / "notes.txt").write_text("mine")
    res = CliRunner().invoke(app, ["train", "--resume", str(run), "--save-every", "1", "--keep-last", "1"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000000-myrun", "step-00000001", "step-00000005"]
    assert (other / "summary.json").is_file() and (run / "checkpoints/step-00000001/notes.txt").read_text() == "mine"


def test_resume_refuses_another_out(tiny_env, tmp_path):
    """Issue 44: `--resume R --out X` ignored --out silently."""
    run = _unfinished_run(tiny_env, tmp_path / "run")
    res = CliRunner().invoke(app, ["train", "--resume", str(run), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and f"a resumed run continues in its own folder {run}; drop --out" in res.stderr
    assert not (tmp_path / "x").exists()
