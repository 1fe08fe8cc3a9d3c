"""compress's calibration one decoder layer at a time (``compress.layerwise``) is ``calibrate``'s, to 1e-5: every
Gram, Fisher diagonal, layer update and gradient energy, rounding error (the head's too) and predicted-token count,
on the loaded model and on the lazy one that reads its weights layer by layer."""


import numpy as np
import pytest
import torch

from bdlora.base.errors import UsageError
from bdlora.compress import layerwise
from bdlora.compress.calibrate import calibrate
from bdlora.compress.layerwise import GramStore, calibrate_layers
from bdlora.export.genai.quantize import rtn_rounded


def _close(a, b, what):
    a, b = torch.as_tensor(np.asarray(a)).double(), torch.as_tensor(np.asarray(b)).double()
    scale = max(float(b.abs().max()), 1e-30)
    assert float((a - b).abs().max()) <= 1e-5 * scale, what


def _same(got, want):
    assert sorted(got.grams) == sorted(want.grams) and sorted(got.fisher) == sorted(want.fisher)
    for k in want.grams:
        _close(got.grams[k], want.grams[k], k)
    for k in want.fisher:
        _close(got.fisher[k], want.fisher[k], k)
    assert sorted(got.residual) == sorted(want.residual)
    for i, (energy, grad) in want.residual.items():
        _close(got.residual[i][0], energy, f"layer {i} energy")
        _close(got.residual[i][1], grad, f"layer {i} gradient")
    assert sorted(got.rounding) == sorted(want.rounding)
    for k, errors in want.rounding.items():
        assert sorted(got.rounding[k]) == sorted(errors)
        for b, e in errors.items():
            assert got.rounding[k][b] == pytest.approx(e, rel=1e-5), (k, b)
    _close(got.mass, want.mass, "mass")
    assert np.array_equal(got.argmax, want.argmax)
    assert got.tokens == want.tokens


@pytest.fixture
def blocks(tiny_model):
    # 11 blocks: two full batches of CALIB_BATCH (8) would hide a short last batch
    return np.random.default_rng(3).integers(0, tiny_model.config.vocab_size, (11, 24))


def test_layer_by_layer_calibration_is_the_whole_models(tiny_model, blocks, tmp_path):
    options = dict(residual=True, rounded=rtn_rounded, head=True, predicted=True)
    want = calibrate(tiny_model, blocks, **options)
    got = calibrate_layers(tiny_model, blocks, where=str(tmp_path), **options)
    _same(got, want)
    assert isinstance(got.grams, GramStore) and len(list(got.grams.root.glob("*.npy"))) == len(want.grams)
    assert not (got.grams.root / "hidden").exists()  # the layers' inputs go once the backward pass is done
    assert all(p.requires_grad for p in tiny_model.parameters())  # the model's own flags are restored
    root = got.grams.root
    got.grams.close()
    assert not root.exists()


def test_grams_alone_and_a_lazy_model(tiny_env, blocks, tmp_path):
    """Without Fisher (no backward pass) only the Grams; on the lazy model (each layer made from its weight files
    when it runs) the same numbers as the loaded model's."""
    from transformers import AutoModelForCausalLM

    from bdlora.models.stream import lazy_folder_model

    loaded = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32).eval()
    want = calibrate(loaded, blocks, fisher=False)
    got = calibrate_layers(loaded, blocks, fisher=False, where=str(tmp_path))
    assert got.fisher == {} and got.residual == {} and got.rounding == {}
    for k in want.grams:
        _close(got.grams[k], want.grams[k], k)
    lazy, _, _ = lazy_folder_model(tiny_env["teacher"])
    _same(calibrate_layers(lazy, blocks, residual=True, predicted=True, where=str(tmp_path)),
          calibrate(loaded, blocks, residual=True, predicted=True))


def test_a_temp_folder_too_small_is_one_line_before_any_work(tiny_model, blocks, tmp_path, monkeypatch):
    monkeypatch.setattr(layerwise.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(UsageError, match=r"writes about .* GiB to .* and it has 0.0 GiB free \(set TMPDIR"):
        calibrate_layers(tiny_model, blocks, where=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options", [("--mac-ratio", "1.4", "--forms", "lowrank,channels,groups,layers"),
                                     ("--mac-ratio", "1.6", "--forms", "layers,channels")])
def test_one_shot_streamed_calibration_writes_the_same_folder(tiny_env, tmp_path, monkeypatch, options):
    """compress --one-shot --streaming on (the calibration layer by layer, its Grams on disk) against --streaming off
    on every form that reads the calibration: the same decisions and the same weights to 1e-5 (a low-rank pair by
    the product of its factors, which is unique where the factors are not: the two paths' BLAS calls differ, and
    between machines with and without AVX-512 they gave opposite factors), and the temp folder gone."""
    import json
    import tempfile

    from safetensors.torch import load_file
    from test_oneshot import shot_args
    from typer.testing import CliRunner

    from bdlora.cli import app

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the Grams wait ($TMPDIR)
    folders = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        res = CliRunner().invoke(app, shot_args(tiny_env, out, *options, "--streaming", mode, "--json"))
        assert res.exit_code == 0, res.output
        assert ("one decoder layer at a time" in res.stderr) == (mode == "on"), res.stderr
        assert ("writing" in res.stderr and "one tensor at a time" in res.stderr) == (mode == "on"), res.stderr
        folders[mode] = (json.loads(res.stdout), load_file(str(out / "model.safetensors")))
    (off, w_off), (on, w_on) = folders["off"], folders["on"]
    assert on["provenance"].get("removed_layers") == off["provenance"].get("removed_layers")
    for k in ("student_val_ppl", "compressed_val_ppl"):  # each scored one layer at a time
        assert abs(on["eval"][k] - off["eval"][k]) <= 1e-4 * off["eval"][k], k
    c_on, c_off = (json.loads((tmp_path / m / "config.json").read_text()) for m in ("on", "off"))
    assert sorted(c_on.pop("bdlora")) == sorted(c_off.pop("bdlora"))  # the provenance: its measured floats to 1e-5
    assert c_on == c_off  # the architecture, every module's form
    assert [(m["name"], m["case"], m.get("lora_rank"), m.get("channels")) for m in on["modules"]] == [
        (m["name"], m["case"], m.get("lora_rank"), m.get("channels")) for m in off["modules"]]
    assert len({m["form"] for m in off["modules"]}) >= 2, "the allocation chose more than one form"
    if "layers,channels" in options:  # the streamed folder reads the kept layers under their source numbers
        assert off["provenance"]["removed_layers"], off["provenance"]
    assert sorted(w_on) == sorted(w_off)
    assert any(k.endswith(".proj_in.weight") for k in w_off) == ("lowrank" in options[3]), "low-rank pairs"
    for k in w_off:
        if k.endswith(".proj_out.weight"):
            continue
        if k.endswith(".proj_in.weight"):  # a factorisation is unique only up to sign and rotation: its product is
            out = k.replace(".proj_in.", ".proj_out.")
            _close(w_on[out].double() @ w_on[k].double(), w_off[out].double() @ w_off[k].double(), k)  # (out, in)
        else:
            _close(w_on[k], w_off[k], k)
    assert list(temp.iterdir()) == []


def test_a_shared_build_is_the_copied_one_without_the_copies(tiny_model):
    """The one-shot builds its folder's model on the source's own tensors (``share``): the same state dict as the
    copying build, bit for bit, no parameter left on the meta device, and the dense projections' storage the
    source's."""
    from bdlora.compress.forms.lowrank import factored
    from bdlora.models.arch import projection_modules
    from bdlora.models.budgeted.model import build_deployed_model
    from bdlora.models.costs import ModuleShape

    mods = dict(projection_modules(tiny_model))
    shapes = {n: ModuleShape(n, m.in_features, m.out_features) for n, m in mods.items()}
    built = {}
    for share in (False, True):
        deployed = {n: factored(shapes[n], m, 0, {}, share=share) for n, m in mods.items()}
        built[share] = build_deployed_model(tiny_model, deployed, {"name": "t"}, share=share)
    copied, shared = (dict(built[s].state_dict()) for s in (False, True))
    assert sorted(copied) == sorted(shared)
    assert all(torch.equal(copied[k], shared[k]) for k in copied)
    assert not any(p.is_meta for p in built[True].parameters())
    name = next(iter(mods))
    assert shared[f"{name}.weight"].data_ptr() == mods[name].weight.data_ptr()
    assert copied[f"{name}.weight"].data_ptr() != mods[name].weight.data_ptr()


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_other_families_calibrate_the_same_layer_by_layer(family, tmp_path):
    """Gemma 3 (local and global layers, its own masks and rotary per kind, scaled embeddings, norms with an offset:
    the head's forward is the model's own) and Qwen2 (projection biases)."""
    from test_gemma3 import WINDOW, _perturbed, gemma3_config
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    if family == "gemma3":
        model = _perturbed(Gemma3ForCausalLM(Gemma3TextConfig(**gemma3_config())))
        blocks = np.random.default_rng(4).integers(0, 96, (5, 2 * WINDOW + 3))  # past the sliding window
    else:
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64)).eval()
        blocks = np.random.default_rng(4).integers(0, 96, (5, 20))
    options = dict(residual=True, rounded=rtn_rounded, head=True, predicted=True)
    _same(calibrate_layers(model, blocks, where=str(tmp_path), **options), calibrate(model, blocks, **options))


def test_plan_of_a_source_read_one_layer_at_a_time_is_the_in_memory_plan(tiny_env):
    """plan --forms with the source lazy (--streaming on: each layer made for the offers and the deploys) reports the
    structure the in-memory plan does."""
    import json

    from typer.testing import CliRunner

    from bdlora.cli import app

    reports = {}
    for mode in ("off", "on"):
        res = CliRunner().invoke(app, ["plan", "--model", str(tiny_env["teacher"]), "--allocation", "quality",
                                       "--forms", "channels,groups,lowrank", "--mac-ratio", "1.4", "--calib-tokens",
                                       "512", "--data", str(tiny_env["corpus"]), "--streaming", mode, "--json"])
        assert res.exit_code == 0, res.output
        assert ("reading" in res.stderr and "one decoder layer at a time" in res.stderr) == (mode == "on")
        reports[mode] = json.loads(res.stdout)
    assert [(m["name"], m["case"], m.get("lora_rank"), m.get("channels")) for m in reports["on"]["modules"]] == [
        (m["name"], m["case"], m.get("lora_rank"), m.get("channels")) for m in reports["off"]["modules"]]
    assert reports["on"]["speedup_vs_dense"] == pytest.approx(reports["off"]["speedup_vs_dense"], rel=1e-9)


def test_a_streamed_one_shot_refuses_what_it_cannot_do_before_any_work(tiny_env, tmp_path, monkeypatch):
    """Read one layer at a time, --correct (it needs the whole model) and an output disk without room for the folder
    are each one line and exit 2, before calibrating; nothing is written."""
    import shutil

    from test_oneshot import shot_args
    from typer.testing import CliRunner

    from bdlora.cli import app

    out = tmp_path / "o"
    res = CliRunner().invoke(app, shot_args(tiny_env, out, "--mac-ratio", "1.4", "--streaming", "on", "--correct"))
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "--correct: re-solves the low-rank pairs" in said and "--streaming off" in said, said
    assert "Traceback" not in res.output and "calibrating" not in res.output and not out.exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    res = CliRunner().invoke(app, shot_args(tiny_env, out, "--mac-ratio", "1.4", "--streaming", "on"))
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{out}: the compressed folder takes up to" in said and "0.0 GiB free" in said, said
    assert "Traceback" not in res.output and "calibrating" not in res.output and not out.exists()
