import math

import torch
import torch.nn.functional as F

from bdlora.train.distill import DistillationLoss


def _setup(B=2, T=7, H=8, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T, H, generator=g, requires_grad=True)
    ht = torch.randn(B, T, H, generator=g)
    head_s = torch.nn.Linear(H, V, bias=False)
    head_t = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head_s.weight, generator=g)
    torch.nn.init.normal_(head_t.weight, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    return hs, ht, head_s, head_t, ids


@torch.no_grad()
def _hand_loss(hs, ht, head_s, head_t, ids, mask, tau, lam):
    """Loop over positions, straight from SPEC 3."""
    kd, ce, n = 0.0, 0.0, 0
    B, T, _ = hs.shape
    for b in range(B):
        for t in range(T - 1):
            if mask is not None and not (mask[b, t] and mask[b, t + 1]):
                continue
            zs, zt = head_s(hs[b, t]).double(), head_t(ht[b, t]).double()
            pt = torch.softmax(zt / tau, -1)
            kd += float((pt * (torch.log(pt) - torch.log_softmax(zs / tau, -1))).sum())
            ce += float(-torch.log_softmax(zs, -1)[ids[b, t + 1]])
            n += 1
    return lam * tau**2 * kd / n + (1 - lam) * ce / n, n


def test_matches_hand_computation():
    hs, ht, hds, hdt, ids = _setup()
    loss, parts = DistillationLoss(3.0, 0.8, chunk_size=5)(hs, hds, ht, hdt, ids)
    expected, n = _hand_loss(hs, ht, hds, hdt, ids, None, 3.0, 0.8)
    assert parts["positions"] == n == 2 * 6
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)


def test_tau_squared_scaling():
    hs, ht, hds, hdt, ids = _setup()
    for tau in (1.0, 2.0, 4.0):
        _, parts = DistillationLoss(tau, 1.0)(hs, hds, ht, hdt, ids)
        raw = 0.0
        zs, zt = hds(hs[:, :-1]).reshape(-1, 11), hdt(ht[:, :-1]).reshape(-1, 11)
        raw = F.kl_div(F.log_softmax(zs / tau, -1), F.log_softmax(zt / tau, -1), log_target=True,
                       reduction="batchmean")
        assert math.isclose(parts["kd"], tau**2 * raw.item(), rel_tol=1e-5)


def test_masking_ignores_padding():
    hs, ht, hds, hdt, ids = _setup()
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # right padding in sequence 0
    mask[1, :2] = 0  # left padding in sequence 1
    loss, parts = DistillationLoss(2.0, 0.5)(hs, hds, ht, hdt, ids, mask)
    expected, n = _hand_loss(hs, ht, hds, hdt, ids, mask, 2.0, 0.5)
    assert parts["positions"] == n == 3 + 4
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)
    # changing what sits under the padding changes nothing
    hs2 = hs.detach().clone()
    hs2[0, 5:] += 100.0
    loss2, _ = DistillationLoss(2.0, 0.5)(hs2, hds, ht, hdt, ids, mask)
    assert math.isclose(loss.item(), loss2.item(), rel_tol=1e-6)


def test_chunked_equals_unchunked_including_gradients():
    hs, ht, hds, hdt, ids = _setup(B=3, T=9)
    grads = []
    losses = []
    # checkpoint_bytes 0: every chunk recomputed in backward; the default keeps these tiny logits instead
    for chunk, limit in ((1, 0), (4, 0), (1000, 0), (4, 1 << 30), (1000, 1 << 30)):
        hs_ = hs.detach().clone().requires_grad_(True)
        loss, _ = DistillationLoss(3.0, 0.8, chunk_size=chunk, checkpoint_bytes=limit)(hs_, hds, ht, hdt, ids)
        loss.backward()
        losses.append(loss.item())
        grads.append(hs_.grad.clone())
    for l_, g in zip(losses[1:], grads[1:]):
        assert math.isclose(l_, losses[0], rel_tol=1e-6)
        torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-7)


def test_right_padding_with_mask_equals_the_unpadded_document(tiny_model):
    """--packing truncate's premise: under causal attention right padding changes no real position, so the masked
    loss (and its gradient) of a padded document equals the loss of the document alone."""
    import copy

    from bdlora.train.distill import kd_step

    student = copy.deepcopy(tiny_model).train()
    doc = torch.tensor([[5, 9, 17, 3, 11, 2]])
    padded = torch.cat([doc, torch.full((1, 4), 0)], dim=1)
    mask = torch.cat([torch.ones(1, 6, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)], dim=1)
    loss_fn = DistillationLoss(2.0, 0.5)
    grads = []
    for x, m in ((doc, None), (padded, mask)):
        loss, parts = kd_step(student, tiny_model, loss_fn, x, torch.device("cpu"), mask=m)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]))
        student.zero_grad(set_to_none=True)
        assert parts["positions"] == 5
        grads.append(float(loss.detach()))
    assert math.isclose(grads[1], grads[3], rel_tol=1e-5)
    assert torch.allclose(grads[0], grads[2], atol=1e-6, rtol=1e-4)


def test_a_bf16_step_on_the_cpu_is_within_tolerance_of_fp32(tiny_env):
    """--autocast bf16 (issue 41): the same micro-batch's loss and gradients in bf16 autocast stay close to fp32
    (the master weights stay fp32; only the matmuls run in bf16)."""
    import copy

    from transformers import AutoModelForCausalLM

    from bdlora.train.distill import kd_step

    teacher = AutoModelForCausalLM.from_pretrained(tiny_env["teacher"], dtype=torch.float32).eval()
    student = copy.deepcopy(teacher).train()
    with torch.no_grad():
        for p in student.parameters():
            p.mul_(0.9)
    x = torch.randint(0, teacher.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    loss_fn, cpu = DistillationLoss(3.0, 0.8, 1024), torch.device("cpu")
    got = {}
    for mode in ("fp32", "bf16"):
        student.zero_grad()
        loss, _ = kd_step(student, teacher, loss_fn, x, cpu, precision=mode)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])
        assert all(p.dtype == torch.float32 for p in student.parameters())
        got[mode] = (float(loss), grad)
    (l32, g32), (l16, g16) = got["fp32"], got["bf16"]
    assert l16 != l32 and abs(l16 - l32) / l32 < 0.02
    assert F.cosine_similarity(g16, g32, dim=0) > 0.99


def test_a_draft_head_keeping_some_tokens_is_fitted_over_those():
    """A student head with ``token_ids`` (a draft's VocabHead): the KL is the teacher's distribution renormalised on
    the kept tokens against the student's over them, the CE counts the positions whose next token is kept."""
    from bdlora.deployed.modeling_bdlora import VocabHead
    from bdlora.train.distill import DistillationLoss

    torch.manual_seed(0)
    vocab, hidden, n = 12, 8, 10
    head = VocabHead(hidden, 4, vocab)
    torch.nn.init.normal_(head.weight)
    head.token_ids.copy_(torch.tensor([1, 3, 5, 7]))
    teacher = torch.nn.Linear(hidden, vocab, bias=False)
    hs, ht = torch.randn(n, hidden), torch.randn(n, hidden)
    y = torch.tensor([1, 3, 0, 5, 7, 2, 1, 11, 3, 5])
    loss = DistillationLoss(temperature=2.0, kd_weight=0.5)
    kd, ce = loss._chunk_sums(head, teacher, hs, ht, y)
    zt = teacher(ht)[:, [1, 3, 5, 7]] / 2.0
    zs = (hs @ head.weight.T) / 2.0
    want_kd = (zt.softmax(-1) * (zt.log_softmax(-1) - zs.log_softmax(-1))).sum()
    kept = torch.tensor([i for i, t in enumerate(y.tolist()) if t in (1, 3, 5, 7)])
    index = {1: 0, 3: 1, 5: 2, 7: 3}
    want_ce = torch.nn.functional.cross_entropy(hs[kept] @ head.weight.T, torch.tensor(
        [index[int(t)] for t in y[kept]]), reduction="sum")
    torch.testing.assert_close(kd, want_kd, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ce, want_ce, atol=1e-5, rtol=1e-5)
