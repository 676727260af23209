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
)

LN2 = math.log(2.0)


def test_mismatch_metrics_hand_computed():
    # One sequence, two tokens: ρ = π_old/μ = [2, 1]
    rollout = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)
    train = rollout + torch.tensor([[LN2, 0.0]], dtype=torch.float64)
    m = compute_mismatch_metrics(train, rollout, torch.ones(1, 2))
    assert m["mismatch/logprob_abs_diff/mean"] == pytest.approx(LN2 / 2)
    assert m["mismatch/logprob_abs_diff/max"] == pytest.approx(LN2)
    assert m["mismatch/logprob_diff"] == pytest.approx(LN2 / 2)
    assert m["mismatch/kl_k1"] == pytest.approx(-LN2 / 2)
    assert m["mismatch/kl_k3"] == pytest.approx(((2 - LN2 - 1) + 0) / 2)
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 1) / 2 - 1)
    assert m["mismatch/chi2_seq"] == pytest.approx((2 * 1) ** 2 - 1)
    # PPL_train = exp(-(ln .5 + ln .5)/2) = 2 ; PPL_rollout = exp(-(ln .25 + ln .5)/2) = √8
    assert m["mismatch/ppl_train"] == pytest.approx(2.0)
    assert m["mismatch/ppl_rollout"] == pytest.approx(math.sqrt(8))
    assert m["mismatch/ppl_ratio"] == pytest.approx(2 / math.sqrt(8))
    assert m["mismatch/ppl_gap"] == pytest.approx(2 - math.sqrt(8))
    # probs: train [0.5, 0.5], rollout [0.25, 0.5] → abs diff [0.25, 0]
    assert m["mismatch/probs_abs_diff/max"] == pytest.approx(0.25)
    assert m["mismatch/probs_abs_diff/mean"] == pytest.approx(0.125)


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
                                 entropy=torch.tensor([[0.5, 0.01]]))
    assert m["mismatch/logprob_abs_diff_high_entropy/mean"] == pytest.approx(0.1, rel=1e-5)
    assert m["policy/entropy/max"] == pytest.approx(0.5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-6, -0.01), min_size=1, max_size=10))
def test_identical_engines_report_no_mismatch(values):
    lp = torch.tensor([values], dtype=torch.float64)
    m = compute_mismatch_metrics(lp, lp.clone(), torch.ones_like(lp))
    for key in ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/chi2_token", "mismatch/chi2_seq",
                "mismatch/logprob_abs_diff/max", "mismatch/probs_abs_diff/max", "mismatch/ppl_gap"):
        assert m[key] == pytest.approx(0.0, abs=1e-12), key
    assert m["mismatch/ppl_ratio"] == pytest.approx(1.0)
    assert m["mismatch/probs_pearson"] == pytest.approx(1.0)


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
    m = compute_mismatch_metrics(train, rollout, mask)
    assert m["mismatch/chi2_seq"] == pytest.approx((16 + 0.25) / 2 - 1)
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 4 + 0.25) / 3 - 1)


def test_empty_batch_is_neutral():
    lp = torch.full((2, 3), -1.0, dtype=torch.float64)
    m = compute_mismatch_metrics(lp, lp + 1, torch.zeros(2, 3))
    assert m["mismatch/chi2_token"] == 0.0 and m["mismatch/chi2_seq"] == 0.0
    assert m["mismatch/ppl_ratio"] == 1.0 and m["mismatch/kl_k1"] == 0.0


def test_infinite_valid_log_prob_gives_finite_tails():
    train = torch.tensor([[-1.0, -math.inf]])
    rollout = torch.tensor([[-1.0, -1.0]])
    m = compute_mismatch_metrics(train, rollout, torch.ones(1, 2))
    assert m["mismatch/logprob_abs_diff/max"] == pytest.approx(20.0)   # ±20 bound
    assert math.isfinite(m["mismatch/logprob_abs_diff/p50"])
