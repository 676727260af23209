import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from training.algorithms.is_correction import (
    CORRECTION_METHODS,
    CompISConfig,
    EWMAConfig,
    SourceCorrection,
    applied_weight_metrics,
    compis_policy_loss,
    compute_compis_weights,
    compute_is_correction,
    decoupled_ppo_loss,
    effective_sample_size,
    ewma_decay_from_staleness,
    ewma_update,
    linear_proximal_log_prob,
    loglinear_proximal_log_prob,
)
from training.algorithms.policy_loss import PolicyLossConfig

LN = math.log


def _pair(ratios, dtype=torch.float64):
    """numerator/denominator log-probs whose ratio is exactly ``ratios``."""
    r = torch.tensor(ratios, dtype=dtype)
    den = torch.full_like(r, -1.0)
    return den + torch.log(r), den


MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
RATIOS = [[0.25, 1.0, 8.0, 123.0], [0.6, 3.0, 7.0, 7.0]]  # last column(s) masked


def test_none_keeps_raw_ratio():
    num, den = _pair(RATIOS)
    out = compute_is_correction(num, den, MASK, "none")
    expected = torch.tensor([[0.25, 1.0, 8.0, 0.0], [0.6, 3.0, 0.0, 0.0]], dtype=torch.float64)
    assert_close(out.weight, expected)
    assert out.keep_mask.equal(MASK)
    # mean over the 5 valid tokens
    assert out.metrics["weight_mean"] == pytest.approx((0.25 + 1 + 8 + 0.6 + 3) / 5)
    assert out.metrics["weight_max"] == pytest.approx(8.0)
    assert out.metrics["weight_min"] == pytest.approx(0.25)
    assert out.metrics["clip_frac"] == 0.0 and out.metrics["mask_frac"] == 0.0


def test_cap_zeroes_and_masks_tokens_above_upper():
    num, den = _pair(RATIOS)
    out = compute_is_correction(num, den, MASK, "cap", bounds=(None, 5.0))
    # 8.0 > 5 is rejected; 0.25 stays (cap is one-sided)
    expected = torch.tensor([[0.25, 1.0, 0.0, 0.0], [0.6, 3.0, 0.0, 0.0]], dtype=torch.float64)
    assert_close(out.weight, expected)
    assert out.keep_mask.tolist() == [[True, True, False, False], [True, True, False, False]]
    assert out.metrics["mask_frac"] == pytest.approx(1 / 5)


def test_clip_clamps_both_sides():
    num, den = _pair(RATIOS)
    out = compute_is_correction(num, den, MASK, "clip", bounds=(0.5, 2.0))
    expected = torch.tensor([[0.5, 1.0, 2.0, 0.0], [0.6, 2.0, 0.0, 0.0]], dtype=torch.float64)
    assert_close(out.weight, expected)
    assert out.keep_mask.equal(MASK)
    assert out.metrics["clip_frac"] == pytest.approx(3 / 5)       # 0.25, 8.0, 3.0
    assert out.metrics["clip_frac_upper"] == pytest.approx(2 / 5)
    assert out.metrics["clip_frac_lower"] == pytest.approx(1 / 5)
    assert out.metrics["mask_frac"] == 0.0


def test_icepop_masks_exactly_out_of_band():
    num, den = _pair(RATIOS)
    out = compute_is_correction(num, den, MASK, "icepop", bounds=(0.5, 5.0))
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.6, 3.0, 0.0, 0.0]], dtype=torch.float64)
    assert_close(out.weight, expected)
    assert out.metrics["mask_frac"] == pytest.approx(2 / 5)      # 0.25 and 8.0


def test_default_bounds_per_method():
    assert SourceCorrection("cap").bounds() == (None, 5.0)
    assert SourceCorrection("icepop").bounds() == (0.5, 5.0)
    assert SourceCorrection("clip").bounds() == (0.0, 2.0)
    with pytest.raises(ValueError, match="unknown IS correction method"):
        SourceCorrection("bogus")
    with pytest.raises(ValueError, match="swap"):
        SourceCorrection("icepop", 3.0, 1.0)


def test_log_ratio_is_clamped_to_20():
    num = torch.tensor([[100.0]], dtype=torch.float64)
    den = torch.tensor([[0.0]], dtype=torch.float64)
    out = compute_is_correction(num, den, torch.ones(1, 1), "none")
    assert out.weight.item() == pytest.approx(math.exp(20.0))


def test_ess_hand_computed():
    w = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    # w̃ = w / mean = [0.5, 1.5]; E[w̃²] = (0.25 + 2.25) / 2 = 1.25; ESS = 0.8
    assert effective_sample_size(w, torch.ones(1, 2)).item() == pytest.approx(0.8)
    assert effective_sample_size(torch.zeros(1, 2), torch.ones(1, 2)).item() == 0.0


def test_kl_metrics_hand_computed():
    num, den = _pair([[2.0, 0.5]])
    out = compute_is_correction(num, den, torch.ones(1, 2), "none")
    # k1 = mean(-log r) = (-ln2 + ln2)/2 = 0; k3 = mean(r - ln r - 1)
    k3 = ((2 - LN(2) - 1) + (0.5 + LN(2) - 1)) / 2
    assert out.metrics["kl_k1"] == pytest.approx(0.0, abs=1e-12)
    assert out.metrics["kl_k3"] == pytest.approx(k3)


def test_compis_weights_multiply_sources():
    valid = torch.ones(1, 3, dtype=torch.bool)
    rollout = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    old = rollout + torch.log(torch.tensor([[1.5, 0.4, 1.0]], dtype=torch.float64))     # r2
    prox = old + torch.log(torch.tensor([[2.0, 1.0, 6.0]], dtype=torch.float64))        # r3
    cfg = CompISConfig(staleness=SourceCorrection("cap", upper=5.0),
                       engine=SourceCorrection("icepop", 0.5, 5.0))
    w = compute_compis_weights(prox, old, rollout, valid, cfg)
    # token 0: f_s(2.0)=2.0, f_e(1.5)=1.5 → 3.0
    # token 1: engine ratio 0.4 is out of band; token 2: cap rejects 6
    assert_close(w.weight, torch.tensor([[3.0, 0.0, 0.0]], dtype=torch.float64))
    assert w.keep_mask.tolist() == [[True, False, False]]
    assert w.metrics["is/engine/mask_frac"] == pytest.approx(1 / 3)
    assert w.metrics["is/staleness/mask_frac"] == pytest.approx(1 / 3)
    assert w.metrics["is/combined/mask_frac"] == pytest.approx(2 / 3)


def test_compis_default_is_seed_000s_cap_without_engine_correction():
    """Seed 000's default CompIS: staleness cap 5, the engine ratio measured but not corrected
    (the IcePop band of its "Fix 2" is opt-in)."""
    valid = torch.ones(1, 3, dtype=torch.bool)
    rollout = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    old = rollout + torch.log(torch.tensor([[1.5, 0.1, 8.0]], dtype=torch.float64))
    prox = old + torch.log(torch.tensor([[2.0, 1.0, 6.0]], dtype=torch.float64))
    default = CompISConfig()
    assert default.staleness.method == "cap" and default.staleness.bounds() == (None, 5.0)
    assert default.engine == SourceCorrection("none")
    w = compute_compis_weights(prox, old, rollout, valid)
    # engine ratios 0.1 and 8 (outside [0.5, 5]) are kept; the staleness cap rejects 6
    assert_close(w.weight, torch.tensor([[3.0, 0.1, 0.0]], dtype=torch.float64))
    assert w.metrics["is/engine/mask_frac"] == 0.0
    assert w.metrics["is/combined/mask_frac"] == pytest.approx(1 / 3)
    assert w.metrics["is/combined/weight_mean"] == pytest.approx(3.1 / 3)


def test_applied_weight_metrics_count_zero_weights_as_rejected():
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    keep = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    weight = torch.tensor([[2.0, 0.0, 0.0, 0.0]])  # an IcePop band zeroes token 1, RS drops 2
    m = applied_weight_metrics(weight, keep, mask)
    assert m == {"is/combined/weight_mean": pytest.approx(2 / 3),
                 "is/combined/ess": pytest.approx(1 / 3),
                 "is/combined/mask_frac": pytest.approx(2 / 3)}
    assert applied_weight_metrics(None, keep, mask, prefix="")["weight_mean"] == \
        pytest.approx(2 / 3)


def test_compis_loss_equals_ppo_times_weights():
    # One token, A = 1, r1 = 1.1 (inside 1 ± 0.2), f_s = 1.2 (cap 5), f_e = 0.9 (icepop band)
    rollout = torch.tensor([[-2.0]], dtype=torch.float64)
    old = rollout + LN(0.9)
    prox = old + LN(1.2)
    cur = (prox + LN(1.1)).requires_grad_(True)
    adv = torch.ones(1, 1, dtype=torch.float64)
    loss, metrics = compis_policy_loss(cur, prox, old, rollout, adv, torch.ones(1, 1),
                                       loss_config=PolicyLossConfig(clip_ratio=0.2))
    # PPO loss per token = -A·r1 = -1.1, times 1.2 · 0.9
    assert loss.item() == pytest.approx(-1.1 * 1.2 * 0.9)
    loss.backward()
    # d/dlogπ of -r1·w = -r1·w
    assert cur.grad.item() == pytest.approx(-1.1 * 1.2 * 0.9)
    assert metrics["is/staleness/weight_mean"] == pytest.approx(1.2)
    assert metrics["is/engine/weight_mean"] == pytest.approx(0.9)


def test_decoupled_ppo_caps_behaviour_weight():
    behav = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    prox = behav + torch.log(torch.tensor([[2.0, 6.0]], dtype=torch.float64))
    cur = prox.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    loss, m = decoupled_ppo_loss(cur, prox, behav, adv, torch.ones(1, 2))
    # token 1 (weight 6 > cap 5) is masked; token 0: -(r=1)·A·2 over 1 kept token
    assert loss.item() == pytest.approx(-2.0)
    assert m["is/combined/mask_frac"] == pytest.approx(0.5)


def test_loglinear_proximal_interpolation():
    behav = torch.tensor([[-2.0, -2.0, -2.0]], dtype=torch.float64)
    cur = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    versions = torch.tensor([[6, 9, 10]])
    prox, alpha = loglinear_proximal_log_prob(behav, cur, versions, current_version=10,
                                              response_mask=torch.ones(1, 3))
    # v_prox = 9: α = (9-6)/(10-6) = 0.75; (9-9)/(10-9) = 0; v_b = v_θ → 0
    assert_close(alpha, torch.tensor([[0.75, 0.0, 0.0]], dtype=torch.float64))
    assert_close(prox, torch.tensor([[-2.0 + 0.75, -2.0, -2.0]], dtype=torch.float64))


def test_linear_prox_interpolates_probabilities_with_the_loglinear_alpha():
    # μ = 0.2, π_θ = 0.6 on every token; versions give α = 0.75, 0 (v_b = v_prox), 0 (v_b = v_θ)
    # and 1 (v_prox given explicitly as v_θ); the last token is masked
    behav = torch.full((1, 5), LN(0.2), dtype=torch.float64)
    cur = torch.full((1, 5), LN(0.6), dtype=torch.float64)
    versions = torch.tensor([[6, 9, 10, 6, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    prox, alpha = linear_proximal_log_prob(behav, cur, versions, 10, mask)
    _, log_alpha = loglinear_proximal_log_prob(behav, cur, versions, 10, mask)
    assert_close(alpha, torch.tensor([[0.75, 0.0, 0.0, 0.75, 0.0]], dtype=torch.float64))
    assert_close(alpha, log_alpha)  # the same α: only the space differs
    # 0.25·0.2 + 0.75·0.6 = 0.5 ; α = 0 → μ ; masked → 0
    assert_close(prox, torch.tensor([[LN(0.5), LN(0.2), LN(0.2), LN(0.5), 0.0]],
                                    dtype=torch.float64))
    full, one = linear_proximal_log_prob(behav, cur, versions, 10, mask, proximal_version=10)
    assert_close(one[0, :4], torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64))
    assert_close(full[0, :4], torch.tensor([LN(0.6), LN(0.6), LN(0.2), LN(0.6)],
                                           dtype=torch.float64))


def test_linear_prox_is_stable_for_tiny_probabilities_and_above_loglinear():
    # exp(−800) underflows in float64: the probability-space sum must stay finite
    behav = torch.tensor([[-800.0, -1.0]], dtype=torch.float64)
    cur = torch.tensor([[-801.0, -3.0]], dtype=torch.float64)
    versions = torch.tensor([[0, 0]])
    prox, alpha = linear_proximal_log_prob(behav, cur, versions, 2, torch.ones(1, 2))
    assert_close(alpha, torch.full((1, 2), 0.5, dtype=torch.float64))
    # log(½e^−800 + ½e^−801) = −800 + log((1 + e^−1)/2)
    expected0 = -800.0 + LN((1 + math.exp(-1.0)) / 2)
    expected1 = LN(0.5 * math.exp(-1.0) + 0.5 * math.exp(-3.0))
    assert_close(prox, torch.tensor([[expected0, expected1]], dtype=torch.float64))
    loglin, _ = loglinear_proximal_log_prob(behav, cur, versions, 2, torch.ones(1, 2))
    assert bool((prox >= loglin).all())  # AM–GM: the arithmetic mean is above the geometric


def test_ewma_decay_and_update():
    assert ewma_decay_from_staleness(0) == 0.0
    assert ewma_decay_from_staleness(2) == pytest.approx(0.5)     # W/(W+2); centre of mass 1
    beta = ewma_decay_from_staleness(4)
    assert beta / (1 - beta) == pytest.approx(2.0)                # centre of the window 0..4
    cfg = EWMAConfig(staleness_window=2, reset_interval=None, reset_mask_frac=None)
    state, reset = ewma_update(None, torch.tensor([0.0]), cfg)
    assert reset and state.reference.item() == 0.0
    state, reset = ewma_update(state, torch.tensor([4.0]), cfg)
    assert not reset and state.reference.item() == pytest.approx(0.5 * 0 + 0.5 * 4)
    state, _ = ewma_update(state, torch.tensor([4.0]), cfg)
    assert state.reference.item() == pytest.approx(0.5 * 2 + 0.5 * 4)
    # parameters (a mapping) work too, and inputs are not mutated
    p0 = {"w": torch.zeros(2)}
    s, _ = ewma_update(None, p0, cfg)
    s, _ = ewma_update(s, {"w": torch.ones(2)}, cfg)
    assert_close(s.reference["w"], torch.full((2,), 0.5))
    assert p0["w"].sum().item() == 0.0


def test_ewma_resets():
    cfg = EWMAConfig(staleness_window=2, reset_interval=2, reset_mask_frac=0.1)
    s, _ = ewma_update(None, torch.tensor([0.0]), cfg)
    s, reset = ewma_update(s, torch.tensor([2.0]), cfg)
    assert not reset and s.reference.item() == 1.0
    s, reset = ewma_update(s, torch.tensor([8.0]), cfg)          # 2nd update since reset
    assert reset and s.reference.item() == 8.0
    s, reset = ewma_update(s, torch.tensor([0.0]), cfg, mask_frac=0.3)  # mask rate trigger
    assert reset and s.reference.item() == 0.0


# ---------------------------------------------------------------- properties

finite = st.floats(-5, 0, allow_nan=False)
garbage = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(float("nan")))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(finite, finite, st.booleans(), garbage, garbage),
                min_size=1, max_size=12),
       st.sampled_from(CORRECTION_METHODS), st.sampled_from([torch.float32, torch.float64]))
def test_masked_garbage_never_matters(rows, method, dtype):
    num = torch.tensor([[r[0] for r in rows]], dtype=dtype)
    den = torch.tensor([[r[1] for r in rows]], dtype=dtype)
    mask = torch.tensor([[r[2] for r in rows]])
    num_g = torch.where(mask, num, torch.tensor([[r[3] for r in rows]], dtype=dtype))
    den_g = torch.where(mask, den, torch.tensor([[r[4] for r in rows]], dtype=dtype))
    a = compute_is_correction(num, den, mask, method)
    b = compute_is_correction(num_g, den_g, mask, method)
    assert_close(a.weight, b.weight)
    assert a.weight.dtype == dtype
    assert a.keep_mask.equal(b.keep_mask)
    for k, v in a.metrics.items():
        assert v == pytest.approx(b.metrics[k], nan_ok=False), k


@settings(max_examples=50, deadline=None)
@given(st.lists(finite, min_size=1, max_size=16), st.sampled_from(CORRECTION_METHODS))
def test_identical_policies_give_unit_weights(values, method):
    lp = torch.tensor([values], dtype=torch.float64)
    out = compute_is_correction(lp, lp.clone(), torch.ones_like(lp), method)
    assert_close(out.weight, torch.ones_like(lp))
    assert out.metrics["ess"] == pytest.approx(1.0)
    assert out.metrics["clip_frac"] == 0.0 and out.metrics["mask_frac"] == 0.0
    assert out.metrics["kl_k1"] == 0.0 and out.metrics["kl_k3"] == 0.0


def test_weights_are_detached():
    num = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    den = torch.tensor([[-1.2, -0.4]], requires_grad=True)
    for method in CORRECTION_METHODS:
        out = compute_is_correction(num, den, torch.ones(1, 2), method)
        assert not out.weight.requires_grad


def test_bounds_override_keeps_the_objects_own_bounds():
    num, den = _pair([[0.4, 5.5]])
    out = compute_is_correction(num, den, torch.ones(1, 2), SourceCorrection("icepop", 0.3, 4.0),
                                bounds=(None, 6.0))
    # band [0.3, 6.0]: both kept
    assert out.keep_mask.tolist() == [[True, True]]
    with pytest.raises(ValueError, match="one-sided"):
        SourceCorrection("cap", lower=0.5)


def test_empty_batch_ess_is_one():
    lp = torch.zeros(2, 3)
    out = compute_is_correction(lp, lp, torch.zeros(2, 3), "icepop")
    assert out.metrics["ess"] == 1.0 and out.metrics["mask_frac"] == 0.0


def test_decoupled_ppo_gradient():
    # one kept token: loss = -w·r·A / 1 with w = π_prox/π_behav = 2, r = 1 → dL/dlogπ = -2·A
    behav = torch.tensor([[-1.0]], dtype=torch.float64)
    prox = behav + LN(2.0)
    cur = prox.clone().requires_grad_(True)
    loss, _ = decoupled_ppo_loss(cur, prox, behav, torch.tensor([[0.5]], dtype=torch.float64),
                                 torch.ones(1, 1))
    loss.backward()
    assert cur.grad.item() == pytest.approx(-2.0 * 0.5)
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        decoupled_ppo_loss(cur, prox, behav, torch.ones(1, 1), torch.ones(1, 1),
                           behaviour_weight_cap=0.0)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(finite, st.floats(-0.3, 0.3), st.floats(-0.3, 0.3),
                          st.floats(-0.3, 0.3), st.floats(-1, 1), st.booleans()),
                min_size=2, max_size=8),
       st.sampled_from([math.nan, math.inf, -math.inf]),
       st.sampled_from([torch.float32, torch.float64]))
def test_composite_losses_ignore_masked_garbage(rows, junk, dtype):
    def col(i):
        return torch.tensor([[r[i] for r in rows]], dtype=dtype)

    mask = torch.tensor([[r[5] for r in rows]])
    mask[0, 0] = True
    rollout = col(0)
    old = rollout + col(1)
    prox = old + col(2)
    cur = prox + col(3)
    adv = col(4)

    def dirty(x):
        return torch.where(mask, x, torch.tensor(junk, dtype=dtype))

    results = []
    for tensors in ((cur, prox, old, rollout, adv), tuple(dirty(t) for t in
                                                         (cur, prox, old, rollout, adv))):
        c = tensors[0].clone().requires_grad_(True)
        loss1, m1 = compis_policy_loss(c, *tensors[1:], mask)
        loss2, _ = decoupled_ppo_loss(c, tensors[1], tensors[3], tensors[4], mask)
        (loss1 + loss2).backward()
        prox_ll, alpha = loglinear_proximal_log_prob(
            tensors[3], tensors[0], torch.zeros_like(mask, dtype=torch.long), 2, mask)
        results.append((loss1.detach(), loss2.detach(), c.grad, prox_ll, alpha, m1))
    (a1, a2, ga, pa, aa, ma), (b1, b2, gb, pb, ab, mb) = results
    assert a1.dtype == dtype
    assert_close(a1, b1)
    assert_close(a2, b2)
    assert_close(ga, gb)
    assert torch.isfinite(gb).all()
    assert_close(pa, pb)
    assert_close(aa, ab)
    for k in ma:
        assert ma[k] == pytest.approx(mb[k]), k
