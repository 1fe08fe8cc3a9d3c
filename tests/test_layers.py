import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bdlora.models.budgeted.config import BudgetedConfig
from bdlora.models.budgeted.layer import GatedLoRALinear
from bdlora.models.budgeted.model import apply_budgeted_lora, gated_modules
from bdlora.train.budgeted.controller import BudgetController


def _layer(bias=True, seed=0):
    torch.manual_seed(seed)
    base = torch.nn.Linear(24, 40, bias=bias)
    return GatedLoRALinear(base, rank=6, alpha=12.0, gate_init=3.0)


def test_forward_matches_equation():
    m = _layer()
    torch.nn.init.normal_(m.lora_B)
    torch.nn.init.normal_(m.gate_logits)
    m.set_retention(0.37)
    x = torch.randn(5, 3, 24)
    W, b = m.base_layer.weight, m.base_layer.bias
    g = torch.sigmoid(m.gate_logits)
    expected = 0.37 * (x @ W.T) + b + (12.0 / 6) * (((x @ m.lora_A.T) * g) @ m.lora_B.T)
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)


def test_fresh_module_equals_dense():
    m = _layer()
    x = torch.randn(4, 24)
    torch.testing.assert_close(m(x), m.base_layer(x), rtol=0, atol=1e-6)


def test_retention_is_a_buffer_without_gradient():
    m = _layer()
    torch.nn.init.normal_(m.lora_B)
    m.set_retention(0.5)
    names = {n for n, _ in m.named_parameters()}
    assert "retention" not in names and "retention" in dict(m.named_buffers())
    m(torch.randn(3, 24)).sum().backward()
    assert m.retention.grad is None
    assert m.base_layer.weight.grad is None and not m.base_layer.weight.requires_grad
    for p in (m.lora_A, m.lora_B, m.gate_logits):
        assert p.grad is not None and p.grad.abs().sum() > 0


def _mm_flops(m, x):
    with FlopCounterMode(display=False) as fc:
        m(x)
    return fc.get_total_flops()


def test_dense_matmul_skipped_when_d_is_zero():
    m = _layer(bias=False)
    x = torch.randn(8, 24)
    lora = 2 * 8 * (24 * 6 + 6 * 40)
    dense = 2 * 8 * 24 * 40
    m.set_retention(1.0)
    assert _mm_flops(m, x) == lora + dense
    m.set_retention(0.2)
    assert _mm_flops(m, x) == lora + dense
    m.set_retention(0.0)
    assert _mm_flops(m, x) == lora


def test_retention_survives_state_dict_roundtrip():
    m = _layer()
    m.set_retention(0.0)
    n = _layer(seed=1)
    n.load_state_dict(m.state_dict())
    assert n.d == 0.0 and _mm_flops(n, torch.randn(2, 24)) == 2 * 2 * (24 * 6 + 6 * 40)


def test_apply_wraps_all_projections_and_starts_equal(tiny_model):
    student = copy.deepcopy(tiny_model)
    x = torch.randint(0, tiny_model.config.vocab_size, (2, 16))
    names = apply_budgeted_lora(student, rank=4, alpha=8)
    assert len(names) == 7 * tiny_model.config.num_hidden_layers
    assert names[:7] == [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B", "gate_logits") for n in trainable)
    with torch.no_grad():
        torch.testing.assert_close(student(x).logits, tiny_model(x).logits, rtol=0, atol=1e-5)


def test_controller_drives_modules(tiny_model):
    student = copy.deepcopy(tiny_model)
    apply_budgeted_lora(student, rank=4, alpha=8)
    gated = gated_modules(student)
    c = BudgetController.for_model(gated, BudgetedConfig(budget=0.0, retention_ema=0.0))
    c.step(1.0)
    assert all(m.d == 0.0 for m in gated.values())
    x = torch.randint(0, tiny_model.config.vocab_size, (1, 8))
    with FlopCounterMode(display=False) as fc:
        student(x)
    dense_flops = sum(2 * 8 * m.in_features * m.out_features for m in gated.values())
    with FlopCounterMode(display=False) as fc_dense:
        tiny_model(x)
    assert fc_dense.get_total_flops() - fc.get_total_flops() == dense_flops - sum(
        2 * 8 * m.lora_cost for m in gated.values())


def test_rank_must_be_positive():
    with pytest.raises(ValueError):
        GatedLoRALinear(torch.nn.Linear(4, 4), rank=0, alpha=1.0)
