"""The fifth round of hostile inputs (issue 89) on the streamed paths: each case as its user met it, refused in one
line before the work it would waste, or read as transformers reads it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from bdlora.cli import app

DOWN = "model.layers.1.mlp.down_proj.weight"


def _one_line(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    return " ".join(r.output.split())


def _sharded(teacher, folder, index: bool = True):
    """The teacher's weights in two shards (layer 0 and the embedding in the first, the rest in the second), with
    the index transformers reads, and a stray ``zz-backup.safetensors`` holding one of its tensors as zeros."""
    shutil.copytree(teacher, folder)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    first = {k: v for k, v in weights.items() if "layers.0." in k or "embed" in k}
    second = {k: v for k, v in weights.items() if k not in first}
    save_file(first, str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    if index:
        where = {**{k: "model-00001-of-00002.safetensors" for k in first},
                 **{k: "model-00002-of-00002.safetensors" for k in second}}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))
    save_file({DOWN: torch.zeros_like(weights[DOWN])}, str(folder / "zz-backup.safetensors"),
              metadata={"format": "pt"})
    return weights


def test_a_stray_shard_beside_an_index_is_not_read(tiny_env, tmp_path):
    """Case 1: every ``*.safetensors`` was read and the last file won: a stray backup's zeros replaced layer 1's
    down projection in the streamed export, rc 0. The index is followed, as transformers follows it: the exported
    weight is the shard's."""
    from onnx import load
    from onnx.numpy_helper import to_array

    from bdlora.models.integrity import check_loadable, weight_files
    from bdlora.models.stream import FolderWeights
    from conftest import genai_teacher

    genai_teacher(tiny_env["tokenizer"], tmp_path / "teacher")
    tiny_env["tokenizer"].save_pretrained(tmp_path / "teacher")
    folder = tmp_path / "sharded"
    weights = _sharded(tmp_path / "teacher", folder)
    assert [p.name for p in weight_files(folder)] == ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]
    check_loadable(folder)
    assert torch.equal(FolderWeights(folder).read(DOWN), weights[DOWN])
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--streaming", "on", "--no-validate", "--out",
                                 str(tmp_path / "g")])
    assert r.exit_code == 0, r.output
    graph = load(str(tmp_path / "g" / "model.onnx"))
    down = next(t for t in graph.graph.initializer if t.name == "/model/layers.1/mlp/down_in.weight")
    assert torch.equal(torch.from_numpy(to_array(down, str(tmp_path / "g"))), weights[DOWN].T)


def test_a_tensor_in_two_files_without_an_index_is_refused(tiny_env, tmp_path):
    """Case 1, without an index: which file holds the model's tensor is not known; one line naming both files,
    exit 2, before anything is written."""
    folder = tmp_path / "two"
    _sharded(tiny_env["teacher"], folder, index=False)
    for argv in (["export", "genai", str(folder), "--streaming", "on", "--no-validate"],
                 ["export", "genai", str(folder), "--streaming", "off", "--no-validate"]):
        r = CliRunner().invoke(app, [*argv, "--out", str(tmp_path / "g")])
        said = _one_line(r)
        assert f"tensor '{DOWN}' is in both model-00002-of-00002.safetensors and zz-backup.safetensors" in said
        assert "model.safetensors.index.json" in said and not (tmp_path / "g").exists()


@pytest.mark.parametrize("damage,needle", [
    ({"weight_map": {DOWN: "../elsewhere.safetensors"}}, "a file outside the folder"),
    ({"weight_map": {DOWN: "model-00009-of-00009.safetensors"}}, "which is not in the folder (a missing shard)"),
    ({"weight_map": []}, "not a sharded checkpoint's index"),
    ({"weight_map": {DOWN: "zz-backup.safetensors", "model.norm.weight": "zz-backup.safetensors"}},
     "maps 'model.norm.weight' to zz-backup.safetensors, which does not hold it"),
])
def test_a_damaged_index_is_one_line(tiny_env, tmp_path, damage, needle):
    folder = tmp_path / "bad"
    _sharded(tiny_env["teacher"], folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(damage))
    r = CliRunner().invoke(app, ["export", "genai", str(folder), "--streaming", "on", "--no-validate", "--out",
                                 str(tmp_path / "g")])
    assert needle in _one_line(r) and not (tmp_path / "g").exists()


@pytest.mark.parametrize("argv", [["bench", "--threads", "512"], ["export", "genai", "--threads", "513"],
                                  ["compress", "builtin", "--one-shot", "--threads", "512"],
                                  ["export", "gguf", "--quant", "q5"]])
def test_a_bad_flag_is_refused_before_torch_loads(argv):
    """Case 7: bench, export genai and compress --one-shot imported torch and onnxruntime before checking their
    flags (13-30 s to refuse a typo on a busy machine); each now refuses it in one line without loading torch."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "bdlora.cli", *argv], capture_output=True,
                       text=True, timeout=120)
    errors = [ln for ln in r.stderr.splitlines() if not ln.startswith("import time:")]
    assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: --"), r.stderr[-500:]
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert "torch" not in imported and "onnxruntime" not in imported


@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling"])
def test_a_negative_rotary_factor_is_refused_like_a_negative_base(tiny_env, tmp_path, where):
    """Case 5: rope_parameters.factor -4.0 was exported (a 2 GB folder, rc 0) where a NaN or 0 rope_theta is
    refused; every rotary number is held to the same rule."""
    folder = tmp_path / "bad"
    shutil.copytree(tiny_env["teacher"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[where] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": -4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    for streaming in ("on", "off"):
        r = CliRunner().invoke(app, ["export", "onnx", str(folder), "--streaming", streaming, "--no-validate",
                                     "--out", str(tmp_path / "o")])
        assert f"{where}.factor -4.0 (must be a positive number)" in _one_line(r) and not (tmp_path / "o").exists()


def _rewritten(src, dst, drop=(), values=None):
    """The GGUF file ``src`` copied to ``dst`` without the keys ``drop`` and with ``values`` set (the tensors as they
    are): a file a user edited, or one another tool wrote short."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in drop or name == "general.architecture":
            continue
        kind = gguf.GGUFValueType(field.types[0])
        value = (values or {}).get(name, field.contents())
        sub = gguf.GGUFValueType(field.types[-1]) if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, kind, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def tiny_gguf(tiny_env, tmp_path_factory):
    from bdlora.export.gguf import export_gguf_folder
    from bdlora.export.settings import GgufExportConfig

    out = tmp_path_factory.mktemp("gguf") / "t"
    export_gguf_folder(tiny_env["teacher"], out, GgufExportConfig(quant="f16", validate=False))
    return out / "model.gguf"


@pytest.mark.parametrize("edit,needle", [
    ({"drop": ("tokenizer.ggml.merges",)}, "its tokenizer (gpt2) lacks tokenizer.ggml.merges"),
    ({"values": {"tokenizer.ggml.model": "llama"}}, "its tokenizer (llama) lacks tokenizer.ggml.scores"),
    ({"values": {"llama.attention.head_count": 8}},
     "declares llama.attention.head_count 8 but the tensors hold 4"),
    ({"values": {"llama.attention.head_count": 8}, "drop": ("llama.rope.dimension_count",
                                                            "llama.attention.key_length")},
     "declares llama.attention.head_count 8 and llama.attention.head_count_kv 2, but the tensors hold 32 query"),
])
def test_a_damaged_gguf_teacher_names_what_is_wrong(tiny_gguf, tmp_path, edit, needle):
    """Case 8: a GGUF without token scores was "could not convert this GGUF file ('scores')", and one whose
    head_count lied was said to lie about head_count_kv."""
    bad = _rewritten(tiny_gguf, tmp_path / "bad.gguf", **edit)
    r = CliRunner().invoke(app, ["export", "onnx", str(bad), "--no-validate", "--out", str(tmp_path / "o")])
    assert needle in _one_line(r) and not (tmp_path / "o").exists()


def test_the_memory_bound_is_what_is_free_not_the_total():
    """Case 3: Llama-405B's largest graph (about 23 GiB) passed against a 24 GiB machine's total with other work
    resident; the bound is MemAvailable."""
    import os

    import psutil

    from bdlora.compress.bounds import machine_memory

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = machine_memory()
    assert 0 < free < total - (64 << 20)  # this process alone holds more than 64 MB: free is not the total
    assert abs(free - psutil.virtual_memory().available) < (256 << 20)


def test_a_speedup_beyond_any_structure_is_refused_from_the_shapes_alone(tiny_env, tmp_path, monkeypatch):
    """Case 4: ship --speedups 1e9 was still in plan's reach check at 90 s (calibrating, timing). A target beyond
    what the forms' cheapest structure does in MACs is refused from the teacher's shapes before any of that, in ship
    and in the one-shot (a MAC ratio exactly, a whole-step speed-up past twice the MAC ceiling)."""
    from bdlora.base.threads import from_options
    from bdlora.cli.spell import spell
    from bdlora.compress.forms.channels import CHANNEL_STEP
    from bdlora.forms import CHANNEL_FLOOR, reach_problem
    from bdlora.ship import run as ship_run
    from bdlora.ship.config import ShipConfig

    assert CHANNEL_FLOOR == CHANNEL_STEP
    cfg = json.loads((tiny_env["teacher"] / "config.json").read_text())
    assert reach_problem(cfg, "channels,groups", speedup=1.25) is None
    said = reach_problem(cfg, "channels,groups", speedup=1e9)
    assert said.startswith("--speedup 1e+09: beyond any structure of --forms channels,groups on this model")
    assert reach_problem(cfg, "lowrank,layers", mac_ratio=1000.0) and not reach_problem(cfg, "layers", mac_ratio=3.9)

    def runner(*a):
        raise AssertionError("no step may run")

    spawned = []
    monkeypatch.setattr("bdlora.ship.preflight.spawn", lambda argv: spawned.append(argv))
    ship = from_options(ShipConfig, {"data": str(tiny_env["corpus"]), "speedups": "1e9", "draft_speedup": 0.0,
                                     "schemes": "rtn", "seq_len": 32, "threads": 1, "eval_data": "none"})
    with pytest.raises(Exception, match=r"--speedups: --speedup 1e\+09: beyond any structure"):
        ship_run.run_ship(str(tiny_env["teacher"]), ship, tmp_path / "ship", spell, runner=runner)
    assert not spawned and not (tmp_path / "ship").exists()
    from test_oneshot import shot_args

    r = CliRunner().invoke(app, shot_args(tiny_env, tmp_path / "s", "--forms", "channels", "--mac-ratio", "50"))
    said = _one_line(r)
    assert "--mac-ratio 50: beyond any structure of --forms channels" in said and "calibrating" not in said


@pytest.mark.parametrize("tokens", ["1", "99999999999"])
def test_quality_tokens_out_of_bounds_are_refused_before_the_model_loads(tiny_env, tmp_path, tokens):
    """Case 6: --quality-tokens 1 and 99999999999 were taken and worked on (90 s and more at 1B)."""
    r = CliRunner().invoke(app, ["export", "genai", str(tiny_env["teacher"]), "--precision", "int4",
                                 "--quality-tokens", tokens, "--out", str(tmp_path / "g")])
    said = _one_line(r)
    assert f"--quality-tokens {tokens}: must be in [16, 1048576]" in said and "loading" not in said
    assert not (tmp_path / "g").exists()
