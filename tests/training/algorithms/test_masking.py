import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.algorithms.masking import m2po_mask, opsm_mask, second_moment


def _behav_prox(deltas):
    d = torch.tensor(deltas, dtype=torch.float64)
    behav = torch.full_like(d, -1.0)
    return behav + d, behav


def test_second_moment():
    prox, behav = _behav_prox([[0.1, -0.3]])
    assert second_moment(prox, behav, torch.ones(1, 2)).tolist()[0] == pytest.approx([0.01, 0.09])


def test_m2po_mean_rule_masks_largest_until_mean_within_budget():
    # m2 = [0.25, 0.09, 0.01, 0.0001]; mean of all = 0.350/4 = 0.0875 > 0.04
    # drop 0.25 → mean([0.09, 0.01, 0.0001]) = 0.1001/3 = 0.0334 ≤ 0.04 → k = 1
    prox, behav = _behav_prox([[0.5, -0.3, 0.1, 0.01]])
    res = m2po_mask(prox, behav, torch.ones(1, 4), threshold=0.04)
    assert res.keep_mask.tolist() == [[False, True, True, True]]
    assert res.metrics["rs/m2po/masked_tokens"] == 1.0
    assert res.metrics["rs/m2po/mask_frac"] == pytest.approx(0.25)
    assert res.metrics["rs/m2po/m2_mean"] == pytest.approx(0.3501 / 4)
    assert res.metrics["rs/m2po/m2_mean_kept"] == pytest.approx(0.1001 / 3)


def test_m2po_never_fires_on_heavy_tail_with_small_mean():
    # Seed 000: 1 extreme token (m2 = 1.0) among 999 negligible ones (m2 = 1e-8): the mean
    # (≈ 0.001) stays under 0.04, so M2PO masks nothing although the max is 1e8 × the median.
    d = torch.full((1, 1000), 1e-4, dtype=torch.float64)
    d[0, 0] = 1.0
    prox, behav = d - 1.0, torch.full_like(d, -1.0)
    res = m2po_mask(prox, behav, torch.ones_like(d, dtype=torch.bool), threshold=0.04)
    assert res.metrics["rs/m2po/mask_frac"] == 0.0
    assert res.metrics["rs/m2po/m2/max"] == pytest.approx(1.0)
    assert res.metrics["rs/m2po/m2/p50"] == pytest.approx(1e-8)


def test_m2po_max_cutoff_variant():
    prox, behav = _behav_prox([[0.5, -0.4, 0.1]])  # m2 = 0.25, 0.16, 0.01
    res = m2po_mask(prox, behav, torch.ones(1, 3), max_cutoff=0.1)
    assert res.keep_mask.tolist() == [[False, False, True]]


def test_opsm_masks_only_negative_advantage_high_kl_sequences():
    rollout = torch.full((3, 2), -1.0, dtype=torch.float64)
    cur = rollout.clone()
    cur[0] -= 0.01   # KL_0 = mean(rollout - cur) = 0.01 > δ, A < 0 → masked
    cur[1] -= 0.01   # same KL, A > 0 → kept
    cur[2] -= 1e-5   # KL = 1e-5 < δ = 1e-4, A < 0 → kept
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    res = opsm_mask(cur, rollout, adv, torch.ones(3, 2), delta=1e-4)
    assert res.keep_mask.tolist() == [[False, False], [True, True], [True, True]]
    assert res.metrics["rs/opsm/masked_seq_frac"] == pytest.approx(1 / 3)
    assert res.metrics["rs/opsm/kl/max"] == pytest.approx(0.01)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-1, 1), st.booleans(),
                          st.sampled_from([math.nan, math.inf, -math.inf, 1e30])),
                min_size=1, max_size=10))
def test_masked_garbage_never_matters(rows):
    d = torch.tensor([[r[0] for r in rows]], dtype=torch.float64)
    mask = torch.tensor([[r[1] for r in rows]])
    g = torch.tensor([[r[2] for r in rows]], dtype=torch.float64)
    behav = torch.full_like(d, -1.0)
    a = m2po_mask(behav + d, behav, mask, threshold=0.01)
    b = m2po_mask(torch.where(mask, behav + d, g), torch.where(mask, behav, g), mask,
                  threshold=0.01)
    assert a.keep_mask.equal(b.keep_mask) and a.metrics == b.metrics
    adv = torch.where(mask, -torch.ones_like(d), g)
    c = opsm_mask(torch.where(mask, behav + d, g), torch.where(mask, behav, g), adv, mask)
    e = opsm_mask(behav + d, behav, -torch.ones_like(d), mask)
    assert c.keep_mask.equal(e.keep_mask) and c.metrics == e.metrics
    assert not (a.keep_mask & ~mask).any()
