"""Tests for training/algorithms/policy_loss.py (hand-computed values, gradients, properties)."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.algorithms.policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_loss,
    compute_policy_loss,
    compute_ppo_clip_terms,
    resolve_clip_range,
    sapo_gate,
    sapo_shape,
)

F64 = torch.float64
EXPECTED_NAMES = {
    "vanilla",
    "gspo",
    "gspo_token",
    "gmpo",
    "geo_mean",
    "sapo",
    "cispo",
    "gpg",
    "reinforce",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
    "bypass_mode",
    "dro",
}
# the settings every loss runs with here (dro has no default β)
RUNNABLE = PolicyLossConfig(dro_beta=0.5)
# every loss that runs without a rollout-correction config
PLAIN_LOSSES = sorted(EXPECTED_NAMES - {"bypass_mode"})

# The 2×3 running example: row 0 has 3 valid tokens, row 1 has 2 (position [1, 2] is padding).
MASK = torch.tensor([[True, True, True], [True, True, False]])
# current log-probs log π_θ at the valid positions; [1, 2] is filled per test (often garbage)
LP = [[-1.0, -2.0, -0.5], [-1.5, -1.0, 0.0]]
NAN = float("nan")


def t(rows: list[list[float]], dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def from_ratios(
    ratios: list[list[float]], lp: list[list[float]] = LP, garbage: float = NAN
) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_log_prob, log_prob leaf) with π_θ/π_old = ``ratios``; garbage at the padded slot."""
    lp_t = t(lp)
    old = lp_t - torch.log(t(ratios))
    lp_t[1, 2] = garbage
    old[1, 2] = garbage
    return old, lp_t.requires_grad_(True)


def run(name: str, old, lp, adv, mask=MASK, config=None, weights=None):
    config = PolicyLossConfig() if config is None else config
    loss, metrics = POLICY_LOSSES.get(name)(old, lp, adv, mask, config, weights)
    loss.backward()
    return loss, metrics, lp.grad


def close(actual, expected, **kw) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype if torch.is_tensor(actual) else F64)
    actual_t = actual.detach() if torch.is_tensor(actual) else torch.tensor(actual, dtype=F64)
    torch.testing.assert_close(actual_t, expected_t, **kw)


def sig(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


# --------------------------------------------------------------------------------------------
# agg_loss
# --------------------------------------------------------------------------------------------

LOSS_MAT = [[1.0, 2.0, 3.0], [4.0, NAN, math.inf], [7.0, 8.0, 9.0]]
AGG_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 2 has no valid token


@pytest.mark.parametrize(
    ("mode", "scale", "expected"),
    [
        ("token-mean", None, (1 + 2 + 3 + 4) / 4),
        ("token-sum", None, 1 + 2 + 3 + 4),  # no normaliser
        ("token-sum", 10.0, 1 + 2 + 3 + 4),  # K belongs to seq-mean-token-sum-norm only
        ("seq-mean-token-sum", None, ((1 + 2 + 3) + 4) / 2),
        ("seq-mean-token-mean", None, ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        # Dr.GRPO: seq-mean-token-sum / K with K = T = 3 by default (verl agg_loss)
        ("seq-mean-token-sum-norm", None, ((1 + 2 + 3) + 4) / 2 / 3),
        ("seq-mean-token-sum-norm", 10.0, ((1 + 2 + 3) + 4) / 2 / 10),
    ],
)
def test_agg_loss_hand_values(mode: str, scale: float | None, expected: float) -> None:
    loss_mat = t(LOSS_MAT).requires_grad_(True)
    loss = agg_loss(loss_mat, AGG_MASK, mode, scale)
    close(loss, expected)
    loss.backward()
    # masked garbage (NaN, inf) and the empty row get an exact zero gradient
    assert loss_mat.grad[1, 1] == 0 and loss_mat.grad[1, 2] == 0
    assert torch.all(loss_mat.grad[2] == 0)


def test_agg_loss_all_masked_is_zero_not_nan() -> None:
    for mode in LOSS_AGG_MODES:
        loss_mat = t([[NAN, 1.0], [math.inf, 2.0]]).requires_grad_(True)
        loss = agg_loss(loss_mat, torch.zeros(2, 2, dtype=torch.bool), mode)
        assert loss.item() == 0.0
        loss.backward()
        assert torch.all(loss_mat.grad == 0)


def test_agg_loss_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(t([[1.0]]), torch.ones(1, 1), "token-sum-everything")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(t([[1.0]]), torch.ones(1, 1), "seq-mean-token-sum-norm", 0.0)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        agg_loss(t([[1.0, 2.0]]), torch.ones(1, 3), "token-mean")


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------


def test_config_defaults_follow_papers_and_verl() -> None:
    c = PolicyLossConfig()
    assert c.loss_agg_mode == "token-mean"
    assert c.sequence_objective_agg_mode == "seq-mean-token-mean"
    assert resolve_clip_range(c) == (0.2, 0.2) and c.clip_ratio_c == 3.0
    assert (c.tau_pos, c.tau_neg) == (1.0, 1.05)
    assert (c.gspo_clip_ratio_low, c.gspo_clip_ratio_high) == (3e-4, 4e-4)
    assert (c.gmpo_clip_ratio_low, c.gmpo_clip_ratio_high) == (0.4, 0.4)
    assert (c.cispo_clip_ratio_low, c.cispo_clip_ratio_high) == (10.0, 0.2)
    assert (c.clip_cov_ratio, c.clip_cov_lb, c.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert (c.kl_cov_ratio, c.ppo_kl_coef) == (2e-4, 0.1)
    assert (c.dppo_tv_low, c.dppo_tv_high) == (0.15, 0.15)
    assert (c.dppo_kl_low, c.dppo_kl_high) == (0.05, 0.05)
    assert c.dppo_is_cap == 20.0
    assert resolve_clip_range(PolicyLossConfig(clip_ratio=0.1, clip_ratio_high=0.28)) == (0.1, 0.28)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_agg_mode": "mean"},
        {"sequence_objective_agg_mode": "token-summ"},
        {"clip_ratio": -0.1},
        {"clip_ratio_high": math.nan},
        {"clip_ratio_c": 1.0},
        {"tau_pos": 0.0},
        {"gspo_clip_ratio_low": -1e-4},
        {"clip_cov_ratio": 0.0},
        {"kl_cov_ratio": 1.5},
        {"clip_cov_lb": 5.0, "clip_cov_ub": 1.0},
        {"kl_cov_estimator": "k2"},
        {"dppo_tv_high": 0.0},
        {"dppo_is_cap": -1.0},
        {"loss_scale_factor": 0.0},
        {"bypass_loss_type": "ppo"},
        {"clip_cov_generator": 3},
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        PolicyLossConfig(**kwargs)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        PolicyLossConfig().clip_ratio = 0.3  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


def test_registry_names_and_aliases() -> None:
    assert set(POLICY_LOSSES.names()) == EXPECTED_NAMES
    assert POLICY_LOSSES.get("gmpo") is POLICY_LOSSES.get("geo_mean")
    assert POLICY_LOSSES.get("gpg") is POLICY_LOSSES.get("reinforce")
    with pytest.raises(KeyError, match="valid names"):
        POLICY_LOSSES.get("ppo2")


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_every_registered_loss_runs_and_reports_base_metrics(name: str) -> None:
    old, lp = from_ratios([[1.1, 0.9, 1.0], [1.0, 1.05, 1.0]])
    adv = t([[1.0, -1.0, 0.5], [2.0, 2.0, NAN]])
    config = RUNNABLE
    if name == "bypass_mode":
        pytest.importorskip("training.algorithms.rollout_correction")
        from training.algorithms.rollout_correction import RolloutCorrectionConfig

        config = PolicyLossConfig(rollout_correction=RolloutCorrectionConfig.bypass_ppo_clip())
    loss, metrics = compute_policy_loss(name, old, lp, adv, MASK, config)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all() and lp.grad[1, 2] == 0
    base_keys = (
        "policy/pg_loss",
        "policy/pg_clipfrac",
        "policy/pg_clipfrac_lower",
        "policy/ppo_kl",
    )
    for key in base_keys:
        assert isinstance(metrics[key], float)
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["policy/pg_loss"] == pytest.approx(loss.item())


# --------------------------------------------------------------------------------------------
# vanilla PPO
# --------------------------------------------------------------------------------------------


def test_vanilla_hand_values_clipfracs_and_grad() -> None:
    ratios = [[1.5, 0.5, 1.1], [4.0, 1.1, 1.0]]
    old, lp = from_ratios(ratios)
    adv = t([[1.0, 1.0, -1.0], [-2.0, 0.5, 7.0]])
    loss, m, grad = run("vanilla", old, lp, adv)  # ε = 0.2, c = 3
    token = [
        max(-1.5, -1.2),  # A=+1, r=1.5: clipped at 1.2 → −1.2
        max(-0.5, -0.8),  # A=+1, r=0.5: below the band but A>0 → unclipped −0.5
        max(1.1, 1.1),  # A=−1, r=1.1: inside the band → 1.1
        min(max(8.0, 2.4), 3.0 * 2.0),  # A=−2, r=4: −A·r = 8 > −c·A = 6 → dual clip → 6
        max(-0.55, -0.55),  # A=0.5, r=1.1
    ]
    close(loss, sum(token) / 5)
    assert m["policy/pg_clipfrac"] == pytest.approx(1 / 5)
    assert m["policy/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    # ppo_kl = mean(log π_old − log π_θ) = −mean(log r)
    log_r = [math.log(1.5), math.log(0.5), math.log(1.1), math.log(4.0), math.log(1.1)]
    close(m["policy/ppo_kl"], -sum(log_r) / 5)
    # ∂(−A r)/∂log π = −A r where unclipped, 0 where either clip is active
    close(grad, t([[0.0, -0.5, 1.1], [0.0, -0.55, 0.0]]) / 5)


def test_vanilla_clip_higher_is_asymmetric() -> None:
    old, lp = from_ratios([[1.25, 0.78, 1.0], [1.0, 1.0, 1.0]])
    adv = t([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    sym, m_sym, _ = run("vanilla", old, lp, adv)
    old, lp = from_ratios([[1.25, 0.78, 1.0], [1.0, 1.0, 1.0]])
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    asym, m_asym, _ = run("vanilla", old, lp, adv, config=cfg)
    close(sym, (-1.2 + 0.8) / 5)  # r=1.25 clipped at 1.2; r=0.78 (A<0) clipped at 0.8
    close(asym, (-1.25 + 0.8) / 5)  # upper bound 1.28 no longer binds
    assert m_sym["policy/pg_clipfrac"] == pytest.approx(2 / 5)
    assert m_asym["policy/pg_clipfrac"] == pytest.approx(1 / 5)


def test_compute_ppo_clip_terms_without_dual_clip() -> None:
    terms = compute_ppo_clip_terms(t([[4.0, 1.0]]), t([[-2.0, 1.0]]), 0.2, 0.2, None)
    close(terms.token_loss, t([[8.0, -1.0]]))  # no −c·A cap without dual clip
    assert not terms.clipped.any() and not terms.clipped_lower.any()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vanilla_uses_config_aggregation(mode: str) -> None:
    old, lp = from_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = t([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])
    loss, _, _ = run("vanilla", old, lp, adv, config=PolicyLossConfig(loss_agg_mode=mode))
    # ratio 1 → ℓ = −A
    expected = {
        "token-mean": -(1 + 2 + 3 + 4 + 5) / 5,
        "token-sum": -(1 + 2 + 3 + 4 + 5),
        "seq-mean-token-sum": -((1 + 2 + 3) + (4 + 5)) / 2,
        "seq-mean-token-mean": -((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2,
        "seq-mean-token-sum-norm": -((1 + 2 + 3) + (4 + 5)) / 2 / 3,
    }[mode]
    close(loss, expected)


# --------------------------------------------------------------------------------------------
# GSPO / GSPO-token
# --------------------------------------------------------------------------------------------

GSPO_LOG_RATIOS = [[0.1, -0.2, 0.4], [0.3, 0.5, 0.0]]  # seq means 0.1 and 0.4
GSPO_CFG = PolicyLossConfig(gspo_clip_ratio_low=0.2, gspo_clip_ratio_high=0.2)


def gspo_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return from_ratios([[math.exp(v) for v in row] for row in GSPO_LOG_RATIOS])


def test_gspo_hand_values_and_sequence_gradient() -> None:
    old, lp = gspo_inputs()
    adv = t([[1.0, 1.0, 1.0], [2.0, 2.0, NAN]])
    loss, m, grad = run("gspo", old, lp, adv, config=GSPO_CFG)
    s0 = math.exp((0.1 - 0.2 + 0.4) / 3)  # 1.105 ∈ [0.8, 1.2]: unclipped
    s1 = math.exp((0.3 + 0.5) / 2)  # 1.492 > 1.2 with A = 2 > 0: clipped → −2·1.2
    close(loss, ((-1 * s0) + (-2 * 1.2)) / 2)  # seq-mean-token-mean
    assert m["policy/pg_clipfrac"] == pytest.approx(2 / 5)
    # ordinary gradient through log s_0 = mean_t log r_t: ∂/∂log π_t = −A s_0 · (1/3) · (1/2)
    close(grad, t([[-s0 / 6, -s0 / 6, -s0 / 6], [0.0, 0.0, 0.0]]))
    assert m["policy/gspo/seq_ratio/max"] == pytest.approx(s1)


def test_gspo_token_gradient_is_per_token_and_matches_gspo_for_constant_advantage() -> None:
    adv = t([[1.0, 2.0, -1.0], [2.0, 2.0, NAN]])
    s0 = math.exp((0.1 - 0.2 + 0.4) / 3)
    old, lp = gspo_inputs()
    loss_tok, _, grad_tok = run("gspo_token", old, lp, adv, config=GSPO_CFG)
    old, lp = gspo_inputs()
    loss_seq, _, grad_seq = run("gspo", old, lp, adv, config=GSPO_CFG)
    expected_value = ((-1 * s0 - 2 * s0 + 1 * s0) / 3 + (-2 * 1.2)) / 2
    close(loss_tok, expected_value)
    close(loss_seq, expected_value)  # same value, different gradient
    # GSPO-token (seed 001, paper §4.3): sg[s_i] — token t gets −A_t s_0 /3 /2
    close(grad_tok, t([[-1 * s0 / 6, -2 * s0 / 6, 1 * s0 / 6], [0.0, 0.0, 0.0]]))
    # GSPO: gradient through log s_0 — every token gets −mean(A) s_0 /3 /2
    mean_a = (1 + 2 - 1) / 3
    close(grad_seq, t([[-mean_a * s0 / 6] * 3, [0.0, 0.0, 0.0]]))
    # with A constant on each sequence the two gradients coincide
    adv_const = t([[1.0, 1.0, 1.0], [2.0, 2.0, NAN]])
    old, lp = gspo_inputs()
    _, _, g1 = run("gspo_token", old, lp, adv_const, config=GSPO_CFG)
    old, lp = gspo_inputs()
    _, _, g2 = run("gspo", old, lp, adv_const, config=GSPO_CFG)
    close(g1, g2)


def test_gspo_default_epsilon_is_tiny() -> None:
    old, lp = gspo_inputs()
    adv = t([[1.0, 1.0, 1.0], [2.0, 2.0, NAN]])
    loss, m, grad = run("gspo", old, lp, adv)  # ε = 3e-4 / 4e-4: both sequences clipped
    close(loss, ((-1 * 1.0004) + (-2 * 1.0004)) / 2)
    assert m["policy/pg_clipfrac"] == 1.0
    assert torch.all(grad == 0)


# --------------------------------------------------------------------------------------------
# SAPO
# --------------------------------------------------------------------------------------------


def test_sapo_hand_values_and_gate_gradient() -> None:
    ratios = [[1.5, 0.5, 1.0], [2.0, 0.8, 1.0]]
    old, lp = from_ratios(ratios)
    adv = t([[1.0, 1.0, -1.0], [-2.0, 0.5, NAN]])
    loss, m, grad = run("sapo", old, lp, adv)  # τ_pos = 1 (A>0), τ_neg = 1.05 (A≤0)

    def g(r: float, tau: float) -> float:  # g(r, τ) = σ(τ(r−1))·4/τ
        return sig(tau * (r - 1)) * 4 / tau

    def gate(r: float, tau: float) -> float:  # g'(r) = 4σ(1−σ)
        return 4 * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1)))

    row0 = [-1 * g(1.5, 1.0), -1 * g(0.5, 1.0), +1 * g(1.0, 1.05)]
    row1 = [+2 * g(2.0, 1.05), -0.5 * g(0.8, 1.0)]
    close(loss, (sum(row0) / 3 + sum(row1) / 2) / 2)
    # ∂ℓ/∂log π = −A · g'(r) · r, then seq-mean-token-mean weights (1/3)(1/2) and (1/2)(1/2)
    expected_grad = t(
        [
            [-1 * gate(1.5, 1) * 1.5 / 6, -1 * gate(0.5, 1) * 0.5 / 6, 1 * gate(1.0, 1.05) / 6],
            [2 * gate(2.0, 1.05) * 2.0 / 4, -0.5 * gate(0.8, 1) * 0.8 / 4, 0.0],
        ]
    )
    close(grad, expected_grad)
    assert m["policy/pg_clipfrac"] == 0.0
    gates = [gate(1.5, 1), gate(0.5, 1), gate(1.0, 1.05), gate(2.0, 1.05), gate(0.8, 1)]
    assert m["policy/sapo/gate_mean"] == pytest.approx(sum(gates) / 5)
    assert m["policy/sapo/gate_min"] == pytest.approx(min(gates))


@pytest.mark.parametrize("tau", [1.0, 1.05, 3.0])
def test_sapo_gate_is_derivative_of_shape_and_peaks_at_ratio_one(tau: float) -> None:
    r = torch.linspace(0.2, 3.0, 281, dtype=F64).requires_grad_(True)  # contains r = 1 exactly
    shape = sapo_shape(r, tau)
    (dshape,) = torch.autograd.grad(shape.sum(), r)
    close(dshape, sapo_gate(r.detach(), tau))
    peak = int(torch.argmax(dshape))
    assert r[peak].item() == pytest.approx(1.0)
    assert dshape[peak].item() == pytest.approx(1.0)  # 4·σ(0)·(1−σ(0)) = 1
    close(sapo_shape(torch.tensor(1.0, dtype=F64), tau), 2 / tau)  # g(1, τ) = 2/τ
    assert torch.all(shape[1:] > shape[:-1])  # monotone objective shape


# --------------------------------------------------------------------------------------------
# GMPO
# --------------------------------------------------------------------------------------------


def gmpo_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    log_ratios = [[0.1, -0.2, 0.6], [-0.5, 0.2, 0.0]]
    return from_ratios([[math.exp(v) for v in row] for row in log_ratios])


def test_gmpo_hand_values_clipfracs_and_grad() -> None:
    old, lp = gmpo_inputs()
    adv = t([[1.0, 1.0, 1.0], [-2.0, -2.0, NAN]])
    loss, m, grad = run("gmpo", old, lp, adv)  # ε = 0.4 in log space
    # seq 0, A>0: log-ratios capped at +0.4 → [0.1, −0.2, 0.4]; seq 1, A<0: floored at −0.4
    rho0 = math.exp((0.1 - 0.2 + 0.4) / 3)
    rho1 = math.exp((-0.4 + 0.2) / 2)
    close(loss, ((-1 * rho0) + (2 * rho1)) / 2)
    assert m["policy/pg_clipfrac"] == pytest.approx(1 / 5)
    assert m["policy/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    # ∂/∂log π_t of ½(−Ā ρ): −Ā ρ /|y| /2 on unclipped tokens, 0 on clipped ones
    close(grad, t([[-rho0 / 6, -rho0 / 6, 0.0], [0.0, 2 * rho1 / 2 / 2, 0.0]]))


def test_gmpo_is_weights_apply_per_token() -> None:
    old, lp = gmpo_inputs()
    adv = t([[1.0, 1.0, 1.0], [-2.0, -2.0, NAN]])
    w = t([[1.0, 2.0, 3.0], [0.5, 1.5, NAN]])
    loss, _, _ = run("geo_mean", old, lp, adv, weights=w)
    rho0 = math.exp((0.1 - 0.2 + 0.4) / 3)
    rho1 = math.exp((-0.4 + 0.2) / 2)
    close(loss, ((-1 * rho0) * (1 + 2 + 3) / 3 + (2 * rho1) * (0.5 + 1.5) / 2) / 2)


# --------------------------------------------------------------------------------------------
# CISPO
# --------------------------------------------------------------------------------------------


def test_cispo_hand_values_and_stop_gradient() -> None:
    old, lp = from_ratios([[1.5, 0.5, 1.1], [0.05, 1.3, 1.0]])
    adv = t([[1.0, 1.0, -1.0], [-2.0, 0.5, NAN]])
    loss, m, grad = run("cispo", old, lp, adv)  # bounds [1 − 10, 1 + 0.2] = [−9, 1.2]
    clipped = [[1.2, 0.5, 1.1], [0.05, 1.2]]
    # ℓ = −sg(clip(r)) · A · log π
    token = [
        -1.2 * 1.0 * -1.0,
        -0.5 * 1.0 * -2.0,
        -1.1 * -1.0 * -0.5,
        -0.05 * -2.0 * -1.5,
        -1.2 * 0.5 * -1.0,
    ]
    close(loss, sum(token) / 5)
    # seed: ∂ℓ/∂log π = −sg(clip(r)) · A / N (token-mean): no gradient through the ratio
    close(
        grad,
        t([[-1.2 * 1.0, -0.5 * 1.0, -1.1 * -1.0], [-0.05 * -2.0, -1.2 * 0.5, 0.0]]) / 5,
    )
    assert clipped[0][0] == 1.2
    assert m["policy/pg_clipfrac"] == pytest.approx(2 / 5)  # r = 1.5 and 1.3
    assert m["policy/cispo/clipfrac"] == pytest.approx(2 / 5)


def test_cispo_lower_bound_when_enabled() -> None:
    old, lp = from_ratios([[1.5, 0.5, 1.1], [0.05, 1.3, 1.0]])
    adv = t([[1.0, 1.0, -1.0], [-2.0, 0.5, NAN]])
    _, m, grad = run("cispo", old, lp, adv, config=PolicyLossConfig(cispo_clip_ratio_low=0.4))
    # lower bound 1 − 0.4 = 0.6: r = 0.5 and 0.05 are raised to 0.6 as well
    assert m["policy/cispo/clipfrac"] == pytest.approx(4 / 5)
    close(grad[0, 1], -0.6 * 1.0 / 5)
    close(grad[1, 0], -0.6 * -2.0 / 5)


# --------------------------------------------------------------------------------------------
# DRO
# --------------------------------------------------------------------------------------------


def test_dro_hand_values_gradient_and_penalty() -> None:
    ratios = [[1.5, 0.5, 1.1], [0.05, 1.3, 1.0]]
    old, lp = from_ratios(ratios)
    adv = t([[1.0, 1.0, -1.0], [-2.0, 0.5, NAN]])
    beta = 0.5
    loss, m, grad = run("dro", old, lp, adv, config=PolicyLossConfig(dro_beta=beta))
    valid = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    a = {(0, 0): 1.0, (0, 1): 1.0, (0, 2): -1.0, (1, 0): -2.0, (1, 1): 0.5}
    d = {(i, j): math.log(ratios[i][j]) for i, j in valid}  # log π_θ − log π_old
    # ℓ = −(A · log π − ½β(log π − log π_old)²), token-mean over the 5 valid tokens
    token = [-(a[k] * LP[k[0]][k[1]] - 0.5 * beta * d[k] ** 2) for k in valid]
    close(loss, sum(token) / 5)
    # ∂ℓ/∂log π = −A + β(log π − log π_old): the penalty pulls back towards π_old
    expected = torch.zeros(2, 3, dtype=F64)
    for k in valid:
        expected[k] = (-a[k] + beta * d[k]) / 5
    close(grad, expected)
    assert m["policy/dro/penalty"] == pytest.approx(sum(0.5 * beta * d[k] ** 2
                                                        for k in valid) / 5)
    assert m["policy/pg_clipfrac"] == 0.0  # nothing is clipped
    assert m["policy/ppo_kl"] == pytest.approx(-sum(d.values()) / 5)


def test_dro_penalty_is_not_clamped_and_weights_multiply_the_whole_term() -> None:
    # log-ratio 30 (beyond the ±20 exp clamp): the restoring gradient is β·30, not 0
    old = t([[-31.0]])
    lp = t([[-1.0]]).requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = compute_policy_loss("dro", old, lp, t([[0.0]]), mask,
                                  PolicyLossConfig(dro_beta=0.1), t([[2.0]]))
    loss.backward()
    close(loss, 2.0 * 0.5 * 0.1 * 30.0**2)
    close(lp.grad, t([[2.0 * 0.1 * 30.0]]))


def test_dro_needs_beta() -> None:
    old, lp = from_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="dro_beta"):
        run("dro", old, lp, t([[1.0] * 3] * 2))
    with pytest.raises(ValueError, match="dro_beta"):
        PolicyLossConfig(dro_beta=0.0)


# --------------------------------------------------------------------------------------------
# GPG / REINFORCE
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpg", "reinforce"])
def test_policy_gradient_with_is_weights(name: str) -> None:
    old, lp = from_ratios([[1.5, 0.5, 1.1], [0.7, 1.3, 1.0]])
    adv = t([[1.0, 1.0, -1.0], [-2.0, 1.5, NAN]])
    w = t([[2.0, 1.0, 0.5], [1.0, 3.0, math.inf]])
    loss, m, grad = run(name, old, lp, adv, weights=w)
    # ℓ = −w · A · log π (no ratio, no clip)
    token = [2 * -1 * -1.0, 1 * -1 * -2.0, 0.5 * 1 * -0.5, 1 * 2 * -1.5, 3 * -1.5 * -1.0]
    close(loss, sum(token) / 5)
    close(grad, t([[-2.0 * 1, -1.0 * 1, -0.5 * -1], [-1.0 * -2, -3.0 * 1.5, 0.0]]) / 5)
    assert m["policy/pg_clipfrac"] == 0.0
    close(m["policy/ppo_kl"], -(math.log(1.5 * 0.5 * 1.1 * 0.7 * 1.3)) / 5)


# --------------------------------------------------------------------------------------------
# Clip-Cov / KL-Cov
# --------------------------------------------------------------------------------------------
# Running example: A valid = [1, 1, −1, −2, 0.5] (mean −0.1), log π valid = [−1, −2, −0.5, −1.5,
# −1] (mean −1.2). Centred covariances (A − Ā)(log π − mean):
COV = [(1.1) * (0.2), (1.1) * (-0.8), (-0.9) * (0.7), (-1.9) * (-0.3), (0.6) * (0.2)]
# = [0.22, −0.88, −0.63, 0.57, 0.12]
COV_ADV = [[1.0, 1.0, -1.0], [-2.0, 0.5, NAN]]


def test_clip_cov_zeroes_the_only_candidate() -> None:
    old, lp = from_ratios([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    cfg = PolicyLossConfig(clip_cov_lb=0.5, clip_cov_ub=5.0)  # only token [1, 0] (0.57) qualifies
    loss, m, grad = run("clip_cov", old, lp, t(COV_ADV), config=cfg)
    # PPO terms: [max(−1.5, −1.2), −1, +1, 2 → zeroed, −0.5]
    close(loss, (-1.2 - 1.0 + 1.0 + 0.0 - 0.5) / 5)
    assert m["policy/clip_cov/clipfrac"] == pytest.approx(1 / 5)
    assert m["policy/pg_clipfrac"] == pytest.approx(1 / 5)  # the ε-clip on r = 1.5
    close(grad, t([[0.0, -1.0, 1.0], [0.0, -0.5, 0.0]]) / 5)


def test_clip_cov_excludes_ratio_clipped_tokens_from_candidates() -> None:
    old, lp = from_ratios([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    # lb = 0.1: covariances 0.22 ([0,0]), 0.57, 0.12 qualify, but [0,0] is already ε-clipped
    cfg = PolicyLossConfig(clip_cov_lb=0.1, clip_cov_ratio=1.0)  # n_clip = 5 ≥ #candidates
    loss, m, _ = run("clip_cov", old, lp, t(COV_ADV), config=cfg)
    assert COV[0] > 0.1 and COV[3] > 0.1 and COV[4] > 0.1
    close(loss, (-1.2 - 1.0 + 1.0 + 0.0 + 0.0) / 5)
    assert m["policy/clip_cov/candidate_frac"] == pytest.approx(2 / 5)
    assert m["policy/clip_cov/clipfrac"] == pytest.approx(2 / 5)


def test_clip_cov_randomness_is_seeded_or_generator_driven() -> None:
    cfg = PolicyLossConfig(clip_cov_lb=0.1)  # 2 candidates, n_clip = max(int(2e-4·5), 1) = 1

    def loss_with(config: PolicyLossConfig) -> float:
        old, lp = from_ratios([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
        return run("clip_cov", old, lp, t(COV_ADV), config=config)[0].item()

    options = {(-1.2 - 1.0 + 1.0 + 0.0 - 0.5) / 5, (-1.2 - 1.0 + 1.0 + 2.0 + 0.0) / 5}
    first = loss_with(cfg)
    assert any(first == pytest.approx(o) for o in options)
    assert all(loss_with(cfg) == first for _ in range(5))  # seeded: deterministic
    gen = torch.Generator().manual_seed(123)
    cfg_gen = PolicyLossConfig(clip_cov_lb=0.1, clip_cov_generator=gen)
    seen = {round(loss_with(cfg_gen), 12) for _ in range(30)}
    assert seen == {round(o, 12) for o in options}  # the generator advances between calls
    gen.manual_seed(123)
    replay = [loss_with(cfg_gen) for _ in range(5)]
    gen.manual_seed(123)
    assert [loss_with(cfg_gen) for _ in range(5)] == replay


def test_kl_cov_penalises_top_covariance_token() -> None:
    ratios = [[1.5, 0.5, 1.1], [0.8, 1.2, 1.0]]
    old, lp = from_ratios(ratios)
    loss, m, grad = run("kl_cov", old, lp, t(COV_ADV))  # k = max(1, int(5·2e-4)) = 1, β = 0.1
    # top covariance is token [1, 0] (0.57): ℓ = −A r + β|log r| there, −A r elsewhere
    token = [-1.5, -0.5, 1.1, 2 * 0.8 + 0.1 * abs(math.log(0.8)), -0.5 * 1.2]
    close(loss, sum(token) / 5)
    assert m["policy/kl_cov/selected_frac"] == pytest.approx(1 / 5)
    assert m["policy/pg_clipfrac"] == 0.0
    # ∂(−A r)/∂log π = −A r ; ∂β|log r|/∂log π = β·sign(log r) = −0.1 at r = 0.8
    close(grad, t([[-1.5, -0.5, 1.1], [2 * 0.8 - 0.1, -0.5 * 1.2, 0.0]]) / 5)


def test_kl_cov_ratio_and_k3_estimator() -> None:
    ratios = [[1.5, 0.5, 1.1], [0.8, 1.2, 1.0]]
    old, lp = from_ratios(ratios)
    cfg = PolicyLossConfig(kl_cov_ratio=0.7, kl_cov_estimator="k3", ppo_kl_coef=0.5)
    loss, m, _ = run("kl_cov", old, lp, t(COV_ADV), config=cfg)

    def k3(r: float) -> float:
        return r - 1 - math.log(r)

    # k = int(5·0.7) = 3 → covariances 0.57 ([1,0]), 0.22 ([0,0]), 0.12 ([1,1])
    token = [-1.5 + 0.5 * k3(1.5), -0.5, 1.1, 1.6 + 0.5 * k3(0.8), -0.6 + 0.5 * k3(1.2)]
    close(loss, sum(token) / 5)
    assert m["policy/kl_cov/selected_frac"] == pytest.approx(3 / 5)


# --------------------------------------------------------------------------------------------
# DPPO
# --------------------------------------------------------------------------------------------

P_OLD = [[0.5, 0.2, 0.9], [0.3, 0.6, 1.0]]
P_NEW = [[0.7, 0.25, 0.6], [0.35, 0.4, 1.0]]
DPPO_ADV = [[1.0, 1.0, -1.0], [-2.0, 0.5, NAN]]


def dppo_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    lp_rows = [[math.log(p) for p in row] for row in P_NEW]
    ratios = [
        [pn / po for pn, po in zip(rn, ro, strict=True)]
        for rn, ro in zip(P_NEW, P_OLD, strict=True)
    ]
    return from_ratios(ratios, lp=lp_rows)


def test_dppo_tv_hand_values() -> None:
    old, lp = dppo_inputs()
    loss, m, grad = run("dppo_tv", old, lp, t(DPPO_ADV))  # δ = 0.15, C = 20
    # p − p_old = [0.2, 0.05, −0.3, 0.05, −0.2]; A>0 keeps ≤ 0.15, A≤0 keeps ≥ −0.15
    # kept: [0,1] (1.25), [1,0] (r = 0.35/0.3), [1,1] (r = 0.4/0.6)
    token = [
        -1.0 * 1.25 * math.log(0.25),
        2.0 * (0.35 / 0.3) * math.log(0.35),  # −A·r·log π with A = −2
        -0.5 * (0.4 / 0.6) * math.log(0.4),
    ]
    close(loss, sum(token) / 5)
    # gradient of the truncated-IS policy gradient: −A · min(r, C) on kept tokens
    close(grad, t([[0.0, -1.25, 0.0], [2.0 * 0.35 / 0.3, -0.5 * 0.4 / 0.6, 0.0]]) / 5)
    assert m["policy/pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["policy/pg_clipfrac_lower"] == 0.0
    assert m["policy/dppo/tv_mean"] == pytest.approx((0.2 + 0.05 + 0.3 + 0.05 + 0.2) / 5)


def test_dppo_truncated_is_cap() -> None:
    old, lp = dppo_inputs()
    _, m, grad = run("dppo_tv", old, lp, t(DPPO_ADV), config=PolicyLossConfig(dppo_is_cap=1.2))
    assert m["policy/pg_clipfrac_lower"] == pytest.approx(1 / 5)  # r = 1.25 truncated to 1.2
    close(grad[0, 1], -1.2 / 5)


def binary_kl(p_old: float, p: float) -> float:
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old) / (1 - p))


def test_dppo_kl_hand_values() -> None:
    bkl = [
        binary_kl(po, pn)
        for po, pn in zip(P_OLD[0] + P_OLD[1][:2], P_NEW[0] + P_NEW[1][:2], strict=True)
    ]
    # [0.0872, 0.0070, 0.2263, 0.0057, 0.0823]: token [0,0] (A>0, p up, KL > 0.05) and [0,2]
    # (A<0, p down, KL > 0.05) leave the trust region; the others stay
    assert bkl[0] > 0.05 and bkl[2] > 0.05 and bkl[1] < 0.05
    kept = [
        -1.0 * 1.25 * math.log(0.25),
        2.0 * (0.35 / 0.3) * math.log(0.35),
        -0.5 * (0.4 / 0.6) * math.log(0.4),
    ]
    old, lp = dppo_inputs()
    loss, m, _ = run("dppo_kl", old, lp, t(DPPO_ADV))
    close(loss, sum(kept) / 5, rtol=1e-6, atol=1e-8)
    assert m["policy/pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["policy/dppo/binary_kl_mean"] == pytest.approx(sum(bkl) / 5, rel=1e-5)
    # a looser upper bound (0.1 > 0.0872) readmits token [0, 0]; DPPO-TV (0.2 > 0.15) would not
    old, lp = dppo_inputs()
    loss2, m2, _ = run("dppo_kl", old, lp, t(DPPO_ADV), config=PolicyLossConfig(dppo_kl_high=0.1))
    close(loss2, (sum(kept) - 1.0 * (0.7 / 0.5) * math.log(0.7)) / 5, rtol=1e-6, atol=1e-8)
    assert m2["policy/pg_clipfrac"] == pytest.approx(1 / 5)


# --------------------------------------------------------------------------------------------
# IS weights (composition), dtypes, detachment
# --------------------------------------------------------------------------------------------


def test_vanilla_is_weights_multiply_per_token() -> None:
    # seed 004: L = r_TIS · PPO_t — weights multiply the per-token loss before aggregation
    ratios = [[1.5, 0.5, 1.1], [4.0, 1.1, 1.0]]
    old, lp = from_ratios(ratios)
    adv = t([[1.0, 1.0, -1.0], [-2.0, 0.5, 7.0]])
    w = t([[2.0, 0.5, 1.0], [0.25, 4.0, NAN]])
    loss, _, grad = run("vanilla", old, lp, adv, weights=w)
    close(loss, (2.0 * -1.2 + 0.5 * -0.5 + 1.0 * 1.1 + 0.25 * 6.0 + 4.0 * -0.55) / 5)
    close(grad, t([[0.0, 0.5 * -0.5, 1.0 * 1.1], [0.0, 4.0 * -0.55, 0.0]]) / 5)


def random_batch(dtype: torch.dtype, seed: int = 0, b: int = 4, tt: int = 5):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, tt, generator=gen, dtype=F64) * 3 - 0.05
    lp = old + (torch.rand(b, tt, generator=gen, dtype=F64) - 0.5) * 0.6
    lp = lp.clamp(max=-1e-3)
    adv = torch.randn(b, tt, generator=gen, dtype=F64)
    w = torch.rand(b, tt, generator=gen, dtype=F64) * 2
    mask = torch.rand(b, tt, generator=gen) > 0.25
    mask[0] = True
    return old.to(dtype), lp.to(dtype), adv.to(dtype), w.to(dtype), mask


@pytest.mark.parametrize("name", PLAIN_LOSSES)
def test_constant_is_weight_scales_the_loss(name: str) -> None:
    old, lp, adv, _, mask = random_batch(F64)
    base, _ = compute_policy_loss(name, old, lp, adv, mask, RUNNABLE)
    scaled, _ = compute_policy_loss(
        name, old, lp, adv, mask, RUNNABLE, torch.full_like(lp, 2.5)
    )
    close(scaled, 2.5 * base.item())


@pytest.mark.parametrize("name", PLAIN_LOSSES)
def test_float32_and_float64(name: str) -> None:
    results = {}
    for dtype in (torch.float32, F64):
        old, lp, adv, w, mask = random_batch(dtype)
        lp.requires_grad_(True)
        loss, metrics = compute_policy_loss(name, old, lp, adv, mask, RUNNABLE, w)
        loss.backward()
        assert loss.dtype == dtype and lp.grad.dtype == dtype
        results[dtype] = (loss.item(), lp.grad.to(F64), metrics)
    (l32, g32, m32), (l64, g64, m64) = results[torch.float32], results[F64]
    assert l32 == pytest.approx(l64, rel=1e-4, abs=1e-5)
    torch.testing.assert_close(g32, g64, rtol=1e-4, atol=1e-5)
    assert m32["policy/pg_clipfrac"] == pytest.approx(m64["policy/pg_clipfrac"])


@pytest.mark.parametrize("name", PLAIN_LOSSES)
def test_only_log_prob_receives_gradient(name: str) -> None:
    old, lp, adv, w, mask = random_batch(F64)
    for x in (old, lp, adv, w):
        x.requires_grad_(True)
    loss, _ = compute_policy_loss(name, old, lp, adv, mask, RUNNABLE, w)
    loss.backward()
    assert lp.grad is not None
    assert old.grad is None and adv.grad is None and w.grad is None


def test_shape_mismatch_raises() -> None:
    old, lp, adv, _, mask = random_batch(F64)
    with pytest.raises(ValueError, match="shape"):
        compute_policy_loss("vanilla", old[:, :2], lp, adv, mask, PolicyLossConfig())


# --------------------------------------------------------------------------------------------
# hypothesis properties
# --------------------------------------------------------------------------------------------

GARBAGE = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30])


@st.composite
def batches(draw):
    b = draw(st.integers(1, 3))
    tt = draw(st.integers(1, 4))
    n = b * tt

    def floats(lo: float, hi: float) -> list[float]:
        return draw(st.lists(st.floats(lo, hi), min_size=n, max_size=n))

    old = torch.tensor(floats(-4.0, -0.01), dtype=F64).reshape(b, tt)
    lp = torch.tensor(floats(-4.0, -0.01), dtype=F64).reshape(b, tt)
    adv = torch.tensor(floats(-2.0, 2.0), dtype=F64).reshape(b, tt)
    w = torch.tensor(floats(0.0, 3.0), dtype=F64).reshape(b, tt)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(b, tt)
    junk = torch.tensor(draw(st.lists(GARBAGE, min_size=4 * n, max_size=4 * n)), dtype=F64).reshape(
        4, b, tt
    )
    return old, lp, adv, w, mask, junk


def loss_grad_metrics(name, old, lp, adv, mask, w, config=None):
    lp = lp.clone().requires_grad_(True)
    config = RUNNABLE if config is None else config
    loss, metrics = compute_policy_loss(name, old, lp, adv, mask, config, w)
    loss.backward()
    return loss.detach(), lp.grad, metrics


@settings(max_examples=50, deadline=None)
@given(batches())
def test_property_masked_garbage_never_changes_outputs_or_grads(batch) -> None:
    old, lp, adv, w, mask, junk = batch
    dirty = [torch.where(mask, x, junk[i]) for i, x in enumerate((old, lp, adv, w))]
    for name in PLAIN_LOSSES:
        l_clean, g_clean, m_clean = loss_grad_metrics(name, old, lp, adv, mask, w)
        l_dirty, g_dirty, m_dirty = loss_grad_metrics(name, *dirty[:3], mask, dirty[3])
        assert torch.isfinite(l_clean)
        torch.testing.assert_close(l_dirty, l_clean, rtol=0, atol=0)
        torch.testing.assert_close(g_dirty, g_clean, rtol=0, atol=0)
        assert torch.all(g_dirty[~mask] == 0)
        assert m_dirty == m_clean


@settings(max_examples=50, deadline=None)
@given(batches())
def test_property_identical_policies(batch) -> None:
    old, _, adv, w, mask, _ = batch
    for name in PLAIN_LOSSES:
        _, _, m = loss_grad_metrics(name, old, old.clone(), adv, mask, w)
        assert m["policy/pg_clipfrac"] == 0.0, name
        assert m["policy/pg_clipfrac_lower"] == 0.0, name
        assert m["policy/ppo_kl"] == 0.0, name
        if mask.any():
            assert m["policy/ratio/max"] == 1.0 and m["policy/ratio/p50"] == 1.0


@settings(max_examples=50, deadline=None)
@given(batches())
def test_property_cispo_gradient(batch) -> None:
    old, lp, adv, _, mask, _ = batch
    _, grad, _ = loss_grad_metrics("cispo", old, lp, adv, mask, None)
    ratio = torch.exp(lp - old).clamp(1 - 10.0, 1 + 0.2)
    n = max(int(mask.sum()), 1)
    expected = torch.where(mask, -ratio * adv / n, torch.zeros_like(lp))
    torch.testing.assert_close(grad, expected)


@settings(max_examples=50, deadline=None)
@given(batches())
def test_property_gspo_token_gradient(batch) -> None:
    old, lp, adv, _, mask, _ = batch
    cfg = PolicyLossConfig(gspo_clip_ratio_low=100.0, gspo_clip_ratio_high=100.0)  # no clipping
    _, grad, _ = loss_grad_metrics("gspo_token", old, lp, adv, mask, None, cfg)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1).to(F64)
    log_r = torch.where(mask, lp - old, torch.zeros_like(lp))
    s = torch.exp((log_r.sum(-1, keepdim=True) / lengths).clamp(max=10.0))
    n_seq = max(int(mask.any(-1).sum()), 1)
    # ∂/∂log π_t of (1/S) Σ_i (1/|y_i|) Σ_t −A_t s_i  with s_i stop-gradient except own factor
    expected = torch.where(mask, -adv * s / lengths / n_seq, torch.zeros_like(lp))
    torch.testing.assert_close(grad, expected)


# --------------------------------------------------------------------------------------------
# bypass mode
# --------------------------------------------------------------------------------------------


def test_bypass_mode_requires_rollout_correction_and_no_external_weights() -> None:
    old, lp = from_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = t([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="rollout_correction"):
        compute_policy_loss("bypass_mode", old, lp, adv, MASK, PolicyLossConfig())
    fake_rc = types.SimpleNamespace(bypass_mode=True, loss_type="ppo_clip")
    with pytest.raises(ValueError, match="rollout_is_weights=None"):
        compute_policy_loss(
            "bypass_mode",
            old,
            lp,
            adv,
            MASK,
            PolicyLossConfig(rollout_correction=fake_rc),
            torch.ones(2, 3, dtype=F64),
        )
    decoupled = types.SimpleNamespace(bypass_mode=False, loss_type="ppo_clip")
    with pytest.raises(ValueError, match="bypass_mode=False"):
        compute_policy_loss(
            "bypass_mode", old, lp, adv, MASK, PolicyLossConfig(rollout_correction=decoupled)
        )
    with pytest.raises(ValueError, match="contradicts"):
        PolicyLossConfig(rollout_correction=fake_rc, bypass_loss_type="reinforce")
    cfg = PolicyLossConfig(rollout_correction=types.SimpleNamespace(loss_type="reinforce"))
    assert cfg.resolved_bypass_loss_type == "reinforce"
    assert PolicyLossConfig().resolved_bypass_loss_type == "ppo_clip"


@pytest.fixture
def fake_rollout_correction(monkeypatch: pytest.MonkeyPatch):
    """Replace the rollout-correction module by a stub with known weights and RS mask."""
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]] = []
    weights = t([[2.0, 0.5, 1.0], [3.0, 3.0, 0.0]])
    keep = torch.tensor([[True, True, True], [False, False, False]])  # RS rejects sequence 1

    def fake(old_log_prob, rollout_log_prob, response_mask, config):
        calls.append((old_log_prob, rollout_log_prob, response_mask, config))
        return weights, keep & response_mask, {"rollout_corr/fake": 1.0}

    module = types.ModuleType("training.algorithms.rollout_correction")
    module.compute_rollout_correction_and_rejection_mask = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "training.algorithms.rollout_correction", module)
    return calls, weights, keep


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_mode_dispatch_semantics(fake_rollout_correction, loss_type: str) -> None:
    calls, weights, keep = fake_rollout_correction
    ratios = [[1.5, 0.5, 1.1], [4.0, 1.1, 1.0]]
    old, lp = from_ratios(ratios)
    adv = t([[1.0, 1.0, -1.0], [-2.0, 0.5, NAN]])
    rc = types.SimpleNamespace(bypass_mode=True, loss_type=loss_type)
    cfg = PolicyLossConfig(rollout_correction=rc)
    loss, m, grad = run("bypass_mode", old, lp, adv, config=cfg)
    # the correction is computed between the current policy (detached) and the rollout policy
    cur, rollout, _, passed_cfg = calls[0]
    assert passed_cfg is rc and not cur.requires_grad
    close(cur[MASK], lp.detach()[MASK])
    close(rollout[MASK], old[MASK])
    assert m["rollout_corr/fake"] == 1.0
    assert m["policy/bypass/kept_token_frac"] == pytest.approx(3 / 5)
    if loss_type == "reinforce":
        # IS weights multiply −A log π; RS leaves only sequence 0 (3 tokens)
        close(loss, (2.0 * 1 * 1.0 + 0.5 * 1 * 2.0 + 1.0 * -1 * 0.5) / 3)
        close(grad, t([[-2.0 * 1, -0.5 * 1, -1.0 * -1], [0.0, 0.0, 0.0]]) / 3)
    else:
        # PPO-clip on r = π_θ/π_rollout, NO IS weights (they would double count); RS mask applies
        close(loss, (-1.2 + -0.5 + 1.1) / 3)
        close(grad, t([[0.0, -0.5, 1.1], [0.0, 0.0, 0.0]]) / 3)
    assert weights.sum() > 0 and not keep[1].any()


def test_bypass_mode_with_rollout_correction_module() -> None:
    rc_mod = pytest.importorskip("training.algorithms.rollout_correction")
    cfg_cls = rc_mod.RolloutCorrectionConfig
    mask = torch.ones(2, 3, dtype=torch.bool)
    rollout = t([[-1.0, -2.0, -0.5], [-1.5, -1.0, -0.7]])
    # reinforce + sequence TIS (C = 2): seq 0 Σ log r = 0.6 → w = e^0.6; seq 1 Σ = 0.9 → e^0.9 > 2
    lp = (rollout + t([[0.1, 0.2, 0.3], [0.5, 0.4, 0.0]])).requires_grad_(True)
    adv = t([[1.0, -1.0, 2.0], [0.5, 1.0, -1.0]])
    cfg = PolicyLossConfig(rollout_correction=cfg_cls.bypass_pg_is())
    loss, m, grad = run("bypass_mode", rollout, lp, adv, mask=mask, config=cfg)
    w0, w1 = math.exp(0.6), 2.0
    lpv = lp.detach()
    expected = (
        -(
            w0 * (1.0 * lpv[0, 0] - 1.0 * lpv[0, 1] + 2.0 * lpv[0, 2])
            + w1 * (0.5 * lpv[1, 0] + 1.0 * lpv[1, 1] - 1.0 * lpv[1, 2])
        )
        / 6
    )
    close(loss, expected.item())
    close(grad, -t([[w0 * 1.0, w0 * -1.0, w0 * 2.0], [w1 * 0.5, w1 * 1.0, w1 * -1.0]]) / 6)
    assert any(k.startswith("rollout_corr/") for k in m)

    # ppo_clip + geometric RS: seq 0 identical to the rollout (kept), seq 1 drifted (rejected)
    lp2 = (rollout + t([[0.0, 0.0, 0.0], [0.5, 0.4, 0.0]])).requires_grad_(True)
    cfg2 = PolicyLossConfig(rollout_correction=cfg_cls.bypass_ppo_clip_geo_rs())
    loss2, m2, grad2 = run("bypass_mode", rollout, lp2, adv, mask=mask, config=cfg2)
    close(loss2, -(1.0 - 1.0 + 2.0) / 3)  # ratio 1 on seq 0 → ℓ = −A, mean over its 3 tokens
    close(grad2, t([[-1.0, 1.0, -2.0], [0.0, 0.0, 0.0]]) / 3)
    assert m2["policy/bypass/kept_token_frac"] == pytest.approx(3 / 6)
