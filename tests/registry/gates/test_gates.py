"""Stability gates on hand-built metric histories whose arithmetic is written out in comments."""

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from registry.gates import (
    GATES,
    GateParams,
    GateResult,
    check_params,
    diagnosis_for,
    evaluate_gate,
    evaluate_gates,
    gate_names,
    gate_params,
    params_model,
    summarize,
    unmet_requirement,
)
from training.algorithms.decision_tree import Thresholds
from training.runtime.sinks import JsonlSink, read_metrics

LP = "mismatch/train_rollout/logprob_abs_diff/mean"
ENT = "policy/entropy/mean"
RW = "rollout/reward_mean"
EV = "eval/reward_mean"
LEN = "rollout/response_length/mean"
RLP = "rollout/logprob_mean"
GN = "policy/grad_norm"
ST = "async/staleness/max"
REP = "rollout/repetition_rate"

ALL_GATES = [
    "engine_mismatch_flat", "entropy_no_blowup", "eval_not_degraded", "eval_tracks_reward",
    "grad_norm_no_spike", "is_health",
    "is_weight_mean_band", "logprob_diff_flat", "no_length_surge", "pg_clipfrac",
    "repetition_rate", "reward_not_collapsed", "rollout_logprob_not_decreasing",
    "staleness_within_bound", "zero_variance_groups",
]


def hist(series: dict[str, list], start: int = 0) -> list[dict]:
    """One training row per step; series[key][i] is the value at step start + i."""
    n = max(len(v) for v in series.values())
    rows = []
    for i in range(n):
        row = {"step": start + i}
        for key, values in series.items():
            if i < len(values):
                row[key] = values[i]
        rows.append(row)
    return rows


def test_registry_lists_the_fifteen_gates():
    assert gate_names() == ALL_GATES
    assert sorted(GATES) == ALL_GATES


# ------------------------------------------------------------------------ entropy_no_blowup


def test_entropy_spike_fails_and_gradual_drift_passes():
    # median of the previous 5 [0.5, 0.4, 0.6, 0.5, 0.5] is 0.5; 1.2 / 0.5 = 2.4 > 2
    r = evaluate_gate("entropy_no_blowup", hist({ENT: [0.5, 0.4, 0.6, 0.5, 0.5, 1.2]}))
    assert not r.passed
    assert r.value == pytest.approx(2.4) and r.threshold == 2.0
    assert "step 5" in r.evidence and "2.40×" in r.evidence
    # 0.9 / 0.5 = 1.8 ≤ 2
    r = evaluate_gate("entropy_no_blowup", hist({ENT: [0.5] * 5 + [0.9]}))
    assert r.passed and r.value == pytest.approx(1.8)
    mild = [0.5 * 1.01 ** i for i in range(30)]  # +1 %/step: never a spike, +30 % over the run
    r = evaluate_gate("entropy_no_blowup", hist({ENT: mild}))
    # quarters of 30 points are 8 points: mean 1.01^i over i = 22..29 vs i = 0..7 = 1.01^22 ≈ 1.245
    assert r.passed and "no sustained rise" in r.evidence and "1.24×" in r.evidence


def test_entropy_sustained_rise_fails_without_a_spike():
    drift = [0.5 * 1.05 ** i for i in range(30)]  # +5 %/step: quadruples, never a spike
    r = evaluate_gate("entropy_no_blowup", hist({ENT: drift}))
    # last 8 vs first 8 points: 1.05^22 ≈ 2.925 > 1.5, every step ≤ 1.05^3 ≈ 1.16× its median
    assert not r.passed and r.value == pytest.approx(1.05 ** 22) and r.threshold == 1.5
    assert r.window == (22, 29) and "sustained entropy rise" in r.evidence
    # a plateau after a rise, flat against itself at the end but 1.6× the reference level 0.5
    plateau = [0.8] * 12
    assert evaluate_gate("entropy_no_blowup", hist({ENT: plateau})).passed
    r = evaluate_gate("entropy_no_blowup", hist({ENT: plateau}), reference={ENT: 0.5})
    assert not r.passed and r.value == pytest.approx(1.6) and "reference level 0.5" in r.evidence


def test_entropy_window_parameter():
    series = [0.5, 0.5, 0.1, 0.1, 0.25]
    # window 2: median of [0.1, 0.1] is 0.1 → 0.25 is 2.5×; window 4: median of
    # [0.5, 0.5, 0.1, 0.1] = 0.3 → 0.83×
    assert not evaluate_gate("entropy_no_blowup", hist({ENT: series}), {"window": 2}).passed
    assert evaluate_gate("entropy_no_blowup", hist({ENT: series}), {"window": 4}).passed


# ------------------------------------------------------------------------ eval_tracks_reward


def _eval_history(last_eval: float) -> list[dict]:
    # the runtime's pre-training eval is an eval-only row at step 0; later evals ride on
    # training rows
    rows = [{"step": 0, EV: 0.6, "step/eval_only": 1.0}]
    rows += hist({RW: [0.3, 0.3, 0.3, 0.6, 0.6, 0.6]})
    rows[-1][EV] = last_eval
    return rows


def test_simplicity_bias_fails():
    # reward: mean of the last 3 (0.6) − mean of the first 3 (0.3) = +0.3 > 0;
    # eval: 0.6 → 0.5, a fall of 0.1 > 0.05
    r = evaluate_gate("eval_tracks_reward", _eval_history(0.5))
    assert not r.passed
    assert r.value == pytest.approx(0.1) and r.threshold == 0.05
    assert r.window == (0, 5)
    assert "simplicity bias" in r.evidence and "0.6 → 0.5" in r.evidence


def test_eval_gate_passes_without_eval_data():
    r = evaluate_gate("eval_tracks_reward", hist({RW: [0.1, 0.2, 0.3]}))
    assert r.passed and r.value is None and "no eval data" in r.evidence
    assert not evaluate_gate("eval_tracks_reward", hist({RW: [0.1, 0.2, 0.3]}),
                             {"require_data": True}).passed


def test_eval_gate_names_the_difficulty_that_fell_most():
    rows = _eval_history(0.5)
    rows[0].update({"eval/reward/d1": 1.0, "eval/reward/d8": 0.5})
    rows[-1].update({"eval/reward/d1": 1.0, "eval/reward/d8": 0.0})
    assert "d8: 0.5 → 0" in evaluate_gate("eval_tracks_reward", rows).evidence


# ------------------------------------------------------------------------ is_health


def test_is_health_passes_and_fails_on_each_threshold():
    ok = {"is/combined/ess": [0.9] * 8, "is/combined/mask_frac": [0.01] * 8,
          "mismatch/train_rollout/chi2_token": [0.1] * 8}
    r = evaluate_gate("is_health", hist(ok))
    assert r.passed and r.value == pytest.approx(0.9) and r.threshold == 0.5
    assert "rs_only" in r.evidence
    # ESS: the last 2 of 8 points are 0.4, 0.3 → mean 0.35 < 0.5
    low_ess = dict(ok, **{"is/combined/ess": [0.9] * 6 + [0.4, 0.3]})
    r = evaluate_gate("is_health", hist(low_ess))
    assert not r.passed
    assert (r.value, r.threshold, r.window) == (pytest.approx(0.35), 0.5, (6, 7))
    assert "ESS 0.35 < 0.5" in r.evidence
    r = evaluate_gate("is_health", hist(dict(ok, **{"is/combined/mask_frac": [0.3] * 8})))
    assert not r.passed and r.value == pytest.approx(0.3) and r.threshold == 0.25
    r = evaluate_gate("is_health", hist(dict(ok, **{"mismatch/train_rollout/chi2_token":
                                                    [1.5] * 8})))
    assert not r.passed and r.value == pytest.approx(1.5) and r.threshold == 1.0


def test_is_health_reads_verl_ess_and_passes_without_is_metrics():
    r = evaluate_gate("is_health", hist({"rollout_corr/rollout_is_eff_sample_size": [0.2] * 4}))
    assert not r.passed and "rollout_corr/rollout_is_eff_sample_size" in r.evidence
    r = evaluate_gate("is_health", hist({RW: [0.5] * 4}))
    assert r.passed and r.evidence.startswith("no IS metrics")
    assert not evaluate_gate("is_health", hist({RW: [0.5] * 4}), {"require_data": True}).passed


def test_is_health_defaults_are_the_decision_tree_thresholds():
    t = Thresholds()
    assert gate_params("is_health") == {
        "min_ess": t.ess_min, "max_mask_frac": t.rs_mask_high,
        "max_chi2_token": t.chi2_token_blowup, "tail": 0.25, "require_data": False}


def test_is_health_reports_each_source_and_names_the_failing_one():
    rows = hist({"is/combined/ess": [0.9] * 4, "is/engine/ess": [0.95] * 4,
                 "is/engine/mask_frac": [0.02] * 4, "is/staleness/ess": [0.3] * 4,
                 "is/staleness/mask_frac": [0.0] * 4})
    r = evaluate_gate("is_health", rows)
    assert not r.passed and r.value == pytest.approx(0.3)
    assert r.evidence.startswith("IS correction is failing (staleness)")
    assert "combined: ESS 0.9 ≥ 0.5 (is/combined/ess)" in r.evidence
    assert "engine: ESS 0.95 ≥ 0.5 (is/engine/ess), mask fraction 0.02 ≤ 0.25" in r.evidence
    assert "staleness: ESS 0.3 < 0.5 (is/staleness/ess)" in r.evidence
    rows = hist({"is/engine/ess": [0.95] * 4, "is/staleness/ess": [0.8] * 4})
    assert evaluate_gate("is_health", rows).passed


# ------------------------------------------------------------------------ is_weight_mean_band


ER, SR = "is/engine/ratio/mean", "is/staleness/ratio/mean"


def test_is_weight_mean_band_catches_seed_000s_engine_dips():
    # the Fix-2 picture: the engine ratio mean sits at 1.0 with dips to 0.992 on steps 3 and 7
    engine = [1.0, 0.999, 1.001, 0.992, 1.0, 1.0, 0.9995, 0.992, 1.0, 1.0]
    rows = hist({ER: engine, SR: [1.0] * 10})
    r = evaluate_gate("is_weight_mean_band", rows)
    assert not r.passed and (r.value, r.threshold) == (2.0, 1.0)
    assert "is/engine/ratio/mean left [0.995, 1.005] on 2 of 10 steps" in r.evidence
    assert "farthest 0.992 at step 3" in r.evidence and "(engine;" in r.evidence
    assert "is/staleness/ratio/mean stayed in [0.995, 1.005] on all 10 steps" in r.evidence
    # one dip is tolerated by default, none with max_steps 0; a wider band passes both
    one = hist({ER: [1.0] * 9 + [0.992]})
    assert evaluate_gate("is_weight_mean_band", one).passed
    assert not evaluate_gate("is_weight_mean_band", one, {"max_steps": 0}).passed
    assert evaluate_gate("is_weight_mean_band", rows, {"delta": 0.01}).passed


def test_is_weight_mean_band_catches_staleness_spikes_upwards():
    rows = hist({ER: [1.0] * 6, SR: [1.0, 1.02, 1.0, 1.03, 1.01, 1.0]})
    r = evaluate_gate("is_weight_mean_band", rows)
    assert not r.passed and r.value == 3.0 and "(staleness;" in r.evidence
    assert "farthest 1.03 at step 3" in r.evidence


def test_is_weight_mean_band_does_not_count_a_methods_rejections_as_dips():
    # the Fix-2 candidate itself: engine IcePop rejects 2 % of tokens each step, so the weight
    # mean (rejected tokens count 0) reads ≈ 0.98 while the raw ratio sits at 1
    rows = hist({"is/engine/weight_mean": [0.98] * 8, ER: [1.0, 1.001, 0.999, 1.0] * 2,
                 "is/engine/mask_frac": [0.02] * 8, SR: [1.0] * 8})
    r = evaluate_gate("is_weight_mean_band", rows)
    assert r.passed and "is/engine/ratio/mean stayed in [0.995, 1.005] on all 8 steps " \
        "(range 0.999–1.001)" in r.evidence
    # only the weight mean logged (a run without the ratio tails): nothing to judge
    r = evaluate_gate("is_weight_mean_band", hist({"is/engine/weight_mean": [0.98] * 8}))
    assert r.passed and "is/engine/ratio/mean or is/staleness/ratio/mean" in r.evidence


# ------------------------------------------------------------------------ pg_clipfrac


def test_pg_clipfrac_fails_when_high_and_rising():
    # quarters of 8 points: first (0.15 + 0.18) / 2 = 0.165, last (0.26 + 0.3) / 2 = 0.28 > 0.2
    rising = [0.15, 0.18, 0.2, 0.21, 0.22, 0.24, 0.26, 0.3]
    r = evaluate_gate("pg_clipfrac", hist({"policy/pg_clipfrac": rising}))
    assert not r.passed and r.value == pytest.approx(0.28) and r.threshold == 0.2
    assert r.window == (6, 7) and "seed 001 cause E" in r.evidence
    # high but falling: not saturation by seed 001's rule; low and rising: fine
    assert evaluate_gate("pg_clipfrac", hist({"policy/pg_clipfrac": rising[::-1]})).passed
    low = [0.01 * i for i in range(8)]
    assert evaluate_gate("pg_clipfrac", hist({"actor/pg_clipfrac": low})).passed


# ------------------------------------------------------------------------ repetition_rate


def test_repetition_rate_rise_fails_against_the_run_start_and_the_reference():
    rep = "rollout/repetition_rate"
    rows = hist({rep: [0.1, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.3]})
    r = evaluate_gate("repetition_rate", rows)
    # last 2 points 0.3 vs the first 2 points 0.1: +0.2 > +0.1
    assert not r.passed and r.value == pytest.approx(0.3) and r.threshold == pytest.approx(0.2)
    assert "+0.2 vs the run's first 2 points 0.1" in r.evidence
    steady = hist({rep: [0.3] * 8})
    assert evaluate_gate("repetition_rate", steady).passed
    # steady at 0.3, but the baseline repeated in 0.15 of responses: +0.15 > +0.1
    r = evaluate_gate("repetition_rate", steady, reference={rep: 0.15})
    assert not r.passed and "vs the reference level 0.15" in r.evidence
    r = evaluate_gate("repetition_rate", steady, {"max_level": 0.25})
    assert not r.passed and r.threshold == 0.25 and "> the ceiling 0.25" in r.evidence


# ------------------------------------------------------------------------ zero_variance_groups


def test_zero_variance_groups_seed_000s_60_of_128():
    zv = "rollout/zero_variance_group_frac"
    r = evaluate_gate("zero_variance_groups", hist({zv: [60 / 128] * 4}))
    assert not r.passed and r.value == pytest.approx(0.46875) and r.threshold == 0.45
    assert "47% of groups carry no gradient" in r.evidence
    assert evaluate_gate("zero_variance_groups", hist({zv: [0.3] * 4})).passed
    # the embedded task's sync baseline already wastes 0.6: relative to it, 0.65 passes
    # and 0.75 (> 0.6 + 0.1) fails
    ref = {zv: 0.6}
    assert evaluate_gate("zero_variance_groups", hist({zv: [0.65] * 4}), reference=ref).passed
    r = evaluate_gate("zero_variance_groups", hist({zv: [0.75] * 4}), reference=ref)
    assert not r.passed and r.threshold == pytest.approx(0.7)


# ------------------------------------------------------------------------ no_length_surge


def test_length_surge_fails_and_small_growth_passes():
    # 100 → 130 within the window: 30 % > 20 %
    r = evaluate_gate("no_length_surge", hist({LEN: [100, 100, 100, 130, 130]}), {"smooth": 1})
    assert not r.passed
    # the window runs from the latest lowest point (step 2) to the high (step 3)
    assert (r.value, r.threshold, r.window) == (pytest.approx(0.3), 0.2, (2, 3))
    r = evaluate_gate("no_length_surge", hist({LEN: [100, 100, 100, 110, 110]}), {"smooth": 1})
    assert r.passed and r.value == pytest.approx(0.1)


def test_length_surge_is_judged_within_the_window():
    # 100 + 0.1·i for 300 steps: +30 % over the run, but within any 100 steps at most
    # (100 + 10) / 100 − 1 = 10 % (steps 0 → 100)
    lengths = [100 + 0.1 * i for i in range(300)]
    r = evaluate_gate("no_length_surge", hist({LEN: lengths}), {"smooth": 1})
    assert r.passed and r.value == pytest.approx(0.1) and r.window == (0, 100)
    r = evaluate_gate("no_length_surge", hist({LEN: lengths}), {"smooth": 1, "window": 300})
    assert not r.passed and r.value == pytest.approx(129.9 / 100 - 1)


# ------------------------------------------------------------------------ rollout_logprob


def test_rollout_logprob_decline_fails_and_rise_passes():
    # −0.2 − 0.01·i, i = 0..9: slope −0.01 < −0.001, fitted fall 0.09 > 0.05
    r = evaluate_gate("rollout_logprob_not_decreasing", hist({RLP: [-0.2 - 0.01 * i
                                                                    for i in range(10)]}))
    assert not r.passed
    assert r.value == pytest.approx(-0.01) and r.threshold == pytest.approx(-0.001)
    assert "slope -0.01/step < -0.001" in r.evidence
    r = evaluate_gate("rollout_logprob_not_decreasing", hist({RLP: [-0.3 + 0.005 * i
                                                                    for i in range(10)]}))
    assert r.passed and r.value == pytest.approx(0.005)
    # slope −0.005 but a fall of only 0.015 over 3 steps: noise on a short run
    assert evaluate_gate("rollout_logprob_not_decreasing",
                         hist({RLP: [-0.2, -0.205, -0.21, -0.215]})).passed


# ------------------------------------------------------------------------ grad_norm_no_spike


def _spike_history(reward_after: float) -> list[dict]:
    # grad norm 30 at step 5 vs the median 2 of steps 0–4: 15× > 10×
    grads = [2.0] * 5 + [30.0] + [2.0] * 5
    rewards = [0.5] * 6 + [reward_after] * 5
    return hist({GN: grads, RW: rewards})


def test_grad_spike_with_reward_loss_fails():
    # reward over steps 0–5 averages 0.5, over steps 6–10 0.2
    r = evaluate_gate("grad_norm_no_spike", _spike_history(0.2))
    assert not r.passed
    assert (r.value, r.threshold, r.window) == (pytest.approx(15.0), 10.0, (0, 10))
    assert "15.0×" in r.evidence and "from 0.5 (steps 0–5) to 0.2 (steps 6–10)" in r.evidence


def test_grad_spike_without_reward_loss_passes_with_a_note():
    r = evaluate_gate("grad_norm_no_spike", _spike_history(0.6))
    assert r.passed and r.value == pytest.approx(15.0)
    assert "without reward loss" in r.evidence and "0.5 → 0.6" in r.evidence


def test_grad_norm_without_spike_and_zero_norm_steps():
    # zero grad norms (no update) are not a baseline: median of [2, 2, 2] = 2, 4 / 2 = 2×
    r = evaluate_gate("grad_norm_no_spike", hist({GN: [2.0, 0.0, 2.0, 0.0, 2.0, 4.0],
                                                  RW: [0.5] * 6}))
    assert r.passed and r.value == pytest.approx(2.0) and "no grad-norm spike" in r.evidence
    # a spike on the last step: the reward after it is unknown, not a confirmed collapse
    r = evaluate_gate("grad_norm_no_spike", hist({GN: [2.0] * 5 + [50.0], RW: [0.5] * 6}))
    assert r.passed and "not observed" in r.evidence


# ------------------------------------------------------------------------ staleness_within_bound


def test_staleness_bound_from_context_and_params():
    run = hist({ST: [0, 1, 1, 2], "async/staleness/mean": [0, 0.5, 0.5, 1.0]})
    r = evaluate_gate("staleness_within_bound", run, context={"max_staleness": 1})
    assert not r.passed and (r.value, r.threshold, r.window) == (2.0, 1.0, (0, 3))
    assert "peaked at 2 (step 3) > the bound 1" in r.evidence
    assert "mean staleness 0.5" in r.evidence
    # the parameter overrides the context
    assert evaluate_gate("staleness_within_bound", run, {"max_staleness": 2},
                         context={"max_staleness": 1}).passed
    r = evaluate_gate("staleness_within_bound", run)
    assert r.passed and r.threshold is None and "no bound configured" in r.evidence
    with pytest.raises(ValueError, match="max_staleness"):
        evaluate_gate("staleness_within_bound", run, context={"max_staleness": "one"})


def test_staleness_gate_judges_the_dropped_fraction_when_drops_are_configured():
    # fully async, max_off_policy_steps 2: the bound holds by construction, drops are the verdict
    run = hist({ST: [1, 2, 2, 2], "async/dropped_stale_frac": [0.0, 0.1, 0.25, 0.4]})
    r = evaluate_gate("staleness_within_bound", run, context={"max_staleness": 2})
    assert not r.passed and (r.value, r.threshold) == (0.4, 0.25)
    assert "async/dropped_stale_frac is 0.4 (40% of the samples, cumulative to step 3)" \
        in r.evidence
    assert "holds by construction" in r.evidence and "(bound 2)" in r.evidence
    run = hist({ST: [1, 2, 2, 2], "async/dropped_stale_frac": [0.0, 0.02, 0.05, 0.05]})
    assert evaluate_gate("staleness_within_bound", run, context={"max_staleness": 2}).passed
    # the context says drops are configured but the metric is missing: not enough data
    r = evaluate_gate("staleness_within_bound", hist({ST: [1, 2]}),
                      context={"max_staleness": 2, "max_off_policy_steps": 2})
    assert r.passed and "async/dropped_stale_frac (drops are configured)" in r.evidence
    assert not evaluate_gate("staleness_within_bound", hist({ST: [1, 2]}),
                             {"require_data": True},
                             context={"max_staleness": 2, "max_off_policy_steps": 2}).passed


def test_staleness_gate_with_drops_still_checks_an_explicit_bound():
    # drops configured at max_off_policy_steps 2, few dropped; an explicit max_staleness 1 is
    # the user's tighter bound, which the drops do not enforce: the peak 2 fails it
    run = hist({ST: [1, 2, 2, 1], "async/dropped_stale_frac": [0.0, 0.02, 0.05, 0.05]})
    ctx = {"max_staleness": 2, "max_off_policy_steps": 2}
    assert evaluate_gate("staleness_within_bound", run, context=ctx).passed
    r = evaluate_gate("staleness_within_bound", run, {"max_staleness": 1}, context=ctx)
    assert not r.passed and (r.value, r.threshold) == (2.0, 1.0)
    assert "few enough samples dropped" in r.evidence and "(bound 2)" in r.evidence
    assert "peaked at 2 (step 1) > the bound 1 from max_staleness parameter" in r.evidence
    # a bound the peak meets, with too many drops: fails on the drops
    many = hist({ST: [1, 2, 2, 1], "async/dropped_stale_frac": [0.0, 0.2, 0.3, 0.4]})
    r = evaluate_gate("staleness_within_bound", many, {"max_staleness": 2}, context=ctx)
    assert not r.passed and (r.value, r.threshold) == (0.4, 0.25)
    assert "≤ the bound 2 from max_staleness parameter" in r.evidence
    assert evaluate_gate("staleness_within_bound", run, {"max_staleness": 2}, context=ctx).passed


# ------------------------------------------------------------------------ unmet_requirement


def _recipe(**over):
    from training.recipe import apply_overrides, recipe_from_dict

    return recipe_from_dict(apply_overrides({}, over))


def test_unmet_requirement_names_the_missing_recipe_setting():
    assert unmet_requirement("eval_tracks_reward", {}, _recipe()) is None
    msg = unmet_requirement("eval_tracks_reward", {}, _recipe(**{"eval.n": 0}))
    assert "eval.n > 0" in msg and "\n" not in msg
    msg = unmet_requirement("staleness_within_bound", {"max_dropped_frac": 0.1},
                            _recipe(**{"async.mode": "fully_async"}))
    assert "async.max_off_policy_steps" in msg
    assert unmet_requirement("staleness_within_bound", {}, _recipe()) is None
    assert unmet_requirement("staleness_within_bound", {"max_dropped_frac": 0.1}, _recipe(
        **{"async.mode": "fully_async", "async.max_off_policy_steps": 2})) is None
    # measured on a sync recipe without any correction
    assert unmet_requirement("is_weight_mean_band", {}, _recipe()) is None
    msg = unmet_requirement("is_weight_mean_band", {},
                            _recipe(**{"algorithm.old_logprob": "bypass"}))
    assert "identically 1" in msg and "old_logprob is bypass" in msg
    msg = unmet_requirement("is_weight_mean_band", {},
                            _recipe(**{"algorithm.old_logprob": "linear_prox"}))
    assert "identically 1" in msg and "old_logprob is linear_prox" in msg
    msg = unmet_requirement("is_weight_mean_band", {}, _recipe(**{
        "algorithm.correction": {"kind": "preset", "name": "bypass_ppo_clip"}}))
    assert "a bypass preset forces old_logprob bypass" in msg
    assert unmet_requirement("is_weight_mean_band", {},
                             _recipe(**{"algorithm.old_logprob": "dedicated"})) is None
    msg = unmet_requirement("zero_variance_groups", {}, _recipe(**{"rollout.n": 1}))
    assert "rollout.n is 1" in msg
    assert all(unmet_requirement(n, {}, _recipe()) is None for n in ALL_GATES)
    with pytest.raises(KeyError):
        unmet_requirement("nope", {}, _recipe())
    with pytest.raises(ValueError, match="max_dropped"):
        unmet_requirement("staleness_within_bound", {"max_dropped": 0.1}, _recipe())


# ------------------------------------------------------------------------ shared behaviour


@pytest.mark.parametrize("name", ALL_GATES)
def test_empty_and_short_histories_pass_unless_data_is_required(name):
    for history in ([], hist({LP: [0.01], RW: [0.5], ST: [0]})):
        r = evaluate_gate(name, history)
        assert r.passed, r.evidence
        assert isinstance(r.evidence, str) and r.evidence
    r = evaluate_gate(name, [], {"require_data": True})
    if name == "staleness_within_bound":  # no bound, nothing to enforce
        assert r.passed and "no bound configured" in r.evidence
    else:
        assert not r.passed
    r = evaluate_gate("logprob_diff_flat", [], {"require_data": True})
    assert r.evidence.startswith("not enough steps (0)")


def test_none_values_and_bad_rows_are_ignored():
    clean = [0.006 + 0.001 * i for i in range(20)]
    rows = hist({LP: clean})
    rows.insert(3, {"step": 3, LP: None, "_nonfinite": [LP]})  # a diverged duplicate of step 3
    rows[4][LP] = clean[3]  # ...that the later row for step 3 overrides
    rows.append({"step": 20, LP: None})
    rows.append({"step": 21, LP: "nan?"})
    rows.append({"no_step": 1, LP: 5.0})
    a = evaluate_gate("logprob_diff_flat", rows)
    b = evaluate_gate("logprob_diff_flat", hist({LP: clean}))
    assert a.value == pytest.approx(b.value) and a.window == b.window == (0, 19)


def test_eval_only_rows_are_ignored_by_training_gates():
    rows = hist({ENT: [0.5] * 8})
    # an eval-only row carrying a training key must not count as a training step
    rows.insert(6, {"step": 6, ENT: 100.0, "step/eval_only": 1.0})
    r = evaluate_gate("entropy_no_blowup", rows)
    assert r.passed and r.value == pytest.approx(1.0)
    assert summarize(rows)[ENT] == pytest.approx(0.5)


def test_unknown_gate_lists_the_valid_gates():
    for call in (lambda: check_params("logprob_flat", {}), lambda: gate_params("nope"),
                 lambda: evaluate_gate("nope", [])):
        with pytest.raises(KeyError) as err:
            call()
        message = str(err.value)
        assert all(g in message for g in ALL_GATES)


def test_unknown_or_bad_params_name_the_param_and_the_fix():
    with pytest.raises(ValueError) as err:
        check_params("logprob_diff_flat", {"max_rse": 0.5})
    msg = str(err.value)
    assert "'max_rse'" in msg and "did you mean 'max_rise'" in msg
    assert "max_rise, t_limit, max_ratio, z_limit, max_level, tail, require_data" in msg
    with pytest.raises(ValueError, match=r"'max_ratio' must be a finite number.*default 1\.5"):
        check_params("logprob_diff_flat", {"max_ratio": "1.5x"})
    with pytest.raises(ValueError, match="'drop' must be > 0 and ≤ 1"):
        check_params("reward_not_collapsed", {"drop": 1.5})
    with pytest.raises(ValueError, match="'window' must be a whole number"):
        check_params("entropy_no_blowup", {"window": 2.5})
    with pytest.raises(ValueError, match="'require_data' must be true or false"):
        check_params("is_health", {"require_data": "yes"})
    with pytest.raises(ValueError, match="'factor' must be a finite number"):
        check_params("grad_norm_no_spike", {"factor": True})
    with pytest.raises(ValueError, match="relative_to"):
        check_params("logprob_diff_flat", {"relative_to": "baseline"})


def test_check_params_fills_defaults_and_coerces():
    out = check_params("entropy_no_blowup", {"window": 3.0, "spike_factor": 3})
    assert out == {"spike_factor": 3.0, "window": 3, "sustained_factor": 1.5, "tail": 0.25,
                   "require_data": False}
    assert isinstance(out["window"], int)
    assert check_params("staleness_within_bound", {"max_staleness": None})["max_staleness"] \
        is None
    for name in ALL_GATES:
        assert check_params(name, {}) == gate_params(name)


def test_documented_defaults():
    assert gate_params("logprob_diff_flat")["max_level"] is None
    assert gate_params("logprob_diff_flat")["max_ratio"] == 1.5
    assert gate_params("entropy_no_blowup") == {"spike_factor": 2.0, "window": 5,
                                                "sustained_factor": 1.5, "tail": 0.25,
                                                "require_data": False}
    assert gate_params("logprob_diff_flat")["max_rise"] == 0.5
    assert gate_params("logprob_diff_flat")["t_limit"] == 3.0
    assert gate_params("is_weight_mean_band") == {"delta": 0.005, "max_steps": 1,
                                                  "require_data": False}
    assert gate_params("pg_clipfrac")["max_level"] == Thresholds().pg_clipfrac_max == 0.2
    assert gate_params("zero_variance_groups")["max_frac"] == 0.45
    assert gate_params("repetition_rate")["max_increase"] == 0.1
    assert gate_params("staleness_within_bound")["max_dropped_frac"] == 0.25
    assert gate_params("reward_not_collapsed")["drop"] == 0.3
    assert gate_params("no_length_surge")["max_rise"] == 0.2
    assert Thresholds().length_surge_ratio - 1 == pytest.approx(0.2)
    assert gate_params("no_length_surge")["window"] == 100
    assert gate_params("grad_norm_no_spike") == {"factor": 10.0, "window": 5, "after": 5,
                                                 "require_data": False}


# Written out by hand from the params models' docstrings: a changed default fails here.
_MISMATCH = {"max_rise": 0.5, "t_limit": 3.0, "max_ratio": 1.5, "z_limit": 3.0, "max_level": None,
             "tail": 0.25, "require_data": False}
DEFAULTS = {
    "engine_mismatch_flat": _MISMATCH,
    "eval_not_degraded": {"max_drop": 0.05, "alpha": 0.05, "require_data": False},
    "entropy_no_blowup": {"spike_factor": 2.0, "window": 5, "sustained_factor": 1.5,
                          "tail": 0.25, "require_data": False},
    "eval_tracks_reward": {"min_rise": 0.0, "max_eval_drop": 0.05, "alpha": 0.05, "smooth": 3,
                           "require_data": False},
    "grad_norm_no_spike": {"factor": 10.0, "window": 5, "after": 5, "require_data": False},
    "is_health": {"min_ess": 0.5, "max_mask_frac": 0.25, "max_chi2_token": 1.0, "tail": 0.25,
                  "require_data": False},
    "is_weight_mean_band": {"delta": 0.005, "max_steps": 1, "require_data": False},
    "logprob_diff_flat": _MISMATCH,
    "no_length_surge": {"max_rise": 0.2, "window": 100, "smooth": 3, "require_data": False},
    "pg_clipfrac": {"max_level": 0.2, "tail": 0.25, "require_data": False},
    "repetition_rate": {"max_increase": 0.1, "max_level": None, "tail": 0.25,
                        "require_data": False},
    "reward_not_collapsed": {"drop": 0.3, "smooth": 5, "alpha": 0.01, "require_data": False},
    "rollout_logprob_not_decreasing": {"max_decline": 0.001, "min_drop": 0.05,
                                       "require_data": False},
    "staleness_within_bound": {"max_staleness": None, "max_dropped_frac": 0.25,
                               "require_data": False},
    "zero_variance_groups": {"max_frac": 0.45, "max_increase": 0.1, "tail": 0.25,
                             "require_data": False},
}


@pytest.mark.parametrize("name", ALL_GATES)
def test_defaults_are_unchanged_in_value_type_and_order(name):
    params = gate_params(name)
    assert params == DEFAULTS[name]
    assert list(params) == list(DEFAULTS[name])  # the order reports and error messages use
    assert [type(v) for v in params.values()] == [type(v) for v in DEFAULTS[name].values()]
    # a gate's result carries the parameters it ran with, defaults filled in
    assert evaluate_gate(name, []).params == DEFAULTS[name]


def test_every_gate_has_its_own_params_model_and_every_model_a_gate():
    models = [params_model(name) for name in gate_names()]
    assert len(set(models)) == len(models) == len(ALL_GATES)
    def leaves(cls):
        subs = cls.__subclasses__()
        return {leaf for sub in subs for leaf in leaves(sub)} if subs else {cls}

    assert set(models) == leaves(GateParams)
    for name, model in zip(gate_names(), models, strict=True):
        assert model.__doc__.startswith(f"``{name}``: "), model.__name__
        assert model.model_config["frozen"] and model.model_config["extra"] == "forbid"
        assert all(f.description for f in model.model_fields.values()), model.__name__
    with pytest.raises(ValidationError):  # frozen: a gate cannot change its own parameters
        params_model("is_health")().tail = 0.5


@pytest.mark.parametrize(("name", "params", "problem"), [
    ("logprob_diff_flat", {"tail": math.nan},
     "parameter 'tail' must be a finite number, got nan (float); set tail to a valid value or "
     "leave it out (default 0.25)"),
    ("staleness_within_bound", {"max_staleness": math.inf},
     "parameter 'max_staleness' must be a finite number, got inf (float); set max_staleness to "
     "a valid value or leave it out (default None)"),
    ("is_health", {"min_ess": True},
     "parameter 'min_ess' must be a finite number, got True (bool); set min_ess to a valid "
     "value or leave it out (default 0.5)"),
    ("pg_clipfrac", {"max_level": "0.2"},
     "parameter 'max_level' must be a finite number, got '0.2' (str); set max_level to a valid "
     "value or leave it out (default 0.2)"),
    ("no_length_surge", {"window": "100"},
     "parameter 'window' must be a finite number, got '100' (str); set window to a valid value "
     "or leave it out (default 100)"),
    ("zero_variance_groups", {"max_frac": 1.01},
     "parameter 'max_frac' must be ≥ 0 and ≤ 1, got 1.01; set max_frac to a valid value or "
     "leave it out (default 0.45)"),
    ("grad_norm_no_spike", {"factor": 1},
     "parameter 'factor' must be > 1, got 1; set factor to a valid value or leave it out "
     "(default 10.0)"),
    ("repetition_rate", {"max_level": -0.1},
     "parameter 'max_level' must be ≥ 0 and ≤ 1, got -0.1; set max_level to a valid value or "
     "leave it out (default None)"),
    ("grad_norm_no_spike", {"after": 3.5},
     "parameter 'after' must be a whole number, got 3.5; set after to a valid value or leave "
     "it out (default 5)"),
    ("is_weight_mean_band", {"require_data": 1},
     "parameter 'require_data' must be true or false, got 1 (int); set require_data to a "
     "valid value or leave it out (default False)"),
    ("reward_not_collapsed", {"smooth": None},
     "parameter 'smooth' must not be null; set smooth to a valid value or leave it out "
     "(default 5)"),
])
def test_bad_values_are_refused_in_one_line_naming_gate_and_parameter(name, params, problem):
    expected = f"gate {name!r}: {problem}"
    with pytest.raises(ValueError) as err:
        check_params(name, params)
    assert str(err.value) == expected
    with pytest.raises(ValueError) as err:
        evaluate_gate(name, [], params)
    assert str(err.value) == expected


def test_numbers_are_taken_from_any_finite_real_and_nulls_only_where_allowed():
    # an int for a float, a whole float for an int, numpy scalars (metrics arrive as them)
    out = check_params("grad_norm_no_spike", {"factor": 12, "window": np.int64(7),
                                              "after": 2.0, "require_data": True})
    assert out == {"factor": 12.0, "window": 7, "after": 2, "require_data": True}
    assert [type(v) for v in out.values()] == [float, int, int, bool]
    assert check_params("is_health", {"tail": np.float32(0.5)})["tail"] == 0.5
    assert check_params("repetition_rate", {"max_level": None})["max_level"] is None
    assert check_params("zero_variance_groups", {"max_frac": 0, "tail": 1})["tail"] == 1.0


def test_several_bad_params_report_the_first_given_and_name_the_others():
    with pytest.raises(ValueError) as err:
        check_params("entropy_no_blowup", {"tail": 0.9, "window": 0, "bogus": 1})
    msg = str(err.value)
    assert msg.startswith("gate 'entropy_no_blowup': parameter 'tail' must be > 0 and ≤ 0.5, "
                          "got 0.9; ")
    assert msg.endswith(" (+2 more: 'window', 'bogus')")
    assert "\n" not in msg


def test_evaluate_gates_validates_everything_first_and_keeps_order():
    run = hist({LP: [0.02] * 8, ENT: [0.5] * 8})
    results = evaluate_gates([("entropy_no_blowup", {}), ("logprob_diff_flat", {"tail": 0.5})],
                             run)
    assert [r.name for r in results] == ["entropy_no_blowup", "logprob_diff_flat"]
    assert results[1].params["tail"] == 0.5
    with pytest.raises(ValueError):
        evaluate_gates([("entropy_no_blowup", {}), ("is_health", {"bogus": 1})], run)


def test_result_to_dict_is_json():
    r = evaluate_gate("logprob_diff_flat", hist({LP: [0.08] * 8}), {"max_level": 0.05})
    d = r.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["window"] == [5, 7] and d["passed"] is False
    assert GateResult("x", True, math.inf, None, None, "e", {}).to_dict()["value"] is None


# ------------------------------------------------------------------------ summarize


def test_summarize_arithmetic():
    rows = [{"step": 0, EV: 0.2, "step/eval_only": 1.0}]
    rows += hist({LP: [0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.02, 0.04], RW: list(range(8))})
    rows[5][EV] = 0.4
    rows[8][EV] = 0.6
    rows[8]["time"] = 12345.0
    rows[7][RW] = None
    s = summarize(rows)
    # 8 training rows → the last ceil(0.25·8) = 2 points: reward 7 (step 6 is None → steps 5, 7)
    assert s[RW] == pytest.approx((5 + 7) / 2)
    assert s[LP] == pytest.approx((0.02 + 0.04) / 2)
    # eval has 3 points (0.2, 0.4, 0.6) → the last ceil(0.75) = 1: 0.6
    assert s[EV] == pytest.approx(0.6)
    # least-squares slope of LP over steps 0–7: x̄ = 3.5, ȳ = 0.015,
    # Σ(x−x̄)(y−ȳ) = 2.5·0.005 + 3.5·0.025 − 0.005·(−3.5 − 2.5 − 1.5 − 0.5 + 0.5 + 1.5) = 0.13,
    # Σ(x−x̄)² = 42 → 0.13 / 42
    assert s[f"{LP}/slope"] == pytest.approx(0.13 / 42)
    assert s[f"{LP}/rise"] == pytest.approx(0.13 / 42 * 7)  # × its own span, steps 0–7
    assert "time" not in s and "step" not in s and "step/eval_only" not in s
    assert summarize(rows, tail=0.5)[LP] == pytest.approx((0.01 + 0.01 + 0.02 + 0.04) / 4)
    assert summarize([]) == {}
    with pytest.raises(ValueError, match="tail"):
        summarize(rows, tail=0)


# ------------------------------------------------------------------------ diagnosis_for


ED = "mismatch/engine/logprob_abs_diff/mean"
EXACT = "mismatch/engine/exact"


def test_diagnosis_for_a_rise_shared_by_the_exact_engine_gap_names_cause_a():
    # sync: π_old is the current version, so engine == train–rollout and exact = 1
    rise = [0.02 + 0.005 * i for i in range(20)]
    rows = hist({LP: rise, ED: rise, EXACT: [1.0] * 20, RW: [0.5] * 20})
    d = diagnosis_for(rows)
    assert json.loads(json.dumps(d.to_dict())) == d.to_dict()
    assert d.causes == ["A"] and d.unseparated is None
    finding = d.findings[0]
    # quarters of 20 points are 5: (0.02 + 0.005·17) / (0.02 + 0.005·2) = 0.105 / 0.03 = 3.5
    assert f"{LP} last/first quarter = 3.5 > 1.5" in finding.evidence
    assert any("train–rollout mean |Δlogp| is growing" in e for e in finding.evidence)
    assert "FP16" in finding.fix and finding.override == {"algorithm.old_logprob":
                                                                "snapshot"}
    assert not d.healthy
    assert "logprob_diff_flat" in [g.name for g in d.failed_gates]
    assert d.window == (0, 19)


def test_diagnosis_for_a_staleness_driven_rise_names_b_not_a():
    # snapshot, one-step: the exact engine gap stays at 0.006 while π_current drifts from μ
    rows = hist({LP: [0.006 + 0.002 * i for i in range(20)], ED: [0.006] * 20,
                 EXACT: [1.0] * 20, "is/staleness/kl_k1": [0.03] * 20, RW: [0.5] * 20})
    d = diagnosis_for(rows)
    assert d.causes == ["B"]
    ev = d.findings[0].evidence
    # a flat staleness KL is one update's size, not growth: not evidence of B by itself
    assert not any(e.startswith("is/staleness/kl_k1 =") for e in ev)
    assert f"{ED} last/first quarter = 1 ≤ 1.5" in ev
    assert any("is growing" in e for e in ev)  # the failing gate joins B, not A
    assert d.findings[0].override == {"algorithm.correction": {
        "kind": "preset", "name": "decoupled_geo_rs_seq_tis",
        "args": {"is_threshold": 2.0, "rs_threshold": "0.99_1.01"}}}


def test_diagnosis_for_an_inexact_engine_gap_is_unseparated_not_a():
    # recompute: π_old = π_current, so the engine family carries staleness too (exact 0)
    rise = [0.02 + 0.005 * i for i in range(20)]
    rows = hist({LP: rise, ED: rise, EXACT: [0.0] * 20, "mismatch/engine/kl_k1": [0.08] * 20})
    d = diagnosis_for(rows)
    assert d.causes == [] and not d.healthy
    u = d.unseparated
    assert u.override == {"algorithm.old_logprob": "snapshot"} and u.engine_exact == 0.0
    assert "mismatch/engine/kl_k1 = 0.08 > 0.05" in u.evidence
    assert any("is growing" in e for e in u.evidence)
    assert "rerun with algorithm.old_logprob: snapshot" in d.summary
    # with no decomposition logged at all (an older run), the failure is not forced into A
    d = diagnosis_for(hist({LP: rise}))
    assert d.causes == [] and d.unseparated is not None


def test_diagnosis_for_rising_proxy3_names_d():
    noise = [1.0, 1.0, 1.1, 1.2, 2.0, 3.0, 3.5, 4.0]
    # no IS weight applied: seed 001's "rises after enabling IS" does not apply
    assert diagnosis_for(hist({"policy/proxy3_pure_noise": noise})).causes == []
    rows = hist({"policy/proxy3_pure_noise": noise, "is/combined/weight_mean": [1.0] * 8})
    d = diagnosis_for(rows)
    # quarters of 8 points: (3.5 + 4.0) / 2 = 3.75 vs (1.0 + 1.0) / 2 = 1.0 → 3.75 > 1.5
    assert d.causes == ["D"]
    assert d.findings[0].evidence == [
        "policy/proxy3_pure_noise last/first quarter = 3.75 > 1.5"]
    assert d.findings[0].override["algorithm.correction"]["name"] == \
        "decoupled_token_icepop"
    assert diagnosis_for(hist({"policy/proxy3_pure_noise": [1.0] * 8,
                               "is/combined/weight_mean": [1.0] * 8})).causes == []


def test_diagnosis_for_skips_gates_whose_default_needs_a_reference():
    # the embedded task's zero-variance fraction (0.6) is above seed 000's absolute 0.45 from
    # the start: evaluated at defaults it would fail every run, so diagnosis leaves it out
    zv = "rollout/zero_variance_group_frac"
    rows = hist({zv: [0.6] * 8, RW: [0.5] * 8})
    assert not evaluate_gate("zero_variance_groups", rows).passed
    d = diagnosis_for(rows)
    assert d.failed_gates == [] and d.causes == []
    assert [g.name for g in d.skipped_gates] == ["zero_variance_groups"]
    assert "0.53–0.70" in d.skipped_gates[0].why
    assert d.summary == ("no decision-tree cause matched and every default gate passes. Not "
                            "judged without a reference: zero_variance_groups (give it "
                            "relative_to a baseline in a campaign).")
    # repetition_rate compares with the run's own start, so it is still judged
    d = diagnosis_for(hist({REP: [0.1, 0.1, 0.5, 0.5]}))
    assert [g.name for g in d.failed_gates] == ["repetition_rate"]


def test_diagnosis_for_runs_the_decision_tree_on_last_window_means():
    # ESS tail mean 0.2 < 0.5 → D; < 0.3 → the systems-fix rung; kl 0.08 > 0.05 → A
    rows = hist({"is/combined/ess": [0.9] * 6 + [0.2, 0.2], "mismatch/engine/kl_k1": [0.08] * 8,
                 EXACT: [1.0] * 8, "mismatch/train_rollout/chi2_token": [0.5] * 8})
    d = diagnosis_for(rows)
    assert d.causes == ["A", "D"]
    assert d.escalation == "systems_fix" and "fix the system" in d.escalation_text
    assert any("is/combined/ess = 0.2 < 0.5" in e for f in d.findings for e in f.evidence)
    assert diagnosis_for([]).causes == []


# ------------------------------------------------------------------------ real runs


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path) as sink:
        for i in range(10):
            sink.log(i, {LP: 0.006 + 0.001 * i if i != 4 else float("nan")})
    r = evaluate_gate("logprob_diff_flat", read_metrics(path))
    # 9 finite points on a line from 0.006 (step 4's NaN skipped): a rise of 0.009 = 150 % of
    # the start with t = ∞, over the 50 % that the noise-free line allows
    assert not r.passed and r.window == (0, 9) and r.value == pytest.approx(0.009)


def test_gate_context_comes_from_the_recipe():
    from registry.gates import GateContext
    from training.recipe import recipe_from_dict

    def of(**a):
        return GateContext.of(recipe_from_dict({"name": "x", "async": a}))

    assert of(mode="sync") == GateContext(mode="sync", max_staleness=0)
    assert of(mode="one_step").max_staleness == 1
    fa = of(mode="fully_async", max_off_policy_steps=3)
    assert (fa.max_staleness, fa.max_off_policy_steps) == (3, 3)
    assert of(mode="fully_async").model_dump() == {"mode": "fully_async", "max_staleness": None,
                                                   "max_off_policy_steps": None, "candidates": 1}
    # a recorded report's plain data reads back to the same context
    assert GateContext.read(fa.model_dump()) == fa and GateContext.read(None) == GateContext()
    with pytest.raises(ValueError) as e:
        GateContext.read({"max_staleness": -1})
    assert str(e.value).startswith("gate context max_staleness: ") and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="gate context bogus"):
        GateContext.read({"bogus": 1})
    with pytest.raises(ValueError, match="must be a whole number"):
        GateContext.read({"max_off_policy_steps": 1.5})
