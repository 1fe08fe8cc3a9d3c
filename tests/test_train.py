import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from bdlora.base.reporter import Reporter
from bdlora.cli import app
from bdlora.models.load import load_run_student
from bdlora.train.config import TrainConfig
from bdlora.train.loop import train
from bdlora.train.student import build_student
from conftest import assert_same_tensors, stop_at


def _cfg(env, out, **kw):
    base = dict(teacher=str(env["teacher"]), data=str(env["corpus"]), cache_dir=str(env["cache"]), seq_len=32,
                batch_size=4, eval_tokens=512, heldout_fraction=0.1, lora_rank=4, lora_alpha=8.0, out=str(out),
                lr=3e-3, measure_step_time=False, max_steps=12, eval_every=6, save_every=0)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("init", ["zero", "whitened"])
def test_kd_lora_trains_only_lora(tiny_env, tiny_model, tmp_path, init):
    s = train(_cfg(tiny_env, tmp_path / "run", method="kd-lora", lora_init=init))
    initial, _ = build_student(tiny_model, 2, "mixed")
    saved = load_file(tmp_path / "run" / "student" / "model.safetensors")
    start = load_file(tmp_path / "run" / "lora_start.safetensors") if init != "zero" else {}
    assert (tmp_path / "run" / "lora_start.json").exists() == (init != "zero")
    for k, v in initial.state_dict().items():
        name = k.removesuffix(".weight")
        if f"{name}.A" in start:  # the frozen dense path is the residual of the whitened start, bit for bit
            residual = v.double() - start[f"{name}.B"].double() @ start[f"{name}.A"].double()
            torch.testing.assert_close(saved[k].double(), residual, rtol=0, atol=1e-5)
        else:
            assert torch.equal(saved[k], v), k  # dense weights unchanged bit for bit
    adapter = load_file(tmp_path / "run" / "student" / "adapter" / "adapter_model.safetensors")
    assert len([k for k in adapter if "lora_B" in k]) == 14
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # the adapter did train
    assert s["trainable_parameters"] == sum(v.numel() for v in adapter.values())


def test_short_run_lowers_validation_loss(tiny_env, tmp_path):
    s = train(_cfg(tiny_env, tmp_path / "run", method="kd-full", max_steps=20, eval_every=20))
    assert s["student_val_ppl"] < 0.9 * s["initial_student_val_ppl"]
    assert s["teacher_val_ppl"] > 1
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 20 and json.loads(lines[-1])["val_ppl"] == s["student_val_ppl"]
    for f in ("config.json", "summary.json", "student/config.json", "student/model.safetensors",
              "student/tokenizer.json"):
        assert (tmp_path / "run" / f).exists()


@pytest.mark.parametrize("method", ["kd-full", "kd-lora", "budgeted"])
def test_resume_equals_uninterrupted(tiny_env, tmp_path, method):
    full = train(_cfg(tiny_env, tmp_path / "a", method=method, save_every=4))
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_env, tmp_path / "b", method=method, save_every=4), reporter=stop_at(10))
    assert not (tmp_path / "b" / "summary.json").exists()
    resumed = train(TrainConfig(), resume=tmp_path / "b")
    assert resumed["resumed_from"] == 8 and resumed["steps"] == 12
    assert_same_tensors(tmp_path / "a" / "student", tmp_path / "b" / "student", ["model.safetensors"] + [
        f for f in ("adapter/adapter_model.safetensors", "budgeted.safetensors")
        if (tmp_path / "a" / "student" / f).exists()])
    assert resumed["student_val_ppl"] == full["student_val_ppl"]
    ma = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    mb = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in ma] == [json.loads(x)["loss"] for x in mb]
    if method == "budgeted":
        ca = (tmp_path / "a" / "controller.jsonl").read_text()
        assert ca == (tmp_path / "b" / "controller.jsonl").read_text()  # controller state restored exactly
        assert resumed["compute_proxy"]["d_bar"] == full["compute_proxy"]["d_bar"]


def test_budgeted_run_artefacts_and_reload(tiny_env, tmp_path):
    s = train(_cfg(tiny_env, tmp_path / "run", method="budgeted", budget=0.0, max_steps=20, retention_ema=0.5,
                   measure_step_time=True, allocation="cost"))
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "controller.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and rows[0]["budget"] == 1.0 and rows[-1]["budget"] == 0.0
    assert rows[-1]["zero"] == 14 and rows[-1]["retained"] == 0.0
    assert all(len(r["d"]) == 14 for r in rows)
    assert (run / "controller.png").stat().st_size > 10_000
    assert s["final_retained"] == 0.0 and len(s["modules"]) == 14
    assert s["compute_proxy"]["d_bar"] == pytest.approx(sum(r["retained"] for r in rows) / 20)
    st = s["step_time_ms"]
    assert st["kd-full"] > 0 and st["kd-lora"] > 0 and st["budgeted"] > 0
    model, tok, _ = load_run_student(run)
    from bdlora.models.perplexity import perplexity
    from bdlora.train.session import prepare

    sess = prepare(_cfg(tiny_env, tmp_path / "x", method="budgeted", budget=0.0, allocation="cost"))
    assert perplexity(model, sess.val_blocks) == pytest.approx(s["student_val_ppl"], rel=1e-5)


def test_cli_train_and_yaml_config(tiny_env, tmp_path):
    from conftest import train_args

    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: kd-lora\nmax_steps: 3\nbatch_size: 2\n")
    res = CliRunner().invoke(app, [*train_args(tiny_env, tmp_path / "run"), "--config", str(cfg),
                                   "--batch-size", "3", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    stored = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert summary["method"] == "kd-lora" and summary["steps"] == 3
    assert stored["batch_size"] == 3  # the flag overrides the YAML value


def test_adam_betas_are_options_and_reach_the_optimiser(tiny_env, tmp_path):
    """The paper does not state AdamW's betas: they are options (default 0.9, 0.95), stored in the run config and
    used by the optimiser (its param groups are saved in every checkpoint)."""
    train(_cfg(tiny_env, tmp_path / "run", method="kd-lora", max_steps=2, save_every=1, adam_beta1=0.8,
               adam_beta2=0.99))
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/state.json")).read_text())
    assert all(tuple(g["betas"]) == (0.8, 0.99) for g in state["param_groups"])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["config"]["adam_beta2"] == 0.99
    assert TrainConfig().adam_beta1 == 0.9 and TrainConfig().adam_beta2 == 0.95
    res = CliRunner().invoke(app, ["train", "--adam-beta2", "1.0", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--adam-beta2 1.0: must be in [0, 1)" in res.stderr


def test_truncate_packing_trains_on_whole_documents(tiny_env, tmp_path):
    """--packing truncate (the paper's data handling): one document per sequence, padding out of the loss; the
    run learns, records the choice, and reads different sequences than packing does."""
    from bdlora.data.blocks import DocumentBlocks, PackedBlocks
    from bdlora.train.session import prepare

    s = train(_cfg(tiny_env, tmp_path / "t", method="kd-full", max_steps=12, eval_every=12, packing="truncate"))
    assert s["student_val_ppl"] < s["initial_student_val_ppl"]
    assert json.loads((tmp_path / "t" / "config.json").read_text())["config"]["packing"] == "truncate"
    p = train(_cfg(tiny_env, tmp_path / "p", method="kd-full", max_steps=1, eval_every=1))
    first = [json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[0])["loss"] for d in "tp"]
    assert first[0] != pytest.approx(first[1]) and p["student_val_ppl"] > 0
    sess = prepare(_cfg(tiny_env, tmp_path / "x", packing="truncate"), Reporter())
    assert isinstance(sess.train_blocks, DocumentBlocks) and isinstance(sess.val_blocks, PackedBlocks)
    res = CliRunner().invoke(app, ["train", "--packing", "stream", "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "--packing 'stream'" in res.stderr and "pack, truncate" in res.stderr
