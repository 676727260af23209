from training.algorithms.decision_tree import Thresholds, diagnose

HEALTHY = {
    "mismatch/probs_pearson": 0.995, "mismatch/ppl_ratio": 1.01, "mismatch/kl_k1": 0.005,
    "mismatch/chi2_token": 0.05, "is/combined/ess": 0.95, "policy/pg_clipfrac": 0.02,
}


def test_healthy_run():
    d = diagnose(HEALTHY)
    assert d.healthy and d.causes == () and d.escalation == "rs_only"


def test_cause_a_low_pearson_with_evidence():
    d = diagnose({**HEALTHY, "mismatch/probs_pearson": 0.9})
    assert d.causes == ("A",) and not d.healthy
    ev = d.findings[0].evidence[0]
    assert (ev.metric, ev.value, ev.op, ev.threshold) == ("mismatch/probs_pearson", 0.9, "<", 0.95)
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
    assert diagnose({**HEALTHY, "mismatch/chi2_token": 0.5}).causes == ("C",)
    d = diagnose({**HEALTHY, "mismatch/chi2_token": 0.5, "is/combined/ess": 0.4})
    assert d.causes == ("D",)
    assert diagnose({**HEALTHY, "mismatch/chi2_token": 1.5}).causes == ("D",)


def test_cause_d_rising_noise_from_history():
    d = diagnose(HEALTHY, history={"policy/proxy3_pure_noise": [0.1, 0.2, 0.4]})
    assert d.causes == ("D",)


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
    d = diagnose({"mismatch/probs_pearson": 0.97}, thresholds=Thresholds(pearson_broken=0.98))
    assert d.causes == ("A",)
    assert "kl" in d.missing and "pg_clipfrac" in d.missing


def test_escalation_ladder():
    assert diagnose({**HEALTHY, "mismatch/chi2_token": 3.0}).escalation == "rs_plus_token_tis"
    assert diagnose({**HEALTHY, "mismatch/chi2_token": 5.0}).escalation == "systems_fix"
    assert diagnose({**HEALTHY, "is/combined/mask_frac": 0.3}).escalation == "systems_fix"


def test_cause_a_probs_diff_max_and_ppl_ratio_branches():
    d = diagnose({**HEALTHY, "mismatch/probs_abs_diff/max": 0.7})
    assert d.causes == ("A",)
    assert d.findings[0].evidence[0].metric == "mismatch/probs_abs_diff/max"
    d = diagnose({**HEALTHY, "mismatch/ppl_ratio": 0.9})
    ev = d.findings[0].evidence[0]
    assert d.causes == ("A",) and (ev.op, ev.threshold) == ("<", 0.95)


def test_cause_f_from_verl_length_name():
    d = diagnose(HEALTHY, history={"response_length/mean": [200.0, 210.0, 260.0]})
    assert d.causes == ("F",)


def test_c_survives_an_unrelated_d_trigger():
    d = diagnose({**HEALTHY, "mismatch/chi2_token": 0.5},
                 history={"policy/proxy3_pure_noise": [0.1, 0.3]})
    assert d.causes == ("C", "D")


def test_empty_batch_from_real_modules_is_not_drift():
    import torch

    from training.algorithms.diagnostics import compute_off_policy_diagnostics

    lp = torch.full((2, 3), -1.0)
    metrics = compute_off_policy_diagnostics(lp, lp, lp, torch.zeros(2, 3, dtype=torch.bool))
    d = diagnose(metrics)
    assert d.causes == () and d.escalation == "rs_only"
