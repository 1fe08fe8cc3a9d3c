"""The fourth round of hostile inputs (issue 78) outside ``ship`` (whose cases are in test_ship_resume.py) and the
draft checks (test_speculative.py): each case as its user met it, refused in one line, before the work it would
waste."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from bdlora.cli import app


def _one_line(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    return " ".join(r.output.split())


@pytest.fixture
def nan_folder(tiny_env, tmp_path):
    """A model folder bdlora wrote (its digests recorded, so every integrity check passes) holding one NaN."""
    from transformers import AutoModelForCausalLM

    from bdlora.deployed.folder import save_model_folder

    model = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"])
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    return save_model_folder(model, tiny_env["tokenizer"], tmp_path / "nan.compressed", {"source": "test"})


def test_bench_on_onnxruntime_refuses_a_folder_with_a_nan_weight(nan_folder, tmp_path):
    """Case 9: rc 0 and bench.json written with timings (genai refused it)."""
    r = CliRunner().invoke(app, ["bench", str(nan_folder), "--runtime", "ort", "--seq-lens", "16", "--batch-sizes",
                                 "1", "--repeats", "1", "--out", str(tmp_path / "b")])
    said = _one_line(r)
    assert "1 weight tensor(s) hold NaN or infinity (model.layers.1.mlp.down_proj.weight)" in said
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("extra,needle", [
    (["--runtime", "ort"], "--speculative: times the teacher's genai export speculating (--runtime genai or both, "
                           "not ort)"),
    (["--quality-tokens", "0"], "--speculative: its prompts are the front's held-out text; --quality-tokens 0"),
])
def test_bench_speculative_refuses_what_gives_it_no_rows(tmp_path, extra, needle):
    """Case 14: rc 0, no speculative rows, nothing said."""
    r = CliRunner().invoke(app, ["bench", str(tmp_path / "any"), "--speculative", *extra])
    assert needle in _one_line(r)


def test_bench_speculative_refuses_synthetic_mode(tiny_env, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--model-config", str(tiny_env["teacher"]), "--budget", "0.5",
                                 "--speculative", "--runtime", "genai", "--out", str(tmp_path / "b")])
    assert "--speculative: synthetic mode (--model-config) has no teacher" in _one_line(r)


@pytest.mark.parametrize("budget", ["1s", "29", "99999999999h", "721h"])
def test_train_time_budget_is_bounded_before_anything_loads(tiny_env, tmp_path, budget):
    """Case 15: 99999999999h planned 237,651,204,793,628 steps into config.json; 1s ran 102 s before refusing."""
    from conftest import train_args

    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "r", "--method", "kd-lora", "--time-budget", budget))
    assert f"--time-budget {budget}: a duration from 30s" in _one_line(r) and "to 720h" in r.output
    assert not (tmp_path / "r").exists()


def test_ship_heal_time_budget_has_the_same_bounds():
    from bdlora.base.errors import Checks, ConfigError
    from bdlora.ship.config import ShipConfig

    with pytest.raises(ConfigError, match="--heal-time-budget 5s: a duration from 30s"):
        ShipConfig(heal_time_budget="5s").check(Checks()).done()
    assert json.dumps(ShipConfig(heal_time_budget="30s").check(Checks()).problems) == "[]"


LLAMA_405B = {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
              "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 131072}


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--model-config", "{cfg}", "--precision", "int4"],
     "plan --precision int4: its largest matrix (2,101,346,304 weights) timed as a graph needs about 23 GiB"),
    (["bench", "--model-config", "{cfg}", "--budget", "0.5", "--out", "{out}"],
     "its 403,752,042,496 parameters in fp32 needs about 1,504 GiB"),
])
def test_shapes_alone_are_bounded_by_this_machines_memory(tmp_path, argv, needle, monkeypatch):
    """Case 12: Llama-405B shapes (every field within its bound): plan --precision int4 segfaulted after 58 s, bench
    raised "can't allocate 8405385216 bytes". The machine's memory is held at 20 GiB so the case is the same on any
    machine."""
    from bdlora.compress import bounds

    monkeypatch.setattr(bounds, "machine_memory", lambda: 20 * 2**30)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_405B))
    argv = [a.format(cfg=tmp_path / "config.json", out=tmp_path / "b") for a in argv]
    said = _one_line(CliRunner().invoke(app, argv))
    assert needle in said and "more than the 20 GiB this machine has free" in said
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("damage", ["rewritten", "truncated", "no digests"])
@pytest.mark.parametrize("spec", ["one", "mixture"])
def test_a_damaged_token_cache_is_tokenised_again(tiny_env, tmp_path, damage, spec):
    """Case 10: a rewritten val.bin was read as it was (eval 21.511 against the teacher's 26.678, truly 36.381); a
    truncated one failed with "mmap length is greater than file size". A corpus and a mixture of two, each damaged
    after it was cached, read back as first written (and a cache from before the digests is made again)."""
    import numpy as np

    from bdlora.data.corpora import load_tokens

    corpus = str(tiny_env["corpus"])
    spec = corpus if spec == "one" else f"{corpus}:1,{_second_corpus(tiny_env, tmp_path)}:1"
    first = load_tokens(spec, tiny_env["tokenizer"], 0.2, tmp_path / "cache")
    want = {s: np.array(first.tokens(s)) for s in ("train", "val")}
    val = first.path / "val.bin"
    if damage == "rewritten":  # the same size, other tokens
        val.write_bytes(np.full(len(want["val"]), 7, dtype=want["val"].dtype).tobytes())
    elif damage == "truncated":
        val.write_bytes(val.read_bytes()[:10])
    else:
        meta = json.loads((first.path / "meta.json").read_text())
        del meta["sha256"]
        (first.path / "meta.json").write_text(json.dumps(meta))
    again = load_tokens(spec, tiny_env["tokenizer"], 0.2, tmp_path / "cache")
    assert again.path == first.path and "sha256" in again.meta
    for s in ("train", "val"):
        assert np.array_equal(np.array(again.tokens(s)), want[s])


def _second_corpus(tiny_env, tmp_path):
    from conftest import make_corpus

    return str(make_corpus(tmp_path / "second", n_docs=40, seed=5))
