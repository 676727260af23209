import pytest

from training.algorithms.decision_tree import Thresholds, diagnose, prescription

# the learner's names (issue 14): exact engine metrics (snapshot or sync), the train–rollout
# χ², the IS weight actually applied
HEALTHY = {
    "mismatch/engine/probs_pearson": 0.995, "mismatch/engine/ppl_ratio": 1.01,
    "mismatch/engine/kl_k1": 0.005, "mismatch/engine/exact": 1.0,
    "mismatch/train_rollout/chi2_token": 0.05, "is/combined/ess": 0.95,
    "is/combined/weight_mean": 1.0, "policy/pg_clipfrac": 0.02,
}
CHI2 = "mismatch/train_rollout/chi2_token"


def test_healthy_run():
    d = diagnose(HEALTHY)
    assert d.healthy and d.causes == () and d.escalation == "rs_only"


def test_cause_a_low_pearson_with_evidence():
    d = diagnose({**HEALTHY, "mismatch/engine/probs_pearson": 0.9})
    assert d.causes == ("A",) and not d.healthy
    ev = d.findings[0].evidence[0]
    assert (ev.metric, ev.value, ev.op, ev.threshold) == ("mismatch/engine/probs_pearson", 0.9,
                                                          "<", 0.95)
    assert "precision" in d.findings[0].fix.lower()
    assert d.escalation == "systems_fix"


def test_cause_a_same_checkpoint_kl_and_verl_names():
    d = diagnose({"training/rollout_actor_probs_pearson_corr": 0.999, "rollout_corr/kl": 0.08,
                  "rollout_corr/ppl_ratio": 1.0})
    assert d.causes == ("A",)
    assert d.findings[0].evidence[0].metric == "rollout_corr/kl"


def test_cause_b_staleness():
    d = diagnose({**HEALTHY, "is/staleness/kl_k1": 0.04})
    assert d.causes == ("B",)


def test_cause_c_vs_d_split_on_ess():
    assert diagnose({**HEALTHY, CHI2: 0.5}).causes == ("C",)
    d = diagnose({**HEALTHY, CHI2: 0.5, "is/combined/ess": 0.4})
    assert d.causes == ("D",)
    assert diagnose({**HEALTHY, CHI2: 1.5}).causes == ("D",)


def test_cause_d_rising_noise_from_history():
    d = diagnose(HEALTHY, history={"policy/proxy3_pure_noise": [0.1, 0.2, 0.4]})
    assert d.causes == ("D",)
    assert str(d.findings[0].evidence[0]) == \
        "policy/proxy3_pure_noise last/first quarter = 4 > 1.5"


def test_rising_noise_without_an_applied_is_weight_is_not_d():
    # seed 001: "proxy3_pure_noise rises after enabling IS" — with no IS weight applied
    # (is/combined/* absent: correction none) the rise says nothing about IS variance
    no_is = {k: v for k, v in HEALTHY.items() if not k.startswith("is/combined/")}
    d = diagnose(no_is, history={"policy/proxy3_pure_noise": [0.1, 0.2, 0.4]})
    assert d.causes == () and d.healthy


def test_cause_e_needs_rising_clipfrac_when_history_given():
    assert diagnose({**HEALTHY, "policy/pg_clipfrac": 0.3}).causes == ("E",)
    falling = {"policy/pg_clipfrac": [0.4, 0.35, 0.3]}
    assert diagnose({**HEALTHY, "policy/pg_clipfrac": 0.3}, history=falling).causes == ()


def test_cause_f_length_surge_within_window():
    lengths = [100.0] * 50 + [130.0]
    d = diagnose(HEALTHY, history={"rollout/response_length/mean": lengths})
    assert d.causes == ("F",)
    assert d.findings[0].evidence[0].value == 1.3
    assert diagnose(HEALTHY, history={"rollout/response_length/mean": [100.0, 115.0]}).causes == ()


def test_thresholds_are_overridable_and_missing_reported():
    d = diagnose({"mismatch/engine/probs_pearson": 0.97, "mismatch/engine/exact": 1.0},
                 thresholds=Thresholds(pearson_broken=0.98))
    assert d.causes == ("A",)
    assert "kl" in d.missing and "pg_clipfrac" in d.missing


def test_escalation_ladder():
    assert diagnose({**HEALTHY, CHI2: 3.0}).escalation == "rs_plus_token_tis"
    assert diagnose({**HEALTHY, CHI2: 5.0}).escalation == "systems_fix"
    assert diagnose({**HEALTHY, "is/combined/mask_frac": 0.3}).escalation == "systems_fix"


def test_cause_a_probs_diff_max_and_ppl_ratio_branches():
    d = diagnose({**HEALTHY, "mismatch/engine/probs_abs_diff/max": 0.7})
    assert d.causes == ("A",)
    assert d.findings[0].evidence[0].metric == "mismatch/engine/probs_abs_diff/max"
    d = diagnose({**HEALTHY, "mismatch/engine/ppl_ratio": 0.9})
    ev = d.findings[0].evidence[0]
    assert d.causes == ("A",) and (ev.op, ev.threshold) == ("<", 0.95)


def test_cause_f_from_verl_length_name():
    d = diagnose(HEALTHY, history={"response_length/mean": [200.0, 210.0, 260.0]})
    assert d.causes == ("F",)


def test_c_survives_an_unrelated_d_trigger():
    d = diagnose({**HEALTHY, CHI2: 0.5},
                 history={"policy/proxy3_pure_noise": [0.1, 0.3]})
    assert d.causes == ("C", "D")


def test_the_old_bare_mismatch_names_are_not_read():
    # renamed to mismatch/engine/* (issue 14's contract), not aliased
    d = diagnose({"mismatch/probs_pearson": 0.5, "mismatch/kl_k1": 0.9,
                  "mismatch/chi2_token": 9.0})
    assert d.causes == () and {"pearson", "kl", "chi2_token"} <= set(d.missing)


def test_empty_batch_from_real_modules_is_not_drift():
    import torch

    from training.algorithms.diagnostics import compute_off_policy_diagnostics

    lp = torch.full((2, 3), -1.0)
    metrics = compute_off_policy_diagnostics(lp, lp, lp, torch.zeros(2, 3, dtype=torch.bool))
    d = diagnose(metrics)
    assert d.causes == () and d.escalation == "rs_only"


# ------------------------------------------------------------------ the decomposed metrics


EXACT = {"mismatch/engine/exact": 1.0}


def test_engine_metrics_name_a_only_when_exact():
    bad_engine = {"mismatch/engine/probs_pearson": 0.9, "mismatch/engine/kl_k1": 0.08}
    d = diagnose({**bad_engine, **EXACT})
    assert d.causes == ("A",) and d.unseparated == () and d.engine_exact == 1.0
    assert d.escalation == "systems_fix"  # same-weights Pearson < 0.95
    # without the flag (or with exact 0: recompute/ewma) the crossing is unseparated, and the
    # Pearson of mixed sources does not call for a systems fix
    for flags in ({}, {"mismatch/engine/exact": 0.0}, {"mismatch/engine/exact": 0.5}):
        d = diagnose({**bad_engine, **flags})
        assert d.causes == () and not d.healthy and d.escalation is None
        assert [e.metric for e in d.unseparated] == ["mismatch/engine/probs_pearson",
                                                     "mismatch/engine/kl_k1"]


def test_staleness_b_from_the_p99_ratio_tail():
    # seed 000's onset: p99 |δ| ≈ 0.12 → ratio e^0.12 ≈ 1.127
    d = diagnose({**EXACT, "is/staleness/ratio/p99": 1.2})
    assert d.causes == ("B",)
    assert str(d.findings[0].evidence[0]) == "is/staleness/ratio/p99 = 1.2 > 1.127"
    assert diagnose({**EXACT, "is/staleness/ratio/p99": 1.05}).causes == ()


def test_train_rollout_rise_is_b_with_a_flat_exact_engine_and_a_with_a_rising_one():
    tr = [0.01, 0.012, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04]  # quarters 0.011 → 0.0375
    flat = [0.006] * 8
    d = diagnose(EXACT, history={"mismatch/train_rollout/logprob_abs_diff/mean": tr,
                                 "mismatch/engine/logprob_abs_diff/mean": flat})
    assert d.causes == ("B",)
    assert d.findings[0].evidence[0].value == pytest.approx(0.0375 / 0.011)
    d = diagnose(EXACT, history={"mismatch/train_rollout/logprob_abs_diff/mean": tr,
                                 "mismatch/engine/logprob_abs_diff/mean": tr})
    assert d.causes == ("A",)
    d = diagnose({}, history={"mismatch/train_rollout/logprob_abs_diff/mean": tr,
                              "mismatch/engine/logprob_abs_diff/mean": flat})
    assert d.causes == () and len(d.unseparated) == 1


def test_prescriptions_are_recipe_overrides():
    assert prescription("A", moe=True) == {"algorithm.old_logprob": "snapshot",
                                           "algorithm.routing_replay": "r3"}
    assert prescription("A", moe=False, rollout="embedded") == {
        "algorithm.old_logprob": "snapshot", "engines.rollout_dtype": "fp32"}
    assert prescription("E", lr=3e-5) == {"optim.epochs": 1, "optim.lr": 1.5e-5}
    assert prescription("F")["optim.length_surge_guard"] == {}  # seed 001's defaults
    assert prescription("F")["algorithm.correction"] == {"kind": "preset",
                                                         "name": "bypass_pg_geo_rs", "args": {}}
    with pytest.raises(ValueError, match="unknown cause"):
        prescription("G")


@pytest.mark.parametrize("cause", ["A", "B", "C", "D", "E", "F", "unseparated"])
@pytest.mark.parametrize("moe", [True, False])
def test_every_prescription_loads_as_a_valid_recipe(cause, moe):
    from training.recipe import load_recipe

    base = "recipes/one_step-moe.yaml" if moe else "recipes/one_step.yaml"
    recipe = load_recipe(base)
    override = prescription(cause, moe=moe, lr=recipe.optim.lr, rollout=recipe.engines.rollout)
    out = load_recipe(base, overrides=override)
    for key, value in override.items():
        node = out.to_dict()
        for part in key.split("."):
            node = node[part]
        if isinstance(value, dict):
            assert {k: node[k] for k in value} == value
        else:
            assert node == value


def test_b_needs_a_growing_staleness_kl_when_its_history_is_known():
    """Seed 001: B's KL "grow[s] with queue age"; a flat KL over the bound is one update's size."""
    flat = {"is/staleness/kl_k1": [0.04] * 8}
    assert diagnose({**EXACT, "is/staleness/kl_k1": 0.04}, history=flat).causes == ()
    rising = {"is/staleness/kl_k1": [0.01, 0.01, 0.02, 0.02, 0.03, 0.03, 0.04, 0.04]}
    d = diagnose({**EXACT, "is/staleness/kl_k1": 0.04}, history=rising)
    assert d.causes == ("B",)
    # first quarter 0.01, last 0.04: ×4 > 1.5
    assert "is/staleness/kl_k1 last/first quarter = 4 > 1.5" in map(str, d.findings[0].evidence)


def test_b_with_ess_and_a_stable_reward_is_information_only():
    """Seed 001: "If ess ≥ 0.5 and reward is stable, continue.\""""
    rising = {"is/staleness/kl_k1": [0.01, 0.01, 0.02, 0.02, 0.03, 0.03, 0.04, 0.04]}
    metrics = {**EXACT, "is/staleness/kl_k1": 0.04, "is/combined/ess": 0.9}
    stable = diagnose(metrics, history={**rising, "rollout/reward_mean": [0.5] * 8})
    assert [(f.cause, f.info) for f in stable.findings] == [("B", True)]
    assert stable.causes == ()  # nothing to act on
    assert "is/combined/ess = 0.9 ≥ 0.5" in map(str, stable.findings[0].evidence)
    # reward falling 0.5 → 0.4 (20 % > 10 %) keeps B a cause; so does an ESS under 0.5
    falling = [0.5, 0.5, 0.5, 0.45, 0.45, 0.4, 0.4, 0.4]
    assert diagnose(metrics, history={**rising, "rollout/reward_mean": falling}).causes == ("B",)
    low = diagnose({**metrics, "is/combined/ess": 0.4},
                   history={**rising, "rollout/reward_mean": [0.5] * 8})
    assert "B" in low.causes


def test_calibrated_takes_each_threshold_from_the_reference_by_its_rule():
    from training.algorithms.decision_tree import calibrated

    ref = {"mismatch/train_rollout/logprob_abs_diff/mean/quarter_ratio": 1.4,
           "mismatch/engine/logprob_abs_diff/mean/quarter_ratio": 1.2,
           "policy/update_kl": 0.03,
           "mismatch/engine/kl_k1": 0.002, "mismatch/engine/kl_k1/sd": 0.001,
           "mismatch/engine/probs_pearson": 0.996, "mismatch/engine/probs_pearson/sd": 0.002}
    t, notes = calibrated(ref, lag=2)
    assert t.diff_rise_ratio == pytest.approx(1.9)        # the seed's 1.5 + the reference's 0.4
    assert t.engine_rise_ratio == pytest.approx(1.7)      # 1.5 + the engine series' own 0.2
    assert t.staleness_rise_ratio == pytest.approx(1.5)   # a sync reference has no staleness rise
    assert t.staleness_kl_max == pytest.approx(0.06)      # lag 2 × one update's KL 0.03
    assert t.kl_engine == pytest.approx(0.005)            # max(1.5 × 0.002, 0.002 + 3 × 0.001)
    assert t.pearson_broken == pytest.approx(0.99)        # 1 − max(1.5 × 0.004, 0.004 + 0.006)
    assert t.pearson_healthy == pytest.approx(0.99)       # min(0.99, pearson_broken)
    assert t.kl_healthy == pytest.approx(0.02)            # max(0.02, kl_engine)
    # no spread for the PPL ratio or max |Δp| in the reference: the seed's values stay
    assert (t.ppl_ratio_tolerance, t.probs_diff_max_large) == (0.05, 0.5)
    assert len(notes) == 5 and any("lag 2 × the reference's update KL 0.03" in n for n in notes)
    # tighter than the seed: an engine KL of 0.01 is A on this pair, not under the seed's 0.05
    m = {"mismatch/engine/exact": 1.0, "mismatch/engine/kl_k1": 0.01}
    assert diagnose(m).causes == () and diagnose(m, t).causes == ("A",)
    # below one update's KL a staleness KL of 0.05 at lag 2 is the lag, not B
    s = {"is/staleness/kl_k1": 0.05}
    assert diagnose(s).causes == ("B",) and diagnose(s, t).causes == ()
    # nothing in the reference: the seed's thresholds, no notes
    assert calibrated({}) == (Thresholds(), ())


def test_calibrated_floors_a_bit_exact_reference_and_reads_unbounded_lag_as_one():
    from training.algorithms.decision_tree import calibrated

    exact = {"mismatch/engine/kl_k1": 0.0, "mismatch/engine/kl_k1/sd": 0.0,
             "mismatch/engine/probs_pearson": 1.0, "mismatch/engine/probs_pearson/sd": 0.0}
    t, _ = calibrated(exact)
    # a tenth of the seed's own deviations (0.05 and 1 − 0.95), not 0
    assert t.kl_engine == pytest.approx(0.005) and t.pearson_broken == pytest.approx(0.995)
    rounding = {"mismatch/engine/exact": 1.0, "mismatch/engine/kl_k1": 1e-7,
                "mismatch/engine/probs_pearson": 0.99999}
    assert diagnose(rounding, t).causes == ()
    # lag None (unbounded staleness) is at least one update of lag
    t, _ = calibrated({"policy/update_kl": 0.05}, None)
    assert t.staleness_kl_max == pytest.approx(0.05)
    # a value that is not a finite number is unknown, not an error
    assert calibrated({"policy/update_kl": "x", "mismatch/engine/kl_k1": float("nan"),
                       "mismatch/engine/kl_k1/sd": None}) == (Thresholds(), ())
    # a reference whose gap fell sets no "rising" (the seed's 1.5× stays)
    t, notes = calibrated({"mismatch/engine/logprob_abs_diff/mean/quarter_ratio": 0.8})
    assert t.engine_rise_ratio is None and t.diff_rise_ratio == 1.5 and notes == ()
