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


# ---- exact quantiles by selection, packed valid tokens (issue 16) -----------------------------


def _same(a: list[float], b: list[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def test_select_quantiles_hand_computed():
    from training.algorithms.masked import select_quantiles

    # n = 5, q = 0.9 → position 3.6 → 4 + 0.6·(5 − 4); q = 0.5 → position 2 → 3 exactly
    assert select_quantiles(torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0]), (0.5, 0.9)) == [
        3.0, pytest.approx(4.6)]
    assert select_quantiles(torch.tensor([7.0]), (0.0, 0.5, 1.0)) == [7.0, 7.0, 7.0]
    # ties: the order statistics repeat
    assert select_quantiles(torch.tensor([2.0, 2.0, 2.0, 9.0]), (0.5, 1.0)) == [2.0, 9.0]
    # NaN orders last, as torch.sort puts it: [1, 3, NaN] → p25 = 2; p50 = 3 + (NaN − 3)·0
    # and the max are NaN (the interpolation reads the next order statistic, as the sort does)
    qs = select_quantiles(torch.tensor([NAN, 1.0, 3.0]), (0.25, 0.5, 1.0))
    assert qs[0] == 2.0 and math.isnan(qs[1]) and math.isnan(qs[2])
    # ints and half precision are read exactly
    assert select_quantiles(torch.tensor([4, 1, 3, 2]), (0.5,)) == [2.5]
    assert select_quantiles(torch.tensor([0.5, 0.25], dtype=torch.bfloat16), (1.0,)) == [0.5]


def test_select_quantiles_equals_sort_on_large_random_input():
    from training.algorithms.masked import select_quantiles, sorted_quantiles

    g = torch.Generator().manual_seed(16)
    x = torch.exp(0.05 * torch.randn(100_003, generator=g))
    qs = (0.5, 0.9, 0.99, 0.999, 0.0, 1.0, 0.123)
    for values in (x, x.double(), torch.round(x * 20) / 20):  # the last one full of ties
        assert select_quantiles(values, qs) == sorted_quantiles(values.double(), qs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(-5, 5), st.sampled_from([NAN, math.inf, -math.inf, 0.0])),
                min_size=1, max_size=40),
       st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
       st.sampled_from([torch.float32, torch.float64]))
def test_select_quantiles_equals_sorted_quantiles(values, quantiles, dtype):
    from training.algorithms.masked import select_quantiles, sorted_quantiles

    x = torch.tensor(values, dtype=dtype)
    qs = tuple(quantiles)
    assert _same(select_quantiles(x, qs), sorted_quantiles(x.double(), qs))


def test_tail_stats_ignores_nan_padding_and_empty_rows():
    x = torch.tensor([[0.5, 4.0, NAN, NAN], [NAN, NAN, NAN, NAN], [2.0, 1.0, 3.0, NAN]])
    m = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]])
    valid = torch.tensor([0.5, 4.0, 2.0, 1.0, 3.0], dtype=torch.float64)
    s = tail_stats(x, m, prefix="t/")
    assert s["t/mean"] == pytest.approx(valid.mean().item())
    assert s["t/max"] == 4.0
    for q in (50, 90, 99):
        assert s[f"t/p{q}"] == pytest.approx(torch.quantile(valid, q / 100).item(), rel=1e-15)
    empty = tail_stats(x, torch.zeros(3, 4), prefix="e/")
    assert empty == {"e/mean": 0.0, "e/p50": 0.0, "e/p90": 0.0, "e/p99": 0.0, "e/max": 0.0}


def _random_mask(seed: int, b: int = 7, t: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < 0.6  # not right-padded: holes anywhere
    mask[0] = False  # empty first, middle and last rows
    mask[3] = False
    mask[-1] = False
    return mask


@pytest.mark.parametrize("seed", range(5))
def test_valid_tokens_match_dense_masked_reductions(seed):
    from training.algorithms.masked import ValidTokens, masked_max, masked_sum

    mask = _random_mask(seed)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(mask.shape, generator=g)
    dirty = torch.where(mask, x, torch.tensor(NAN))
    tokens = ValidTokens.of(mask.to(torch.float32))  # a float 0/1 mask reads the same
    assert torch.equal(tokens.mask, mask)
    assert tokens.n == int(mask.sum()) and tokens.n_seq == int(mask.any(-1).sum())
    assert torch.equal(tokens.lengths, mask.sum(-1))
    assert torch.equal(tokens.starts, torch.cumsum(mask.sum(-1), 0) - mask.sum(-1))
    assert torch.equal(tokens.seq_valid, mask.any(-1))

    packed = tokens.pack(dirty)
    assert torch.equal(packed, x[mask])  # row-major order, padding never read
    assert torch.equal(tokens.unpack(packed), sanitize(x, mask))
    assert torch.equal(tokens.unpack(packed > 0, fill=False), mask & (x > 0))

    x64 = x.double()
    torch.testing.assert_close(tokens.row_sum(packed), masked_sum(x64, mask, dim=-1))
    torch.testing.assert_close(tokens.row_mean(packed), masked_mean(x64, mask, dim=-1))
    assert torch.equal(tokens.row_max(packed), masked_max(x64, mask, dim=-1))
    per_row = torch.arange(mask.shape[0], dtype=torch.float32)
    assert torch.equal(tokens.broadcast(per_row), per_row.unsqueeze(-1).expand_as(x)[mask])


def test_valid_tokens_of_an_empty_mask():
    from training.algorithms.masked import ValidTokens

    tokens = ValidTokens.of(torch.zeros(3, 4, dtype=torch.bool))
    assert tokens.n == 0 and tokens.n_seq == 0
    empty = tokens.pack(torch.full((3, 4), NAN))
    assert empty.shape == (0,)
    assert tokens.row_sum(empty).tolist() == [0.0, 0.0, 0.0]
    assert tokens.row_max(empty).tolist() == [-math.inf] * 3
    assert torch.equal(tokens.unpack(empty), torch.zeros(3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("seed", range(3))
def test_segment_reduce_numpy_path_equals_torch_path(dtype, seed):
    # CPU tensors take numpy's reduceat; other devices torch.segment_reduce: same results.
    from training.algorithms.masked import _segment_reduce_numpy, _segment_reduce_torch

    lengths = _random_mask(seed).sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(int(lengths.sum()), generator=g)
    values = values > 0 if dtype == torch.bool else values.to(dtype)
    for how in ("sum", "max") if dtype != torch.bool else ("sum",):
        ours = _segment_reduce_numpy(values, starts, lengths, how)
        ref = _segment_reduce_torch(values, lengths, how)
        assert ours.dtype == ref.dtype == torch.float64
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_flat_nonzero_and_valid_values():
    from training.algorithms.masked import flat_nonzero, valid_values

    flat = torch.tensor([False, True, True, False, True])
    assert flat_nonzero(flat).tolist() == [1, 2, 4]
    assert flat_nonzero(flat).dtype == torch.int64
    assert flat_nonzero(torch.zeros(4, dtype=torch.bool)).tolist() == []
    x = torch.tensor([[1.0, NAN], [3.0, 4.0]])
    assert valid_values(x, torch.tensor([[1, 0], [1, 1]])).tolist() == [1.0, 3.0, 4.0]
    assert valid_values(x, torch.tensor([False, True])).tolist() == [[3.0, 4.0]]  # row mask
