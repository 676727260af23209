import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.algorithms.diagnostics import (
    compute_mismatch_metrics,
    compute_off_policy_diagnostics,
    probs_pearson,
    token_entropy,
    variance_proxy_metrics,
)

LN2 = math.log(2.0)
E = "mismatch/engine/"


def test_mismatch_metrics_hand_computed():
    # One sequence, two tokens: ρ = π_old/μ = [2, 1]
    rollout = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)
    train = rollout + torch.tensor([[LN2, 0.0]], dtype=torch.float64)
    m = compute_mismatch_metrics(train, rollout, torch.ones(1, 2), prefix=E)
    assert m["mismatch/engine/logprob_abs_diff/mean"] == pytest.approx(LN2 / 2)
    assert m["mismatch/engine/logprob_abs_diff/max"] == pytest.approx(LN2)
    assert m["mismatch/engine/logprob_diff"] == pytest.approx(LN2 / 2)
    assert m["mismatch/engine/kl_k1"] == pytest.approx(-LN2 / 2)
    assert m["mismatch/engine/kl_k3"] == pytest.approx(((2 - LN2 - 1) + 0) / 2)
    assert m["mismatch/engine/chi2_token"] == pytest.approx((4 + 1) / 2 - 1)
    assert m["mismatch/engine/chi2_seq"] == pytest.approx((2 * 1) ** 2 - 1)
    # PPL_train = exp(-(ln .5 + ln .5)/2) = 2 ; PPL_rollout = exp(-(ln .25 + ln .5)/2) = √8
    assert m["mismatch/engine/ppl_train"] == pytest.approx(2.0)
    assert m["mismatch/engine/ppl_rollout"] == pytest.approx(math.sqrt(8))
    assert m["mismatch/engine/ppl_ratio"] == pytest.approx(2 / math.sqrt(8))
    assert m["mismatch/engine/ppl_gap"] == pytest.approx(2 - math.sqrt(8))
    # probs: train [0.5, 0.5], rollout [0.25, 0.5] → abs diff [0.25, 0]
    assert m["mismatch/engine/probs_abs_diff/max"] == pytest.approx(0.25)
    assert m["mismatch/engine/probs_abs_diff/mean"] == pytest.approx(0.125)


def test_pearson_hand_computed():
    p = torch.tensor([[0.1, 0.2, 0.3]])
    q = torch.tensor([[0.3, 0.2, 0.1]])
    assert probs_pearson(p, q, torch.ones(1, 3)) == pytest.approx(-1.0)
    assert probs_pearson(p, 2 * p, torch.ones(1, 3)) == pytest.approx(1.0)
    assert probs_pearson(torch.ones(1, 2), torch.ones(1, 2), torch.ones(1, 2)) == 1.0


def test_entropy_and_high_entropy_split():
    logits = torch.zeros(1, 2, 4)
    ent = token_entropy(logits)
    assert ent[0, 0].item() == pytest.approx(math.log(4))
    train = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-1.1, -2.0]])
    m = compute_mismatch_metrics(train, rollout, torch.ones(1, 2),
                                 entropy=torch.tensor([[0.5, 0.01]]), prefix=E)
    assert m["mismatch/engine/logprob_abs_diff_high_entropy/mean"] == pytest.approx(0.1, rel=1e-5)
    assert m["policy/entropy/max"] == pytest.approx(0.5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-6, -0.01), min_size=1, max_size=10))
def test_identical_engines_report_no_mismatch(values):
    lp = torch.tensor([values], dtype=torch.float64)
    m = compute_mismatch_metrics(lp, lp.clone(), torch.ones_like(lp), prefix=E)
    for key in ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "logprob_abs_diff/max",
                "logprob_abs_diff_seq/max", "probs_abs_diff/max", "ppl_gap"):
        assert m[E + key] == pytest.approx(0.0, abs=1e-12), key
    assert m["mismatch/engine/ppl_ratio"] == pytest.approx(1.0)
    assert m["mismatch/engine/probs_pearson"] == pytest.approx(1.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, -0.1), st.floats(-5, -0.1), st.booleans()),
                min_size=2, max_size=10),
       st.sampled_from([math.nan, math.inf, -math.inf]),
       st.sampled_from([torch.float32, torch.float64]))
def test_masked_garbage_never_matters(rows, junk, dtype):
    a = torch.tensor([[r[0] for r in rows], [r[1] for r in rows]], dtype=dtype)
    b = torch.tensor([[r[1] for r in rows], [r[0] for r in rows]], dtype=dtype)
    mask = torch.tensor([[r[2] for r in rows], [True] + [False] * (len(rows) - 1)])
    clean = compute_off_policy_diagnostics(a, a, b, mask)
    dirty = compute_off_policy_diagnostics(torch.where(mask, a, junk), torch.where(mask, a, junk),
                                           torch.where(mask, b, junk), mask)
    assert clean.keys() == dirty.keys()
    for k in clean:
        assert clean[k] == pytest.approx(dirty[k]), k


def test_chi2_seq_over_several_sequences():
    # seq 0: ρ = [2, 2] → Π = 4; seq 1: ρ = [0.5] → Π = 0.5 ; χ²_seq = (16 + 0.25)/2 − 1
    rollout = torch.full((2, 2), -1.0, dtype=torch.float64)
    train = rollout + torch.tensor([[LN2, LN2], [-LN2, 123.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    m = compute_mismatch_metrics(train, rollout, mask, prefix=E)
    assert m["mismatch/engine/chi2_seq"] == pytest.approx((16 + 0.25) / 2 - 1)
    assert m["mismatch/engine/chi2_token"] == pytest.approx((4 + 4 + 0.25) / 3 - 1)


def test_empty_batch_is_neutral():
    lp = torch.full((2, 3), -1.0, dtype=torch.float64)
    m = compute_mismatch_metrics(lp, lp + 1, torch.zeros(2, 3), prefix=E)
    assert m["mismatch/engine/chi2_token"] == 0.0 and m["mismatch/engine/chi2_seq"] == 0.0
    assert m["mismatch/engine/ppl_ratio"] == 1.0 and m["mismatch/engine/kl_k1"] == 0.0


def test_infinite_valid_log_prob_gives_finite_tails():
    train = torch.tensor([[-1.0, -math.inf]])
    rollout = torch.tensor([[-1.0, -1.0]])
    m = compute_mismatch_metrics(train, rollout, torch.ones(1, 2), prefix=E)
    assert m["mismatch/engine/logprob_abs_diff/max"] == pytest.approx(20.0)   # ±20 bound
    assert math.isfinite(m["mismatch/engine/logprob_abs_diff/p50"])


def test_per_sequence_tails_hand_computed():
    # |Δ| per token: seq 0 = [0.1, 0.3] → mean 0.2; seq 1 = [1.0] (second token masked out,
    # its junk must not count); seq 2 has no valid token and is no sequence of the tails
    rollout = torch.full((3, 2), -1.0, dtype=torch.float64)
    train = rollout + torch.tensor([[0.1, -0.3], [-1.0, 50.0], [7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    m = compute_mismatch_metrics(train, rollout, mask, prefix="x/")
    assert m["x/logprob_abs_diff_seq/mean"] == pytest.approx((0.2 + 1.0) / 2)
    assert m["x/logprob_abs_diff_seq/max"] == pytest.approx(1.0)
    assert m["x/logprob_abs_diff_seq/p50"] == pytest.approx(0.6)  # linear between 0.2 and 1.0
    assert m["x/logprob_abs_diff_seq/p90"] == pytest.approx(0.2 + 0.9 * 0.8)
    # the token mean weighs seq 0 twice: (0.1 + 0.3 + 1.0) / 3
    assert m["x/logprob_abs_diff/mean"] == pytest.approx(1.4 / 3)
    assert not any(k.startswith("mismatch/") for k in m)


def test_prefix_is_required():
    lp = torch.zeros(1, 2)
    with pytest.raises(TypeError):
        compute_mismatch_metrics(lp, lp, torch.ones(1, 2))  # type: ignore[call-arg]


def test_off_policy_diagnostics_tell_the_sources_apart():
    # π_prox = π_current is 0.5 above μ; π_old (the behaviour version) is 0.1 above μ
    mu = torch.full((1, 3), -2.0, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    m = compute_off_policy_diagnostics(mu + 0.5, mu + 0.1, mu, mask)
    assert m["mismatch/train_rollout/logprob_abs_diff/mean"] == pytest.approx(0.5)
    assert m["mismatch/engine/logprob_abs_diff/mean"] == pytest.approx(0.1)
    assert m["is/staleness/ratio/mean"] == pytest.approx(math.exp(0.4))
    assert m["is/engine/ratio/mean"] == pytest.approx(math.exp(0.1))
    assert not any(k.startswith("mismatch/") and not k.startswith(
        ("mismatch/train_rollout/", "mismatch/engine/")) for k in m)


def test_off_policy_diagnostics_read_train_rollout_off_the_current_policy():
    """Under ewma / loglinear π_prox is not π_current: train_rollout and the measured staleness
    follow π_current (the contract), the applied CompIS weight and M2 follow π_prox."""
    mu = torch.full((1, 3), -2.0, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    m = compute_off_policy_diagnostics(mu + 0.3, mu + 0.1, mu, mask, current_log_prob=mu + 0.5)
    assert m["mismatch/train_rollout/logprob_abs_diff/mean"] == pytest.approx(0.5)
    assert m["mismatch/engine/logprob_abs_diff/mean"] == pytest.approx(0.1)
    assert m["is/staleness/ratio/mean"] == pytest.approx(math.exp(0.4))
    assert m["is/engine/ratio/mean"] == pytest.approx(math.exp(0.1))
    # CompIS's weight f_s(π_prox/π_old) · f_e(π_old/μ) = e^0.2 · e^0.1 (cap 5, engine none)
    assert m["is/combined/weight_mean"] == pytest.approx(math.exp(0.3))
    assert m["rs/m2po/m2/max"] == pytest.approx(0.3 ** 2)  # (log π_prox − log μ)²
    assert "mismatch/engine/exact" not in m  # needs the token versions: the learner's
    # default: π_current = π_prox (recompute, snapshot)
    same = compute_off_policy_diagnostics(mu + 0.3, mu + 0.1, mu, mask)
    assert same["mismatch/train_rollout/logprob_abs_diff/mean"] == pytest.approx(0.3)
    assert same == compute_off_policy_diagnostics(mu + 0.3, mu + 0.1, mu, mask,
                                                  current_log_prob=mu + 0.3)


def test_variance_proxies_hand_computed():
    # 2 sequences, vocab-free inputs: π_t(y_t) and Σ_v π_v² per token
    #   seq 0: π = [0.5, 0.25], Σπ² = [0.5, 0.375]  → W = (1 − 1 + .5) + (1 − .5 + .375) = 1.375
    #   seq 1: π = [0.8, (masked)], Σπ² = [0.68, x] → W = 1 − 1.6 + 0.68 = 0.08
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.8, 0.9]], dtype=torch.float64))
    s2 = torch.tensor([[0.5, 0.375], [0.68, 0.99]], dtype=torch.float64)
    adv = torch.tensor([[2.0, 2.0], [-1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    m = variance_proxy_metrics(lp, s2, adv, mask, signal_strength=0.5,
                               sequences_per_minibatch=2)
    p2 = (2.0 ** 2 * 1.375 + 1.0 * 0.08) / 2
    assert m["policy/proxy2_total_power"] == pytest.approx(p2)
    assert m["policy/proxy1_signal_strength"] == 0.5
    assert m["policy/proxy3_pure_noise"] == pytest.approx((p2 - 0.5) / (2 - 1))
    # IS weights: ρ̄ = token mean over the sequence's valid tokens
    w = torch.tensor([[1.0, 3.0], [0.5, 100.0]], dtype=torch.float64)
    m = variance_proxy_metrics(lp, s2, adv, mask, signal_strength=0.5,
                               sequences_per_minibatch=2, is_weights=w)
    assert m["policy/proxy2_total_power"] == pytest.approx(
        (2.0 ** 2 * 4.0 * 1.375 + 0.25 * 1.0 * 0.08) / 2)
    # a signal stronger than the total power: the noise proxy is clamped at 0; N = 1 → 0
    m = variance_proxy_metrics(lp, s2, adv, mask, signal_strength=100.0,
                               sequences_per_minibatch=4)
    assert m["policy/proxy3_pure_noise"] == 0.0
    m = variance_proxy_metrics(lp, s2, adv, mask, signal_strength=0.0,
                               sequences_per_minibatch=1)
    assert m["policy/proxy3_pure_noise"] == 0.0
