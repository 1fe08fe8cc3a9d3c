"""``train --forms F``: the student starts as the structure ``compress --one-shot`` with the same options writes,
then trains from it (kd-lora heals a pruned structure; budgeted moves the projections the allocation makes low rank
through its schedule while the pruned sites stay fixed)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from bdlora.cli import app
from conftest import assert_same_tensors, stop_at, train_args

CALIB = ("--calib-tokens", "512")


def shot(env, out, *extra):
    return CliRunner().invoke(app, [
        "compress", str(env["teacher"]), "--one-shot", "--data", str(env["corpus"]), "--cache-dir", str(env["cache"]),
        "--seq-len", "32", *CALIB, "--eval-tokens", "512", "--heldout-fraction", "0.1", "--out", str(out), "--json",
        *extra])


def modules(folder) -> dict:
    return json.loads((folder / "config.json").read_text())["bdlora_modules"]


def test_kd_lora_heals_the_one_shot_structure_of_the_same_options(tiny_env, tmp_path):
    """The run's start is the one-shot folder of the same options, weight for weight (one code path); kd-lora heals
    it and compress keeps every pruned site and the removed layer; the summary names the teacher layers kept."""
    opts = ("--forms", "channels,groups,layers", "--mac-ratio", "1.5")
    r = shot(tiny_env, tmp_path / "shot", *opts)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "run", "--method", "kd-lora", "--student-layers", "4",
                                           "--max-steps", "3", *CALIB, *opts))
    assert r.exit_code == 0, r.output
    start = tmp_path / "run" / "structure"
    declared = modules(tmp_path / "shot")
    assert modules(start) == declared
    assert any(k.endswith(".mlp") for k in declared)
    a, b = load_file(tmp_path / "shot" / "model.safetensors"), load_file(start / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    shot_prov = json.loads((tmp_path / "shot" / "compression.json").read_text())["provenance"]
    kept = shot_prov.get("layer_indices", list(range(4)))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["layer_indices"] == kept
    assert json.loads((tmp_path / "run" / "config.json").read_text())["run"]["layer_indices"] == kept
    r = CliRunner().invoke(app, ["compress", str(tmp_path / "run"), "--out", str(tmp_path / "healed"), "--json"])
    assert r.exit_code == 0, r.output
    healed = modules(tmp_path / "healed")
    assert {k: v for k, v in healed.items() if k.endswith((".mlp", ".self_attn"))} == {
        k: v for k, v in declared.items() if k.endswith((".mlp", ".self_attn"))}
    assert json.loads((tmp_path / "healed" / "config.json").read_text())["num_hidden_layers"] == len(kept)
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "healed"), "--ppl", "--report", str(tmp_path / "e.json")])
    assert r.exit_code == 0, r.output


def test_budgeted_moves_the_allocated_projections_to_low_rank_beside_fixed_pruned_sites(tiny_env, tmp_path):
    """budgeted with --forms lowrank,channels: the pruned MLPs are narrower from step 0, the projections the
    allocation makes low rank start from the one-shot's factors (the student unchanged at d = 1) and end at d = 0,
    every other gated module stays dense; compress gives pairs exactly there and keeps the pruned widths."""
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "run", "--method", "budgeted", "--allocation",
                                           "quality", "--student-layers", "4", "--max-steps", "4", "--decay-start",
                                           "0", "--decay-end", "0.5", "--retention-ema", "0", *CALIB, "--forms",
                                           "lowrank,channels", "--mac-ratio", "1.6"))
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "run" / "structure" / "compression.json").read_text())
    low = report["provenance"]["low_rank_in_training"]
    sites = {k: v for k, v in modules(tmp_path / "run" / "structure").items() if k.endswith(".mlp")}
    assert low and sites  # both forms chosen at this dial
    start = json.loads((tmp_path / "run" / "lora_start.json").read_text())
    assert {n for n, r in start["allocation"]["ranks"].items() if r} == set(low)
    # at d = 1 the gated student is the structure: its pairs' residual W - B A sits in the dense path
    from transformers import AutoModelForCausalLM

    from bdlora.compress.start import LowRankStart
    from bdlora.train.config import TrainConfig
    from bdlora.train.methods import Budgeted

    structured = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "structure", dtype=torch.float32).eval()
    ids = torch.randint(0, structured.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = structured(input_ids=ids).logits
        lora = LowRankStart.load(tmp_path / "run" / "lora_start.json", tmp_path / "run" / "lora_start.safetensors")
        gated = Budgeted(TrainConfig(lora_rank=4, lora_alpha=8.0, measure_step_time=False)).wrap(structured, lora)
        torch.testing.assert_close(gated(input_ids=ids).logits, want, rtol=0, atol=1e-5)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    d = {m["name"]: m["d"] for m in summary["modules"]}
    assert {n for n, v in d.items() if v == 0.0} == set(low)
    r = CliRunner().invoke(app, ["compress", str(tmp_path / "run"), "--out", str(tmp_path / "c"), "--json"])
    assert r.exit_code == 0, r.output
    out = modules(tmp_path / "c")
    assert {n for n, v in out.items() if v.get("form") == "lowrank"} == set(low)
    assert {k: v for k, v in out.items() if k.endswith(".mlp")} == sites
    for n in low:
        assert out[n]["rank"] == start["ranks"][n]


@pytest.mark.parametrize("extra, needle", [
    (("--method", "kd-lora", "--forms", "lowrank,channels", "--mac-ratio", "1.3"), "kd-lora heals a dense structure"),
    (("--method", "budgeted", "--forms", "channels", "--mac-ratio", "1.3"), "lowrank among the forms"),
    (("--method", "kd-lora", "--forms", "channels"), "needs the dial"),
    (("--method", "kd-lora", "--forms", "channels", "--speedup", "1.2"), "--speedup 1.2: with --forms F and"),
    (("--method", "kd-lora", "--forms", "channels", "--mac-ratio", "1.3", "--student-init", "x"), "is a structure"),
    (("--method", "kd-lora", "--forms", "bits", "--mac-ratio", "1.3"), "give --precision int4"),
    (("--method", "kd-lora", "--forms", "pruned", "--mac-ratio", "1.3"), "--forms 'pruned': allowed lowrank"),
    (("--method", "kd-lora", "--width-multiple", "256"), "--width-multiple 256: is the grid of a --forms start's"),
    (("--method", "kd-lora", "--forms", "channels", "--mac-ratio", "1.3", "--width-multiple", "100"),
     "--width-multiple 100: must be a multiple of 32"),
])
def test_forms_refusals_are_one_line_and_write_nothing(tiny_env, tmp_path, extra, needle):
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "run", "--max-steps", "2", *extra))
    assert r.exit_code == 2 and needle in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_speedup_allocates_the_start_for_the_whole_decode_step(tiny_env, tmp_path):
    """train --forms F --precision int4 --speedup S: the start's allocation is priced by the measured table (here a
    hand-made one and its decode-step overhead: nothing timed) and its predicted whole-step speed-up meets S."""
    from test_latency import _hand_table

    from bdlora.base.errors import usable_cores
    from bdlora.models.costs import shapes_from_config
    from conftest import genai_teacher

    genai_teacher(tiny_env["tokenizer"], tmp_path / "teacher", seed=3, layers=4)  # head dim 16, what genai takes
    config = json.loads((tmp_path / "teacher" / "config.json").read_text())
    _hand_table(tmp_path / "c", shapes_from_config(config), (), threads=usable_cores(), teacher=tmp_path / "teacher")
    env = {**tiny_env, "teacher": tmp_path / "teacher", "cache": tmp_path / "c"}
    r = CliRunner().invoke(app, train_args(env, tmp_path / "run", "--method", "kd-lora", "--student-layers", "4",
                                           "--max-steps", "2", *CALIB, "--forms", "channels,layers", "--precision",
                                           "int4", "--speedup", "1.3"))
    assert r.exit_code == 0, r.output
    prov = json.loads((tmp_path / "run" / "structure" / "compression.json").read_text())["provenance"]
    assert prov["speedup"] == 1.3 and prov["mac_ratio"] is None
    assert prov["allocation_cost"]["predicted_decode_speedup"] >= 1.3 - 1e-9 and "whole decode time" in r.output


def test_a_resumed_forms_run_reads_its_structure_and_ends_bit_identical(tiny_env, tmp_path, monkeypatch):
    """A --forms run stopped after a checkpoint resumes from the structure it saved (never recomputed) and
    ends with the same weights as the run that was not stopped; its layers stay the structure's."""
    from bdlora.forms.dials import TrainDials
    from bdlora.train.config import TrainConfig
    from bdlora.train.loop import train

    common = dict(teacher=str(tiny_env["teacher"]), data=str(tiny_env["corpus"]), cache_dir=str(tiny_env["cache"]),
                  seq_len=32, batch_size=4, eval_tokens=512, heldout_fraction=0.1, lr=3e-3, max_steps=6,
                  eval_every=6, save_every=2, calib_tokens=512, method="kd-lora", student_layers=4,
                  dials=TrainDials(forms="layers", mac_ratio=1.3), lora_rank=4, lora_alpha=8.0,
                  measure_step_time=False)
    full = train(TrainConfig(out=str(tmp_path / "a"), **common))

    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=str(tmp_path / "b"), **common), reporter=stop_at(3))

    def recompute(*a, **k):
        raise AssertionError("a resumed run recomputed its structure")

    monkeypatch.setattr("bdlora.train.forms_start.structure", recompute)
    resumed = train(TrainConfig(), resume=tmp_path / "b")
    assert resumed["resumed_from"] == 2 and resumed["layer_indices"] == full["layer_indices"]
    assert len(full["layer_indices"]) < 4  # a layer removed: the kept ones map back to the teacher's
    assert_same_tensors(tmp_path / "a", tmp_path / "b", ("student/model.safetensors",
                                                         "student/adapter/adapter_model.safetensors",
                                                         "structure/model.safetensors"))


def test_width_multiple_shapes_the_start_as_the_one_shot_with_the_same_options(tiny_env, tmp_path):
    """train --forms channels --width-multiple 64: the start's kept MLP widths are those of compress --one-shot with
    the same options, every one on the 64 grid (the one code path, ``one_shot_options``)."""
    from conftest import genai_teacher

    genai_teacher(tiny_env["tokenizer"], tmp_path / "t", seed=1, layers=2)  # MLP 128: the grid is 64 alone
    env = {**tiny_env, "teacher": tmp_path / "t"}
    opts = ("--forms", "channels", "--mac-ratio", "1.3", "--width-multiple", "64")
    assert shot(env, tmp_path / "shot", *opts).exit_code == 0
    r = CliRunner().invoke(app, train_args(env, tmp_path / "run", "--method", "kd-lora", "--student-layers", "2",
                                           "--max-steps", "1", *CALIB, *opts))
    assert r.exit_code == 0, r.output
    declared = modules(tmp_path / "run" / "structure")
    assert declared == modules(tmp_path / "shot")
    widths = [v["keep"] for k, v in declared.items() if k.endswith(".mlp")]
    assert widths and all(w % 64 == 0 for w in widths)
