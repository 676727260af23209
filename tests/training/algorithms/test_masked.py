import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_masked_reductions_hand_computed():
    from training.algorithms.masked import (
        as_bool_mask,
        masked_count,
        masked_max,
        masked_min,
        masked_sum,
        sequence_mask,
        sorted_quantiles,
    )

    x = torch.tensor([[1.0, -2.0, NAN], [5.0, math.inf, 0.5]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    assert as_bool_mask(m).tolist() == [[True, True, False], [True, False, True]]
    assert masked_sum(x, m).item() == 1 - 2 + 5 + 0.5
    assert masked_sum(x, m, dim=-1).tolist() == [-1.0, 5.5]
    assert masked_count(m).item() == 4 and masked_count(m, dim=-1).tolist() == [2, 2]
    assert masked_max(x, m).item() == 5.0 and masked_min(x, m, dim=-1).tolist() == [-2.0, 0.5]
    assert sequence_mask(torch.tensor([[0, 0], [0, 1]])).tolist() == [False, True]
    # n = 5, q = 0.9 → position 3.6 → 4 + 0.6·(5 − 4)
    qs = sorted_quantiles(torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0]), (0.5, 0.9))
    assert qs == pytest.approx([3.0, 4.6])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3), st.booleans()), min_size=2, max_size=12),
       st.sampled_from([NAN, math.inf, -math.inf]),
       st.sampled_from([torch.float32, torch.float64]))
def test_garbage_never_reaches_values_or_gradients(rows, junk, dtype):
    vals = torch.tensor([[r[0] for r in rows]], dtype=dtype)
    mask = torch.tensor([[r[1] for r in rows]])
    dirty = torch.where(mask, vals, torch.tensor(junk, dtype=dtype)).requires_grad_(True)
    clean = vals.clone().requires_grad_(True)
    for fn in (masked_mean, masked_var, masked_whiten):
        a, b = fn(clean, mask), fn(dirty, mask)
        assert a.dtype == dtype
        torch.testing.assert_close(a, b)
        (ga,) = torch.autograd.grad(a.sum(), clean)
        (gb,) = torch.autograd.grad(b.sum(), dirty)
        assert torch.isfinite(gb).all()
        torch.testing.assert_close(ga, gb)
        assert (gb[~mask] == 0).all()
