import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bdlora.train.budgeted.controller import BudgetController, budget_schedule, greedy_targets


def test_schedule_endpoints_and_midpoint():
    for F in (0.0, 0.4, 1.0):
        assert budget_schedule(0.0, F) == 1.0
        assert budget_schedule(0.1, F) == 1.0
        assert budget_schedule(0.3, F) == F
        assert budget_schedule(0.9, F) == F
        assert math.isclose(budget_schedule(0.2, F), F + (1 - F) / 2, rel_tol=0, abs_tol=1e-15)


def test_schedule_immediate_drop_when_t0_equals_t1():
    assert budget_schedule(0.0, 0.2, 0.0, 0.0) == 0.2
    assert budget_schedule(0.49, 0.2, 0.5, 0.5) == 1.0
    assert budget_schedule(0.5, 0.2, 0.5, 0.5) == 0.2


@given(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
def test_schedule_is_monotone_and_bounded(F, a, b):
    lo, hi = sorted((a, b))
    assert budget_schedule(hi, F) <= budget_schedule(lo, F) + 1e-15
    assert F - 1e-15 <= budget_schedule(a, F) <= 1.0


costs_st = st.lists(st.integers(1, 10_000), min_size=1, max_size=40)


@given(costs_st, st.floats(0, 1))
@settings(max_examples=300)
def test_greedy_meets_target_cheapest_first_one_fractional(costs, b):
    t = greedy_targets(costs, b)
    c = np.asarray(costs, dtype=np.float64)
    assert math.isclose(float((t * c).sum()), b * c.sum(), rel_tol=1e-9, abs_tol=1e-6)
    assert ((t >= 0) & (t <= 1)).all()
    assert int(((t > 0) & (t < 1)).sum()) <= 1
    # walking in ascending (cost, index) order, targets never increase... i.e. lowered modules come first
    order = sorted(range(len(c)), key=lambda i: (c[i], i))
    walked = t[order]
    assert all(walked[i] <= walked[i + 1] for i in range(len(walked) - 1))


def test_greedy_ties_follow_registration_order():
    t = greedy_targets([5, 3, 3, 5], 1 - 4 / 16)  # remove 4 MACs: first cost-3 module fully, second by 1/3
    np.testing.assert_allclose(t, [1.0, 0.0, 2 / 3, 1.0])


@given(costs_st, st.floats(0, 1), st.floats(0, 0.99), st.lists(st.floats(0, 1), min_size=1, max_size=30))
@settings(max_examples=200)
def test_ema_and_clamp(costs, F, beta, progresses):
    c = BudgetController([f"m{i}" for i in range(len(costs))], costs, F, ema=beta, eps_zero=1e-3)
    for p in sorted(progresses):
        before = c.d.copy()
        c.step(p)
        target = greedy_targets(costs, budget_schedule(p, F))
        expected = beta * before + (1 - beta) * target
        expected[expected < 1e-3] = 0.0
        np.testing.assert_array_equal(c.d, expected)
        assert not ((c.d > 0) & (c.d < 1e-3)).any()


def test_without_ema_retained_equals_budget():
    c = BudgetController(["a", "b", "c"], [10, 20, 30], 0.25, ema=0.0)
    for p in np.linspace(0, 1, 11):
        rec = c.step(float(p))
        assert math.isclose(rec["retained"], rec["budget"], rel_tol=1e-12)


def test_deterministic_and_state_roundtrip():
    costs = [7, 3, 3, 11, 5]
    a = BudgetController(list("abcde"), costs, 0.3)
    b = BudgetController(list("abcde"), costs, 0.3)
    for i in range(50):
        a.step(i / 49)
        b.step(i / 49)
    assert a.d.tobytes() == b.d.tobytes()  # bit-identical
    c = BudgetController(list("abcde"), costs, 0.3)
    for i in range(20):
        c.step(i / 49)
    state = c.state_dict()
    d = BudgetController(list("abcde"), costs, 0.3)
    d.load_state_dict(state)
    for i in range(20, 50):
        d.step(i / 49)
    assert d.d.tobytes() == a.d.tobytes()
    assert d.mean_retained == a.mean_retained
    with pytest.raises(ValueError):
        BudgetController(list("abcdf"), costs, 0.3).load_state_dict(state)
