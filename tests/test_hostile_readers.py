"""Hostile inputs to the readers that plan from shapes alone (plan FOLDER, plan/bench --model-config): refused in one
line naming the bad field, before any graph is built or memory allocated; plan FOLDER runs the integrity checks of
every other reader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from bdlora.cli import app

PAPER = {"model_type": "mistral", "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
         "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 12, "vocab_size": 32000}


def _one_line_refusal(res, needle: str) -> None:
    assert res.exit_code == 2, res.output
    assert needle in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


@pytest.fixture(scope="module")
def shot(tiny_env, tmp_path_factory):
    """A one-shot compressed folder of the tiny teacher (its compression.json is what plan FOLDER reads)."""
    out = tmp_path_factory.mktemp("hostile-plan") / "shot"
    res = CliRunner().invoke(app, ["compress", str(tiny_env["teacher"]), "--one-shot", "--data",
                                   str(tiny_env["corpus"]), "--calib-tokens", "512", "--mac-ratio", "1.3", "--no-eval",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def _edited(shot, tmp_path, edit) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(shot, folder)
    report = json.loads((folder / "compression.json").read_text())
    edit(report)
    (folder / "compression.json").write_text(json.dumps(report))
    return str(folder)


def _prov(**kv):
    def edit(r):
        r.setdefault("provenance", {}).update(kv)
    return edit


@pytest.mark.parametrize("edit,needle", [
    (_prov(layer_indices=[0, 10 ** 9]), "provenance layer_indices [0, 1000000000] are not distinct increasing"),
    # issue 78 case 11: without teacher_layers, [0, 511] had plan measuring a 512-layer step (90 s and more)
    (_prov(layer_indices=[0, 511], teacher_layers=None), "provenance layer_indices [0, 511] are not distinct "
                                                         "increasing layers in 0..15"),
    (_prov(teacher_layers=10 ** 6), "provenance teacher_layers 1000000 is not a layer count in 1..512"),
    (_prov(layer_indices=["a", 3]), "provenance layer_indices ['a', 3]"),
    (lambda r: r.pop("modules"), "no modules list"),
    (lambda r: r.update(speedup_vs_dense="fast"), "speedup_vs_dense 'fast' is not a positive number"),
    (lambda r: r["modules"][0].update(in_features=-3), "in_features -3 is not a positive integer"),
])
def test_plan_refuses_an_edited_compression_report_before_any_work(shot, tmp_path, monkeypatch, edit, needle):
    """Before: layer_indices [0, 1e9] or teacher_layers 1e6 had plan build 137- and 274-layer synthetic graphs
    (1.7 GB, still running at 90 s); other edits raised TypeError/KeyError/ValueError tracebacks."""
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(app, ["plan", _edited(shot, tmp_path, edit), "--precision", "int4"])
    _one_line_refusal(res, needle)
    assert not (tmp_path / "cache").exists()  # nothing measured, nothing cached


def test_plan_runs_the_checks_every_other_reader_runs(shot, tmp_path):
    """An unknown form in config.json (eval, export and bench refuse it) passed plan with exit 0."""
    folder = tmp_path / "damaged"
    shutil.copytree(shot, folder)
    cfg = json.loads((folder / "config.json").read_text())
    site = next(iter(cfg["bdlora_modules"]))
    cfg["bdlora_modules"][site] = {**cfg["bdlora_modules"][site], "form": "chanels"}
    (folder / "config.json").write_text(json.dumps(cfg))
    _one_line_refusal(CliRunner().invoke(app, ["plan", str(folder)]), "chanels")
    assert CliRunner().invoke(app, ["plan", str(shot)]).exit_code == 0


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", 10 ** 7, "hidden_size 10,000,000 is above 32,768"),
    ("intermediate_size", 10 ** 9, "intermediate_size 1,000,000,000 is above 262,144"),
    ("vocab_size", 10 ** 9, "vocab_size 1,000,000,000 is above 1,048,576"),
    ("hidden_size", 256.5, "hidden_size 256.5 (must be a positive integer)"),
    ("hidden_size", "256", "hidden_size '256' (must be a positive integer)"),
    ("hidden_size", None, "hidden_size None (must be a positive integer)"),
    ("num_attention_heads", -4, "num_attention_heads -4 (must be a positive integer)"),
    ("num_key_value_heads", 3, "num_key_value_heads 3 must divide num_attention_heads"),
])
@pytest.mark.parametrize("command", ["plan", "bench"])
def test_shape_configs_are_bounded_before_anything_is_allocated(tmp_path, monkeypatch, command, field, value, needle):
    """Before: plan --model-config with hidden 1e7 was still measuring at 150 s (and ignored SIGTERM); bench tried
    to allocate 40 GB to 1 TB, or raised TypeError / an onnxruntime Reshape dump."""
    monkeypatch.setenv("BDLORA_CACHE", str(tmp_path / "cache"))
    cfg = {**PAPER, field: value} if value is not None else {k: v for k, v in PAPER.items() if k != field}
    if field == "num_key_value_heads":
        cfg["num_attention_heads"] = 4
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    args = ["plan", "--model-config", str(path), "--precision", "int4"] if command == "plan" else [
        "bench", "--model-config", str(path), "--budget", "0.4", "--out", str(tmp_path / "b")]
    _one_line_refusal(CliRunner().invoke(app, args), needle)
    assert not (tmp_path / "b").exists() and not (tmp_path / "cache").exists()


def test_a_nan_weight_is_refused_by_eval_and_export_never_reported(shot, tmp_path):
    """Before: one NaN weight (digests refreshed) gave "held-out perplexity: nan" with exit 0, and the exporters
    validated "max |ONNX-torch| inf (tolerance inf)" and wrote the folder."""
    from safetensors.torch import load_file, save_file

    from bdlora.models.integrity import DIGEST_KEY, digests

    folder = tmp_path / "nan"
    shutil.copytree(shot, folder)
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("q_proj.weight") or k.endswith("proj_in.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    report = json.loads((folder / "compression.json").read_text())
    report[DIGEST_KEY] = digests(folder)  # a consistent folder: only the value is wrong
    (folder / "compression.json").write_text(json.dumps(report))
    res = CliRunner().invoke(app, ["eval", str(folder), "--ppl", "--report", str(tmp_path / "e.json")])
    assert res.exit_code != 0 and "hold NaN or infinity" in res.stderr, res.output  # refused on load now
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "e.json").exists()
    res = CliRunner().invoke(app, ["export", "onnx", str(folder), "--out", str(tmp_path / "g")])  # head dim 8
    assert res.exit_code != 0 and "hold NaN or infinity" in res.stderr, res.output
    assert not (tmp_path / "g").exists()


def _rope_minus_one(cfg):
    if "rope_parameters" in cfg and isinstance(cfg["rope_parameters"], dict):
        cfg["rope_parameters"]["rope_theta"] = -1
    else:
        cfg["rope_theta"] = -1


@pytest.mark.parametrize("edit,needle", [
    (_rope_minus_one, "rope_theta -1 (must be a positive number)"),
    (lambda c: c.update(sliding_window=-5), "sliding_window -5 (must be a positive integer or null)"),
    (lambda c: c.update(rms_norm_eps=float("nan")), "rms_norm_eps nan (must be a positive number)"),
])
@pytest.mark.parametrize("command", ["eval", "export", "train"])
def test_config_values_the_architecture_reads_are_checked_by_every_reader(shot, tiny_env, tmp_path, edit, needle,
                                                                          command):
    """Before: rope_theta -1 gave "perplexity: nan" (exit 0) and a rotary-table traceback in export; sliding_window
    -5 scored 805.5 in PyTorch and 124.6 in the runtime on the same folder, and train --student-init started."""
    folder = tmp_path / "edited"
    shutil.copytree(shot, folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    args = {"eval": ["eval", str(folder), "--ppl"],
            "export": ["export", "onnx", str(folder), "--out", str(tmp_path / "o")],
            "train": ["train", "--teacher", str(tiny_env["teacher"]), "--student-init", str(folder), "--data",
                      str(tiny_env["corpus"]), "--method", "kd-lora", "--max-steps", "1", "--out",
                      str(tmp_path / "t")]}[command]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and needle in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()


def test_a_weight_stored_as_int8_is_refused(shot, tmp_path):
    """Before: an int8 tensor (digests refreshed) loaded and scored 566.9 against 124.6, exit 0."""
    from safetensors.torch import load_file, save_file

    from bdlora.models.integrity import DIGEST_KEY, digests

    folder = tmp_path / "int8"
    shutil.copytree(shot, folder)
    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].to(torch.int8)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    report = json.loads((folder / "compression.json").read_text())
    report[DIGEST_KEY] = digests(folder)
    (folder / "compression.json").write_text(json.dumps(report))
    res = CliRunner().invoke(app, ["eval", str(folder), "--ppl"])
    assert res.exit_code == 2 and f"tensor {name} is stored as I8, not F32 / F16 / BF16" in res.stderr, res.output


@pytest.mark.parametrize("dangling", [False, True])
def test_an_out_that_is_a_symbolic_link_is_refused_before_any_work(shot, tmp_path, dangling):
    """Before: export --out LINK --force ran the whole export, then "Cannot call rmtree on a symbolic link"."""
    target = tmp_path / "real"
    if not dangling:
        assert CliRunner().invoke(app, ["export", "onnx", str(shot), "--out", str(target)]).exit_code == 0
    link = tmp_path / "link"
    link.symlink_to(target)
    before = sorted(p.name for p in target.iterdir()) if not dangling else None
    res = CliRunner().invoke(app, ["export", "onnx", str(shot), "--out", str(link), "--force"])
    _one_line_refusal(res, f"--out {link}: is a symbolic link (to {target})")
    assert link.is_symlink() and (dangling or sorted(p.name for p in target.iterdir()) == before)


def test_train_student_init_runs_the_folder_checks_eval_and_export_run(shot, tiny_env, tmp_path):
    """Before: train --student-init on a folder declaring a projection at 16 bits started training (eval and export
    refused it)."""
    folder = tmp_path / "bits16"
    shutil.copytree(shot, folder)
    cfg = json.loads((folder / "config.json").read_text())
    site = next(iter(cfg["bdlora_modules"]))
    cfg["bdlora_modules"][site] = {**cfg["bdlora_modules"][site], "bits": 16}
    (folder / "config.json").write_text(json.dumps(cfg))
    evaluated = CliRunner().invoke(app, ["eval", str(folder), "--ppl"])
    assert evaluated.exit_code == 2, evaluated.output
    res = CliRunner().invoke(app, ["train", "--teacher", str(tiny_env["teacher"]), "--student-init", str(folder),
                                   "--data", str(tiny_env["corpus"]), "--method", "kd-lora", "--max-steps", "1",
                                   "--out", str(tmp_path / "t")])
    assert res.exit_code == 2 and evaluated.stderr.strip().split(": ", 1)[-1] in res.stderr, res.output
    assert not (tmp_path / "t").exists()


def test_exports_report_the_folders_own_mac_speedup_and_bench_refuses_a_self_peer(shot, tmp_path):
    """Before: a 1.30x channels folder exported as "MAC speed-up of the projections vs dense 1.00x" (its pruned MLPs
    were their own dense baseline), and `bench X --peer X` accepted a student as its own peer."""
    report = json.loads((shot / "compression.json").read_text())
    assert any(m.get("channels") for m in report["modules"])  # the fixture prunes MLP channels
    res = CliRunner().invoke(app, ["export", "onnx", str(shot), "--out", str(tmp_path / "o"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    found = [v for k, v in _walk(summary) if k == "mac_speedup_vs_dense"]
    assert found and all(v == pytest.approx(report["speedup_vs_dense"], rel=1e-6) for v in found), found
    res = CliRunner().invoke(app, ["bench", str(shot), "--runtime", "genai", "--peer", str(shot), "--out",
                                   str(tmp_path / "b")])
    _one_line_refusal(res, f"--peer {shot}: is the benched folder itself")
    assert not (tmp_path / "b").exists()


def _walk(doc):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _walk(v)


def _refreshed(folder) -> None:
    """compression.json's digests recomputed: a consistent folder whose config or weights alone are wrong."""
    from bdlora.models.integrity import DIGEST_KEY, digests

    report = json.loads((folder / "compression.json").read_text())
    report[DIGEST_KEY] = digests(folder)
    (folder / "compression.json").write_text(json.dumps(report))


def _undeclared_pruned_site(folder) -> str:
    """A pruned (channels) site other than layer 0's loses its config declaration: the architecture then builds it
    dense at the full width while the file holds its kept channels."""
    cfg = json.loads((folder / "config.json").read_text())
    site = next(s for s, spec in sorted(cfg["bdlora_modules"].items())
                if spec.get("form") == "channels" and not s.startswith("model.layers.0."))
    del cfg["bdlora_modules"][site]
    (folder / "config.json").write_text(json.dumps(cfg))
    return f"{site}.down_proj.weight"  # the first of its tensors in name order


def _short_norm(folder) -> str:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = "model.layers.1.post_attention_layernorm.weight"
    weights[name] = weights[name][:-1].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    _refreshed(folder)
    return name


@pytest.mark.parametrize("damage", [_undeclared_pruned_site, _short_norm])
def test_a_tensor_whose_shape_the_config_does_not_declare_is_named(shot, tmp_path, damage):
    """Before: "could not load the model (You set `ignore_mismatched_sizes`... see the above report!)", naming no
    tensor, from eval, export and bench alike."""
    folder = tmp_path / "damaged"
    shutil.copytree(shot, folder)
    name = damage(folder)
    for args in (["eval", str(folder), "--ppl"], ["export", "onnx", str(folder), "--out", str(tmp_path / "o")]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and f"tensor {name} is " in res.stderr, res.output
        assert len(res.stderr.strip().splitlines()) == 1 and "ignore_mismatched_sizes" not in res.stderr
    assert not (tmp_path / "o").exists()
