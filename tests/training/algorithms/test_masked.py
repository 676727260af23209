import math

import pytest
import torch

from training.algorithms.masked import (
    clamped_log_ratio,
    masked_mean,
    masked_var,
    masked_whiten,
    sanitize,
    tail_stats,
)

NAN = math.nan


def test_masked_mean_ignores_nan_and_empty_rows():
    x = torch.tensor([[1.0, 3.0, NAN], [NAN, NAN, NAN]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(x, m).item() == 2.0
    assert masked_mean(x, m, dim=-1).tolist() == [2.0, 0.0]


def test_masked_var_and_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 1e9]])
    m = torch.tensor([[1, 1, 1, 0]])
    assert masked_var(x, m).item() == pytest.approx(1.0)          # ((1)+(0)+(1))/(3-1)
    w = masked_whiten(x, m)
    assert w.tolist()[0][:3] == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert w[0, 3].item() == 0.0


def test_sanitize_gives_zero_grad_at_masked_positions():
    x = torch.tensor([1.0, NAN], requires_grad=True)
    y = sanitize(x, torch.tensor([True, False]))
    (y.exp()).sum().backward()
    assert x.grad.tolist() == [pytest.approx(math.e), 0.0]


def test_clamped_log_ratio():
    r = clamped_log_ratio(torch.tensor([[50.0, -1.0]]), torch.tensor([[0.0, NAN]]),
                          torch.tensor([[1, 0]]))
    assert r.tolist() == [[20.0, 0.0]]


def test_tail_stats_valid_only():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    s = tail_stats(x, torch.tensor([[1, 1, 1, 0]]), prefix="q/")
    assert s == {"q/mean": 2.0, "q/p50": 2.0, "q/p90": pytest.approx(2.8),
                 "q/p99": pytest.approx(2.98), "q/max": 3.0}
    assert tail_stats(x, torch.zeros(1, 4), prefix="e/")["e/max"] == 0.0
