"""``train --reweight-every K`` (``bdlora.train.reweight``): the mixture's weights move toward the component where the
student trails the teacher most, the batches follow the weights, and a resumed run continues the same stream."""

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.data.blocks import PackedBlocks
from bdlora.train.reweight import SMOOTHING, Reweighter, next_weights
from conftest import assert_same_tensors, stop_at, train_args

OTHER = "0 1 2 3 4 5 6 7 8 9 # $ % & @ ~ 10 20 30 40 50 60 70 80 90 ## $$ %% &&\n"  # no byte of WORDS' text


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A second corpus, of digits and symbols the tiny corpus never holds."""
    folder = tmp_path_factory.mktemp("digits") / "corpus"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        words = OTHER.split()
        (folder / f"d{i:02d}.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(12)) + "\n")
    return folder


@given(w=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=6), data=st.data())
def test_next_weights_is_a_distribution_moved_toward_larger_gaps(w, data):
    w = np.asarray(w) / np.sum(w)
    gaps = data.draw(st.lists(st.floats(0.0, 5.0), min_size=len(w), max_size=len(w)))
    out = next_weights(w, gaps)
    assert out.sum() == pytest.approx(1.0, abs=1e-9) and np.all(out >= SMOOTHING / len(w) - 1e-12)
    before = (out - SMOOTHING / len(w)) / (1 - SMOOTHING)  # the exponentiated step alone
    for i in range(len(w)):
        for j in range(len(w)):
            if gaps[i] > gaps[j]:
                assert before[i] / w[i] >= before[j] / w[j] * (1 - 1e-9)
    np.testing.assert_allclose(next_weights(w, [0.0] * len(w)), (1 - SMOOTHING) * w + SMOOTHING / len(w))


def test_the_batches_follow_the_weights_and_are_a_function_of_seed_and_index():
    blocks = [PackedBlocks(np.arange(640) % 50, 32), PackedBlocks(np.arange(640) % 50 + 50, 32)]
    mix = Reweighter(["a", "b"], blocks, blocks, [0.9, 0.1], seed=3, every=1)
    picks = mix.indices(0, 4000)
    share = sum(c == 0 for c, _ in picks) / len(picks)
    assert 0.88 < share < 0.92
    assert picks[100:110] == mix.indices(100, 10)  # sequence k does not depend on the batch it is drawn in
    x, mask = mix.batch(picks[:5])
    assert x.shape == (5, 32) and mask is None
    assert all((x[r] >= 50).all() == (picks[r][0] == 1) for r in range(5))


def test_weight_moves_to_the_component_made_harder_for_the_student(tiny_env, tiny_model, digits):
    """A student equal to the teacher except for the embeddings of the tokens only the digits corpus uses: its gap
    there is large, on the tiny corpus near zero, and one update moves weight to the digits."""
    tok = tiny_env["tokenizer"]

    def blocks(folder):
        ids = tok("\n".join(p.read_text() for p in sorted(folder.glob("*.txt"))))["input_ids"]
        return PackedBlocks(np.asarray(ids), 32)

    a, b = blocks(tiny_env["corpus"]), blocks(digits)
    only_b = sorted(set(b.tokens.tolist()) - set(a.tokens.tolist()))
    assert len(only_b) >= 5
    student = copy.deepcopy(tiny_model)
    with torch.no_grad():
        emb = student.get_input_embeddings().weight
        emb[only_b] = torch.randn(len(only_b), emb.shape[1], generator=torch.Generator().manual_seed(0)) * 3
    held = [PackedBlocks(x.tokens[:32 * 8], 32) for x in (a, b)]
    mix = Reweighter(["tiny", "digits"], [a, b], held, [0.5, 0.5], seed=0, every=1)
    rec = mix.update(1, student, tiny_model)
    assert rec["gaps"][1] > 0.5 and rec["gaps"][1] > 10 * rec["gaps"][0]
    assert rec["weights"][1] > 0.6
    again = mix.update(2, student, tiny_model)
    assert again["weights"][1] > rec["weights"][1]  # it keeps moving while the gap stays
    assert mix.summary()["updates"] == 2 and mix.summary()["initial_weights"] == [0.5, 0.5]


def test_train_reweights_a_mixture_and_logs_the_weights(tiny_env, tmp_path, digits):
    data = f"{tiny_env['corpus']}:1,{digits}:1"
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "r", "--data", data, "--reweight-every", "2",
                                           "--max-steps", "6", "--method", "kd-lora"))
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    mix = s["mixture"]
    assert mix["updates"] == 2 and mix["every"] == 2 and len(mix["final_weights"]) == 2
    assert mix["final_weights"] != mix["initial_weights"]
    logged = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "mixture_weights" in m] == [2, 4]
    assert logged[3]["mixture_weights"] == pytest.approx(mix["final_weights"])


def test_teacher_text_in_a_reweighted_mixture_is_generated_once(tiny_env, tmp_path, digits):
    """The mixture, its reweighting slices and the run's evaluation read the same teacher samples (continuing the
    other parts' prefixes); a run from before prefixes reads its own, without them."""
    from bdlora.base.runs import RunDir
    from bdlora.data.corpora import settings_tokens
    from bdlora.models.teacher import recorded_teacher

    cache = tmp_path / "cache"
    data = f"{tiny_env['corpus']}:1,{digits}:1,teacher:400:1"
    r = CliRunner().invoke(app, [*train_args(tiny_env, tmp_path / "r", "--data", data, "--reweight-every", "2",
                                             "--max-steps", "2", "--method", "kd-lora"), "--cache-dir", str(cache)])
    assert r.exit_code == 0, r.output
    made = sorted((cache / "corpora").glob("teacher-*"))
    assert len(made) == 1 and r.output.count("sampling 400 tokens from the teacher") == 1
    meta = json.loads((made[0] / "corpus.json").read_text())
    assert meta["prefix_sources"] == [str(tiny_env["corpus"]), str(digits)]
    run = RunDir(tmp_path / "r")
    assert run.facts().samples_prefixes and run.data_settings()["samples_prefixes"]
    recorded = run.data_settings()
    settings_tokens(recorded, tiny_env["tokenizer"], teacher=recorded_teacher(recorded))  # the run's corpus again:
    # nothing new sampled
    assert sorted((cache / "corpora").glob("teacher-*")) == made
    old = {**run.data_settings(), "samples_prefixes": False}  # as a run written before prefixes records it
    settings_tokens(old, tiny_env["tokenizer"], teacher=recorded_teacher(old))
    plain = [f for f in (cache / "corpora").glob("teacher-*") if f not in made]
    assert len(plain) == 1 and json.loads((plain[0] / "corpus.json").read_text())["prefix_sources"] == []


def test_reweighting_needs_a_mixture(tiny_env, tmp_path):
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "r", "--reweight-every", "2", "--max-steps", "2"))
    assert r.exit_code != 0 and "needs a --data mixture" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_resumed_reweighted_run_ends_bit_identical(tiny_env, tmp_path, digits):
    """The weights are in every checkpoint: a run stopped after one resumes to the same student as one that was
    not stopped."""
    from bdlora.train.config import TrainConfig
    from bdlora.train.loop import train

    common = dict(teacher=str(tiny_env["teacher"]), data=f"{tiny_env['corpus']}:1,{digits}:1",
                  cache_dir=str(tiny_env["cache"]), seq_len=32, batch_size=4, eval_tokens=512, heldout_fraction=0.1,
                  lr=3e-3, max_steps=6, eval_every=6, save_every=3, method="kd-lora", lora_rank=4, lora_alpha=8.0,
                  reweight_every=2, measure_step_time=False)
    full = train(TrainConfig(out=str(tmp_path / "a"), **common))
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=str(tmp_path / "b"), **common), reporter=stop_at(4))
    resumed = train(TrainConfig(), resume=tmp_path / "b")
    assert resumed["resumed_from"] == 3
    assert resumed["mixture"]["final_weights"] == full["mixture"]["final_weights"]
    assert_same_tensors(tmp_path / "a", tmp_path / "b", ("student/adapter/adapter_model.safetensors",))
