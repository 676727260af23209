"""Reactive LR guards (training/algorithms/guards.py), by hand."""

import re

import pytest
import torch

from training.algorithms.guards import LengthSurgeGuard, vcpo_lr_scale


def test_vcpo_scale_is_the_normalised_ess_with_a_floor():
    w = torch.tensor([[1.0, 3.0], [0.0, 9.0]])  # the last token is masked out
    mask = torch.tensor([[True, True], [True, False]])
    # valid w = (1, 3, 0): (Σw)² / (N·Σw²) = 16 / (3 · 10)
    scale, ess = vcpo_lr_scale(w, mask, min_scale=0.05)
    assert ess == pytest.approx(16 / 30) and scale == pytest.approx(16 / 30)
    scale, _ = vcpo_lr_scale(w, mask, min_scale=0.6)
    assert scale == 0.6
    assert vcpo_lr_scale(torch.full((2, 3), 2.5), torch.ones(2, 3), 0.05) == (1.0, 1.0)
    with pytest.raises(ValueError, match=re.escape("min_scale=0.0 must be in")):
        vcpo_lr_scale(w, mask, min_scale=0.0)


def test_length_surge_halves_once_per_surge_and_restarts_its_window():
    g = LengthSurgeGuard(ratio=1.2, window_steps=2, factor=0.5, max_halvings=2)
    assert g.observe(0, 10.0) is None and g.last_ratio is None   # no full window yet
    assert g.observe(1, 11.0) is None and g.last_ratio is None
    h = g.observe(2, 13.0)                                         # 13 / 10 = 1.3 > 1.2
    assert h is not None and (h.step, h.reference, h.halvings) == (2, 10.0, 1)
    assert h.ratio == pytest.approx(1.3) and g.lr_scale == 0.5
    assert "step 2" in h.message(g.lr_scale) and "1.30×" in h.message(g.lr_scale)
    # the window restarts at step 2: step 3 has no full window, step 4 compares with step 2
    assert g.observe(3, 14.0) is None and g.last_ratio is None
    assert g.observe(4, 15.0) is None and g.last_ratio == pytest.approx(15 / 13)
    state = g.state_dict()
    h = g.observe(5, 17.0)                                         # 17 / 14 > 1.2
    assert h is not None and h.halvings == 2 and g.lr_scale == 0.25
    assert g.observe(7, 17.0) is None                              # no full window again
    assert g.observe(8, 100.0) is None and g.halvings == 2         # max_halvings reached
    # a restored guard decides exactly as the original did
    again = LengthSurgeGuard(ratio=1.2, window_steps=2, factor=0.5, max_halvings=2)
    again.load_state_dict(state)
    assert again.halvings == 1 and again.lr_scale == 0.5
    h = again.observe(5, 17.0)
    assert h is not None and h.reference == 14.0 and again.lr_scale == 0.25


def test_length_surge_guard_settings_name_the_fix():
    with pytest.raises(ValueError, match=re.escape("ratio=1.0 must be > 1")):
        LengthSurgeGuard(ratio=1.0)
    with pytest.raises(ValueError, match=re.escape("factor=1.0 must be in")):
        LengthSurgeGuard(factor=1.0)
    with pytest.raises(ValueError, match="window_steps=0"):
        LengthSurgeGuard(window_steps=0)
