"""The CLI's error contract, case by case (issue 19's hostile-user list): every bad input, unusable output or damaged
artefact gives one line on stderr naming what is wrong, a non-zero exit (2 for bad usage, 1 for a failure), no
traceback, and leaves nothing half-written: no output appears and nothing the user had changes.

Each row of CASES builds its input from a finished tiny run, its compressed folder and its ONNX export (copied
before any damage) and names what must not exist afterwards. More rows of the same contract: ``test_cli`` (bad
``train`` options), ``test_compress`` (damaged compressed folders x every reader), ``test_serve`` (the server).
The property tests at the end cover every numeric option of every command by construction.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bdlora.cli import app
from conftest import put_foreign_tokenizer, train_args


@pytest.fixture(scope="module")
def made(tiny_env, tmp_path_factory):
    """A finished budgeted run, its compressed folder and its ONNX export, made through the CLI."""
    root = tmp_path_factory.mktemp("contract")
    run = root / "run"
    for args in (train_args(tiny_env, run, "--max-steps", "2"),
                 ["compress", str(run), "--svd-max-rank", "8", "--no-eval"],
                 ["export", "onnx", str(root / "run.compressed"), "--out", str(root / "onnx")]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
    return {"env": tiny_env, "run": run, "compressed": root / "run.compressed", "onnx": root / "onnx"}


@dataclass
class Case:
    id: str
    build: Callable  # (made, tmp) -> argv; may write damaged copies under tmp
    needle: str
    code: int = 2
    absent: tuple[str, ...] = ("out",)  # paths under tmp that must not exist afterwards
    kept: dict = field(default_factory=dict)  # {path under tmp: content it must still have}


def copy(made, key, tmp, name=None) -> Path:
    dst = tmp / (name or made[key].name)
    shutil.copytree(made[key], dst)
    return dst


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def edit_forms(folder: Path, edit) -> None:
    """Rewrite the first module's declaration in ``folder``'s config.json with ``edit(spec)``."""
    cfg = json.loads((folder / "config.json").read_text())
    name = next(iter(cfg["bdlora_modules"]))
    cfg["bdlora_modules"][name] = edit(cfg["bdlora_modules"][name])
    (folder / "config.json").write_text(json.dumps(cfg))


def half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def train(made, tmp, *extra):
    return train_args(made["env"], tmp / "out", "--max-steps", "3", *extra)


def damaged_run(made, tmp, rel, data):
    run = copy(made, "run", tmp, "r")
    if callable(data):
        data(run / rel)
    else:
        write(run / rel, data)
    return ["compress", str(run), "--no-eval", "--out", str(tmp / "out")]


def damaged_compressed(cmd, data):
    def build(made, tmp):
        folder = copy(made, "compressed", tmp, "m")
        write(folder / "compression.json", data)
        if cmd == "eval":
            return ["eval", str(folder), "--ppl", "--report", str(tmp / "out")]
        return [*cmd.split(), str(folder), "--out", str(tmp / "out")]
    return build


def damaged_onnx(rel, data, onnx_file="model.onnx"):
    def build(made, tmp):
        folder = copy(made, "onnx", tmp, "o")
        if callable(data):
            data(folder / rel)
        elif data is not None:
            write(folder / rel, data)
        return ["eval", str(folder), "--ppl", "--data", str(made["env"]["corpus"]), "--report", str(tmp / "out"),
                "--onnx-file", onnx_file]
    return build


def declare(**sizes):
    def edit(path: Path) -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **sizes}))
    return edit


def corpus(name, data):
    def build(made, tmp):
        write(tmp / "c" / name, data)
        return train(made, tmp, "--data", str(tmp / "c"))
    return build


def nan_teacher(made, tmp):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(made["env"]["teacher"], dtype=torch.float32)
    with torch.no_grad():
        m.model.norm.weight.fill_(float("nan"))
    m.save_pretrained(tmp / "t")
    made["env"]["tokenizer"].save_pretrained(tmp / "t")
    return train(made, tmp, "--teacher", str(tmp / "t"))


OUT_WRITERS = {  # command -> argv writing its output at OUT (a path string)
    "train": lambda m, o: train_args(m["env"], o, "--max-steps", "3"),
    "compress": lambda m, o: ["compress", str(m["run"]), "--no-eval", "--out", o],
    "compress --force": lambda m, o: ["compress", str(m["run"]), "--no-eval", "--force", "--out", o],
    "export onnx": lambda m, o: ["export", "onnx", str(m["compressed"]), "--out", o],
    "export hf": lambda m, o: ["export", "hf", str(m["compressed"]), "--out", o],
    "export hf --force": lambda m, o: ["export", "hf", str(m["compressed"]), "--force", "--out", o],
    "bench": lambda m, o: ["bench", str(m["compressed"]), "--out", o],
    "eval --report": lambda m, o: ["eval", str(m["compressed"]), "--ppl", "--report", o],
}


def writes(cmd, rel, *extra, setup=None):
    def build(made, tmp):
        if setup is not None:
            setup(tmp)
        return [*OUT_WRITERS[cmd](made, rel if rel.startswith("/") else str(tmp / rel)), *extra]
    return build


def a_file(tmp):
    write(tmp / "f", "mine")


def out_cases():
    cases = []
    for cmd in OUT_WRITERS:
        cases.append(Case(f"{cmd}: output under /proc", writes(cmd, "/proc/x/out"),
                          "cannot create it (/proc is not a writable folder)", absent=()))
        cases.append(Case(f"{cmd}: output under a file", writes(cmd, "f/sub", setup=a_file),
                          "is not a writable folder", absent=("f/sub",), kept={"f": "mine"}))
        if cmd != "eval --report":
            cases.append(Case(f"{cmd}: output is a file", writes(cmd, "f", setup=a_file), "is a file, not a folder",
                              absent=(), kept={"f": "mine"}))
    cases.append(Case("eval --report: names a folder", writes("eval --report", "d", setup=lambda t: (t / "d").mkdir()),
                      "is a folder (name a file)", absent=()))
    return cases


def fifo(tmp):
    import os

    os.mkfifo(tmp / "pipe")
    return tmp / "pipe"


def json_cases():
    """Issue 44 case 1: a --json path is written by a rename, which replaced whatever was there: a device node
    (/dev/full became a regular file, run as root), a FIFO, a link, or a model's own config.json (the model no longer
    loaded); eval's default report was overwritten silently."""
    def model_config(made, tmp):
        folder = copy(made, "compressed", tmp, "m")
        return ["eval", str(made["compressed"]), "--ppl", "--report", str(folder / "config.json")]

    def existing_report(made, tmp):
        folder = copy(made, "compressed", tmp, "m")
        write(tmp / "m.eval.json", "mine")
        return ["eval", str(folder), "--ppl"]

    def link(made, tmp):
        write(tmp / "target.json", "mine")
        (tmp / "link.json").symlink_to(tmp / "target.json")
        return ["eval", str(made["compressed"]), "--ppl", "--report", str(tmp / "link.json")]

    return [
        Case("eval --report a FIFO", lambda m, t: ["eval", str(m["compressed"]), "--ppl", "--report", str(fifo(t))],
             "pipe: is a named pipe; only a regular file is ever replaced", absent=()),
        Case("eval --report a symbolic link", link, "link.json: is a symbolic link", absent=(),
             kept={"target.json": "mine"}),
        Case("eval --report M/config.json", model_config, "config.json: is inside the model/run folder", absent=()),
        Case("eval --report an existing file", writes("eval --report", "f", setup=a_file),
             "f: exists (use --force to replace it)", absent=(), kept={"f": "mine"}),
        Case("eval: the default report exists", existing_report, "m.eval.json: exists (use --force", absent=(),
             kept={"m.eval.json": "mine"}),
        Case("bench --report a FIFO", lambda m, t: [*OUT_WRITERS["bench"](m, str(t / "out")), "--report",
                                                    str(fifo(t))],
             "is a named pipe"),
        Case("loadtest --report an existing file", lambda m, t: (a_file(t), ["loadtest", "http://127.0.0.1:9",
                                                                          "--report", str(t / "f")])[1],
             "f: exists (use --force to replace it)", absent=(), kept={"f": "mine"}),
        Case("compress --force over a folder bdlora did not write", writes("compress --force", "d", setup=lambda t: (
            write(t / "d" / "notes.txt", "mine"))), "is not a folder bdlora wrote; --force replaces only those",
            absent=(), kept={"d/notes.txt": "mine"}),
        Case("compress --out inside a model folder", lambda m, t: (copy(m, "compressed", t, "m"), OUT_WRITERS[
            "compress"](m, str(t / "m" / "sub")))[1], "is inside the model/run folder", absent=("m/sub",)),
    ]


def foreign_tokenizer(cmd):
    """Issue 44 case 5: another model's tokenizer files in a model folder (ids the model cannot embed): export exited
    0 and eval died with an IndexError traceback."""
    def build(made, tmp):
        from conftest import make_corpus, train_tokenizer

        folder = copy(made, "compressed", tmp, "m")
        train_tokenizer(make_corpus(tmp / "c", n_docs=40, seed=5), vocab_size=400).save_pretrained(folder)
        # a folder written before the tokenizer's identity was recorded: the vocabulary check still catches it
        report = json.loads((folder / "compression.json").read_text())
        report.pop("tokenizer_sha256")
        (folder / "compression.json").write_text(json.dumps(report))
        tail = ["--ppl", "--report", str(tmp / "out")] if cmd == "eval" else ["--out", str(tmp / "out")]
        return [*cmd.split(), str(folder), *tail]
    return build


def edited_model_type(made, tmp):
    folder = copy(made, "compressed", tmp, "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bdlora_foo"}))
    return ["eval", str(folder), "--ppl", "--report", str(tmp / "out")]


# an export's config.json edited: refused by the digest export.json records (test_serve checks the sizes without it)
EDITED_EXPORT_CONFIG = "differs from the config.json the graph was exported with"

CASES = out_cases() + json_cases() + [
    # issue 44 cases 9, 10 and the minor ones
    Case("export genai --threads 100000", lambda m, t: ["export", "genai", str(m["compressed"]), "--threads",
                                                        "100000", "--out", str(t / "out")],
         "--threads 100000: must be in [0, 512]"),
    Case("export genai --context-length 0", lambda m, t: ["export", "genai", str(m["compressed"]),
                                                          "--context-length", "0", "--out", str(t / "out")],
         "--context-length 0: must be in [1, 128]"),
    Case("loadtest of an invalid URL", lambda m, t: ["loadtest", "http://[::1"], "http://[::1: not a valid URL"),
    Case("loadtest of a URL without a scheme", lambda m, t: ["loadtest", "localhost:8000"],
         "localhost:8000: not an http(s) address with a host"),
    Case("train --config a FIFO", lambda m, t: train(m, t, "--config", str(fifo(t))), "pipe: is not a regular file"),
    Case("train --config a folder", lambda m, t: (t.joinpath("d").mkdir(), train(m, t, "--config", str(t / "d")))[1],
         "d: is a folder; name a YAML file"),
    Case("an unknown model_type is named", edited_model_type, "(model_type 'bdlora_foo'); bdlora adapts"),
    *[Case(f"{cmd}: a tokenizer that is not the model's", foreign_tokenizer(cmd),
           "its tokenizer has 400 tokens but the model embeds 320; the tokenizer files are not this model's")
      for cmd in ("export onnx", "export genai", "eval")],
    # options (defect 6, 7): values and types, from flags and from YAML
    Case("train --weight-decay nan", lambda m, t: train(m, t, "--weight-decay", "nan"), "--weight-decay nan: must be"),
    Case("train --weight-decay -1", lambda m, t: train(m, t, "--weight-decay", "-1"), "--weight-decay -1.0: must be"),
    Case("train --seq-len 1", lambda m, t: train(m, t, "--seq-len", "1"), "--seq-len 1: must be >= 2"),
    Case("train --lr inf", lambda m, t: train(m, t, "--lr", "inf"), "--lr inf: must be > 0"),
    Case("train --gate-init nan", lambda m, t: train(m, t, "--gate-init", "nan"), "--gate-init nan: must be a finite"),
    Case("YAML grad_clip: .nan", lambda m, t: train(m, t, "--config", str(write(t / "c.yaml", "grad_clip: .nan\n"))),
         "--grad-clip nan: must be > 0"),
    Case('YAML budget: "0.4"', lambda m, t: train(m, t, "--config", str(write(t / "c.yaml", 'budget: "0.4"\n'))),
         "budget: '0.4' is not a number"),
    Case("YAML batch_size: true", lambda m, t: train(m, t, "--config", str(write(t / "c.yaml", "batch_size: true\n"))),
         "batch_size: True is not an integer"),
    Case("YAML alias bomb (billions of nested items in 11 lines)", lambda m, t: train(m, t, "--config", str(write(
        t / "c.yaml", "lora_rank:\n  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
            f"  - &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefghi", "bcdefghij"))))),
         "lora_rank: [['lol', 'lol', 'lol', 'lol', ...], [[...], [...], [...], [...], ...], "),
    Case("YAML --config of 2 MiB", lambda m, t: train(m, t, "--config", str(write(t / "c.yaml", "#" * (2 << 20)))),
         "2,097,152 bytes; an option file is a few lines"),
    Case("train --max-steps abc (parser)", lambda m, t: train(m, t, "--max-steps", "abc"),
         "Invalid value for '--max-steps'"),
    Case("train --no-such-option (parser)", lambda m, t: train(m, t, "--no-such-option"),
         "No such option: --no-such-option"),
    Case("train --student-init missing", lambda m, t: train(m, t, "--student-init", str(t / "nope")),
         "--student-init"),
    # resources (defect 5)
    Case("train --lora-rank 100000", lambda m, t: train(m, t, "--lora-rank", "100000"), "largest useful rank 16"),
    Case("bench --lora-rank 100000", writes("bench", "out", "--lora-rank", "100000"), "largest useful rank 16"),
    Case("bench --seq-lens 100000", writes("bench", "out", "--seq-lens", "100000"),
         "above the model's context of 128 positions"),
    Case("bench --threads 100000", writes("bench", "out", "--threads", "100000"), "--threads 100000: must be in [1,"),
    Case("bench --provider cuda", writes("bench", "out", "--provider", "cuda"), "the [gpu] extra"),
    # corpora (defect 6)
    Case("a .jsonl that is not UTF-8", corpus("a.jsonl", b'{"text": "caf\xe9"}\n'), "a.jsonl:1: not UTF-8"),
    Case("a garbage .parquet", corpus("a.parquet", bytes(range(256)) * 4), "not a readable parquet file"),
    Case("eval --data with a non-UTF-8 .jsonl", lambda m, t: (write(t / "c" / "a.jsonl", b"\xff\xfe\n"), [
        "eval", str(m["compressed"]), "--ppl", "--data", str(t / "c"), "--report", str(t / "out")])[1], "not UTF-8"),
    # damaged run files read by compress (defect 6)
    Case("compress: summary.json not JSON", lambda m, t: damaged_run(m, t, "summary.json", "{bad"),
         "summary.json: not valid JSON"),
    Case("compress: budgeted.safetensors cut", lambda m, t: damaged_run(m, t, "student/budgeted.safetensors", half),
         "budgeted.safetensors: "),
    Case("compress: budgeted.json not JSON", lambda m, t: damaged_run(m, t, "student/budgeted.json", "[1"),
         "budgeted.json: not valid JSON"),
    Case("compress: budgeted.json wrong schema", lambda m, t: damaged_run(m, t, "student/budgeted.json",
                                                                          '{"rank": "x"}'),
         "budgeted.json: not a budgeted-module description"),
    Case("compress: student config.json not JSON", lambda m, t: damaged_run(m, t, "student/config.json", "{"),
         "student/config.json: not valid JSON"),
    Case("compress: student weights cut", lambda m, t: damaged_run(m, t, "student/model.safetensors", half),
         "student/model.safetensors: "),
    # an invalid compression.json, for every reader of a compressed folder (defect 6)
    *[Case(f"{cmd}: compression.json {kind}", damaged_compressed(cmd, data), needle)
      for cmd in ("export onnx", "export hf", "eval", "bench")
      for kind, data, needle in (("not JSON", "{bad", "compression.json: not valid JSON"),
                                 ("an array", "[]", "compression.json: not a JSON object"))],
    # damaged ONNX folders given to eval (defect 6)
    Case("eval: model.onnx cut in half", damaged_onnx("model.onnx", half), "cannot load the ONNX model"),
    Case("eval: model.onnx random bytes", damaged_onnx("model.onnx", bytes(range(256)) * 64),
         "cannot load the ONNX model"),
    Case("eval: model.onnx empty", damaged_onnx("model.onnx", b""), "cannot load the ONNX model"),
    Case("eval: ONNX config.json not JSON", damaged_onnx("config.json", "{x"), "its config.json does not load"),
    Case("eval: ONNX config.json an array", damaged_onnx("config.json", "[]"), "not a model config"),
    Case("eval: ONNX config.json without sizes", damaged_onnx("config.json", '{"model_type": "llama"}'),
         "no num_hidden_layers"),
    Case("eval: ONNX tokenizer damaged", damaged_onnx("tokenizer.json", "{"), "its tokenizer does not load"),
    # issue 32: sizes the graph does not have, and an export that never finished
    Case("eval: ONNX config.json declares 1,000,000 layers", damaged_onnx("config.json", declare(
        num_hidden_layers=1_000_000)), EDITED_EXPORT_CONFIG),
    Case("eval: ONNX config.json declares 65,536 KV heads", damaged_onnx("config.json", declare(
        num_key_value_heads=65536)), EDITED_EXPORT_CONFIG),
    Case("eval: an unfinished ONNX export (no export.json)", damaged_onnx("export.json", lambda f: f.unlink()),
         "an unfinished export (no export.json"),
    Case("eval --onnx-file outside the folder", damaged_onnx("x", None, onnx_file="../onnx/model.onnx"),
         "must name a graph inside"),
    # unfinished runs and failed training (defect 7)
    Case("eval of an unfinished run", lambda m, t: (shutil.copytree(m["run"], t / "r"), (t / "r/summary.json")
                                                    .unlink(), ["eval", str(t / "r"), "--report", str(t / "out")])[2],
         "has not finished"),
    Case("compress of an unfinished run", lambda m, t: (shutil.copytree(m["run"], t / "r"), (t / "r/summary.json")
                                                        .unlink(), ["compress", str(t / "r"), "--out",
                                                                    str(t / "out")])[2], "not a finished bdlora run"),
    # issue 53, case 3: an empty held-out slice scored perplexity 1.000 with exit 0 (an ONNX folder: a traceback)
    *[Case(f"eval {key}: a one-document corpus has no held-out slice", lambda m, t, key=key: [
        "eval", str(m[key]), "--ppl", "--data", str(m["env"]["corpus"] / "doc000.txt"), "--report", str(t / "out")],
        "its held-out slice has 0 tokens, fewer than one block of 32") for key in ("compressed", "onnx")],
    # issue 53, case 5: a foreign tokenizer of a smaller vocabulary was accepted (eval 1261 where its own gave 115.6)
    *[Case(f"eval {key}: a foreign tokenizer copied in", lambda m, t, key=key: (
        put_foreign_tokenizer(copy(m, key, t, "m"), m["env"]["corpus"]),
        ["eval", str(t / "m"), "--ppl", "--report", str(t / "out")])[1],
        "its tokenizer (tokenizer.json) differs from the one recorded in") for key in ("compressed", "onnx")],
    Case("serve: an ONNX folder with a foreign tokenizer", lambda m, t: (
        put_foreign_tokenizer(copy(m, "onnx", t, "m"), m["env"]["corpus"]),
        ["serve", str(t / "m"), "--port", "9"])[1], "differs from the one recorded in export.json"),
    # issue 53, case 7: tracebacks, and the minor cases
    Case("train --data teacher:²", lambda m, t: train(m, t, "--data", "teacher:²"),
         "teacher:N needs a whole number of tokens from 1 to 100,000,000"),
    Case("eval --domains teacher:²", lambda m, t: ["eval", str(m["compressed"]), "--ppl", "--domains", "teacher:²",
                                                   "--report", str(t / "out")],
         "--domains teacher:²: teacher:N needs"),
    Case("train --data teacher:1000000000000", lambda m, t: train(m, t, "--data", "teacher:1000000000000"),
         "teacher:N needs a whole number of tokens from 1 to 100,000,000"),
    Case("train --data builtin:-1 is printed as written", lambda m, t: train(m, t, "--data", "builtin:-1"),
         "--data builtin:-1:"),
    Case("--report with a 300-byte name", lambda m, t: ["eval", str(m["compressed"]), "--ppl", "--report",
                                                      str(t / ("a" * 300 + ".json"))],
         "a name in this path (305 bytes) is longer than the file system allows"),
    Case("--data with a 300-byte name", lambda m, t: train(m, t, "--data", str(t / ("a" * 300))),
         "a name in this path (300 bytes) is longer than the file system allows"),
    Case("a model folder with a 300-byte name", lambda m, t: ["eval", str(t / ("a" * 300)), "--ppl"],
         "is longer than the file system allows"),
    Case("bench --genai-precisions fp32,fp32", lambda m, t: [
        "bench", str(m["compressed"]), "--runtime", "genai", "--genai-precisions", "fp32,fp32",
        "--out", str(t / "out")],
         "--genai-precisions fp32,fp32: fp32 given twice"),
    Case("export genai --precision fp32 --quant gptq", lambda m, t: [
        "export", "genai", str(m["compressed"]), "--precision", "fp32", "--quant", "gptq", "--out", str(t / "out")],
        "--quant gptq: rounds quantised graphs only"),
    Case("export genai --precision int8 --head-bits 4", lambda m, t: [
        "export", "genai", str(m["compressed"]), "--precision", "int8", "--head-bits", "4", "--out", str(t / "out")],
        "--head-bits 4: sets the LM head's bits of an int4 graph; at --precision int8"),
    # issue 51, part 1: a form the registry lacks, or one declared inconsistently, was loaded as dense (random)
    *[Case(f"{cmd}: config.json declares an unknown form", lambda m, t, cmd=cmd: (
        edit_forms(copy(m, "compressed", t, "m"), lambda spec: {"form": "sparse24"}),
        [*cmd.split(), str(t / "m"), "--out", str(t / "out")] if cmd != "eval"
        else ["eval", str(t / "m"), "--ppl", "--report", str(t / "out")])[1],
        "unknown form 'sparse24' (bdlora knows dense, lowrank, channels, groups, vocab)")
      for cmd in ("eval", "export onnx", "export hf")],
    Case("train diverges (--lr 1e30)", lambda m, t: train(m, t, "--lr", "1e30"), "lower --lr (now 1e+30); ", code=1),
    Case("train: a teacher with NaN weights", nan_teacher, "on the calibration tokens are not finite"),
    Case("train: a teacher with NaN weights, the paper's zero start", lambda m, t: [
        *nan_teacher(m, t), "--lora-init", "zero", "--allocation", "cost"], "its outputs are not finite"),  # the
    # teacher's held-out perplexity, before the run folder exists (it failed "before any update" at step 0 before)
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error_contract(made, tmp_path, case):
    argv = case.build(made, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == case.code, (argv, res.output)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and case.needle in err, err
    for rel in case.absent:
        assert not (tmp_path / rel).exists(), f"{rel} was written"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing changed or added
    for rel, content in case.kept.items():
        assert (tmp_path / rel).read_text() == content


def test_a_failed_run_frees_its_out_or_keeps_its_checkpoints(made, tmp_path):
    """Divergence with no checkpoint removes the folder (``--out`` is reusable); after a checkpoint the folder is
    kept and marked failed, and ``--resume`` removes the mark."""
    argv = train(made, tmp_path, "--lr", "1e30")
    assert CliRunner().invoke(app, argv).exit_code == 1
    assert not (tmp_path / "out").exists()
    res = CliRunner().invoke(app, argv + ["--save-every", "1"])
    assert res.exit_code == 1 and "kept with its checkpoints and marked failed (failed.json)" in res.stderr
    failed = json.loads((tmp_path / "out" / "failed.json").read_text())
    assert failed["step"] == 1 and "loss became nan" in failed["error"]
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["step-00000001"]


# --------------------------------------------------------------------------------------------------------------------
# By construction: every numeric option of every command refuses a non-finite or out-of-range value in one line
# --------------------------------------------------------------------------------------------------------------------


def numeric_options(command_path):
    """(flag, is_int) of every int/float option of ``bdlora COMMAND`` as the parser sees it."""
    import typer.main

    cmd = typer.main.get_command(app)
    for part in command_path.split():
        cmd = cmd.commands[part]
    for p in cmd.params:
        if not (p.opts and p.opts[0].startswith("--")):
            continue
        ann = getattr(getattr(p, "type_descriptor", None), "annotation", None)  # typer >= 0.24
        if ann is None:  # older typers: click's parameter types
            ann = {"integer": int, "float": float}.get(getattr(getattr(p, "type", None), "name", ""))
        ann = next((a for a in typing.get_args(ann) if a is not type(None)), ann)  # Optional[X] -> X
        if ann in (int, float):
            yield p.opts[0], ann is int


PARSED = {  # parser command -> argv writing its output at OUT
    "train": OUT_WRITERS["train"], "compress": OUT_WRITERS["compress"], "export onnx": OUT_WRITERS["export onnx"],
    "export genai": lambda m, o: ["export", "genai", str(m["compressed"]), "--out", o],
    "bench": OUT_WRITERS["bench"], "eval": OUT_WRITERS["eval --report"],
    "plan": lambda m, o: ["plan", "--model-config", str(m["env"]["teacher"]), "--json"],
    "loadtest": lambda m, o: ["loadtest", "http://127.0.0.1:9", "--report", o],  # refused before connecting
    "sweep": lambda m, o: ["sweep", "--teacher", str(m["env"]["teacher"]), "--data", str(m["env"]["corpus"]),
                           "--out", o],
}
NUMERIC = [(c, flag, is_int) for c in PARSED for flag, is_int in numeric_options(c)]


def test_every_command_has_numeric_options_to_check():
    found = {c: [f for cc, f, _ in NUMERIC if cc == c] for c in PARSED}
    assert all(found.values()), found
    assert "--lr" in found["train"] and "--threads" in found["bench"] and "--eps-lr" in found["compress"]


@pytest.mark.parametrize("command,flag,value", [(c, f, v) for c, f, is_int in NUMERIC
                                                for v in (["nan"] if is_int else ["nan", "inf", "-inf"])],
                         ids=lambda x: str(x))
def test_non_finite_values_are_one_line(made, tmp_path, command, flag, value):
    """NaN and infinities are never a valid setting: every float option of every command names itself and exits 2
    before writing anything; every integer option refuses them at parse time, in one line too. The list of options
    is read from the parser, so a new option is covered without a new test."""
    res = CliRunner().invoke(app, [*PARSED[command](made, str(tmp_path / "out")), flag, value])
    assert res.exit_code == 2, (flag, value, res.output)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "out").exists()


TRAIN_RANGES = {  # option -> (allowed?, value strategy): the documented contract of `bdlora train`
    "--budget": (lambda v: 0 <= v <= 1, st.floats(-2, 3)),
    "--retention-ema": (lambda v: 0 <= v < 1, st.floats(-1, 2)),
    "--lora-alpha": (lambda v: v > 0, st.floats(-10, 10)),
    "--weight-decay": (lambda v: v >= 0, st.floats(-1, 1)),
    "--temperature": (lambda v: v > 0, st.floats(-5, 5)),
}


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_train_validation_agrees_with_the_documented_ranges(data):
    """For any value, `train`'s validation refuses exactly the values outside the documented range, in one line
    naming the option (checked on the config, which every flag and YAML value goes through)."""
    from bdlora.base.errors import ConfigError
    from bdlora.train.config import TrainConfig

    flag = data.draw(st.sampled_from(sorted(TRAIN_RANGES)))
    allowed, values = TRAIN_RANGES[flag]
    v = data.draw(values)
    cfg = TrainConfig(**{flag[2:].replace("-", "_"): v})
    try:
        cfg.validate()
        ok = True
    except ConfigError as e:
        ok = False
        assert flag in str(e) and len(str(e).splitlines()) == 1, str(e)
    assert ok == allowed(v), (flag, v)
    assert math.isfinite(v)


def test_every_artefact_file_is_readable_by_others(made, tiny_env):
    """Weights included: safetensors and transformers may create files 0600, which a shared folder cannot use."""
    import stat

    from bdlora.base.io import _UMASK

    folders = [made["run"], made["compressed"], made["onnx"]]
    files = [p for f in folders for p in f.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files) and any(p.suffix == ".onnx" for p in files)
    modes = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~_UMASK)}, modes


# --------------------------------------------------------------------------------------------------------------------
# One writer per output (issue 53, case 1): two commands writing one new --out both printed "wrote" and exited 0,
# and one output vanished
# --------------------------------------------------------------------------------------------------------------------


class Holder:
    """Another live process holding the claim on ``path``, as a command writing it does (until ``release``)."""

    def __init__(self, path: Path):
        import subprocess
        import sys

        code = ("import sys; from bdlora.base.io import claim; claim(sys.argv[1]); print('held', flush=True); "
                "sys.stdin.read()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.mark.parametrize("cmd", [c for c in OUT_WRITERS if c != "train"] + ["export genai"])
def test_an_output_another_command_is_writing_is_refused_before_any_work(made, tmp_path, cmd):
    writers = {**OUT_WRITERS, "export genai": PARSED["export genai"]}
    out = tmp_path / "out"
    holder = Holder(out)
    try:
        res = CliRunner().invoke(app, writers[cmd](made, str(out)))
        assert res.exit_code == 2, res.output
        err = res.stderr.strip()
        assert len(err.splitlines()) == 1 and f"{out}: another bdlora command (pid {holder.proc.pid} on" in err, err
        assert "is writing it now" in err and not out.exists()
    finally:
        holder.release()
    assert not (tmp_path / ".out.lock").exists()  # the holder's lock file went with it


def test_two_commands_writing_one_new_output_at_once_leave_one_whole_winner(made, tmp_path):
    """The case as reported: ``compress RUN --out X --eps-lr 0.7 & compress RUN --out X --eps-lr 0.3``. Whatever the
    timing, exactly one writes X (the other is refused while the first writes, or finds X written) and X is that
    one's output."""
    import subprocess
    import sys

    out = tmp_path / "x"
    argv = [[sys.executable, "-m", "bdlora.cli", "compress", str(made["run"]), "--no-eval", "--svd-max-rank", "8",
             "--out", str(out), "--eps-lr", eps] for eps in ("0.7", "0.3")]
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argv]
    done = [(p.wait(300), *p.communicate()) for p in procs]
    assert sorted(code for code, _, _ in done) == [0, 2], done
    (winner,) = [eps for (code, _, _), eps in zip(done, (0.7, 0.3)) if code == 0]
    (loser_err,) = [err for code, _, err in done if code == 2]
    assert len(loser_err.strip().splitlines()) == 1 and "Traceback" not in loser_err, loser_err
    assert "is writing it now" in loser_err or "exists and is not empty" in loser_err, loser_err
    report = json.loads((out / "compression.json").read_text())
    assert report["thresholds"]["eps_lr"] == winner, report.get("thresholds")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no temp or lock left beside it


def test_two_runs_started_in_the_same_second_get_two_folders(tmp_path, monkeypatch):
    from datetime import datetime

    from bdlora.base import runs

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(runs, "datetime", Frozen)
    made = [runs.RunDir.new("budgeted", tmp_path).path for _ in range(3)]
    assert [p.name for p in made] == ["20260102-030405-budgeted", "20260102-030405-budgeted-1",
                                      "20260102-030405-budgeted-2"]
    assert all(p.is_dir() for p in made)


def test_a_folder_whose_path_reads_as_markup_is_evaluated(made, tmp_path):
    """Issue 53, case 7: a model folder whose path contains ``[/]`` was a rich MarkupError (eval could not run)."""
    folder = copy(made, "compressed", tmp_path / "a[", "]b")
    res = CliRunner().invoke(app, ["eval", str(folder), "--ppl", "--report", str(tmp_path / "e.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "e.json").read_text())["ppl"]["val_ppl"] > 1.0


def test_train_refuses_an_out_inside_a_model_folder_before_loading_anything(made, tmp_path, monkeypatch):
    """Issue 53, minor: ``train --out`` inside a compressed folder was refused only after the teacher had loaded and
    the start was calibrated (~40 s)."""
    from bdlora.train import loop as train_module

    def never(*args, **kwargs):
        raise AssertionError("the teacher was loaded before --out was checked")

    monkeypatch.setattr(train_module, "prepare", never)
    folder = copy(made, "compressed", tmp_path)
    res = CliRunner().invoke(app, train_args(made["env"], folder / "run", "--max-steps", "1"))
    assert res.exit_code == 2 and "is inside the model/run folder" in res.stderr, res.output


def test_loadtest_counts_a_server_answering_nonsense_as_failures(tmp_path):
    """Issue 53, case 7: a server answering ``"completion_tokens": "lots"`` was a TypeError traceback."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Liar(BaseHTTPRequestHandler):
        def _answer(self, doc):
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            self._answer({"object": "list", "data": [{"id": "m"}]})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._answer({"choices": [{"text": "x"}], "usage": {"completion_tokens": "lots"}})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        res = CliRunner().invoke(app, ["loadtest", url, "--concurrency", "1", "--requests", "3", "--max-tokens", "2",
                                       "--report", str(tmp_path / "l.json")])
    finally:
        server.shutdown()
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    rows = json.loads((tmp_path / "l.json").read_text())["results"]
    assert rows[0]["failures"] == 3 and "completion_tokens is not a whole number" in rows[0]["first_failure"]


def test_a_low_rank_declaration_its_tensors_contradict_is_refused(tiny_model, tiny_env, tmp_path):
    """A low-rank module declared with another rank than its tensors hold (or none) is refused in one line."""
    from bdlora.base.errors import ModelError
    from bdlora.deployed.folder import save_model_folder
    from bdlora.models.integrity import check_model_folder
    from conftest import compressed_student

    _, model, report = compressed_student(tiny_model, [0.0, 1.0, 0.2], seed=1)
    folder = save_model_folder(model, tiny_env["tokenizer"], tmp_path / "m", report)
    cfg = json.loads((folder / "config.json").read_text())
    name, spec = next((n, s) for n, s in cfg["bdlora_modules"].items() if s["form"] == "lowrank")
    for bad, needle in ((spec["rank"] + 1, f"is declared lowrank with rank {spec['rank'] + 1}, but its proj_in holds"),
                        (0, "is declared lowrank with rank 0 (a positive integer)"),
                        ("4", "is declared lowrank with rank '4' (a positive integer)")):
        cfg["bdlora_modules"][name] = {**spec, "rank": bad}
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelError, match=re.escape(needle)):
            check_model_folder(folder, json.loads((folder / "compression.json").read_text()))
