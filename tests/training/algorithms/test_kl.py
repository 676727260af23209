"""Tests for training/algorithms/kl.py (KL estimators, kl_penalty/kl_loss, KL controllers)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from training.algorithms.kl import (
    K3_BOUND,
    KL_ALIASES,
    KL_ESTIMATORS,
    KL_IS_CORRECTIONS,
    AdaptiveKLController,
    FixedKLController,
    get_kl_estimator,
    kl_loss,
    kl_loss_term,
    kl_penalty,
    resolve_kl_estimator,
)

ALL_NAMES = ["abs", "abs+", "k1", "k1+", "k2", "k3", "k3+"]
GARBAGE = [math.nan, math.inf, -math.inf, 1e30, -1e30, 123.0]


def k3_value(x: float) -> float:
    # k3 = exp(−log_ratio) − 1 + log_ratio
    return math.exp(-x) - 1.0 + x


# log_prob − ref_log_prob = [0.5, 0.0, −1.0 | masked]
LOG_PROB = [[-1.0, -0.5, -2.0, math.nan]]
REF_LOG_PROB = [[-1.5, -0.5, -1.0, -0.3]]
MASK = [[1, 1, 1, 0]]
LOG_RATIO = [0.5, 0.0, -1.0]

EXPECTED_VALUE = {
    "k1": [0.5, 0.0, -1.0, 0.0],
    "abs": [0.5, 0.0, 1.0, 0.0],
    "k2": [0.5 * 0.5**2, 0.0, 0.5 * (-1.0) ** 2, 0.0],
    "k3": [k3_value(0.5), 0.0, k3_value(-1.0), 0.0],  # [0.10653, 0, e − 2 = 0.71828]
    "k1+": [0.5, 0.0, -1.0, 0.0],
    "abs+": [0.5, 0.0, 1.0, 0.0],
    "k3+": [k3_value(0.5), 0.0, k3_value(-1.0), 0.0],
}
# d value / d log_prob
EXPECTED_GRAD = {
    "k1": [1.0, 1.0, 1.0, 0.0],
    "abs": [1.0, 0.0, -1.0, 0.0],  # sign(log_ratio)
    "k2": [0.5, 0.0, -1.0, 0.0],  # log_ratio
    "k3": [1 - math.exp(-0.5), 0.0, 1 - math.exp(1.0), 0.0],  # 1 − exp(−log_ratio)
    "k1+": [0.5, 0.0, -1.0, 0.0],  # gradient of k2
    "abs+": [0.5, 0.0, -1.0, 0.0],  # gradient of k2 (abs's own is sign: 1, 0, −1)
    "k3+": [0.5, 0.0, -1.0, 0.0],  # gradient of k2
}


def test_registry_names_are_exactly_the_seven_estimators() -> None:
    assert KL_ESTIMATORS.names() == ALL_NAMES
    assert set(EXPECTED_VALUE) == set(ALL_NAMES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ALL_NAMES)
def test_hand_computed_values_and_gradients(kind: str, dtype: torch.dtype) -> None:
    lp = torch.tensor(LOG_PROB, dtype=dtype, requires_grad=True)
    ref = torch.tensor(REF_LOG_PROB, dtype=dtype, requires_grad=True)
    kl = kl_penalty(lp, ref, torch.tensor(MASK), kind)
    assert kl.dtype == dtype
    assert_close(kl, torch.tensor([EXPECTED_VALUE[kind]], dtype=dtype))
    kl.sum().backward()
    assert_close(lp.grad, torch.tensor([EXPECTED_GRAD[kind]], dtype=dtype))
    # log_ratio = lp − ref, so d/d ref = −d/d lp (0 at the masked position, not NaN)
    assert_close(ref.grad, -torch.tensor([EXPECTED_GRAD[kind]], dtype=dtype))


@pytest.mark.parametrize("kind", ["k1+", "abs+", "k3+"])
def test_straight_through_forward_is_exact_and_gradient_is_log_ratio(kind: str) -> None:
    base = kind[:-1]
    lp = torch.tensor(LOG_PROB, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(REF_LOG_PROB, dtype=torch.float64)
    plus = kl_penalty(lp, ref, torch.tensor(MASK), kind)
    plain = kl_penalty(lp.detach(), ref, torch.tensor(MASK), base)
    assert torch.equal(plus.detach(), plain)  # forward value bit-identical to k1 / abs / k3
    (grad,) = torch.autograd.grad(plus.sum(), lp)
    assert_close(grad, torch.tensor([[*LOG_RATIO, 0.0]], dtype=torch.float64))


def test_log_ratio_is_clamped_and_k3_is_clamped_like_verl() -> None:
    # log_ratio = [30 → clamped to 20, −5, −30 → clamped to −20]
    lp = torch.tensor([[10.0, -6.0, -40.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-20.0, -1.0, -10.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    k1 = kl_penalty(lp, ref, mask, "k1")
    assert_close(k1, torch.tensor([[20.0, -5.0, -20.0]], dtype=torch.float64))
    (g1,) = torch.autograd.grad(k1.sum(), lp)
    assert_close(g1, torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64))  # clamp stops grad
    # k3(−5) = e^5 − 1 − 5 = 142.41 → clamped to 10; k3(20) = e^−20 − 1 + 20 ≈ 19 → 10
    k3 = kl_penalty(lp, ref, mask, "k3")
    assert_close(k3, torch.tensor([[K3_BOUND, K3_BOUND, K3_BOUND]], dtype=torch.float64))
    (g3,) = torch.autograd.grad(k3.sum(), lp)
    assert_close(g3, torch.zeros(1, 3, dtype=torch.float64))
    # k3+ keeps k2's gradient (= clamped log_ratio, zero outside the ±20 log-ratio clamp)
    k3p = kl_penalty(lp, ref, mask, "k3+")
    assert_close(k3p, torch.tensor([[K3_BOUND, K3_BOUND, K3_BOUND]], dtype=torch.float64))
    (g3p,) = torch.autograd.grad(k3p.sum(), lp)
    assert_close(g3p, torch.tensor([[0.0, -5.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize(("alias", "canonical"), sorted(KL_ALIASES.items()))
def test_verl_aliases(alias: str, canonical: str) -> None:
    assert resolve_kl_estimator(alias) == canonical
    assert get_kl_estimator(alias) is KL_ESTIMATORS.get(canonical)
    lp = torch.tensor(LOG_PROB, dtype=torch.float64)
    ref = torch.tensor(REF_LOG_PROB, dtype=torch.float64)
    assert torch.equal(kl_penalty(lp, ref, torch.tensor(MASK), alias),
                       kl_penalty(lp, ref, torch.tensor(MASK), canonical))


def test_expected_alias_table() -> None:
    assert KL_ALIASES["kl"] == "k1"
    assert KL_ALIASES["mse"] == "k2"
    assert KL_ALIASES["low_var_kl"] == "k3"
    # verl's k2+ / mse+: the straight-through of k2 onto itself is k2
    assert KL_ALIASES["k2+"] == KL_ALIASES["mse+"] == "k2"
    for name in ALL_NAMES:
        assert resolve_kl_estimator(name) == name


def test_unknown_estimator_lists_valid_names() -> None:
    with pytest.raises(KeyError, match=r"k3\+.*low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "full")


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3), "k1")


def test_kl_loss_metrics_hand_computed() -> None:
    lp = torch.tensor(LOG_PROB, dtype=torch.float64)
    ref = torch.tensor(REF_LOG_PROB, dtype=torch.float64)
    kl, metrics = kl_loss(lp, ref, torch.tensor(MASK), "k2")
    assert_close(kl, torch.tensor([EXPECTED_VALUE["k2"]], dtype=torch.float64))
    # mean over the 3 valid tokens: (0.125 + 0 + 0.5) / 3; max 0.5; median 0.125
    assert metrics["policy/kl_loss/mean"] == pytest.approx((0.125 + 0.0 + 0.5) / 3)
    assert metrics["policy/kl_loss/max"] == pytest.approx(0.5)
    assert metrics["policy/kl_loss/p50"] == pytest.approx(0.125)
    assert all(isinstance(v, float) for v in metrics.values())


def test_zero_valid_tokens_gives_zero_not_nan() -> None:
    lp = torch.full((2, 3), math.nan, requires_grad=True)
    ref = torch.full((2, 3), math.inf)
    for kind in ALL_NAMES:
        kl, metrics = kl_loss(lp, ref, torch.zeros(2, 3), kind)
        assert torch.equal(kl, torch.zeros(2, 3))
        assert metrics["policy/kl_loss/mean"] == 0.0
        (g,) = torch.autograd.grad(kl.sum(), lp)
        assert torch.equal(g, torch.zeros(2, 3))


# ------------------------------------------------------------------------------------------------
# hypothesis properties
# ------------------------------------------------------------------------------------------------

finite = st.floats(min_value=-8.0, max_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def kl_batch(draw: st.DrawFn) -> tuple[list[list[float]], list[list[float]], list[list[int]]]:
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 5))
    lp = [[draw(finite) for _ in range(t)] for _ in range(b)]
    ref = [[draw(finite) for _ in range(t)] for _ in range(b)]
    mask = [[draw(st.integers(0, 1)) for _ in range(t)] for _ in range(b)]
    return lp, ref, mask


def _with_garbage(x: list[list[float]], mask: list[list[int]], garbage: float
                  ) -> list[list[float]]:
    return [[v if m else garbage for v, m in zip(row, mrow, strict=True)]
            for row, mrow in zip(x, mask, strict=True)]


@settings(max_examples=50, deadline=None)
@given(batch=kl_batch(), garbage=st.sampled_from(GARBAGE),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_masked_garbage_never_changes_values_or_gradients(batch, garbage, dtype) -> None:
    lp, ref, mask = batch
    m = torch.tensor(mask)
    for kind in ALL_NAMES:
        outs = []
        for lp_x, ref_x in ((lp, ref), (_with_garbage(lp, mask, garbage),
                                        _with_garbage(ref, mask, -garbage))):
            lpt = torch.tensor(lp_x, dtype=dtype, requires_grad=True)
            reft = torch.tensor(ref_x, dtype=dtype, requires_grad=True)
            kl = kl_penalty(lpt, reft, m, kind)
            g_lp, g_ref = torch.autograd.grad(kl.sum(), (lpt, reft))
            outs.append((kl.detach(), g_lp, g_ref))
        for clean, dirty in zip(outs[0], outs[1], strict=True):
            assert torch.equal(clean, dirty)
            assert torch.isfinite(clean).all()
        assert (outs[0][0][m == 0] == 0).all()
        assert (outs[0][1][m == 0] == 0).all()


@settings(max_examples=50, deadline=None)
@given(batch=kl_batch(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_nonnegative_estimators(batch, dtype) -> None:
    lp, ref, mask = batch
    m = torch.tensor(mask)
    for kind in ["abs", "abs+", "k2", "k3", "k3+"]:
        kl = kl_penalty(torch.tensor(lp, dtype=dtype), torch.tensor(ref, dtype=dtype), m, kind)
        assert kl.dtype == dtype
        assert (kl >= 0).all(), kind


@settings(max_examples=50, deadline=None)
@given(batch=kl_batch(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_identical_policies_give_zero_kl(batch, dtype) -> None:
    lp, _, mask = batch
    m = torch.tensor(mask)
    for kind in KL_ESTIMATORS:
        x = torch.tensor(lp, dtype=dtype, requires_grad=True)
        kl = kl_penalty(x, x.detach().clone(), m, kind)
        assert torch.equal(kl.detach(), torch.zeros_like(kl)), kind
        if kind != "k1":  # k1's gradient is 1 everywhere; the others vanish at log_ratio = 0
            (g,) = torch.autograd.grad(kl.sum(), x)
            assert torch.equal(g, torch.zeros_like(g)), kind


@settings(max_examples=50, deadline=None)
@given(batch=kl_batch(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_plus_variants_forward_and_gradient(batch, dtype) -> None:
    lp, ref, mask = batch
    m = torch.tensor(mask)
    ref_t = torch.tensor(ref, dtype=dtype)
    for plus, base in (("k1+", "k1"), ("abs+", "abs"), ("k3+", "k3")):
        x = torch.tensor(lp, dtype=dtype, requires_grad=True)
        kl = kl_penalty(x, ref_t, m, plus)
        assert torch.equal(kl.detach(), kl_penalty(x.detach(), ref_t, m, base))
        (g,) = torch.autograd.grad(kl.sum(), x)
        # d k2 / d log_prob = log_ratio (at valid positions; 0 at masked ones)
        log_ratio = torch.where(m.bool(), x.detach() - ref_t, torch.zeros_like(ref_t))
        assert_close(g, log_ratio)
        # and it is k2's gradient exactly
        x2 = torch.tensor(lp, dtype=dtype, requires_grad=True)
        (g2,) = torch.autograd.grad(kl_penalty(x2, ref_t, m, "k2").sum(), x2)
        assert torch.equal(g, g2)


@settings(max_examples=50, deadline=None)
@given(batch=kl_batch())
def test_float32_matches_float64(batch) -> None:
    lp, ref, mask = batch
    m = torch.tensor(mask)
    for kind in KL_ESTIMATORS:
        k32 = kl_penalty(torch.tensor(lp, dtype=torch.float32),
                         torch.tensor(ref, dtype=torch.float32), m, kind)
        k64 = kl_penalty(torch.tensor(lp, dtype=torch.float64),
                         torch.tensor(ref, dtype=torch.float64), m, kind)
        assert_close(k32, k64.to(torch.float32), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# controllers
# ------------------------------------------------------------------------------------------------


def test_fixed_controller_never_moves() -> None:
    ctrl = FixedKLController(kl_coef=0.001)
    for kl in (0.0, 0.5, 100.0):
        ctrl.update(kl, n_steps=256)
        assert ctrl.value == 0.001


def test_adaptive_controller_hand_computed() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    # KL 1.5: error = clip(1.5/1 − 1 = 0.5, ±0.2) = 0.2 → β = 0.1 · (1 + 0.2·10/100) = 0.102
    ctrl.update(1.5, n_steps=10)
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    # KL 1.1: error = 0.1 (inside the clip) → β = 0.102 · (1 + 0.1·10/100) = 0.10302
    ctrl.update(1.1, n_steps=10)
    assert ctrl.value == pytest.approx(0.102 * (1 + 0.1 * 10 / 100))
    # KL 0.5: error = clip(−0.5) = −0.2 → β = 0.10302 · (1 − 0.2·20/100) = 0.0988992
    ctrl.update(0.5, n_steps=20)
    assert ctrl.value == pytest.approx(0.10302 * (1 - 0.2 * 20 / 100))
    assert ctrl.value == pytest.approx(0.0988992)
    # KL on target: error 0 → unchanged
    ctrl.update(1.0, n_steps=50)
    assert ctrl.value == pytest.approx(0.0988992)


def test_adaptive_controller_direction() -> None:
    up = AdaptiveKLController(0.05, target_kl=0.1, horizon=1000)
    up.update(0.2, n_steps=100)
    down = AdaptiveKLController(0.05, target_kl=0.1, horizon=1000)
    down.update(0.01, n_steps=100)
    assert down.value < 0.05 < up.value


def test_controller_validation() -> None:
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1.0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="init_kl_coef"):
        AdaptiveKLController(math.nan, target_kl=0.1, horizon=10)
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError, match="not finite"):
        ctrl.update(math.nan, n_steps=1)
    with pytest.raises(ValueError, match="n_steps"):
        ctrl.update(0.1, n_steps=-1)
    assert ctrl.value == 0.1


# ------------------------------------------------------------------------------------------------
# KL as a loss term with its IS correction (kl_loss_term)
# ------------------------------------------------------------------------------------------------

LN2 = math.log(2.0)


def _term_case():
    """Two tokens: π_θ = (.5, .2), π_old = (.4, .3), π_ref = (.25, .4).

    log_ratio to the reference = (ln 2, −ln 2); ρ = π_θ/π_old = (1.25, 2/3);
    k3 = e^{−x} − 1 + x = (ln 2 − ½, 1 − ln 2); dk3/dlogπ = 1 − e^{−x} = (½, −1)."""
    lp = torch.tensor([[0.5, 0.2]]).log().requires_grad_(True)
    old = torch.tensor([[0.4, 0.3]]).log()
    ref = torch.tensor([[0.25, 0.4]]).log()
    return lp, old, ref, torch.ones(1, 2, dtype=torch.bool)


def test_kl_loss_term_none_is_the_plain_estimate_with_its_gradient():
    lp, old, ref, mask = _term_case()
    term, m = kl_loss_term(lp, old, ref, mask, "k2")
    assert_close(term, torch.tensor([[0.5 * LN2 ** 2, 0.5 * LN2 ** 2]]))
    term.sum().backward()
    assert_close(lp.grad, torch.tensor([[LN2, -LN2]]))  # ∂k2/∂logπ = log_ratio
    assert m["policy/kl_loss/mean"] == pytest.approx(0.5 * LN2 ** 2)
    assert "policy/kl_loss/is_ratio_mean" not in m


def test_kl_loss_term_clipped_takes_the_seed_004_minimum():
    lp, old, ref, mask = _term_case()
    term, m = kl_loss_term(lp, old, ref, mask, "k3", "clipped", clip_ratio_low=0.2,
                           clip_ratio_high=0.2)
    k3 = torch.tensor([[LN2 - 0.5, 1 - LN2]])
    # token 0: ρ = 1.25 > 1.2, min(1.25·k, 1.2·k) = 1.2·k (clipped branch, k ≥ 0)
    # token 1: ρ = 2/3 < 0.8, min(2/3·k, 0.8·k) = 2/3·k (unclipped branch)
    assert_close(term, torch.tensor([[1.2, 2 / 3]]) * k3)
    term.sum().backward()
    # token 0: 1.2 · dk3 = 1.2 · ½; token 1: d(ρ·k3)/dlogπ = ρ·k3 + ρ·dk3 = 2/3 · (1 − ln 2 − 1)
    assert_close(lp.grad, torch.tensor([[0.6, -2 / 3 * LN2]]))
    assert m["policy/kl_loss/clipfrac"] == 0.5
    assert m["policy/kl_loss/is_ratio_mean"] == pytest.approx((1.25 + 2 / 3) / 2)


def test_kl_loss_term_deepseek_k3_weights_k3_by_the_ratio():
    lp, old, ref, mask = _term_case()
    term, _ = kl_loss_term(lp, old, ref, mask, "low_var_kl", "deepseek_k3")
    assert_close(term, torch.tensor([[1.25 * (LN2 - 0.5), 2 / 3 * (1 - LN2)]]))
    term.sum().backward()
    # d(ρ·k3)/dlogπ = ρ·(k3 + 1 − e^{−x}) = (1.25 · ln 2, 2/3 · (−ln 2))
    assert_close(lp.grad, torch.tensor([[1.25 * LN2, -2 / 3 * LN2]]))


def test_kl_loss_term_rollout_weights_multiply_only_the_is_corrected_terms():
    lp, old, ref, mask = _term_case()
    w = torch.tensor([[2.0, 0.5]])
    plain, _ = kl_loss_term(lp, old, ref, mask, "k3", rollout_is_weights=w)
    assert_close(plain, torch.tensor([[LN2 - 0.5, 1 - LN2]]))
    weighted, _ = kl_loss_term(lp, old, ref, mask, "k3", "deepseek_k3", rollout_is_weights=w)
    assert_close(weighted, torch.tensor([[2 * 1.25 * (LN2 - 0.5), 0.5 * 2 / 3 * (1 - LN2)]]))


def test_deepseek_k3_is_unbiased_for_the_kl_and_its_gradient_off_policy():
    """Σ_y π_old(y)·ρ(y)·k3(y) = KL(π_θ ‖ π_ref) exactly, gradient included (DeepSeek-V3.2 Eq. 7);
    plain k3 under π_old is not."""
    logits = torch.tensor([0.3, -0.2, 0.9], requires_grad=True)
    old = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.5, 0.3])
    log_pi = torch.log_softmax(logits, -1)
    # every vocabulary entry as a one-token response: (3, 1)
    lp, o, r = log_pi[:, None], old.log()[:, None], ref.log()[:, None]
    mask = torch.ones(3, 1, dtype=torch.bool)
    term, _ = kl_loss_term(lp, o, r, mask, "k3", "deepseek_k3")
    estimate = (old[:, None] * term).sum()
    exact = (log_pi.exp() * (log_pi - ref.log())).sum()
    assert_close(estimate, exact)
    g_est, = torch.autograd.grad(estimate, logits, retain_graph=True)
    g_exact, = torch.autograd.grad(exact, logits, retain_graph=True)
    assert_close(g_est, g_exact)
    plain, _ = kl_loss_term(lp, o, r, mask, "k3")
    assert abs(float(((old[:, None] * plain).sum() - exact).detach())) > 1e-2


def test_kl_loss_term_masked_tokens_are_zero_and_bad_options_name_the_fix():
    lp, old, ref, _ = _term_case()
    mask = torch.tensor([[True, False]])
    term, m = kl_loss_term(lp, old, ref, mask, "k3", "clipped")
    assert float(term[0, 1]) == 0.0 and m["policy/kl_loss/clipfrac"] == 1.0
    with pytest.raises(ValueError, match="deepseek_k3 weights the k3 estimator"):
        kl_loss_term(lp, old, ref, mask, "k2", "deepseek_k3")
    with pytest.raises(ValueError, match="use one of none, clipped, deepseek_k3"):
        kl_loss_term(lp, old, ref, mask, "k3", "sometimes")
    assert KL_IS_CORRECTIONS == ("none", "clipped", "deepseek_k3")
