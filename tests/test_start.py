"""Low-rank paths that start from the teacher's weights (issue 29): the whitened start leaves the student unchanged
at d = 1, the dense path holds the residual, the paper's compression cases stay exact on that form, the quality
allocation drives the controller, and runs store their start so resumes and other processes never recompute it."""

import copy
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.compress.start import LowRankStart, compute_start
from bdlora.data.blocks import PackedBlocks
from bdlora.data.documents import Corpus
from bdlora.data.tokens import tokenize_corpus
from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.models.budgeted.model import apply_budgeted_lora, gated_modules
from bdlora.train.budgeted.start import start_gated
from bdlora.train.config import TrainConfig
from bdlora.train.methods import Budgeted, KDLoRA
from bdlora.train.student import build_student
from conftest import assert_same_tensors, stop_at, train_args

TH = BudgetedConfig(eps_zero=1e-3, eps_lr=0.7, gate_threshold=0.3, svd_max_rank=8)


@pytest.fixture(scope="module")
def blocks(tiny_env):
    data = tokenize_corpus(Corpus(tiny_env["corpus"]), tiny_env["tokenizer"], 0.1, tiny_env["cache"])
    return PackedBlocks(data.tokens("train"), 32)


@pytest.fixture(scope="module")
def student_and_start(tiny_env, blocks):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32).eval()
    student, _ = build_student(teacher, 4, "first")
    start = compute_start(student, "whitened", "quality", rank=4, budget=0.4, mac_ratio=2.0, blocks=blocks,
                          calib_tokens=512)
    return student.eval(), start


def _cfg(**kw):
    return TrainConfig(lora_rank=4, lora_alpha=8.0, measure_step_time=False, **kw)


def _ids(tiny_env):
    return torch.tensor([tiny_env["tokenizer"]("alpha beta gamma delta. one two three four five")["input_ids"]])


@pytest.mark.parametrize("method", [Budgeted, KDLoRA])
def test_the_whitened_start_leaves_the_student_unchanged_at_d_1(tiny_env, student_and_start, method):
    student, start = student_and_start
    wrapped = method(_cfg(method=method.name)).wrap(copy.deepcopy(student), start).eval()
    x = _ids(tiny_env)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x).logits, student(x).logits, rtol=1e-5, atol=1e-5)


def test_the_dense_path_holds_the_residual(student_and_start):
    """Per module: residual + (alpha / r) B diag(g) A == W, and the low-rank path is the stored factors' B A."""
    student, start = student_and_start
    wrapped = copy.deepcopy(student)
    apply_budgeted_lora(wrapped, 4, 8.0, ranks=start.ranks)
    gated = gated_modules(wrapped)
    start_gated(gated, start)
    dense = dict(student.named_modules())
    for name, m in gated.items():
        w = dense[name].weight.detach().double()
        total = m.base_layer.weight.double() + m.low_rank_weight()
        torch.testing.assert_close(total, w, rtol=0, atol=1e-6 * float(w.abs().max()))
        a, b = start.factors[name]
        torch.testing.assert_close(m.low_rank_weight(), b.double() @ a.double(), rtol=1e-5, atol=1e-7)
        assert m.rank == start.ranks[name] == a.shape[0]


@pytest.mark.parametrize("d,case", [(0.0, "dropped"), (0.85, "kept"), (1.0, "kept")])
def test_compression_cases_1_and_3_stay_exact_on_the_residual_form(student_and_start, d, case):
    student, start = student_and_start
    wrapped = copy.deepcopy(student)
    apply_budgeted_lora(wrapped, 4, 8.0, ranks=start.ranks)
    gated = gated_modules(wrapped)
    start_gated(gated, start)
    for name, m in gated.items():
        m.set_retention(d)
        dep = m.to_deployed(name, TH)
        assert dep.decision.case in (case, "merged-cheaper")
        x = torch.randn(5, m.in_features)
        with torch.no_grad():
            torch.testing.assert_close(dep.module()(x), m(x), rtol=1e-5, atol=1e-5)


def test_compression_case_2_is_the_truncated_svd_of_the_residual():
    """SVD case on the residual form: the deployed pair differs from the trained module by at most the first
    discarded singular value of d (W - B A), exactly as on the paper's form (SPEC 6.2)."""
    from bdlora.compress.forms.lowrank import factors, spectrum
    from bdlora.models.budgeted.layer import GatedLoRALinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 200)
    m = GatedLoRALinear(lin, rank=4, alpha=8.0)
    x = torch.randn(300, 24)
    a, b = factors(lin.weight, spectrum(lin.weight, (x.T @ x).double()), 4)
    m.start_from(a.float(), b.float())
    m.set_retention(0.35)
    dep = m.to_deployed("m", TH)
    assert dep.decision.case == "svd" and dep.decision.svd_rank == 4 and dep.decision.rank == 8
    s = torch.linalg.svdvals(0.35 * m.base_layer.weight.detach().double())
    with torch.no_grad():
        err = (dep.module()(x) - m(x)).double().norm(dim=1)
    assert float((err / x.double().norm(dim=1)).max()) <= float(s[4]) * (1 + 1e-4)


def test_the_quality_allocation_drives_the_controller_to_exactly_its_structure(student_and_start):
    student, start = student_and_start
    cfg = _cfg(method="budgeted", decay_start=0.0, decay_end=0.0, retention_ema=0.0)
    method = Budgeted(cfg)
    method.wrap(copy.deepcopy(student), start)
    method.before_step(1.0)
    dropped = {n for n, r in start.allocation.ranks.items() if r}
    assert dropped and {n for n, m in method.gated.items() if m.d == 0.0} == dropped
    assert all(m.d == 1.0 for n, m in method.gated.items() if n not in dropped)
    assert start.allocation.mac_ratio(_shapes(student)) >= 2.0
    for n in dropped:
        assert method.gated[n].rank == start.allocation.ranks[n]


def _shapes(model):
    from bdlora.compress.start import shapes_of

    return shapes_of(model)


def test_a_start_round_trips_through_its_files(student_and_start, tmp_path):
    _, start = student_and_start
    start.save(tmp_path / "s.json", tmp_path / "s.safetensors")
    back = LowRankStart.load(tmp_path / "s.json", tmp_path / "s.safetensors")
    assert back.ranks == start.ranks and back.allocation.to_json() == start.allocation.to_json()
    assert all(torch.equal(back.factors[n][k], start.factors[n][k]) for n in start.factors for k in (0, 1))


def test_plain_svd_start_is_worse_on_real_inputs_than_whitened(student_and_start, blocks):
    """On the calibration tokens, every module's whitened factors approximate it at least as well as plain SVD
    of the same rank (in the activation norm)."""
    from bdlora.compress.calibrate import calibrate, calibration_blocks
    from bdlora.compress.forms.lowrank import factors, spectrum

    student, _ = student_and_start
    calib = calibrate(student, calibration_blocks(blocks, 512), fisher=False)
    for name, m in list(dict(student.named_modules()).items()):
        if not name.endswith(("q_proj", "down_proj")):
            continue
        gram = calib.gram(name)
        w = m.weight.detach().double()
        for r in (2, 6):
            wa, wb = factors(w, spectrum(w, gram), r)
            pa, pb = factors(w, spectrum(w, None), r)
            ew = float(torch.trace((w - wb @ wa) @ gram @ (w - wb @ wa).T))
            ep = float(torch.trace((w - pb @ pa) @ gram @ (w - pb @ pa).T))
            assert ew <= ep * (1 + 1e-9)


def test_a_run_stores_its_start_and_resume_never_recomputes_it(tiny_env, tmp_path, monkeypatch):
    from bdlora.train.loop import train

    common = dict(teacher=str(tiny_env["teacher"]), data=str(tiny_env["corpus"]), cache_dir=str(tiny_env["cache"]),
                  seq_len=32, batch_size=4, eval_tokens=512, heldout_fraction=0.1, lr=3e-3, max_steps=8,
                  eval_every=8, save_every=4, calib_tokens=512, method="budgeted")
    full = train(_cfg(out=str(tmp_path / "a"), **common))
    assert full["lora_init"] == "whitened" and full["allocation"]["rule"] == "quality"
    meta = json.loads((tmp_path / "a" / "lora_start.json").read_text())
    assert meta["init"] == "whitened" and meta["calib_tokens"] == 512 and len(meta["ranks"]) == 14

    class Stop(Exception):
        pass

    with pytest.raises(KeyboardInterrupt):
        train(_cfg(out=str(tmp_path / "b"), **common), reporter=stop_at(6))

    def recompute(*a, **k):
        raise Stop("a resumed run recomputed its start")

    monkeypatch.setattr("bdlora.train.forms_start.compute_start", recompute)
    resumed = train(TrainConfig(), resume=tmp_path / "b")
    assert resumed["resumed_from"] == 4
    assert_same_tensors(tmp_path / "a", tmp_path / "b",
                        ("student/model.safetensors", "student/budgeted.safetensors", "lora_start.safetensors"))


def test_calibration_beyond_the_training_split_is_one_line(tiny_env, tmp_path):
    res = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "out", "--calib-tokens", "100000000"))
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert "--calib-tokens 100000000: the training split holds" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_defaulted_calibration_fits_the_split(tiny_env, tmp_path):
    """The default 8192 tokens exceed the tiny corpus: a defaulted count is lowered to the split, not refused."""
    from bdlora.train.session import prepare

    sess = prepare(TrainConfig(teacher=str(tiny_env["teacher"]), data=str(tiny_env["corpus"]),
                               cache_dir=str(tiny_env["cache"]), seq_len=32, heldout_fraction=0.1, lora_rank=4,
                               lora_alpha=8.0))
    assert sess.cfg.calib_tokens == min(8192, len(sess.train_blocks) * 32)
    assert np.isfinite(sess.cfg.calib_tokens)
