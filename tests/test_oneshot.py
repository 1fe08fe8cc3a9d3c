"""``bdlora compress SOURCE --one-shot --mac-ratio R`` (issue 29): a training-free compressed folder that meets its
ratio, whose weights are exactly the allocated factors, that every reader (eval, export, bench) takes, with
one-line errors for bad input; and ``plan --allocation quality`` shows the structure before any training."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from bdlora.cli import app


def shot_args(env, out, *extra):
    return ["compress", str(env["teacher"]), "--one-shot", "--data", str(env["corpus"]), "--cache-dir",
            str(env["cache"]), "--seq-len", "32", "--calib-tokens", "512", "--eval-tokens", "512",
            "--heldout-fraction", "0.1", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def shot(tiny_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("oneshot") / "shot"
    res = CliRunner().invoke(app, shot_args(tiny_env, out, "--mac-ratio", "1.5", "--json"))
    assert res.exit_code == 0, res.output
    return out, json.loads(res.stdout)


def test_one_shot_meets_its_ratio_and_its_weights_are_the_allocated_factors(tiny_env, shot):
    from transformers import AutoModelForCausalLM

    out, report = shot
    assert report["source"] == "compress --one-shot" and report["provenance"]["mac_ratio"] == 1.5
    assert report["speedup_vs_dense"] >= 1.5 and report["provenance"]["calib_tokens"] == 512
    assert json.loads((out / "compression.json").read_text())["speedup_vs_dense"] == report["speedup_vs_dense"]
    teacher = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32)
    src = dict(teacher.named_parameters())
    got = load_file(str(out / "model.safetensors"))
    low = {m["name"]: m for m in report["modules"] if m["form"] == "lowrank"}
    kept = [m["name"] for m in report["modules"] if m["case"] == "kept"]
    pruned = {m["name"]: m for m in report["modules"] if m["case"] == "pruned"}
    assert low and kept and pruned, "1.5x on this teacher (default forms) keeps, factors and narrows"
    assert len(low) + len(kept) + len(pruned) == len(report["modules"])
    for name, m in pruned.items():  # gate and up keep a subset of the source's rows; down is refitted to them
        w, s = got[f"{name}.weight"], src[f"{name}.weight"].detach()
        if name.endswith("down_proj"):
            assert w.shape == (s.shape[0], m["channels"])
        else:
            assert w.shape == (m["channels"], s.shape[1])
            assert all(any(torch.equal(r, t) for t in s) for r in w), name
    for name in kept:  # a dense projection is the source's, bit for bit
        assert torch.equal(got[f"{name}.weight"], src[f"{name}.weight"]), name
    for name, m in low.items():  # a factored one is rank r and no better than the source in the plain norm
        a, b = got[f"{name}.proj_in.weight"], got[f"{name}.proj_out.weight"]
        assert a.shape[0] == b.shape[1] == m["lora_rank"]
        w = src[f"{name}.weight"].detach()
        assert torch.linalg.matrix_rank(b @ a) <= m["lora_rank"] and (b @ a - w).norm() > 0
    # the non-projection weights are the source's
    for k, v in got.items():
        if ".self_attn." not in k and ".mlp." not in k:
            assert torch.equal(v, src[k].detach()), k
    ev = report["eval"]
    assert ev["compressed_val_ppl"] > ev["student_val_ppl"] > 1.0 and ev["tokens"] == 512


def test_every_reader_takes_the_one_shot_folder(tiny_env, shot, tmp_path):
    """eval scores the same slice the report did (from the folder's provenance); export onnx and bench run it."""
    out, report = shot
    res = CliRunner().invoke(app, ["eval", str(out), "--ppl", "--report", str(tmp_path / "eval.json")])
    assert res.exit_code == 0, res.output
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert ev["data"]["data"] == str(tiny_env["corpus"]) and ev["data"]["seq_len"] == 32
    assert ev["data"]["source"] == "the --one-shot options"
    assert ev["ppl"]["val_ppl"] == pytest.approx(report["eval"]["compressed_val_ppl"], rel=1e-5)
    res = CliRunner().invoke(app, ["export", "onnx", str(out), "--out", str(tmp_path / "shot.onnx")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "shot.onnx" / "export.json").read_text())
    res = CliRunner().invoke(app, ["bench", str(out), "--scope", "model", "--batch-sizes", "1", "--seq-lens", "16",
                                   "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "bench")])
    assert res.exit_code == 0, res.output


def test_higher_ratios_cost_quality_monotonically(tiny_env, tmp_path):
    ppl = []
    for r in ("1.2", "2.0"):
        res = CliRunner().invoke(app, shot_args(tiny_env, tmp_path / r, "--mac-ratio", r, "--json"))
        assert res.exit_code == 0, res.output
        rep = json.loads(res.stdout)
        assert rep["speedup_vs_dense"] >= float(r)
        ppl.append(rep["eval"]["compressed_val_ppl"])
    assert ppl[0] < ppl[1]


@pytest.mark.parametrize("extra, needle, code", [
    ([], "--mac-ratio: --one-shot needs the projection-MAC speed-up", 2),
    (["--mac-ratio", "0.5"], "--mac-ratio 0.5:", 2),
    (["--mac-ratio", "1000"], "--mac-ratio 1000", 2),
    (["--mac-ratio", "1.5", "--calib-tokens", "100000000"], "--calib-tokens 100000000: the training split holds", 2),
    (["--mac-ratio", "1.5", "--streaming", "sometimes"],
     "--streaming 'sometimes': unknown (allowed: auto, on, off)", 2),
])
def test_one_shot_bad_input_is_one_line_and_writes_nothing(tiny_env, tmp_path, extra, needle, code):
    res = CliRunner().invoke(app, shot_args(tiny_env, tmp_path / "out", *extra))
    assert res.exit_code == code, res.output
    err = res.stderr.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in res.output, err
    assert not (tmp_path / "out").exists()


def test_one_shot_options_need_one_shot_and_a_source(tiny_env, tmp_path):
    res = CliRunner().invoke(app, ["compress", "--mac-ratio", "1.5", "--runs-dir", str(tmp_path)])
    assert res.exit_code == 2 and "--mac-ratio: options of --one-shot" in res.stderr, res.output
    res = CliRunner().invoke(app, ["compress", "--one-shot", "--mac-ratio", "1.5"])
    assert res.exit_code == 2 and "--one-shot: name the pretrained model to compress" in res.stderr, res.output


def test_plan_shows_the_quality_structure_before_training(tiny_env):
    res = CliRunner().invoke(app, ["plan", "--model", str(tiny_env["teacher"]), "--allocation", "quality",
                                   "--mac-ratio", "1.5", "--lora-rank", "8", "--calib-tokens", "512", "--data",
                                   str(tiny_env["corpus"]),
                                   "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["source"] == "plan --allocation quality" and rep["speedup_vs_dense"] >= 1.5
    ranks = {m["lora_rank"] for m in rep["modules"] if m["case"] != "kept"}
    assert len(ranks) > 1, "per-module ranks, not one fixed rank"
