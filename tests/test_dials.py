"""The dials one-shot and train share (``forms.dials.Dials``): one dataclass embedded in both settings, checked once,
read back from flat options and from a run's config.json as it was written before it was embedded."""

from __future__ import annotations

import json

import pytest
import typer.main
from typer.testing import CliRunner

from bdlora.base.argv import fields_of
from bdlora.base.errors import Checks, ConfigError
from bdlora.base.threads import flat, from_options
from bdlora.cli import app
from bdlora.cli.compress import ONE_SHOT_ORDER
from bdlora.cli.options import from_dataclass
from bdlora.compress.config import OneShotConfig
from bdlora.forms import ONE_SHOT_FORMS
from bdlora.forms.dials import Dials, TrainDials
from bdlora.train.config import TrainConfig, merge
from bdlora.train.forms_start import one_shot_options

DIALS = ("mac_ratio", "precision", "quant", "forms", "speedup", "width_multiple")


def test_both_settings_embed_the_one_dials_dataclass():
    shot, train = fields_of(OneShotConfig), fields_of(TrainConfig)
    assert {n: shot[n] for n in DIALS} == dict.fromkeys(DIALS, Dials)
    assert {n: train[n] for n in DIALS} == dict.fromkeys(DIALS, TrainDials) and issubclass(TrainDials, Dials)
    # flat options go into the dials; a dial not given keeps the holder's default (one-shot's forms)
    cfg = from_options(OneShotConfig, {"mac_ratio": 1.5, "seq_len": 64})
    assert cfg.dials == Dials(mac_ratio=1.5, forms=ONE_SHOT_FORMS) and cfg.seq_len == 64
    train_cfg = from_options(TrainConfig, {"forms": "channels", "mac_ratio": 1.2})
    assert train_cfg.dials == TrainDials(1.2, forms="channels")
    assert flat(cfg)["mac_ratio"] == 1.5 and "dials" not in flat(cfg)
    # train's --forms start is the one-shot with the same dials
    run = from_options(TrainConfig, {"method": "kd-lora", "forms": "channels", "speedup": 1.3, "precision": "int4",
                                     "width_multiple": 64, "calib_tokens": 512, "seq_len": 32})
    assert one_shot_options(run).dials == Dials(forms="channels", speedup=1.3, precision="int4", width_multiple=64)
    assert one_shot_options(run).dials.whole_step and not cfg.dials.whole_step


@pytest.mark.parametrize("dials,line", [
    (dict(speedup=0.5, precision="int4", forms="channels"), "--speedup 0.5"),
    (dict(mac_ratio=1.2, forms="channels", width_multiple=48), "--width-multiple 48: must be a multiple of 32"),
    (dict(mac_ratio=1.2, forms="lowrank,bits", precision="int8"), "--forms lowrank,bits: bits chooses"),
    (dict(mac_ratio=1.2, forms="channels", precision="int4", quant="nope"), "--quant 'nope': unknown"),
    (dict(mac_ratio=1.2, forms="channels,nope"), "--forms 'nope': allowed lowrank"),
])
def test_a_rule_the_dials_share_is_one_line_from_both_commands(dials, line):
    """The same bad dial is refused by one-shot and by train in the same words, once (``Dials.check``)."""
    shot = from_options(OneShotConfig, dials).check(Checks()).problems
    train = from_options(TrainConfig, {"method": "kd-lora", **dials}).check(Checks()).problems
    said = [p for p in shot if line in p]
    assert len(said) == 1 and [p for p in train if line in p] == said, (shot, train)


def test_train_reads_the_dials_from_a_recipe_and_its_config_json_is_written_flat(tiny_env, tmp_path):
    """A YAML recipe's flat keys and a run's config.json (the layout written before the dials were embedded: every
    option at the top level) are read into the dials; the folder keeps that layout."""
    cfg = merge({"forms": "layers", "mac_ratio": 1.3}, {"method": "kd-lora", "lora_rank": None})
    assert cfg.dials == TrainDials(mac_ratio=1.3, forms="layers")
    with pytest.raises(ConfigError, match="--mac-ratio 0.5"):
        merge({"mac_ratio": 0.5}, {}).validate()
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "--teacher", str(tiny_env["teacher"]), "--data", str(tiny_env["corpus"]),
                                 "--cache-dir", str(tiny_env["cache"]), "--seq-len", "32", "--batch-size", "4",
                                 "--eval-tokens", "256", "--heldout-fraction", "0.1", "--method", "kd-lora",
                                 "--student-layers", "4", "--forms", "layers", "--mac-ratio", "1.3",
                                 "--calib-tokens", "512", "--max-steps", "1", "--save-every", "0",
                                 "--no-measure-step-time", "--out", str(out)])
    assert r.exit_code == 0, r.output
    stored = json.loads((out / "config.json").read_text())["config"]
    assert "dials" not in stored and (stored["forms"], stored["mac_ratio"], stored["speedup"]) == ("layers", 1.3, None)


def test_the_one_shot_help_keeps_its_order_and_a_wrong_order_is_refused():
    params = [p.name for p in typer.main.get_command(app).commands["compress"].params]
    shown = [n for n in params if n in ONE_SHOT_ORDER]
    assert shown == list(ONE_SHOT_ORDER)
    with pytest.raises(ValueError, match="order names fields OneShotConfig lacks: mac_ratios"):
        from_dataclass(OneShotConfig, order=("mac_ratios",))
