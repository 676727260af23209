"""Tests for training.algorithms.rollout_correction (seed 001: rollout correction framework)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from training.algorithms.rollout_correction import (
    METRIC_PREFIX,
    PRESETS,
    RS_MODES,
    RolloutCorrectionConfig,
    apply_bypass_mode,
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    compute_rs_divergence,
    compute_rs_metrics,
    from_preset,
    parse_is_threshold,
    parse_rs_options,
)

P = METRIC_PREFIX
LN = math.log


def _lp_pair(ratios: list[list[float]], base: float = 0.25) -> tuple[torch.Tensor, torch.Tensor]:
    """old/rollout log-probs whose ratio π_old/π_rollout is ``ratios`` (rollout prob = base)."""
    rho = torch.tensor(ratios, dtype=torch.float64)
    rollout = torch.full_like(rho, math.log(base))
    return rollout + torch.log(rho), rollout


def _run(old, rollout, mask, **cfg):
    return compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, RolloutCorrectionConfig(**cfg)
    )


# ------------------------------------------------------------------------------------------------
# IS weights: hand-computed
# ------------------------------------------------------------------------------------------------


def test_token_tis_hand_computed() -> None:
    old, rollout = _lp_pair([[0.5, 1.0, 3.0], [1.5, 4.0, 0.25]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    old[1, 2] = float("nan")  # garbage at a masked position
    w, new_mask, m = _run(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    # w_t = min(ρ_t, C=2); masked → 0
    expected = torch.tensor(
        [[0.5, 1.0, min(3.0, 2.0)], [1.5, min(4.0, 2.0), 0.0]], dtype=torch.float64
    )
    assert_close(w, expected)
    assert new_mask.dtype == torch.bool and torch.equal(new_mask, mask)
    valid = [0.5, 1.0, 2.0, 1.5, 2.0]
    assert m[P + "rollout_is_mean"] == pytest.approx(sum(valid) / 5)
    assert m[P + "rollout_is_max"] == pytest.approx(2.0)
    assert m[P + "rollout_is_min"] == pytest.approx(0.5)
    # raw ρ above C: 3.0, 4.0 → 2/5;  below 1/C = 0.5: none (0.5 is not < 0.5)
    assert m[P + "rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)
    assert m[P + "rollout_is_ratio_fraction_low"] == pytest.approx(0.0)
    mean = sum(valid) / 5
    assert m[P + "rollout_is_std"] == pytest.approx(
        math.sqrt(sum(v * v for v in valid) / 5 - mean**2)
    )
    # ESS = 1 / E[w̃²], w̃ = w / mean(w)
    assert m[P + "rollout_is_eff_sample_size"] == pytest.approx(
        1 / (sum((v / mean) ** 2 for v in valid) / 5)
    )
    # per-sequence mean applied weight: [3.5/3, 3.5/2]
    s0, s1 = 3.5 / 3, 3.5 / 2
    assert m[P + "rollout_is_seq_mean"] == pytest.approx((s0 + s1) / 2)
    assert m[P + "rollout_is_seq_max"] == pytest.approx(s1)
    assert m[P + "rollout_is_seq_min"] == pytest.approx(s0)
    assert m[P + "rollout_is_seq_max_deviation"] == pytest.approx(abs(s1 - 1))
    assert m[P + "rollout_is_seq_std"] == pytest.approx(abs(s1 - s0) / math.sqrt(2))
    # raw per-sequence mean ratio: [4.5/3 = 1.5, 5.5/2 = 2.75] → one above C = 2
    assert m[P + "rollout_is_seq_fraction_high"] == pytest.approx(0.5)
    assert m[P + "rollout_is_seq_fraction_low"] == pytest.approx(0.0)


def test_sequence_tis_hand_computed() -> None:
    old, rollout = _lp_pair([[0.5, 2.0, 3.0], [1.2, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w, _, m = _run(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0)
    # row 0: Π ρ = 0.5·2·3 = 3 → min(3, 2) = 2;  row 1: 1.2·0.5 = 0.6 (the masked 7.0 is ignored)
    expected = torch.tensor([[2.0, 2.0, 2.0], [0.6, 0.6, 0.0]], dtype=torch.float64)
    assert_close(w, expected)
    # sequence level: max/min report the untruncated sequence ratio (as verl)
    assert m[P + "rollout_is_max"] == pytest.approx(3.0)
    assert m[P + "rollout_is_min"] == pytest.approx(0.6)
    assert m[P + "rollout_is_mean"] == pytest.approx((3 * 2.0 + 2 * 0.6) / 5)  # token-weighted
    # fractions over sequences: 3 > 2 (high); 0.6 > 1/2 (not low)
    assert m[P + "rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    assert m[P + "rollout_is_ratio_fraction_low"] == pytest.approx(0.0)


def test_sequence_tis_log_space_bound() -> None:
    # Σ log ρ = 30·1.0 = 30 > 20 → weight exp(20) before truncation; with C = 1e9 it stays exp(20)
    lr = torch.ones(1, 30, dtype=torch.float64)
    w, m = compute_rollout_correction_weights(lr, torch.ones(1, 30), "sequence", 1e9)
    assert_close(w, torch.full((1, 30), math.exp(20.0), dtype=torch.float64))
    assert m["rollout_is_max"] == pytest.approx(math.exp(20.0))
    # a single token log ratio of +inf is bounded to +20 instead of producing inf/NaN
    lr_inf = torch.tensor([[float("inf"), 0.0]], dtype=torch.float64)
    w_inf, _ = compute_rollout_correction_weights(lr_inf, torch.ones(1, 2), "token", 1e12)
    assert_close(w_inf, torch.tensor([[math.exp(20.0), 1.0]], dtype=torch.float64))


def test_icepop_band_hand_computed() -> None:
    ratios = [[0.4, 0.51, 1.0, 4.99, 6.0], [0.49, 2.0, 5.01, 0.3, 1.0]]
    old, rollout = _lp_pair(ratios)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    cfg = RolloutCorrectionConfig.decoupled_token_icepop()  # band [0.5, 5.0]
    assert cfg.rollout_is_threshold == "0.5_5.0"
    w, new_mask, m = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)
    # M(ρ) = ρ if 0.5 ≤ ρ ≤ 5 else 0
    expected = torch.tensor(
        [[0.0, 0.51, 1.0, 4.99, 0.0], [0.0, 2.0, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    assert_close(w, expected)
    assert torch.equal(new_mask, mask)  # IcePop zeroes weights; the response mask is unchanged
    # out of band among the 8 valid tokens: 0.4, 6.0, 0.49, 5.01 → 4/8
    assert m[P + "rollout_is_oob_ratio"] == pytest.approx(4 / 8)
    assert m[P + "rollout_is_ratio_fraction_high"] == pytest.approx(2 / 8)
    assert m[P + "rollout_is_ratio_fraction_low"] == pytest.approx(2 / 8)
    assert m[P + "rollout_is_min"] == pytest.approx(0.0)


def test_icepop_band_bounds_are_inclusive() -> None:
    lr = torch.log(torch.tensor([[0.5, 5.0, 0.4999, 5.0001]], dtype=torch.float64))
    lo, hi = torch.exp(lr[0, :2]).tolist()  # the exact floats the module will compare
    w, _ = compute_rollout_correction_weights(lr, torch.ones(1, 4), "token", f"{lo!r}_{hi!r}")
    assert_close(w, torch.tensor([[lo, hi, 0.0, 0.0]], dtype=torch.float64))


def test_batch_normalize_token_and_sequence() -> None:
    old, rollout = _lp_pair([[0.5, 1.0, 3.0], [1.5, 4.0, 0.25]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w, _, m = _run(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=True,
    )
    mean = (0.5 + 1.0 + 2.0 + 1.5 + 2.0) / 5  # over valid tokens, after truncation
    expected = torch.tensor([[0.5, 1.0, 2.0], [1.5, 2.0, 0.0]], dtype=torch.float64) / mean
    assert_close(w, expected)
    assert m[P + "rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert m[P + "rollout_is_mean"] == pytest.approx(mean)  # metrics are pre-normalisation

    old, rollout = _lp_pair([[0.5, 2.0, 3.0], [1.2, 0.5, 1.0]])
    w, _, m = _run(
        old,
        rollout,
        mask,
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=True,
    )
    seq_mean = (2.0 + 0.6) / 2  # one weight per valid sequence
    expected = torch.tensor([[2.0, 2.0, 2.0], [0.6, 0.6, 0.0]], dtype=torch.float64) / seq_mean
    assert_close(w, expected)
    assert m[P + "rollout_is_batch_norm_factor"] == pytest.approx(seq_mean)


def test_batch_normalize_skipped_when_all_weights_zero() -> None:
    old, rollout = _lp_pair([[10.0, 20.0]])  # both outside the band [0.5, 5]
    w, _, m = _run(
        old,
        rollout,
        torch.ones(1, 2),
        rollout_is="token",
        rollout_is_threshold="0.5_5.0",
        rollout_is_batch_normalize=True,
    )
    assert_close(w, torch.zeros(1, 2, dtype=torch.float64))
    assert m[P + "rollout_is_batch_norm_factor"] == 1.0
    assert m[P + "rollout_is_eff_sample_size"] == 0.0


def test_ess_hand_computed() -> None:
    w = torch.tensor([[1.0, 3.0]])
    m = compute_is_metrics(w, w, torch.ones(1, 2), rollout_is="token", threshold=10.0)
    # w̃ = w / 2 = [0.5, 1.5];  E[w̃²] = (0.25 + 2.25) / 2 = 1.25 → ESS = 0.8
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / 1.25)


# ------------------------------------------------------------------------------------------------
# Off-policy diagnostics: hand-computed
# ------------------------------------------------------------------------------------------------


def test_kl_chi2_hand_computed() -> None:
    old, rollout = _lp_pair([[2.0, 0.5], [1.5, 99.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    m = compute_offpolicy_metrics(old, rollout, mask)
    # k1 = E[log π_rollout − log π_old] = −(ln 2 + ln 0.5 + ln 1.5) / 3
    assert m["kl"] == pytest.approx(-(LN(2) + LN(0.5) + LN(1.5)) / 3)
    # k3 = E[ρ − ln ρ − 1]
    k3 = ((2 - LN(2) - 1) + (0.5 - LN(0.5) - 1) + (1.5 - LN(1.5) - 1)) / 3
    assert m["k3_kl"] == pytest.approx(k3)
    # χ²_token = E[ρ²] − 1 = (4 + 0.25 + 2.25)/3 − 1
    assert m["chi2_token"] == pytest.approx((4 + 0.25 + 2.25) / 3 - 1)
    # χ²_seq = E_seq[(Π ρ)²] − 1: products 2·0.5 = 1 and 1.5 → (1 + 2.25)/2 − 1
    assert m["chi2_seq"] == pytest.approx((1 + 2.25) / 2 - 1)


def test_ppl_metrics_hand_computed() -> None:
    old = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.3]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.25, 0.25], [0.2, 0.3]], dtype=torch.float64))
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    m = compute_offpolicy_metrics(old, rollout, mask)
    ppl_old = [math.sqrt(1 / (0.5 * 0.25)), 1 / 0.1]  # exp(−mean log p) per sequence: √8, 10
    ppl_roll = [4.0, 5.0]
    assert m["training_ppl"] == pytest.approx(sum(ppl_old) / 2)
    assert m["rollout_ppl"] == pytest.approx(sum(ppl_roll) / 2)
    assert m["training_log_ppl"] == pytest.approx((LN(ppl_old[0]) + LN(ppl_old[1])) / 2)
    assert m["rollout_log_ppl"] == pytest.approx((LN(4) + LN(5)) / 2)
    # seed: PPL ratio = PPL_old / PPL_rollout (per sequence, then averaged)
    ratios = [ppl_old[0] / ppl_roll[0], ppl_old[1] / ppl_roll[1]]
    assert m["ppl_ratio"] == pytest.approx(sum(ratios) / 2)
    diffs = [LN(r) for r in ratios]
    assert m["log_ppl_diff"] == pytest.approx(sum(diffs) / 2)
    assert m["log_ppl_abs_diff"] == pytest.approx((abs(diffs[0]) + abs(diffs[1])) / 2)
    assert m["log_ppl_diff_max"] == pytest.approx(max(diffs))
    assert m["log_ppl_diff_min"] == pytest.approx(min(diffs))
    # raw token-ratio tails (added key family)
    assert m["rho_token_max"] == pytest.approx(2.0)  # ρ = 0.5/0.25


def test_offpolicy_metrics_without_rollout_log_prob() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    m = compute_offpolicy_metrics(old, None, torch.ones(1, 2))
    assert set(m) == {"training_ppl", "training_log_ppl"}
    assert m["training_ppl"] == pytest.approx(2.0)


def test_metrics_from_logprobs_prefixed() -> None:
    old, rollout = _lp_pair([[2.0, 0.5]])
    m = compute_rollout_corr_metrics_from_logprobs(old, rollout, torch.ones(1, 2))
    assert m[P + "kl"] == pytest.approx(-(LN(2) + LN(0.5)) / 2)
    assert all(k.startswith(P) for k in m)


# ------------------------------------------------------------------------------------------------
# Rejection sampling: every mode by hand
# ------------------------------------------------------------------------------------------------

# log ρ per token; row 1 has a masked third position
LR = [[0.1, -0.2, 0.3], [0.0, 0.5, 0.0], [-0.05, 0.05, 0.0]]
LR_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
VALID = [[0.1, -0.2, 0.3], [0.0, 0.5], [-0.05, 0.05, 0.0]]


def _k1(x: float) -> float:
    return -x


def _k2(x: float) -> float:
    return 0.5 * x * x


def _k3(x: float) -> float:
    return math.exp(x) - x - 1


_DIV = {"k1": _k1, "k2": _k2, "k3": _k3}
_AGG = {"seq_sum": sum, "seq_mean": lambda v: sum(v) / len(v), "seq_max": max}

# mode → (threshold, expected keep-mask over valid positions, per row)
RS_CASES: dict[str, tuple[str | float, list[list[int]]]] = {
    # −log ρ within [ln 0.8, ln 1.25] = [−0.223, 0.223]: −0.3 and −0.5 fall out
    "token_k1": ("0.8_1.25", [[1, 1, 0], [1, 0], [1, 1, 1]]),
    # ½(log ρ)² ≤ 0.03: 0.045 (0.3) and 0.125 (0.5) fall out
    "token_k2": (0.03, [[1, 1, 0], [1, 0], [1, 1, 1]]),
    # ρ − log ρ − 1 ≤ 0.02: e^0.3−1.3 = 0.0499 and e^0.5−1.5 = 0.1487 fall out
    "token_k3": (0.02, [[1, 1, 0], [1, 0], [1, 1, 1]]),
    # Σ(−log ρ) = −0.2, −0.5, 0 vs [ln 0.7, ln 1.5] = [−0.357, 0.405]
    "seq_sum_k1": ("0.7_1.5", [[1, 1, 1], [0, 0], [1, 1, 1]]),
    # Σ ½(log ρ)² = 0.07, 0.125, 0.0025 ≤ 0.1
    "seq_sum_k2": (0.1, [[1, 1, 1], [0, 0], [1, 1, 1]]),
    # Σ k3 = 0.0738, 0.1487, 0.0025 ≤ 0.07: row 0 falls out too
    "seq_sum_k3": (0.07, [[0, 0, 0], [0, 0], [1, 1, 1]]),
    # mean(−log ρ) = −0.0667, −0.25, 0 vs single bound 1.25 → [1/1.25, 1.25] = [ln 0.8, ln 1.25]
    "seq_mean_k1": (1.25, [[1, 1, 1], [0, 0], [1, 1, 1]]),
    # mean ½(log ρ)² = 0.0233, 0.0625, 0.00083 ≤ 0.05
    "seq_mean_k2": (0.05, [[1, 1, 1], [0, 0], [1, 1, 1]]),
    # mean k3 = 0.0246, 0.0744, 0.00083 ≤ 0.02
    "seq_mean_k3": (0.02, [[0, 0, 0], [0, 0], [1, 1, 1]]),
    # max ½(log ρ)² = 0.045, 0.125, 0.00125 ≤ 0.04
    "seq_max_k2": (0.04, [[0, 0, 0], [0, 0], [1, 1, 1]]),
    # max k3 = 0.0499, 0.1487, 0.00127 ≤ 0.1
    "seq_max_k3": (0.1, [[1, 1, 1], [0, 0], [1, 1, 1]]),
}


def _expected_mask(keep: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(3, 3, dtype=torch.bool)
    for i, row in enumerate(keep):
        for j, k in enumerate(row):
            out[i, j] = bool(k)
    return out


def test_rs_cases_cover_all_modes() -> None:
    assert set(RS_CASES) == set(RS_MODES)
    assert len(RS_MODES) == 11


@pytest.mark.parametrize("mode", RS_MODES)
def test_rs_mode_hand_computed(mode: str) -> None:
    threshold, keep = RS_CASES[mode]
    lr = torch.tensor(LR, dtype=torch.float64)
    lr[1, 2] = float("inf")  # garbage at the masked position
    new_mask, m = compute_rollout_rejection_mask(lr, LR_MASK, mode, threshold)
    assert new_mask.dtype == torch.bool
    assert torch.equal(new_mask, _expected_mask(keep))

    aggregation, div = mode.rsplit("_", 1)
    d = [[_DIV[div](x) for x in row] for row in VALID]
    if aggregation == "token":
        per_seq = [sum(r) / len(r) for r in d]  # token modes: per-sequence value = mean
    else:
        per_seq = [_AGG[aggregation](r) for r in d]
    p = f"rollout_rs_{mode}"
    assert m[f"{p}_seq_mean"] == pytest.approx(sum(per_seq) / 3)
    assert m[f"{p}_seq_max"] == pytest.approx(max(per_seq))
    assert m[f"{p}_seq_min"] == pytest.approx(min(per_seq))
    assert m[f"{p}_seq_max_deviation"] == pytest.approx(max(abs(v) for v in per_seq))
    n_rejected = sum(1 - k for row in keep for k in row)
    assert m[f"{p}_masked_fraction"] == pytest.approx(n_rejected / 8)
    seq_rejected = sum(1 for row in keep if 0 in row)
    assert m[f"{p}_seq_masked_fraction"] == pytest.approx(seq_rejected / 3)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(n_rejected / 8)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(seq_rejected / 3)
    if aggregation == "token":
        flat = [v for r in d for v in r]
        assert m[f"{p}_mean"] == pytest.approx(sum(flat) / 8)
        assert m[f"{p}_max"] == pytest.approx(max(flat))
    else:
        # token-weighted mean of the sequence statistic; max over sequences
        assert m[f"{p}_mean"] == pytest.approx(
            (3 * per_seq[0] + 2 * per_seq[1] + 3 * per_seq[2]) / 8
        )
        assert m[f"{p}_max"] == pytest.approx(max(per_seq))
    assert (f"{p}_seq_fraction_low" in m) == (div == "k1")


def test_rs_k1_fraction_and_std_metrics() -> None:
    lr = torch.tensor(LR, dtype=torch.float64)
    _, m = compute_rollout_rejection_mask(lr, LR_MASK, "token_k1", "0.8_1.25")
    lo, hi = LN(0.8), LN(1.25)
    flat = [-x for row in VALID for x in row]
    assert m["rollout_rs_token_k1_fraction_high"] == pytest.approx(sum(v > hi for v in flat) / 8)
    assert m["rollout_rs_token_k1_fraction_low"] == pytest.approx(sum(v < lo for v in flat) / 8)
    clamped = [min(max(v, lo), hi) for v in flat]
    mean = sum(clamped) / 8
    assert m["rollout_rs_token_k1_std"] == pytest.approx(
        math.sqrt(sum(c * c for c in clamped) / 8 - mean**2)
    )


@pytest.mark.parametrize("mode", ["seq_mean_k3", "seq_sum_k1", "seq_max_k2"])
def test_rs_seq_mode_std_counts_each_sequence_once_per_token(mode: str) -> None:
    # The std of a sequence criterion is over tokens of the broadcast sequence statistic; an
    # all-padding sequence (the garbage row appended here) counts for nothing.
    threshold = RS_CASES[mode][0]
    lr = torch.cat([torch.tensor(LR, dtype=torch.float64), torch.full((1, 3), math.inf)])
    mask = torch.cat([LR_MASK, torch.zeros(1, 3, dtype=torch.bool)])
    _, m = compute_rollout_rejection_mask(lr, mask, mode, threshold)
    (opt,) = parse_rs_options(mode, threshold)
    aggregation, div = mode.rsplit("_", 1)
    per_seq = [_AGG[aggregation]([_DIV[div](x) for x in row]) for row in VALID]
    hi = LN(opt.upper) if div == "k1" else opt.upper
    lo = LN(opt.lower) if div == "k1" else 0.0
    clamped = [min(max(v, lo), hi) for v, row in zip(per_seq, VALID, strict=True) for _ in row]
    mean = sum(clamped) / 8
    std = math.sqrt(sum(c * c for c in clamped) / 8 - mean**2)
    assert std > 1e-3  # not degenerate
    assert m[f"rollout_rs_{mode}_std"] == pytest.approx(std)
    assert m[f"rollout_rs_{mode}_mean"] == pytest.approx(
        sum(v * len(row) for v, row in zip(per_seq, VALID, strict=True)) / 8
    )


def test_rs_combined_modes_are_anded() -> None:
    lr = torch.tensor(LR, dtype=torch.float64)
    new_mask, m = compute_rollout_rejection_mask(lr, LR_MASK, "token_k2, seq_max_k2", "0.03,0.04")
    # token_k2 rejects (0,2) and (1,1); seq_max_k2 rejects rows 0 and 1 → only row 2 survives
    expected = _expected_mask([[0, 0, 0], [0, 0], [1, 1, 1]])
    assert torch.equal(new_mask, expected)
    assert m["rollout_rs_token_k2_masked_fraction"] == pytest.approx(2 / 8)
    assert m["rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(5 / 8)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(5 / 8)


def test_rs_divergences_hand_computed() -> None:
    lr = torch.tensor([LN(2.0), 0.0])
    assert_close(compute_rs_divergence(lr, "k1"), torch.tensor([-LN(2.0), 0.0]))
    assert_close(compute_rs_divergence(lr, "k2"), torch.tensor([0.5 * LN(2.0) ** 2, 0.0]))
    assert_close(compute_rs_divergence(lr, "k3"), torch.tensor([2.0 - LN(2.0) - 1.0, 0.0]))
    with pytest.raises(ValueError, match="k1"):
        compute_rs_divergence(lr, "k4")


def test_compute_rs_metrics_direct() -> None:
    (opt,) = parse_rs_options("seq_mean_k3", 0.05)
    seq = torch.tensor([0.01, 0.1])
    m = compute_rs_metrics(opt, seq.unsqueeze(-1).expand(2, 2), torch.ones(2, 2), seq)
    assert m["rollout_rs_seq_mean_k3_fraction_high"] == pytest.approx(1 / 2)
    assert m["rollout_rs_seq_mean_k3_seq_std"] == pytest.approx(0.09 / math.sqrt(2))


# ------------------------------------------------------------------------------------------------
# Length trap (seed 001 "Failure mode catalog")
# ------------------------------------------------------------------------------------------------


def _length_batch(c: float, T: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of length 1..T with the constant per-token log ratio c."""
    lr = torch.full((T, T), c, dtype=torch.float64)
    mask = torch.arange(T).unsqueeze(0) < torch.arange(1, T + 1).unsqueeze(1)
    return lr, mask


@pytest.mark.parametrize("div", ["k1", "k2", "k3"])
def test_length_trap_seq_mean_invariant_seq_sum_not(div: str) -> None:
    c = -0.1  # ρ_t = e^-0.1 per token
    lr, mask = _length_batch(c)
    d = _DIV[div](c)  # per-token divergence
    thr = "0.5_2.0" if div == "k1" else 3.5 * d  # between 1·d and 12·d
    # k1: −log ρ = 0.1/token, so the sum leaves [ln 0.5, ln 2] = [−0.69, 0.69] at length 7
    keep_mean, _ = compute_rollout_rejection_mask(lr, mask, f"seq_mean_{div}", thr)
    keep_sum, _ = compute_rollout_rejection_mask(lr, mask, f"seq_sum_{div}", thr)
    row_kept_mean = [bool(keep_mean[i, : i + 1].all()) for i in range(12)]
    row_kept_sum = [bool(keep_sum[i, : i + 1].all()) for i in range(12)]
    assert len(set(row_kept_mean)) == 1 and row_kept_mean[0]  # every length kept alike
    assert row_kept_sum[0] and not row_kept_sum[-1]  # long sequences preferentially rejected


@settings(max_examples=50, deadline=None)
@given(c=st.floats(-1.0, 1.0), thr=st.floats(1e-4, 1.0))
def test_length_trap_property(c: float, thr: float) -> None:
    lr, mask = _length_batch(c, T=8)
    for stat in (-c, 0.5 * c * c, math.exp(c) - c - 1):  # stay off the decision boundary
        assume(abs(abs(stat) - thr) > 1e-9)
    for mode in ("seq_mean_k1", "seq_mean_k2", "seq_mean_k3"):
        spec: str | float = f"{math.exp(-thr)}_{math.exp(thr)}" if mode.endswith("k1") else thr
        new_mask, _ = compute_rollout_rejection_mask(lr, mask, mode, spec)
        kept = {bool(new_mask[i, : i + 1].all()) for i in range(8)}
        assert len(kept) == 1, mode  # decision independent of length


# ------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------

# seed 001 preset table: name → (bypass, loss_type, rollout_is, is_threshold, rollout_rs,
# rs_threshold); "(any)" loss → our default "ppo_clip"; RS defaults are verl's.
PRESET_TABLE: dict[str, tuple] = {
    "bypass_ppo_clip": (True, "ppo_clip", None, 2.0, None, None),
    "bypass_ppo_clip_geo_rs": (True, "ppo_clip", None, 2.0, "seq_mean_k1", "0.999_1.001"),
    "bypass_ppo_clip_k3_rs": (True, "ppo_clip", None, 2.0, "seq_mean_k3", 0.01),
    "bypass_pg_is": (True, "reinforce", "sequence", 2.0, None, None),
    "bypass_pg_geo_rs": (True, "reinforce", None, 2.0, "seq_mean_k1", "0.999_1.001"),
    "bypass_pg_geo_rs_seq_tis": (True, "reinforce", "sequence", 2.0, "seq_mean_k1", "0.999_1.001"),
    "bypass_pg_geo_rs_token_tis": (True, "reinforce", "token", 2.0, "seq_mean_k1", "0.999_1.001"),
    "decoupled_token_is": (False, "ppo_clip", "token", 2.0, None, None),
    "decoupled_seq_is": (False, "ppo_clip", "sequence", 2.0, None, None),
    "decoupled_seq_is_rs": (False, "ppo_clip", "sequence", 2.0, "seq_sum_k1", "0.5_2.0"),
    "decoupled_geo_rs": (False, "ppo_clip", None, 2.0, "seq_mean_k1", "0.999_1.001"),
    "decoupled_geo_rs_seq_tis": (False, "ppo_clip", "sequence", 2.0, "seq_mean_k1", "0.999_1.001"),
    "decoupled_geo_rs_token_tis": (False, "ppo_clip", "token", 2.0, "seq_mean_k1", "0.999_1.001"),
    "decoupled_k3_rs": (False, "ppo_clip", None, 2.0, "seq_mean_k3", 0.01),
    "decoupled_k3_rs_seq_tis": (False, "ppo_clip", "sequence", 2.0, "seq_mean_k3", 0.01),
    "decoupled_k3_rs_token_tis": (False, "ppo_clip", "token", 2.0, "seq_mean_k3", 0.01),
    "decoupled_token_icepop": (False, "ppo_clip", "token", "0.5_5.0", None, None),
    "bypass_pg_token_icepop": (True, "reinforce", "token", "0.5_5.0", None, None),
    "disabled": (False, "ppo_clip", None, 2.0, None, None),
}


def test_presets_match_seed_table_exactly() -> None:
    assert list(PRESETS) == list(PRESET_TABLE)
    for name, (bypass, loss, is_level, is_thr, rs, rs_thr) in PRESET_TABLE.items():
        cfg = getattr(RolloutCorrectionConfig, name)()
        got = (
            cfg.bypass_mode,
            cfg.loss_type,
            cfg.rollout_is,
            cfg.rollout_is_threshold,
            cfg.rollout_rs,
            cfg.rollout_rs_threshold,
        )
        assert got == (bypass, loss, is_level, is_thr, rs, rs_thr), name
        assert cfg.rollout_is_batch_normalize is False
        assert PRESETS[name]() == cfg


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_runs_end_to_end(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    old = rollout + 0.05 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[2, 4:] = False
    cfg = from_preset(name)
    w, new_mask, m = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)
    assert (w is None) == (cfg.rollout_is is None)
    if w is not None:
        assert w.shape == (4, 7) and not w.requires_grad and bool((w[~mask] == 0).all())
    assert not bool((new_mask & ~mask).any())  # RS only removes
    assert all(k.startswith(P) and math.isfinite(v) for k, v in m.items())
    assert (P + "rollout_rs_masked_fraction" in m) == (cfg.rollout_rs is not None)


def test_preset_keyword_overrides_use_verl_names_and_defaults() -> None:
    expected = {
        "decoupled_token_is": {"threshold": 2.0},
        "decoupled_seq_is": {"threshold": 2.0},
        "bypass_pg_is": {"threshold": 2.0},
        "decoupled_token_icepop": {"threshold": 5.0, "threshold_lower": 0.5},
        "bypass_pg_token_icepop": {"threshold": 5.0, "threshold_lower": 0.5},
        "decoupled_seq_is_rs": {"is_threshold": 2.0, "rs_threshold": "0.5_2.0"},
        "decoupled_geo_rs": {"rs_threshold": "0.999_1.001"},
        "bypass_ppo_clip_geo_rs": {"rs_threshold": "0.999_1.001"},
        "bypass_pg_geo_rs": {"rs_threshold": "0.999_1.001"},
        "bypass_ppo_clip_k3_rs": {"rs_threshold": 0.01},
        "decoupled_k3_rs": {"rs_threshold": 0.01},
        "bypass_ppo_clip": {},
        "disabled": {},
    }
    for name in (
        "decoupled_geo_rs_seq_tis",
        "decoupled_geo_rs_token_tis",
        "bypass_pg_geo_rs_seq_tis",
        "bypass_pg_geo_rs_token_tis",
    ):
        expected[name] = {"is_threshold": 2.0, "rs_threshold": "0.999_1.001"}
    for name in ("decoupled_k3_rs_seq_tis", "decoupled_k3_rs_token_tis"):
        expected[name] = {"is_threshold": 2.0, "rs_threshold": 0.01}
    assert set(expected) == set(PRESETS)
    for name, params in expected.items():
        sig = inspect.signature(PRESETS[name]).parameters
        assert {k: p.default for k, p in sig.items()} == params, name


def test_decision_tree_call_signatures() -> None:
    # seed 001 decision tree, Cause B / C / D
    cfg = RolloutCorrectionConfig.decoupled_geo_rs_seq_tis(
        is_threshold=2.0, rs_threshold="0.99_1.01"
    )
    assert cfg.rs_options[0].lower == 0.99 and cfg.rs_options[0].upper == 1.01
    assert (
        RolloutCorrectionConfig.decoupled_geo_rs(rs_threshold="0.99_1.01").rollout_rs
        == "seq_mean_k1"
    )
    ice = RolloutCorrectionConfig.decoupled_token_icepop(threshold_lower=0.5, threshold=5.0)
    assert ice.is_bounds == (0.5, 5.0) and ice.uses_icepop
    assert (
        RolloutCorrectionConfig.decoupled_token_icepop(threshold=3.0).rollout_is_threshold
        == "0.5_3.0"
    )


def test_from_preset_overrides_and_errors() -> None:
    cfg = from_preset(
        "decoupled_k3_rs_token_tis",
        is_threshold=3.0,
        rs_threshold=0.02,
        rollout_is_batch_normalize=True,
    )
    assert (cfg.rollout_is_threshold, cfg.rollout_rs_threshold) == (3.0, 0.02)
    assert cfg.rollout_is_batch_normalize is True
    with pytest.raises(KeyError, match=r"valid presets:.*decoupled_geo_rs"):
        from_preset("decoupled_geo_rss")
    with pytest.raises(ValueError, match="unknown override"):
        from_preset("decoupled_geo_rs", is_threshold=2.0)
    with pytest.raises(ValueError, match="bypass"):  # validation still runs on field overrides
        from_preset("decoupled_token_is", loss_type="reinforce")


# ------------------------------------------------------------------------------------------------
# Config validation and parsing
# ------------------------------------------------------------------------------------------------


def test_default_config_is_metrics_only() -> None:
    cfg = RolloutCorrectionConfig()
    assert cfg.rollout_is is None and cfg.rollout_rs is None and not cfg.is_enabled
    assert cfg == RolloutCorrectionConfig.disabled()
    with pytest.raises(AttributeError):
        cfg.rollout_is = "token"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rollout_is": "tokens"}, "'token' or 'sequence'"),
        ({"rollout_is_threshold": -1.0}, "positive"),
        ({"rollout_is_threshold": "5.0_0.5"}, "lower bound exceeds"),
        ({"rollout_is_threshold": "abc"}, "cannot parse"),
        ({"rollout_is_threshold": True}, "float or a string"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "valid modes"),
        ({"rollout_rs": "seq_mean_k1"}, "needs rollout_rs_threshold"),
        ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "0.1_0.2"}, "no 'lower_upper'"),
        ({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": 0.5}, "exceeds upper"),
        ({"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "1,2,3"}, "one per mode"),
        ({"rollout_rs": " , ", "rollout_rs_threshold": 1.0}, "empty"),
        ({"loss_type": "grpo"}, "'ppo_clip' or 'reinforce'"),
        ({"loss_type": "reinforce"}, "bypass_mode=True"),
        ({"debug_rollout_actor_probs": True}, "bypass mode"),
    ],
)
def test_config_validation_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig(**kwargs)


def test_threshold_parsing() -> None:
    assert parse_is_threshold(2.0) == (None, 2.0)
    assert parse_is_threshold("3") == (None, 3.0)
    assert parse_is_threshold(" 0.5_5.0 ") == (0.5, 5.0)
    opts = parse_rs_options("token_k1, seq_mean_k3,token_k1", "2.0, 0.01")
    assert [o.name for o in opts] == ["token_k1", "seq_mean_k3"]  # duplicates dropped
    assert (opts[0].lower, opts[0].upper) == (0.5, 2.0)  # single K1 bound u → [1/u, u]
    assert (opts[1].lower, opts[1].upper) == (None, 0.01)
    shared = parse_rs_options("seq_max_k2,seq_sum_k3", 0.3)
    assert [o.upper for o in shared] == [0.3, 0.3]
    assert parse_rs_options(None, None) == ()


# ------------------------------------------------------------------------------------------------
# Bypass mode
# ------------------------------------------------------------------------------------------------


def test_apply_bypass_mode() -> None:
    old, rollout = torch.zeros(1, 2), torch.ones(1, 2)
    assert apply_bypass_mode(old, rollout, RolloutCorrectionConfig.bypass_ppo_clip()) is not old
    assert torch.equal(
        apply_bypass_mode(None, rollout, RolloutCorrectionConfig.bypass_pg_is()), rollout
    )
    assert apply_bypass_mode(old, rollout, RolloutCorrectionConfig.decoupled_token_is()) is old
    with pytest.raises(ValueError, match="old_log_prob"):
        apply_bypass_mode(None, rollout, RolloutCorrectionConfig.decoupled_token_is())
    # after the substitution the batch-level correction is the identity
    cfg = RolloutCorrectionConfig.bypass_pg_geo_rs_token_tis()
    o = apply_bypass_mode(None, rollout, cfg)
    w, new_mask, _ = compute_rollout_correction_and_rejection_mask(
        o, rollout, torch.ones(1, 2), cfg
    )
    assert_close(w, torch.ones(1, 2))
    assert bool(new_mask.all())


# ------------------------------------------------------------------------------------------------
# Metric key names (verl dashboards)
# ------------------------------------------------------------------------------------------------

OFFPOLICY_KEYS = {
    "training_ppl",
    "training_log_ppl",
    "kl",
    "k3_kl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
}
IS_KEYS = {
    "rollout_is_mean",
    "rollout_is_max",
    "rollout_is_min",
    "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low",
    "rollout_is_std",
    "rollout_is_eff_sample_size",
    "rollout_is_seq_mean",
    "rollout_is_seq_std",
    "rollout_is_seq_max",
    "rollout_is_seq_min",
    "rollout_is_seq_max_deviation",
    "rollout_is_seq_fraction_high",
    "rollout_is_seq_fraction_low",
}
ADDED_KEYS = {f"rho_token_{s}" for s in ("mean", "p50", "p90", "p99", "max")} | {
    f"rollout_is_{q}" for q in ("p50", "p90", "p99")
}


def _rs_keys(mode: str) -> set[str]:
    p = f"rollout_rs_{mode}"
    keys = {
        f"{p}_{s}"
        for s in (
            "mean",
            "max",
            "min",
            "fraction_high",
            "fraction_low",
            "std",
            "seq_mean",
            "seq_std",
            "seq_max",
            "seq_min",
            "seq_max_deviation",
            "seq_fraction_high",
            "masked_fraction",
            "seq_masked_fraction",
        )
    }
    return keys | ({f"{p}_seq_fraction_low"} if mode.endswith("k1") else set())


def test_exact_metric_key_names() -> None:
    old, rollout = _lp_pair([[0.5, 1.0, 3.0], [1.5, 4.0, 0.25]])
    mask = torch.ones(2, 3)
    cfg = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold="0.5_5.0",
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_max_k3",
        rollout_rs_threshold="2.0,0.1",
    )
    _, _, m = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)
    expected = (
        OFFPOLICY_KEYS
        | IS_KEYS
        | ADDED_KEYS
        | _rs_keys("token_k1")
        | _rs_keys("seq_max_k3")
        | {
            "rollout_is_oob_ratio",
            "rollout_is_batch_norm_factor",
            "rollout_rs_masked_fraction",
            "rollout_rs_seq_masked_fraction",
        }
    )
    assert set(m) == {P + k for k in expected}
    _, _, m0 = compute_rollout_correction_and_rejection_mask(old, rollout, mask, None)
    assert set(m0) == {P + k for k in OFFPOLICY_KEYS | {k for k in ADDED_KEYS if "rho" in k}}


# ------------------------------------------------------------------------------------------------
# Properties
# ------------------------------------------------------------------------------------------------

ALL_CONFIGS = [PRESETS[n]() for n in PRESETS] + [
    RolloutCorrectionConfig(
        rollout_is="sequence",
        rollout_is_threshold="0.2_5.0",
        rollout_is_batch_normalize=True,
        rollout_rs=",".join(RS_MODES),
        rollout_rs_threshold="2.0",
    ),
    RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=1.5,
        rollout_is_batch_normalize=True,
        rollout_rs="token_k2,token_k3",
        rollout_rs_threshold=0.05,
    ),
]

GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0]


@st.composite
def batches(draw, max_b: int = 4, max_t: int = 6):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.0, 0.01, 0.1, 1.0, 5.0]))
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    old = rollout + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.75
    mask[0, 0] = True  # at least one valid token
    return old, rollout, mask


def _outputs_equal(a, b) -> None:
    wa, ma, mea = a
    wb, mb, meb = b
    assert (wa is None) == (wb is None)
    if wa is not None:
        assert torch.equal(wa, wb)
    assert torch.equal(ma, mb)
    assert mea.keys() == meb.keys()
    for k in mea:
        assert mea[k] == meb[k] or (math.isnan(mea[k]) and math.isnan(meb[k])), k


@settings(max_examples=50, deadline=None)
@given(
    batch=batches(),
    cfg_idx=st.integers(0, len(ALL_CONFIGS) - 1),
    garbage=st.sampled_from(GARBAGE),
    float_mask=st.booleans(),
)
def test_masked_garbage_never_changes_outputs(batch, cfg_idx, garbage, float_mask) -> None:
    old, rollout, mask = batch
    cfg = ALL_CONFIGS[cfg_idx]
    m = mask.to(torch.float64) if float_mask else mask
    clean = compute_rollout_correction_and_rejection_mask(old, rollout, m, cfg)
    old_g = torch.where(mask, old, torch.full_like(old, garbage))
    roll_g = torch.where(mask, rollout, torch.full_like(rollout, -garbage))
    dirty = compute_rollout_correction_and_rejection_mask(old_g, roll_g, m, cfg)
    _outputs_equal(clean, dirty)
    assert all(math.isfinite(v) for v in clean[2].values())


@settings(max_examples=50, deadline=None)
@given(
    batch=batches(),
    cfg_idx=st.integers(0, len(ALL_CONFIGS) - 1),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_identical_policies_are_neutral(batch, cfg_idx, dtype) -> None:
    _, rollout, mask = batch
    rollout = rollout.to(dtype)
    cfg = ALL_CONFIGS[cfg_idx]
    w, new_mask, m = compute_rollout_correction_and_rejection_mask(
        rollout, rollout.clone(), mask, cfg
    )
    assert torch.equal(new_mask, mask)
    if w is not None:
        assert w.dtype == dtype
        assert_close(w, torch.where(mask, 1.0, 0.0).to(dtype))
        assert m[P + "rollout_is_eff_sample_size"] == pytest.approx(1.0)
        assert m[P + "rollout_is_ratio_fraction_high"] == 0.0
        assert m[P + "rollout_is_ratio_fraction_low"] == 0.0
        assert m[P + "rollout_is_std"] == pytest.approx(0.0, abs=1e-12)
    for k, v in m.items():
        if k.endswith("masked_fraction") or k.endswith("oob_ratio"):
            assert v == 0.0, k
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff"):
        assert m[P + k] == pytest.approx(0.0, abs=1e-12), k
    assert m[P + "ppl_ratio"] == pytest.approx(1.0)


@settings(max_examples=50, deadline=None)
@given(batch=batches(), lo=st.floats(0.2, 1.0), hi=st.floats(1.0, 5.0))
def test_icepop_zeroes_exactly_the_out_of_band_tokens(batch, lo, hi) -> None:
    old, rollout, mask = batch
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=f"{lo}_{hi}")
    w, new_mask, m = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)
    rho = torch.exp((old - rollout).clamp(-20, 20))
    oob = mask & ((rho < lo) | (rho > hi))
    in_band = mask & ~oob
    assert torch.equal(w == 0, oob | ~mask)  # ρ > 0 always (log ratio bounded by ±20)
    assert_close(w[in_band], rho[in_band])
    assert torch.equal(new_mask, mask)
    assert m[P + "rollout_is_oob_ratio"] == pytest.approx(oob.sum().item() / mask.sum().item())


@settings(max_examples=50, deadline=None)
@given(batch=batches(), level=st.sampled_from(["token", "sequence"]))
def test_weights_and_masks_are_detached(batch, level) -> None:
    old, rollout, mask = batch
    old = old.clone().requires_grad_(True)
    rollout = rollout.clone().requires_grad_(True)
    cfg = RolloutCorrectionConfig(
        rollout_is=level, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1
    )
    w, new_mask, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)
    assert w is not None and not w.requires_grad and w.grad_fn is None
    assert not new_mask.requires_grad


@settings(max_examples=50, deadline=None)
@given(batch=batches(), cfg_idx=st.integers(0, len(ALL_CONFIGS) - 1))
def test_float32_matches_float64(batch, cfg_idx) -> None:
    old, rollout, mask = batch
    cfg = ALL_CONFIGS[cfg_idx]
    w64, _, m64 = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)
    w32, _, m32 = compute_rollout_correction_and_rejection_mask(
        old.float(), rollout.float(), mask, cfg
    )
    if w64 is not None:
        assert w32.dtype == torch.float32
        assert_close(w32.double(), w64, rtol=1e-4, atol=1e-5)
    assert m32.keys() == m64.keys()


def test_empty_sequences_and_empty_batch_are_finite() -> None:
    old, rollout = _lp_pair([[2.0, 0.5], [3.0, 3.0]])
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)  # second sequence empty
    for cfg in ALL_CONFIGS:
        w, new_mask, m = compute_rollout_correction_and_rejection_mask(old, rollout, mask, cfg)
        assert all(math.isfinite(v) for v in m.values())
        if w is not None:
            assert bool((w[1] == 0).all())
    # the empty sequence does not enter per-sequence averages: χ²_seq = (2·0.5)² − 1 = 0
    m = compute_offpolicy_metrics(old, rollout, mask)
    assert m["chi2_seq"] == pytest.approx(0.0)
    none = torch.zeros(2, 2, dtype=torch.bool)
    for cfg in ALL_CONFIGS:
        w, new_mask, m = compute_rollout_correction_and_rejection_mask(old, rollout, none, cfg)
        assert not bool(new_mask.any())
        assert all(math.isfinite(v) for v in m.values())


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_rollout_correction_and_rejection_mask(
            torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)
        )


def test_rejection_leaves_is_weights_unchanged() -> None:
    # IS weights are computed on the original mask: RS rejection does not zero them (as verl)
    old, rollout = _lp_pair([[1.5, 1.5], [1.0, 1.0]])
    cfg = RolloutCorrectionConfig.decoupled_geo_rs_token_tis()
    w, new_mask, _ = compute_rollout_correction_and_rejection_mask(
        old, rollout, torch.ones(2, 2), cfg
    )
    assert torch.equal(new_mask, torch.tensor([[False, False], [True, True]]))
    assert_close(w, torch.tensor([[1.5, 1.5], [1.0, 1.0]], dtype=torch.float64))
