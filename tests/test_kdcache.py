"""--kd-topk: the top-k KD loss against the full one, the teacher's cached targets, and a run that reuses them."""

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bdlora.cli import app
from bdlora.train.distill import DistillationLoss
from bdlora.train.kdcache import TeacherTopK, cache_dir, row_key, teacher_topk
from bdlora.train.loop import train
from conftest import train_args


def _cfg(env, out, **kw):
    from bdlora.train.config import TrainConfig

    base = dict(teacher=str(env["teacher"]), data=str(env["corpus"]), cache_dir=str(env["cache"]), seq_len=32,
                batch_size=4, eval_tokens=512, heldout_fraction=0.1, lora_rank=4, lora_alpha=8.0, out=str(out),
                lr=3e-3, measure_step_time=False, save_every=0)
    return TrainConfig(**{**base, **kw})


def _recomputed(logp2, logp, index2=None, index=None):
    """A row computed again alone against the same row computed in a batch: the same targets to float rounding (the
    GEMM's blocking follows the batch size, so the bits differ between BLAS code paths: AVX2 against AVX-512)."""
    torch.testing.assert_close(logp2, logp, rtol=1e-5, atol=1e-6)
    assert index2 is None or torch.equal(index2, index)


def _heads(B=2, T=7, H=8, V=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T, H, generator=g, requires_grad=True)
    ht = torch.randn(B, T, H, generator=g)
    head_s, head_t = torch.nn.Linear(H, V, bias=False), torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head_s.weight, generator=g)
    torch.nn.init.normal_(head_t.weight, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    return hs, ht, head_s, head_t, ids


def _topk_targets(ht, head_t, k, tau):
    with torch.no_grad():
        return F.log_softmax(head_t(ht[:, :-1]) / tau, -1).topk(k, -1)


@pytest.mark.parametrize("masked", [False, True])
def test_topk_loss_at_full_vocabulary_equals_the_full_loss(masked):
    hs, ht, hds, hdt, ids = _heads()
    mask = torch.ones_like(ids)
    if masked:
        mask[1, 4:] = 0
    fn = DistillationLoss(3.0, 0.8, chunk_size=5)
    full, pf = fn(hs, hds, ht, hdt, ids, mask)
    (g_full,) = torch.autograd.grad(full, hs)
    logp, index = _topk_targets(ht, hdt, hdt.weight.shape[0], 3.0)
    top, pt = fn.forward_topk(hs, hds, logp, index, ids, mask)
    (g_top,) = torch.autograd.grad(top, hs)
    assert pt["positions"] == pf["positions"] == (12 - 3 if masked else 12)
    assert abs(float(top.detach()) - float(full.detach())) < 1e-5
    assert torch.allclose(g_top, g_full, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 22), tau=st.floats(0.5, 4.0), seed=st.integers(0, 10_000))
def test_topk_kl_is_a_lower_bound_of_the_full_kl(k, tau, seed):
    """KL over the partition {top-k tokens, the rest} never exceeds the full KL (data processing) and is >= 0."""
    hs, ht, hds, hdt, ids = _heads(seed=seed)
    fn = DistillationLoss(tau, 1.0, chunk_size=4)
    with torch.no_grad():
        _, full = fn(hs, hds, ht, hdt, ids)
        _, top = fn.forward_topk(hs, hds, *_topk_targets(ht, hdt, k, tau), ids)
    assert -1e-6 <= top["kd"] <= full["kd"] + 1e-5


def test_topk_loss_is_finite_with_a_confident_teacher():
    """Teacher mass all in the top k (the bucket's share rounds to 0): no NaN in the loss or its gradient."""
    hs, ht, hds, hdt, ids = _heads()
    with torch.no_grad():
        hdt.weight.mul_(200.0)
    loss, _ = DistillationLoss(1.0, 0.8).forward_topk(hs, hds, *_topk_targets(ht, hdt, 3, 1.0), ids)
    (g,) = torch.autograd.grad(loss, hs)
    assert torch.isfinite(loss) and torch.isfinite(g).all()


class _Counting:
    def __init__(self, model):
        self.calls = 0
        model.model.register_forward_hook(lambda *a: setattr(self, "calls", self.calls + 1))


def test_targets_are_computed_once_then_read(tiny_model, tmp_path):
    counter = _Counting(tiny_model)
    x = torch.randint(0, tiny_model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    cpu = torch.device("cpu")
    cache = TeacherTopK(tiny_model, 5, 2.0, tmp_path / "c", cpu)
    logp, index = cache.targets(x)
    assert counter.calls == 1 and (cache.hits, cache.misses) == (0, 3)
    ref_logp, ref_index = teacher_topk(tiny_model, x, 5, 2.0, cpu)
    assert torch.equal(logp, ref_logp) and torch.equal(index, ref_index) and logp.shape == (3, 8, 5)
    assert len(list((tmp_path / "c").rglob("*.safetensors"))) == 3
    again = TeacherTopK(tiny_model, 5, 2.0, tmp_path / "c", cpu)  # another run, same teacher and settings
    logp2, index2 = again.targets(x[[2, 0]])
    assert counter.calls == 2 and (again.hits, again.misses) == (2, 0)  # the reference above ran it once more
    assert torch.equal(logp2, logp[[2, 0]]) and torch.equal(index2, index[[2, 0]])
    assert json.loads((tmp_path / "c" / "cache.json").read_text())["k"] == 5


def test_a_damaged_entry_is_computed_again(tiny_model, tmp_path):
    cpu = torch.device("cpu")
    x = torch.randint(0, tiny_model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    cache = TeacherTopK(tiny_model, 4, 1.0, tmp_path, cpu)
    logp, _ = cache.targets(x)
    key = row_key(x[1].numpy())
    (tmp_path / key[:2] / f"{key}.safetensors").write_bytes(b"not a safetensors file")
    again = TeacherTopK(tiny_model, 4, 1.0, tmp_path, cpu)
    logp2, _ = again.targets(x)
    assert (again.hits, again.misses) == (1, 1)
    _recomputed(logp2, logp)


DAMAGES = {  # issue 53, case 4: entries of the right shape whose values no teacher_topk writes
    "logp +5": lambda logp, index: (torch.full_like(logp, 5.0), index),
    "logp NaN": lambda logp, index: (logp.masked_fill(torch.ones_like(logp, dtype=torch.bool), float("nan")), index),
    "logp -inf": lambda logp, index: (torch.full_like(logp, -float("inf")), index),
    "logp rising": lambda logp, index: (logp.flip(-1), index),
    "index 50000": lambda logp, index: (logp, torch.full_like(index, 50000)),
    "index -3": lambda logp, index: (logp, torch.full_like(index, -3)),
    "index repeated": lambda logp, index: (logp, index[:, :1].expand_as(index).contiguous()),
    "index as float": lambda logp, index: (logp, index.float()),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_entry_with_impossible_values_is_computed_again_and_replaced(tiny_model, tmp_path, damage):
    """Before: read 16/16 and trusted (+5 ended a run at perplexity 1256 instead of 279; NaN failed the run blaming
    the model; an index of 50000 or -3 was a traceback), and never replaced, so every rerun failed again."""
    from bdlora.base.io import load_tensors, save_tensors

    cpu = torch.device("cpu")
    x = torch.randint(0, tiny_model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    logp, index = TeacherTopK(tiny_model, 4, 1.0, tmp_path, cpu).targets(x)
    key = row_key(x[1].numpy())
    f = tmp_path / key[:2] / f"{key}.safetensors"
    stored = load_tensors(f)
    bad_logp, bad_index = DAMAGES[damage](stored["logp"], stored["index"])
    save_tensors(f, {"logp": bad_logp, "index": bad_index})
    again = TeacherTopK(tiny_model, 4, 1.0, tmp_path, cpu)
    logp2, index2 = again.targets(x)
    assert (again.hits, again.misses, again.replaced) == (1, 1, 1)
    _recomputed(logp2, logp, index2, index)
    third = TeacherTopK(tiny_model, 4, 1.0, tmp_path, cpu)  # the entry on disk was replaced by a good one
    third.targets(x)
    assert (third.hits, third.misses, third.replaced) == (2, 0, 0)


def test_cache_folder_is_keyed_by_teacher_and_settings(tmp_path):
    base = cache_dir(tmp_path, "abc", 32, 3.0, None)
    assert base == cache_dir(tmp_path, "abc", 32, 3.0, None)
    others = {cache_dir(tmp_path, "abd", 32, 3.0, None), cache_dir(tmp_path, "abc", 64, 3.0, None),
              cache_dir(tmp_path, "abc", 32, 2.0, None), cache_dir(tmp_path, "abc", 32, 3.0, "bf16")}
    assert base not in others and len(others) == 4


def test_a_rerun_reads_every_target_and_trains_the_same(tiny_env, tmp_path):
    """The second run of the same recipe never runs the teacher for a training batch and ends where the first did."""
    first = train(_cfg(tiny_env, tmp_path / "a", method="kd-lora", max_steps=6, eval_every=6, kd_topk=16))
    second = train(_cfg(tiny_env, tmp_path / "b", method="kd-lora", max_steps=6, eval_every=6, kd_topk=16))
    assert first["kd_topk"]["sequences_computed"] > 0
    assert second["kd_topk"]["sequences_computed"] == 0 and second["kd_topk"]["hit_rate"] == 1.0
    assert second["kd_topk"]["sequences_read"] == 6 * 4
    assert second["student_val_ppl"] == pytest.approx(first["student_val_ppl"], rel=1e-6)


def test_kd_topk_above_the_vocabulary_is_one_line(tiny_env, tmp_path):
    vocab = len(tiny_env["tokenizer"])
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "run", "--method", "kd-lora", "--max-steps", "1",
                                           "--kd-topk", str(vocab + 1)))
    assert r.exit_code == 2, r.output
    assert f"--kd-topk {vocab + 1}: must be between 1 and the teacher's vocabulary ({vocab})" in r.output
    assert not (tmp_path / "run").exists()
    r = CliRunner().invoke(app, train_args(tiny_env, tmp_path / "run", "--kd-topk", "-1"))
    assert r.exit_code == 2 and "--kd-topk -1: must be" in r.output
