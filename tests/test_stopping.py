"""Healing that stops on what it was not trained on and within a time budget (``bdlora.train.stopping``), and the
healing objective's defaults: ``train --eval-data`` keeps the step best on a corpus the run never trains on,
``--time-budget`` plans the step count from measured steps and stops before the budget, and a structure is healed
by full-vocabulary forward KL with the embeddings and head frozen."""

import itertools
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from typer.testing import CliRunner

from bdlora.base.errors import UsageError
from bdlora.cli import app
from bdlora.data.documents import DEFAULT_HELDOUT_FRACTION, is_heldout
from bdlora.forms.dials import TrainDials
from bdlora.train import stopping
from bdlora.train.config import OBJECTIVE_DEFAULTS, TrainConfig, resolve_defaults
from bdlora.train.distill import DistillationLoss
from bdlora.train.stopping import PROBE_STEPS, budget_steps, parse_duration
from conftest import make_corpus, train_args

CALIB = ("--calib-tokens", "512")
HEAL = ("--method", "kd-full", "--student-layers", "4", *CALIB, "--forms", "channels", "--mac-ratio", "1.3")


@pytest.fixture(scope="module")
def other_corpus(tmp_path_factory):
    """A second corpus of the same kind of text, never named by --data: a JSONL file whose records' ids put 24 of
    them in the held-out slice of a user corpus (0.2% of the id hash space)."""
    texts = sorted(make_corpus(tmp_path_factory.mktemp("other") / "docs", n_docs=30, seed=7).glob("*.txt"))
    ids = (f"e{i}" for i in itertools.count() if is_heldout(f"e{i}", DEFAULT_HELDOUT_FRACTION))
    path = tmp_path_factory.mktemp("other") / "unseen.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t.read_text()}) + "\n"
                            for i, t in zip(itertools.islice(ids, 24), texts)) +
                    "".join(json.dumps({"id": f"t{k}", "text": t.read_text()}) + "\n" for k, t in enumerate(texts)))
    return path


def run(env, out, *extra):
    r = CliRunner().invoke(app, train_args(env, out, *extra))
    return r


# --------------------------------------------------------------------------------------------------------------------
# --eval-data: the best step on unseen text
# --------------------------------------------------------------------------------------------------------------------


def test_eval_data_scores_every_validation_and_keeps_the_best_step(tiny_env, tmp_path, other_corpus):
    """Every validation scores --eval-data; the saved student is the step with the lowest figure there (its weights
    bit for bit those of RUN/best/), and the summary names that step and the figures."""
    r = run(tiny_env, tmp_path / "r", *HEAL, "--max-steps", "6", "--eval-every", "2", "--lr", "3e-2",
            "--eval-data", str(other_corpus))
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    logged = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    scored = {m["step"]: m["eval_data_ppl"] for m in logged if "eval_data_ppl" in m}
    assert sorted(scored) == [2, 4, 6]
    scored[0] = summary["eval_data_ppl_initial"]
    best = min(scored, key=scored.get)
    assert summary["best_step"] == best
    assert summary["eval_data_ppl_best"] == pytest.approx(scored[best], rel=1e-12)
    assert summary["eval_data_ppl_last"] == pytest.approx(scored[6], rel=1e-12)
    assert summary["kept"] == ("last" if best == 6 else "best")
    kept = load_file(tmp_path / "r" / "best" / "trainable.safetensors")
    student = load_file(tmp_path / "r" / "student" / "model.safetensors")
    for name, t in kept.items():
        key = name.removeprefix("base_model.model.")
        if key in student:
            assert torch.equal(student[key], t), name


def test_the_best_step_is_kept_when_training_makes_unseen_text_worse(tiny_env, tmp_path, other_corpus):
    """A learning rate that wrecks the student: the last step is the worst on --eval-data, so the saved student
    is an earlier step's and the summary says so."""
    r = run(tiny_env, tmp_path / "r", *HEAL, "--max-steps", "4", "--eval-every", "1", "--lr", "3.0",
            "--grad-clip", "100", "--eval-data", str(other_corpus))
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["kept"] == "best" and s["best_step"] < 4
    assert s["eval_data_ppl_best"] < s["eval_data_ppl_last"]


def test_eval_data_never_enters_a_training_batch(tiny_env, tmp_path, other_corpus, monkeypatch):
    """Every training batch of the run is drawn from --data's training blocks: none holds a sequence of the
    --eval-data slice the run is scored on."""
    from bdlora.train import session as S

    seen, scored = [], {}
    real = S.prepare

    def prepare(cfg, reporter=None, **kw):
        sess = real(cfg, reporter, **kw)
        scored["blocks"] = {tuple(r) for r in sess.eval_blocks.get(range(len(sess.eval_blocks)))}
        batch = sess.train_blocks.batch
        sess.train_blocks.batch = lambda idx: (seen.append(b := batch(idx)), b)[1]
        return sess

    monkeypatch.setattr("bdlora.train.loop.prepare", prepare)
    r = run(tiny_env, tmp_path / "r", *HEAL, "--max-steps", "3", "--eval-data", str(other_corpus))
    assert r.exit_code == 0, r.output
    assert len(seen) == 3 and scored["blocks"]
    rows = {tuple(row.tolist()) for x, _ in seen for row in x}
    assert not rows & scored["blocks"]


@pytest.mark.parametrize("eval_data, needle", [
    ("DATA", "is in --data"),
    ("builtin:1,DATA:1", "is in --data"),
])
def test_eval_data_that_is_trained_on_is_refused(tiny_env, tmp_path, eval_data, needle):
    corpus = str(tiny_env["corpus"])
    r = run(tiny_env, tmp_path / "r", "--max-steps", "2", "--eval-data", eval_data.replace("DATA", corpus))
    assert r.exit_code != 0 and needle in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_budgeted_run_keeps_no_step_from_before_its_decay_ends(tiny_env, tmp_path, other_corpus):
    """Before the budget schedule is over the student still has the dense paths the budget removes: no step
    before --decay-end is a candidate, whatever its score."""
    r = run(tiny_env, tmp_path / "r", "--max-steps", "6", "--eval-every", "1", "--budget", "0", "--decay-start", "0",
            "--decay-end", "0.6", "--eval-data", str(other_corpus))
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["best_step"] >= 4  # step k runs at progress (k - 1) / 5: 0.6 is reached at step 4


# --------------------------------------------------------------------------------------------------------------------
# --time-budget
# --------------------------------------------------------------------------------------------------------------------


def test_parse_duration():
    assert parse_duration("90s") == 90 and parse_duration("60m") == 3600 and parse_duration("1.5h") == 5400
    assert parse_duration("45") == 45 and parse_duration(None) is None
    for bad in ("0", "-5m", "1d", "m", "ten minutes", ""):
        with pytest.raises(ValueError, match="--time-budget"):
            parse_duration(bad)


@given(left=st.floats(0, 1e5), step=st.floats(1e-3, 100), ev=st.floats(0, 100), every=st.integers(1, 1000))
def test_the_planned_steps_fit_and_one_more_would_not(left, step, ev, every):
    """The planned count n fits: n steps, a validation every ``every`` steps and one at the end take at most the
    time left, and n + 1 would exceed it (when any fits)."""
    n = budget_steps(left, step, ev, every)
    cost = lambda k: k * step + (k / every) * ev + ev  # noqa: E731
    assert n >= 0
    if n > 0:
        assert cost(n) <= left * (1 + 1e-9) + 1e-9
    assert cost(n + 1) > left * (1 - 1e-9) - 1e-9


class FakeClock:
    """A clock that the training loop drives: every read after the start adds ``tick`` seconds, so a run's
    timing is a function of its code path, never of the machine."""

    def __init__(self, tick: float):
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def test_time_budget_plans_the_steps_and_stops_before_the_budget(tiny_env, tmp_path, monkeypatch):
    """With a clock that advances one second a read, the run plans its steps after the probe, writes the planned
    count to config.json, ends within the budget with the last step's student saved and says so."""
    clock = FakeClock(1.0)
    monkeypatch.setattr(stopping, "now", clock)
    r = run(tiny_env, tmp_path / "r", "--method", "kd-lora", "--time-budget", "40s", "--eval-every", "5")
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    tb = s["time_budget"]
    assert tb["seconds"] == 40 and tb["planned_steps"] is not None
    assert tb["used_seconds"] <= 40
    assert PROBE_STEPS < s["steps"] <= tb["planned_steps"]
    assert json.loads((tmp_path / "r" / "config.json").read_text())["config"]["max_steps"] == tb["planned_steps"]
    logged = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, s["steps"] + 1))
    assert "val_ppl" in logged[-1]  # the finish validated the last step
    assert (tmp_path / "r" / "student" / "model.safetensors").is_file()


def test_time_budget_stops_within_one_step_when_steps_slow_down(tiny_env, tmp_path, monkeypatch, other_corpus):
    """Steps that get slower than the probe measured: the run stops early (before the plan), with the finish
    still inside the budget and the best step on --eval-data kept."""
    clock = FakeClock(1.0)
    monkeypatch.setattr(stopping, "now", clock)
    real = stopping.TimeBudget.after_step

    def slower(self, done, start_step, eval_every):
        if done > PROBE_STEPS + 1:
            clock.t += 3.0  # each later step costs 4 s instead of 1
        return real(self, done, start_step, eval_every)

    monkeypatch.setattr(stopping.TimeBudget, "after_step", slower)
    r = run(tiny_env, tmp_path / "r", *HEAL, "--time-budget", "60", "--eval-every", "3", "--eval-data",
            str(other_corpus))
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    tb = s["time_budget"]
    assert tb["stopped_by_budget"] and s["steps"] < tb["planned_steps"]
    assert tb["used_seconds"] <= 60
    assert 60 - tb["used_seconds"] < 4 + tb["eval_seconds"] * 2 + 60 * stopping.FINISH_SHARE + 4  # within a step
    assert s["best_step"] is not None and (tmp_path / "r" / "best" / "best.json").is_file()


@pytest.mark.parametrize("extra, needle", [
    (("--time-budget", "soon"), "--time-budget soon: a positive duration"),
    (("--time-budget", "10m", "--max-steps", "5"), "drop --max-steps"),
    (("--time-budget", "10m", "--tokens", "5000"), "drop --max-steps / --tokens"),
])
def test_time_budget_refusals(tiny_env, tmp_path, extra, needle):
    r = run(tiny_env, tmp_path / "r", *extra)
    assert r.exit_code != 0 and needle in r.output, r.output
    assert not (tmp_path / "r").exists()


def test_a_time_budget_flag_replaces_a_recipes_step_count():
    """`train --config smollm2-cpu --time-budget 60m` was refused ("drop --max-steps") for the recipe's max_steps:
    the length of a run is one setting given three ways, and a flag giving any of them replaces the file's."""
    from bdlora.train.config import merge
    from bdlora.train.option_files import load_yaml

    recipe = load_yaml("smollm2-cpu")
    assert recipe["max_steps"] == 150
    cfg = resolve_defaults(merge(recipe, {"time_budget": "60m"}), builtin_teacher=False).validate()
    assert cfg.time_budget == "60m" and "max_steps" in cfg.defaulted and cfg.lr == recipe["lr"]
    cfg = merge({**recipe, "time_budget": "60m"}, {"tokens": 4096})
    assert (cfg.max_steps, cfg.tokens, cfg.time_budget) == (None, 4096, None)
    with pytest.raises(UsageError, match="drop --max-steps"):  # both as flags: still refused
        resolve_defaults(merge(recipe, {"time_budget": "60m", "max_steps": 5}), builtin_teacher=False).validate()


# --------------------------------------------------------------------------------------------------------------------
# The healing objective
# --------------------------------------------------------------------------------------------------------------------


CHANNELS_13 = TrainDials(forms="channels", mac_ratio=1.3)


def test_a_structure_heals_with_embeddings_frozen_and_the_paper_keeps_its_own():
    """The measured default objective (the paper's KL at tau 3 with 0.2 cross-entropy, for both) and the healing
    default of a frozen head; explicit flags win either way."""
    heal = resolve_defaults(TrainConfig(method="kd-full", dials=CHANNELS_13), builtin_teacher=True)
    paper = resolve_defaults(TrainConfig(method="kd-full"), builtin_teacher=True)
    assert (heal.temperature, heal.kd_weight, heal.freeze_embeddings) == (3.0, 0.8, True)
    assert (paper.temperature, paper.kd_weight, paper.freeze_embeddings) == (3.0, 0.8, False)
    assert "freeze_embeddings" in heal.defaulted
    mine = resolve_defaults(TrainConfig(method="kd-full", dials=CHANNELS_13, kd_weight=1.0,
                                        temperature=1.0, freeze_embeddings=False), builtin_teacher=True)
    assert (mine.temperature, mine.kd_weight, mine.freeze_embeddings) == (1.0, 1.0, False)
    assert OBJECTIVE_DEFAULTS["heal"].keys() == OBJECTIVE_DEFAULTS["paper"].keys()


def test_the_healing_loss_is_the_full_vocabulary_forward_kl():
    """At tau 1 and lambda 1 the loss is mean over positions of KL(p_teacher || p_student) over the whole
    vocabulary, to 1e-5 against a direct computation (no cross-entropy term)."""
    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(2, 9, 16, generator=g), torch.randn(2, 9, 16, generator=g)
    head_s, head_t = torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(16, 50, bias=False)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    loss, parts = DistillationLoss(1.0, 1.0, chunk_size=5)(hs, head_s, ht, head_t, ids)
    pt = torch.softmax(head_t(ht[:, :-1]), -1)
    want = (pt * (pt.log() - torch.log_softmax(head_s(hs[:, :-1]), -1))).sum(-1).mean()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert parts["positions"] == 16


def test_a_healed_structure_keeps_the_teachers_embeddings_and_head(tiny_env, tmp_path):
    """kd-full healing a --forms structure: every other weight moves, the embeddings and LM head are the
    teacher's bit for bit."""
    r = run(tiny_env, tmp_path / "r", *HEAL, "--max-steps", "2")
    assert r.exit_code == 0, r.output
    start = load_file(tmp_path / "r" / "structure" / "model.safetensors")
    healed = load_file(tmp_path / "r" / "student" / "model.safetensors")
    frozen = [k for k in start if "embed_tokens" in k or k.startswith("lm_head")]
    assert frozen and all(torch.equal(start[k], healed[k]) for k in frozen)
    assert any(not torch.equal(start[k], healed[k]) for k in start if k not in frozen)


def test_a_budget_spent_before_the_first_step_is_refused_in_one_line(tiny_env, tmp_path, monkeypatch):
    """Loading and calibration that eat the budget: the run says so before training, not after a step past it."""
    clock = FakeClock(1.0)
    monkeypatch.setattr(stopping, "now", clock)
    real = stopping.TimeBudget.begin

    def late(self):
        clock.t += 100.0  # the start took 100 s of a 60 s budget
        return real(self)

    monkeypatch.setattr(stopping.TimeBudget, "begin", late)
    r = run(tiny_env, tmp_path / "r", "--method", "kd-lora", "--time-budget", "60")
    assert r.exit_code != 0 and "went before the first step" in r.output, r.output
    assert "Traceback" not in r.output
