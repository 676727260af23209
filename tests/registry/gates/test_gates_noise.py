"""The gates' noise model (issue 26) on hand-built histories whose arithmetic is written out:
every limit is max(effect size, noise floor), lagged runs are judged on growth, the engine
component on its own, eval against its binomial standard error."""

import math

import pytest

from registry.gates import evaluate_gate, summarize
from registry.gates.stats import level, proportion_se, step_sd, trend, z_limit

LP = "mismatch/train_rollout/logprob_abs_diff/mean"
EN = "mismatch/engine/logprob_abs_diff/mean"
EXACT = "mismatch/engine/exact"
LAG = "async/staleness/mean"
UPD = "policy/update/logprob_abs_diff/mean"
RW = "rollout/reward_mean"
EV = "eval/reward_mean"
EVN = "eval/n"


def hist(series: dict[str, list], start: int = 0) -> list[dict]:
    n = max(len(v) for v in series.values())
    return [{"step": start + i, **{k: v[i] for k, v in series.items() if i < len(v)}}
            for i in range(n)]


# ------------------------------------------------------------------------------- stats


def test_stats_by_hand():
    assert z_limit(0.05) == pytest.approx(1.644854, abs=1e-6)
    assert z_limit(0.05, 6) == pytest.approx(2.393980, abs=1e-6)  # Bonferroni: z_{1−0.05/6}
    # successive differences 1, −1, 1: √(3 / (2·3)) = √0.5
    assert step_sd([1.0, 2.0, 1.0, 2.0]) == pytest.approx(math.sqrt(0.5))
    # (0,0) (1,1) (2,0) (3,1): slope Σ(x−1.5)(y−0.5)/Σ(x−1.5)² = 1/5 = 0.2; residuals
    # −0.2, 0.6, −0.6, 0.2 → SSR 0.8, SE √(0.8/2/5) = √0.08, t = 0.2/√0.08
    tr = trend([(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)])
    assert tr.slope == pytest.approx(0.2) and tr.se == pytest.approx(math.sqrt(0.08))
    assert tr.t == pytest.approx(0.2 / math.sqrt(0.08))
    assert (tr.start, tr.end, tr.rise, tr.span) == (pytest.approx(0.2), pytest.approx(0.8),
                                                    pytest.approx(0.6), 3)
    assert trend([(0, 1.0), (1, 2.0), (2, 3.0)]).t == math.inf  # a perfect line
    assert trend([(0, 1.0), (1, 2.0)]) is None
    # p̃ = (15 + ½) / 31 = ½: √(¼ / 30)
    assert proportion_se(0.5, 30) == pytest.approx(math.sqrt(0.25 / 30))
    assert proportion_se(1.0, 30) > 0  # n/n still carries noise
    lv = level([(0, 1.0), (1, 2.0), (2, 1.0), (3, 2.0)])
    assert (lv.mean, lv.n) == (1.5, 4) and lv.se == pytest.approx(math.sqrt(0.5) / 2)


# ------------------------------------------------------------------------------- mismatch


def _one_step(values: list[float]) -> list[dict]:
    """A one-step run: step 0 trains fresh samples (lag 0), every later step lag 1."""
    return hist({LP: values, LAG: [0.0] + [1.0] * (len(values) - 1)})


NOISE = [0.0005, -0.0005] * 20


def test_a_lagged_run_flat_at_five_times_the_sync_level_passes():
    # the embedded testbed's one-step regime: lag 0 at 0.009, then flat at 0.040 ± 0.0005
    run = _one_step([0.009] + [0.040 + NOISE[i] for i in range(12)])
    ref = summarize(hist({LP: [0.008 + NOISE[i] for i in range(12)]}))
    r = evaluate_gate("logprob_diff_flat", run, reference=ref, context={"max_staleness": 1})
    assert r.passed, r.evidence
    assert "1 lag-0 step(s) left out" in r.evidence and "level not judged in a lagged mode" \
        in r.evidence
    # the same history judged as a sync run: the level is 5× the reference's, far beyond noise
    sync_like = hist({LP: [0.009] + [0.040 + NOISE[i] for i in range(12)]})
    r = evaluate_gate("logprob_diff_flat", sync_like, reference=ref,
                      context={"max_staleness": 0})
    assert not r.passed and "is too high" in r.evidence
    # its limit: max(1.5 × 0.008, 0.008 + 3 SE) — the ratio binds on this quiet series
    assert r.threshold == pytest.approx(1.5 * ref[LP])


def test_a_lagged_run_whose_gap_grows_fails_on_its_growth():
    # 0.03 + 0.002·i over 12 lagged steps: fitted rise 0.022 = 73 % of the start 0.03, over
    # the allowed 50 % (reference flat); noise ±0.0005 keeps t far above 3
    run = _one_step([0.009] + [0.03 + 0.002 * i + NOISE[i] for i in range(12)])
    ref = summarize(hist({LP: [0.008 + NOISE[i] for i in range(12)]}))
    r = evaluate_gate("logprob_diff_flat", run, reference=ref, context={"max_staleness": 1})
    assert not r.passed and "is growing" in r.evidence
    assert r.value == pytest.approx(0.022, rel=0.05)
    assert r.window == (1, 12)  # the lag-0 step is not in the fit
    # a reference that itself rose 80 % over its run allows it: (0.8 + 0.5) × start
    rising_ref = summarize(hist({LP: [0.008 * (1 + 0.8 * i / 11) for i in range(12)]}))
    assert rising_ref[f"{LP}/rel_rise"] == pytest.approx(0.8)
    assert evaluate_gate("logprob_diff_flat", run, reference=rising_ref,
                         context={"max_staleness": 1}).passed


def test_a_rise_inside_its_own_noise_passes_and_says_noise_binds():
    # a sync baseline "rising" 0.0076 → 0.0126 by a line, with ±0.004 alternating noise:
    # the fitted rise (≈ 0.005) is under 3 SE of itself
    noisy = [0.0076 + 0.005 * i / 11 + (0.004 if i % 2 else -0.004) for i in range(12)]
    r = evaluate_gate("logprob_diff_flat", hist({LP: noisy}))
    assert r.passed and "noise binds" in r.evidence
    # without the noise the same 66 % rise is clear (t = ∞): the baseline can fail
    clean = [0.0076 + 0.005 * i / 11 for i in range(12)]
    r = evaluate_gate("logprob_diff_flat", hist({LP: clean}))
    assert not r.passed and r.value == pytest.approx(0.005)
    assert r.threshold == pytest.approx(0.5 * 0.0076)


def test_engine_mismatch_flat_decides_only_on_an_exact_component():
    ref = summarize(hist({EN: [0.008 + NOISE[i] for i in range(12)], EXACT: [1.0] * 12}))
    high = {EN: [0.02 + NOISE[i] for i in range(12)]}
    r = evaluate_gate("engine_mismatch_flat", hist({**high, EXACT: [0.0] * 12}), reference=ref)
    assert r.passed and r.value is None and "does not decide" in r.evidence
    r = evaluate_gate("engine_mismatch_flat", hist({**high, EXACT: [1.0] * 12}), reference=ref)
    assert not r.passed and "is too high" in r.evidence
    r = evaluate_gate("engine_mismatch_flat", hist({LP: [0.01] * 12}))
    assert r.passed and "absent" in r.evidence


def test_the_expected_lagged_level_comes_from_the_engine_gap_and_the_update_size():
    n = 9
    run = hist({LP: [0.009] + [0.04] * (n - 1), LAG: [0.0] + [1.0] * (n - 1),
                EN: [0.01] * n, EXACT: [1.0] * n, UPD: [0.03] * n})
    r = evaluate_gate("logprob_diff_flat", run)
    # last quarter: engine 0.01 + lag 1 × update 0.03 = 0.04
    assert r.passed and "≈ 0.04" in r.evidence, r.evidence


def test_summarize_carries_the_noise_of_the_levels():
    s = summarize(hist({LP: [0.01, 0.02] * 4}))
    # 8 points → level window of 3 (at least three): 0.02, 0.01, 0.02 → spread √(2·0.0001/4)
    assert s[f"{LP}/n"] == 3 and s[f"{LP}/sd"] == pytest.approx(math.sqrt(0.0002 / 4))
    assert f"{LP}/rel_rise" in s and f"{LP}/start" in s


# ------------------------------------------------------------------------------- reward


def test_a_real_collapse_fails_and_a_noisy_dip_passes():
    # [0.6]×10 then [0.3]×5, windows of 5: peak 0.6, last 0.3, fall 0.3 = 50 %; σ̂ = √(0.09 /
    # (2·14)), SE = σ̂·√(2/5) ≈ 0.0359, z_{1−0.01/3} ≈ 2.71 → noise ≈ 0.097 < 0.3 × 0.6
    r = evaluate_gate("reward_not_collapsed", hist({RW: [0.6] * 10 + [0.3] * 5}))
    assert not r.passed and r.value == pytest.approx(0.3) and r.threshold == pytest.approx(0.18)
    assert "effect size binds" in r.evidence
    # single points (smooth 1): peak 0.9, last 0.6: a 33 % fall, but σ̂ = √(1.35/10) ≈ 0.367,
    # SE = σ̂·√2 ≈ 0.52, z_{1−0.01/6} ≈ 2.94 → limit ≈ 1.53: inside the noise
    r = evaluate_gate("reward_not_collapsed", hist({RW: [0.5, 0.9, 0.2, 0.8, 0.3, 0.6]}),
                      {"smooth": 1})
    assert r.passed and "noise binds" in r.evidence
    assert r.threshold == pytest.approx(z_limit(0.01, 6) * math.sqrt(1.35 / 10) * math.sqrt(2))


# ------------------------------------------------------------------------------- eval


def _evals(first: float, last: float, n: int, steps: int = 6, rewards=None) -> list[dict]:
    rows = [{"step": 0, EV: first, EVN: float(n), "step/eval_only": 1.0}]
    rows += hist({RW: rewards or [0.5] * steps})
    rows[-1].update({EV: last, EVN: float(n)})
    return rows


def test_a_significant_eval_loss_fails_the_baseline():
    # the seed ladder's sync reference: 25/30 → 15/30. p̃ = 25.5/31 and 15.5/31:
    # SE = √(p̃₁(1−p̃₁)/30 + p̃₂(1−p̃₂)/30) ≈ 0.1149; fall 0.333 ≈ 2.9 SE > 1.645 SE
    r = evaluate_gate("eval_not_degraded", _evals(25 / 30, 15 / 30, 30))
    p1, p2 = 25.5 / 31, 15.5 / 31
    se = math.sqrt(p1 * (1 - p1) / 30 + p2 * (1 - p2) / 30)
    assert not r.passed and r.threshold == pytest.approx(z_limit(0.05) * se)
    assert "2.90 SE" in r.evidence
    # the same accuracies on 8 prompts are not distinguishable
    assert evaluate_gate("eval_not_degraded", _evals(0.833, 0.5, 8)).passed


def test_eval_limits_are_corrected_for_the_candidates_of_the_stage():
    # reward rose, eval 0.70 → 0.55 on 58 prompts: ≈ 1.7 SE — fails alone (limit 1.645 SE),
    # passes as one of six candidates (limit 2.394 SE)
    rows = _evals(0.70, 0.55, 58, rewards=[0.3, 0.3, 0.3, 0.6, 0.6, 0.6])
    alone = evaluate_gate("eval_tracks_reward", rows)
    six = evaluate_gate("eval_tracks_reward", rows, context={"candidates": 6})
    assert not alone.passed and "simplicity bias" in alone.evidence
    assert six.passed and "over 6 candidates" in six.evidence
    # without eval/n the noise is unknown and the effect size alone decides, said so
    bare = [{k: v for k, v in row.items() if k != EVN} for row in rows]
    r = evaluate_gate("eval_tracks_reward", bare, context={"candidates": 6})
    assert not r.passed and "noise is unknown" in r.evidence


def test_eval_below_the_reference_uses_both_sizes():
    rows = _evals(0.6, 0.58, 58)
    ref = {EV: 0.7, EVN: 58.0}
    r = evaluate_gate("eval_tracks_reward", rows, reference=ref)
    # 0.12 below on 58 prompts each ≈ 1.35 SE < 1.645: not distinguishable
    assert r.passed, r.evidence
    r = evaluate_gate("eval_tracks_reward", _evals(0.6, 0.45, 58), reference=ref)
    assert not r.passed and "fell below the reference" in r.evidence
