"""Low-rank factors from the teacher's weights (whitened SVD), their calibration, and the quality allocation."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bdlora.compress.allocate import BUCKETS
from bdlora.compress.calibrate import calibrate, calibration_blocks, input_group
from bdlora.compress.forms.lowrank import factors, spectrum
from bdlora.compress.pricing import break_even, options
from bdlora.models.costs import ModuleShape
from conftest import allocate_with


def _data(d_out=24, d_in=16, n=400, seed=0, rank_x=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    mix = torch.randn(d_in, d_in, generator=g, dtype=torch.float64) * torch.logspace(0, -3, d_in, dtype=torch.float64)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64) @ mix  # strongly anisotropic inputs
    if rank_x is not None:
        x = x[:, :rank_x] @ torch.randn(rank_x, d_in, generator=g, dtype=torch.float64)
    return w, x


def act_err(w, w2, x) -> float:
    return float(((w - w2) @ x.T).square().sum())


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])  # both decompositions: d_out <= d_in and d_out > d_in
def test_whitened_factors_are_the_best_rank_r_on_the_inputs(shape):
    """B A = U_r U_r^T W; its activation error is the discarded energy, below plain SVD's at every rank, and no
    rank-r matrix does better than the truncated SVD of W S (Eckart-Young in the whitened space)."""
    w, x = _data(*shape)
    spec = spectrum(w, x.T @ x, damping=0.0 + 1e-12)
    plain = spectrum(w, None)
    for r in range(1, min(shape)):
        a, b = factors(w, spec, r)
        assert a.shape == (r, shape[1]) and b.shape == (shape[0], r)
        err = act_err(w, b @ a, x)
        assert err == pytest.approx(spec.error(r), rel=1e-6)
        pa, pb = factors(w, plain, r)
        assert err <= act_err(w, pb @ pa, x) * (1 + 1e-9)
        torch.testing.assert_close(b @ a, spec.basis[:, :r] @ spec.basis[:, :r].T @ w)  # the projection form
    a, b = factors(w, spec, min(shape))
    torch.testing.assert_close(b @ a, w)  # full rank is exact


def test_factors_are_balanced_on_the_inputs():
    """Each component is split evenly, s^1/2 on both sides, measured where the factors act: the first factor's
    outputs over the calibration inputs (||A_k X^T||) equal the second factor's column norms."""
    w, x = _data()
    a, b = factors(w, spectrum(w, x.T @ x, damping=1e-12), 6)
    torch.testing.assert_close((a @ x.T).norm(dim=1), b.norm(dim=0))


def test_a_rank_deficient_gram_is_handled_by_damping():
    """Inputs spanning 5 of 16 directions (fewer active features than dimensions): the Gram is singular, the
    factors stay finite, exact on the inputs' span at rank 5, and unseen directions keep W's projected action."""
    w, x = _data(rank_x=5)
    gram = x.T @ x
    assert torch.linalg.matrix_rank(gram) == 5
    spec = spectrum(w, gram)
    a, b = factors(w, spec, 5)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert act_err(w, b @ a, x) <= 1e-6 * float((w @ x.T).square().sum())
    zero = spectrum(w, torch.zeros(16, 16, dtype=torch.float64))  # no signal at all: plain SVD
    torch.testing.assert_close(zero.energy, spectrum(w, None).energy, rtol=1e-9, atol=1e-9)


def test_fisher_weighted_factors_minimise_the_weighted_output_error():
    """With output weights f the factors minimise ||diag(f)^1/2 (W - B A) X^T|| (f damped by 1% of its mean): the
    weighted error equals the tail energy, and no unweighted factorisation of the same rank does better by it."""
    w, x = _data()
    f = torch.rand(24, dtype=torch.float64) ** 4 + 1e-3  # very unequal output weights
    fd = f + 1e-2 * f.mean()
    spec = spectrum(w, x.T @ x, damping=1e-12, fisher=f)
    plain = spectrum(w, x.T @ x, damping=1e-12)
    for r in (2, 7):
        a, b = factors(w, spec, r)
        err = float((fd[:, None] * ((w - b @ a) @ x.T).square()).sum())
        assert err == pytest.approx(spec.error(r), rel=1e-6)
        pa, pb = factors(w, plain, r)
        assert err <= float((fd[:, None] * ((w - pb @ pa) @ x.T).square()).sum()) * (1 + 1e-9)


def test_options_stop_below_break_even():
    s = ModuleShape("m", 64, 32)
    assert break_even(s) == 22  # 22 * 96 >= 2048 > 21 * 96
    w = np.linspace(10, 0.1, 32)
    opts = options(s, w, step=4)
    assert [r for r, _, _ in opts] == [0, 1, 2, 4, 8, 12, 16, 20] and opts[0] == (0, 2048, 0.0)
    assert [e for _, _, e in opts] == sorted(e for _, _, e in opts)[:1] + sorted((e for _, _, e in opts[1:]),
                                                                                 reverse=True)
    assert opts[3][2] == pytest.approx(w[4:].sum())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(8, 96), st.integers(8, 96), st.integers(0, 10_000)), min_size=1, max_size=6),
       st.floats(1.0, 3.0))
def test_allocation_is_the_least_error_meeting_the_budget(mods, ratio):
    """The allocation meets any reachable MAC target, and no other choice of forms within the budget has less
    total error: checked against every combination (brute force) and, in particular, against one uniform rank."""
    import itertools

    shapes = [ModuleShape(f"m{i}", a, b) for i, (a, b, _) in enumerate(mods)]
    spectra = {s.name: np.sort(np.random.default_rng(seed).exponential(1.0, min(s.in_features, s.out_features)))
               [::-1] for s, (_, _, seed) in zip(shapes, mods)}
    target = sum(s.dense_cost for s in shapes) / ratio
    try:
        alloc = allocate_with(shapes, spectra, ratio)
    except Exception as e:  # noqa: BLE001
        assert "beyond reach" in str(e)
        return
    assert alloc.macs(shapes) <= target * (1 + 1e-12)
    assert set(alloc.order) == {n for n, r in alloc.ranks.items() if r}
    total = sum(alloc.errors.values())
    slack = target * (1 - len(shapes) / BUCKETS)  # what the budget's resolution may leave unspent
    choices = [options(s, spectra[s.name]) for s in shapes]
    for combo in itertools.islice(itertools.product(*choices), 200_000):
        if sum(c for _, c, _ in combo) <= slack:
            assert total <= sum(e for _, _, e in combo) * (1 + 1e-9) + 1e-12


def test_allocation_order_gives_controller_scores():
    shapes = [ModuleShape(n, 64, 64) for n in ("a", "b", "c")]
    spectra = {"a": np.full(64, 1.0), "b": np.full(64, 0.01), "c": np.full(64, 100.0)}  # b is cheapest to cut
    alloc = allocate_with(shapes, spectra, 1.3)
    assert alloc.order[0] == "b" and alloc.ranks["c"] == 0
    scores = alloc.scores(["a", "b", "c"])
    assert scores[1] == 0.0 and scores[2] > max(scores[0], scores[1])


def test_an_unreachable_ratio_names_the_reachable_one():
    with pytest.raises(Exception, match=r"--mac-ratio 100: beyond reach; the cheapest form of every projection "
                                        r"gives 32.00x fewer projection MACs"):
        allocate_with([ModuleShape("m", 64, 64)], {"m": np.ones(64)}, 100.0)


def test_calibration_is_deterministic_and_shared_inputs_share_a_gram(tiny_model, tiny_env):
    from bdlora.data.blocks import PackedBlocks
    from bdlora.data.documents import Corpus
    from bdlora.data.tokens import tokenize_corpus

    data = tokenize_corpus(Corpus(tiny_env["corpus"]), tiny_env["tokenizer"], 0.1, tiny_env["cache"])
    blocks = PackedBlocks(data.tokens("train"), 32)
    x = calibration_blocks(blocks, 256)
    assert x.shape == (8, 32)
    np.testing.assert_array_equal(x, calibration_blocks(blocks, 256))
    one, two = calibrate(tiny_model, x), calibrate(tiny_model, x)
    assert input_group("model.layers.1.self_attn.k_proj") == "model.layers.1.self_attn.qkv"
    assert len(one.grams) == 4 * 4 and len(one.fisher) == 4 * 7
    for k in one.grams:
        assert torch.equal(one.grams[k], two.grams[k])
    for k in one.fisher:
        assert torch.equal(one.fisher[k], two.fisher[k]) and (one.fisher[k] > 0).all()
    assert not any(p.grad is not None for p in tiny_model.parameters())
    # the Gram really is X^T X of the module's inputs
    seen = []
    mod = tiny_model.model.layers[0].mlp.down_proj
    h = mod.register_forward_hook(lambda m, i, o: seen.append(i[0].reshape(-1, i[0].shape[-1]).double()))
    with torch.no_grad():
        tiny_model(input_ids=torch.from_numpy(x))
    h.remove()
    torch.testing.assert_close(one.gram("model.layers.0.mlp.down_proj"), seen[0].T @ seen[0], rtol=1e-5, atol=1e-6)


def test_too_few_calibration_tokens_is_one_line(tiny_env):
    from bdlora.base.errors import DataError
    from bdlora.data.blocks import PackedBlocks

    with pytest.raises(DataError, match=r"--calib-tokens 100000: the training split holds 320 tokens in 10 blocks"):
        calibration_blocks(PackedBlocks(np.arange(330), 32), 100_000)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(24, 16), (16, 24)]), st.integers(1, 12))
def test_factors_do_not_depend_on_the_sign_an_eigensolver_returns(seed, shape, rank):
    """Issue 89: the same one-shot gave opposite factors on machines with and without AVX-512 (an eigenvector is
    unique only up to its sign). Each direction's sign is fixed (``column_signs``): a spectrum whose basis columns
    were negated gives the same factors, every column's largest entry is positive, and the product is unchanged."""
    from bdlora.compress.forms.lowrank import Spectrum
    from bdlora.models.budgeted.layer import column_signs

    w, x = _data(*shape, seed=seed)
    spec = spectrum(w, x.T @ x)
    peak = spec.basis.gather(0, spec.basis.abs().argmax(0, keepdim=True))[0]
    assert bool((peak > 0).all())
    coin = torch.rand(spec.basis.shape[1], generator=torch.Generator().manual_seed(seed))
    flips = torch.where(coin < 0.5, -1.0, 1.0)
    flipped = spec.basis * flips.double()
    canon = Spectrum(spec.energy, flipped * column_signs(flipped), spec.phi)
    a, b = factors(w, spec, rank)
    a2, b2 = factors(w, canon, rank)
    torch.testing.assert_close(a2, a, rtol=0, atol=0)
    torch.testing.assert_close(b2, b, rtol=0, atol=0)
    raw_a, raw_b = factors(w, Spectrum(spec.energy, flipped, spec.phi), rank)  # unfixed: other factors, same product
    torch.testing.assert_close(raw_b @ raw_a, b @ a, rtol=1e-9, atol=1e-12)


def test_the_fused_svd_pair_fixes_signs_and_keeps_its_product():
    from bdlora.models.budgeted.layer import fused_svd_pair

    g = torch.Generator().manual_seed(0)
    dw, a, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((12, 10), (2, 10), (12, 2)))
    first, second = fused_svd_pair(dw, a, b, 4)
    u, s, vh = torch.linalg.svd(dw, full_matrices=False)
    torch.testing.assert_close(second @ first, u[:, :4] * s[:4] @ vh[:4] + b @ a)
    peak = second[:, :4].gather(0, second[:, :4].abs().argmax(0, keepdim=True))[0]
    assert bool((peak > 0).all()) and first.shape == (6, 10) and second.shape == (12, 6)
