"""Tests for training/algorithms/advantages.py (advantage estimators by name)."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from training.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    TokenPolicy,
    compute_advantage,
    discounted_returns,
    group_ids,
    group_stats,
    whiten_or_zero,
)

ALL_NAMES = [
    "dr_grpo", "gae", "gdpo", "gpg", "grpo", "grpo_passk", "opo", "optimal_token_baseline",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo",
    "tir_optimal_token_baseline",
]
# estimators whose advantage is purely group-relative: all-equal groups → exactly 0
GROUP_RELATIVE = ["dr_grpo", "gpg", "grpo", "grpo_passk", "opo", "rloo"]
GARBAGE = [math.nan, math.inf, -math.inf, 1e30, -7.0]
EPS = 1e-6
NAN = math.nan


def pol(shape: tuple[int, ...]) -> TokenPolicy:
    """A policy input for the OTB estimators (the others ignore it): π = 0.5, Σπ² = 0.3."""
    return TokenPolicy(torch.full(shape, math.log(0.5)), torch.full(shape, 0.3))


def tok(values: list[float], mask: list[list[int]]) -> torch.Tensor:
    """Broadcast one value per sequence to its valid tokens (0 elsewhere), float64."""
    rows = [[v if m else 0.0 for m in row] for v, row in zip(values, mask, strict=True)]
    return torch.tensor(rows, dtype=torch.float64)


def whiten(xs: list[float]) -> list[float]:
    """(x − mean) / sqrt(unbiased var + 1e-8), the reference for the global whitening."""
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


# A batch of 4 sequences: group "a" = rows 0..2, group "b" = row 3 (a singleton).
# Masked positions hold garbage that must be ignored.
MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]]
REWARDS = [
    [0.25, 0.0, 0.75],  # score 1.0 (sum over valid tokens), length 3
    [0.0, 0.0, NAN],  # score 0.0, length 2
    [0.5, 9.0, -math.inf],  # score 0.5, length 1
    [0.0, 2.0, math.inf],  # score 2.0, length 2 (singleton group "b")
]
INDEX = ["a", "a", "a", "b"]
SCORES_A = [1.0, 0.0, 0.5]
MEAN_A = (1.0 + 0.0 + 0.5) / 3  # 0.5
STD_A = math.sqrt(((1.0 - 0.5) ** 2 + (0.0 - 0.5) ** 2 + (0.5 - 0.5) ** 2) / 2)  # 0.5


def run(name: str, config: AdvantageConfig | None = None, **kw):
    return compute_advantage(name, torch.tensor(REWARDS, dtype=torch.float64),
                             torch.tensor(MASK), INDEX, config, **kw)


# ------------------------------------------------------------------------------------------------
# hand-computed values, one estimator at a time
# ------------------------------------------------------------------------------------------------


def test_grpo_hand_computed() -> None:
    adv, ret, metrics = run("grpo", AdvantageConfig(epsilon=EPS))
    expected = [
        (1.0 - MEAN_A) / (STD_A + EPS),  # 0.5 / 0.5 = 1
        (0.0 - MEAN_A) / (STD_A + EPS),  # −1
        (0.5 - MEAN_A) / (STD_A + EPS),  # 0
        (2.0 - 0.0) / (1.0 + EPS),  # singleton: mean 0, std 1 (verl)
    ]
    assert_close(adv, tok(expected, MASK))
    assert torch.equal(adv, ret)
    assert metrics == {"rollout/num_groups": 2.0, "rollout/zero_variance_groups": 0.0,
                       "rollout/zero_variance_group_frac": 0.0, "rollout/singleton_groups": 1.0}


def test_dr_grpo_hand_computed_and_equal_to_grpo_without_std() -> None:
    adv, ret, _ = run("dr_grpo")
    expected = [1.0 - MEAN_A, 0.0 - MEAN_A, 0.5 - MEAN_A, 2.0 - 0.0]  # [0.5, −0.5, 0, 2]
    assert_close(adv, tok(expected, MASK))
    assert torch.equal(adv, ret)
    grpo_no_std, _, _ = run("grpo", AdvantageConfig(norm_adv_by_std_in_grpo=False))
    assert torch.equal(adv, grpo_no_std)
    # dr_grpo ignores the flag
    assert torch.equal(adv, run("dr_grpo", AdvantageConfig(norm_adv_by_std_in_grpo=True))[0])


def test_rloo_hand_computed() -> None:
    adv, ret, _ = run("rloo")
    expected = [
        1.0 - (0.0 + 0.5) / 2,  # 0.75
        0.0 - (1.0 + 0.5) / 2,  # −0.75
        0.5 - (1.0 + 0.0) / 2,  # 0
        2.0,  # singleton: raw score (verl)
    ]
    assert_close(adv, tok(expected, MASK))
    assert torch.equal(adv, ret)


def test_opo_hand_computed() -> None:
    adv, _, _ = run("opo")
    # length-weighted baseline of group a: lengths [3, 2, 1], scores [1, 0, 0.5]
    b = (3 * 1.0 + 2 * 0.0 + 1 * 0.5) / (3 + 2 + 1)  # 3.5 / 6
    expected = [1.0 - b, 0.0 - b, 0.5 - b, 2.0]  # singleton: baseline 0
    assert_close(adv, tok(expected, MASK))


def test_gpg_hand_computed() -> None:
    adv, _, _ = run("gpg")
    alpha = 4 / 3  # 4 valid sequences, 3 of them with a non-zero score (1, 0.5, 2)
    expected = [alpha * (1.0 - MEAN_A), alpha * (0.0 - MEAN_A), alpha * (0.5 - MEAN_A),
                alpha * (2.0 - 0.0)]
    assert_close(adv, tok(expected, MASK))
    adv2, _, _ = run("gpg", AdvantageConfig(gpg_f_norm=2.0))
    assert_close(adv2, adv / 2)


def test_grpo_passk_default_k_is_group_size_best_minus_second() -> None:
    mask = [[1, 1]] * 4
    rewards = torch.tensor([[0.0, 0.2], [0.9, 0.0], [0.0, 0.5], [0.3, 0.4]], dtype=torch.float64)
    scores = [0.2, 0.9, 0.5, 0.7]
    cfg = AdvantageConfig(norm_adv_by_std_in_grpo=False)
    adv, ret, _ = compute_advantage("grpo_passk", rewards, torch.tensor(mask), [0] * 4, cfg)
    # only the best sample is credited: r_max − r_second = 0.9 − 0.7
    assert_close(adv, tok([0.0, 0.9 - 0.7, 0.0, 0.0], mask))
    assert torch.equal(adv, ret)
    adv_std, _, _ = compute_advantage("grpo_passk", rewards, torch.tensor(mask), [0] * 4,
                                      AdvantageConfig(epsilon=EPS))
    assert_close(adv_std, tok([0.0, (0.9 - 0.7) / (statistics.stdev(scores) + EPS), 0.0, 0.0],
                              mask))


def test_grpo_passk_general_k_hand_computed() -> None:
    # group scores [0, 1, 3], k = 2: average over the 2 pairs holding i of max(S) − max(S \ {i})
    rewards = torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64)
    cfg = AdvantageConfig(pass_k=2, norm_adv_by_std_in_grpo=False)
    adv, _, _ = compute_advantage("grpo_passk", rewards, torch.ones(3, 1), [7, 7, 7], cfg)
    expected = [
        ((1 - 1) + (3 - 3)) / 2,  # 0 is never the max of its pair
        ((1 - 0) + (3 - 3)) / 2,  # pairs {1,0}, {1,3}
        ((3 - 0) + (3 - 1)) / 2,  # pairs {3,0}, {3,1}
    ]
    assert_close(adv, torch.tensor([expected], dtype=torch.float64).T)


def test_grpo_passk_rejects_small_groups() -> None:
    with pytest.raises(ValueError, match="at least"):
        run("grpo_passk")  # group "b" is a singleton
    rewards = torch.tensor([[0.0], [1.0], [3.0]])
    with pytest.raises(ValueError, match="pass_k"):
        compute_advantage("grpo_passk", rewards, torch.ones(3, 1), [0, 0, 0],
                          AdvantageConfig(pass_k=4))


def test_reinforce_plus_plus_hand_computed() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret, metrics = compute_advantage("reinforce_plus_plus", rewards, mask, None,
                                          AdvantageConfig(gamma=0.5))
    # G_t = r_t + 0.5 G_{t+1}
    g0 = [1.0 + 0.5 * (0.0 + 0.5 * 2.0), 0.0 + 0.5 * 2.0, 2.0]  # [1.5, 1.0, 2.0]
    g1 = [0.0 + 0.5 * 4.0, 4.0]  # [2.0, 4.0]
    assert_close(ret, torch.tensor([g0, [*g1, 0.0]], dtype=torch.float64))
    w = whiten(g0 + g1)  # mean 2.1, unbiased var 5.2 / 4 = 1.3
    assert_close(adv, torch.tensor([w[:3], [*w[3:], 0.0]], dtype=torch.float64))
    assert metrics == {}  # no index → no group metrics


def test_discounted_returns_skip_masked_tokens() -> None:
    # a masked observation token in the middle neither counts as a step nor resets the return
    rewards = torch.tensor([[1.0, 100.0, 2.0]])
    mask = torch.tensor([[True, False, True]])
    assert_close(discounted_returns(rewards, mask, 0.5), torch.tensor([[1.0 + 0.5 * 2.0, 0, 2.0]]))


def test_reinforce_plus_plus_baseline_hand_computed() -> None:
    mask = [[1, 1], [1, 0], [1, 0], [1, 0], [1, 0]]
    rewards = torch.tensor([[0.0, 1.0], [0.0, NAN], [3.0, 1.0], [3.0, 2.0], [2.0, 5.0]],
                           dtype=torch.float64)
    index = ["a", "a", "b", "b", "c"]
    adv, ret, metrics = compute_advantage("reinforce_plus_plus_baseline", rewards,
                                          torch.tensor(mask), index)
    # scores: a = [1, 0] (mean 0.5), b = [3, 3] (zero variance), c = [2] singleton (baseline 0)
    centred = [1 - 0.5, 0 - 0.5, 0.0, 0.0, 2.0 - 0.0]
    w = whiten([centred[0], centred[0], centred[1], centred[2], centred[3], centred[4]])
    assert_close(adv, torch.tensor([[w[0], w[1]], [w[2], 0], [w[3], 0], [w[4], 0], [w[5], 0]],
                                   dtype=torch.float64))
    assert torch.equal(adv, ret)
    assert metrics["rollout/zero_variance_groups"] == 1.0
    assert metrics["rollout/zero_variance_group_frac"] == pytest.approx(1 / 3)
    assert metrics["rollout/singleton_groups"] == 1.0


def test_remax_hand_computed() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.5], [2.0, NAN, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    baselines = torch.tensor([1.0, 0.5], dtype=torch.float64)
    adv, ret, _ = compute_advantage("remax", rewards, mask, None, reward_baselines=baselines)
    # return-to-go (undiscounted): row 0 [0 + 1 + 0.5, 1 + 0.5, 0.5]; row 1 [2]
    assert_close(ret, torch.tensor([[1.5, 1.5, 0.5], [2.0, 0, 0]], dtype=torch.float64))
    assert_close(adv, torch.tensor([[1.5 - 1.0, 1.5 - 1.0, 0.5 - 1.0], [2.0 - 0.5, 0, 0]],
                                   dtype=torch.float64))
    # gamma is ignored (verl)
    adv_g, _, _ = compute_advantage("remax", rewards, mask, None, AdvantageConfig(gamma=0.5),
                                    reward_baselines=baselines)
    assert torch.equal(adv, adv_g)


def test_gae_hand_computed() -> None:
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, NAN]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret, metrics = compute_advantage("gae", rewards, mask, ["p", "p"],
                                          AdvantageConfig(gamma=gamma, lam=lam), values=values)
    # row 0: δ2 = 1 − 0.7 = 0.3; δ1 = 0.9·0.7 − 0.6 = 0.03; δ0 = 0.9·0.6 − 0.5 = 0.04
    a02 = 0.3
    a01 = 0.03 + gamma * lam * a02  # 0.246
    a00 = 0.04 + gamma * lam * a01  # 0.21712
    # row 1: δ1 = 2 − 1 = 1; δ0 = 0.9·1 − 1 = −0.1
    a11 = 1.0
    a10 = -0.1 + gamma * lam * a11  # 0.62
    assert_close(ret, torch.tensor([[a00 + 0.5, a01 + 0.6, a02 + 0.7], [a10 + 1.0, a11 + 1.0, 0]],
                                   dtype=torch.float64))
    w = whiten([a00, a01, a02, a10, a11])
    assert_close(adv, torch.tensor([w[:3], [*w[3:], 0.0]], dtype=torch.float64))
    assert metrics["rollout/num_groups"] == 1.0


def test_gae_skips_masked_observation_tokens() -> None:
    # with γ = λ = 1 and a masked token in the middle, A_0 = r_0 + V_2 − V_0 + (r_2 − V_2)
    rewards = torch.tensor([[0.0, 50.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.25, 99.0, 0.5]], dtype=torch.float64)
    _, ret, _ = compute_advantage("gae", rewards, torch.tensor([[1, 0, 1]]), None,
                                  values=values)
    a2 = 1.0 - 0.5
    a0 = (0.0 + 0.5 - 0.25) + a2
    assert_close(ret, torch.tensor([[a0 + 0.25, 0.0, a2 + 0.5]], dtype=torch.float64))


# ------------------------------------------------------------------------------------------------
# zero-variance groups, empty sequences, helpers, errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GROUP_RELATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_equal_groups_are_exactly_zero_and_counted(name: str, dtype: torch.dtype) -> None:
    # 0.1 is not representable: the group mean carries rounding, the output must not
    rewards = torch.tensor([[0.1, 0.0], [0.0, 0.1], [0.1, 0.0], [0.3, 0.0], [0.3, 0.0],
                            [1.0, 0.0], [0.0, 0.0]], dtype=dtype)
    mask = torch.tensor([[1, 0], [1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1]])
    index = [0, 0, 0, 1, 1, 2, 2]
    adv, _, metrics = compute_advantage(name, rewards, mask, index)
    assert torch.equal(adv[:5], torch.zeros(5, 2, dtype=dtype))
    assert (adv[5, :2] > 0).all()
    # the worse sample of the mixed group: below the baseline, except for pass@k (never credited)
    assert (adv[6, :2] == 0).all() if name == "grpo_passk" else (adv[6, :2] < 0).all()
    assert metrics["rollout/num_groups"] == 3.0
    assert metrics["rollout/zero_variance_groups"] == 2.0
    assert metrics["rollout/zero_variance_group_frac"] == pytest.approx(2 / 3)
    assert metrics["rollout/singleton_groups"] == 0.0


@pytest.mark.parametrize("name", ALL_NAMES)
def test_empty_sequences_are_zero_and_not_group_members(name: str) -> None:
    # row 2 has no valid token and NaN everywhere: no NaN anywhere, and it does not change group a
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [NAN, NAN], [0.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 1], [1, 1], [0, 0], [1, 1], [1, 1]])
    values = torch.tensor([[0.5, 0.5], [0.5, 0.5], [NAN, NAN], [0.5, 0.5], [0.5, 0.5]])
    baselines = torch.tensor([0.5, 0.5, NAN, 0.5, 0.5])
    index = ["a", "a", "a", "b", "b"]
    kw = {"values": values, "reward_baselines": baselines}
    kw["policy"] = pol(tuple(rewards.shape))
    adv, ret, metrics = compute_advantage(name, rewards, mask, index, **kw)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.equal(adv[2], torch.zeros(2)) and torch.equal(ret[2], torch.zeros(2))
    keep = [0, 1, 3, 4]
    adv_without, _, _ = compute_advantage(
        name, rewards[keep], mask[keep], [index[i] for i in keep],
        values=values[keep], reward_baselines=baselines[keep], policy=pol((4, 2)))
    assert_close(adv[keep], adv_without)
    assert metrics["rollout/num_groups"] == 2.0


def test_group_of_only_empty_sequences_is_not_counted() -> None:
    _, _, metrics = compute_advantage("grpo", torch.ones(3, 2), torch.tensor([[1, 1], [1, 1],
                                                                              [0, 0]]),
                                      ["a", "a", "z"])
    assert metrics["rollout/num_groups"] == 1.0
    assert metrics["rollout/zero_variance_groups"] == 1.0


def test_group_ids_from_tensor_and_sequences() -> None:
    ids, n = group_ids(["x", "y", "x", ("t", 1)], 4)
    assert ids.tolist() == [0, 1, 0, 2] and n == 3
    ids_t, n_t = group_ids(torch.tensor([5, 3, 5, 9]), 4)
    assert n_t == 3 and ids_t[0] == ids_t[2] and len(set(ids_t.tolist())) == 3
    with pytest.raises(ValueError, match="one group id per sequence"):
        group_ids(["x"], 2)
    with pytest.raises(ValueError, match="one group id per sequence"):
        group_ids(torch.zeros(3), 2)


def test_tensor_index_equals_list_index() -> None:
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    for name in GROUP_RELATIVE:
        if name == "grpo_passk":
            continue
        a_list = compute_advantage(name, rewards, torch.tensor(MASK), INDEX)[0]
        index_t = torch.tensor([4, 4, 4, 1])
        a_tensor = compute_advantage(name, rewards, torch.tensor(MASK), index_t)[0]
        assert torch.equal(a_list, a_tensor)


def test_group_stats_hand_computed() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0], dtype=torch.float64)
    valid = torch.tensor([True, True, True, True, False])
    stats = group_stats(scores, valid, ["a", "a", "a", "b", "b"])
    assert_close(stats.count, torch.tensor([3.0, 1.0], dtype=torch.float64))
    assert_close(stats.mean, torch.tensor([MEAN_A, 2.0], dtype=torch.float64))
    assert_close(stats.std, torch.tensor([STD_A, 0.0], dtype=torch.float64))
    assert stats.singleton.tolist() == [False, True]
    assert stats.zero_var.tolist() == [False, False]


def test_whiten_or_zero() -> None:
    mask = torch.tensor([[True, True, False]])
    assert torch.equal(whiten_or_zero(torch.tensor([[0.1, 0.1, NAN]]), mask), torch.zeros(1, 3))
    assert_close(whiten_or_zero(torch.tensor([[1.0, 3.0, NAN]], dtype=torch.float64), mask),
                 torch.tensor([[*whiten([1.0, 3.0]), 0.0]], dtype=torch.float64))


def test_errors() -> None:
    r, m = torch.zeros(2, 2), torch.ones(2, 2)
    with pytest.raises(ValueError, match="values="):
        compute_advantage("gae", r, m, None)
    with pytest.raises(ValueError, match="reward_baselines="):
        compute_advantage("remax", r, m, None)
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        compute_advantage("remax", r, m, None, reward_baselines=torch.zeros(3))
    with pytest.raises(ValueError, match=r"values \(2, 3\)"):
        compute_advantage("gae", r, m, None, values=torch.zeros(2, 3))
    for name in [*GROUP_RELATIVE, "reinforce_plus_plus_baseline"]:
        with pytest.raises(ValueError, match="index="):
            compute_advantage(name, r, m, None)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        compute_advantage("grpo", torch.zeros(2, 3), m, [0, 0])
    with pytest.raises(KeyError, match="valid names: dr_grpo, gae"):
        compute_advantage("ppo", r, m, [0, 0])


@pytest.mark.parametrize(
    ("field", "value"),
    [("gamma", 1.5), ("lam", -0.1), ("epsilon", 0.0), ("pass_k", 1), ("gpg_f_norm", 0.0)],
)
def test_config_validation(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        AdvantageConfig(**{field: value})


def test_registry_names() -> None:
    assert ADVANTAGE_ESTIMATORS.names() == ALL_NAMES


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_estimator_shapes_dtype_masking_and_detached(name: str, dtype: torch.dtype) -> None:
    rewards = torch.tensor([[0.0, 1.0, 7.0], [0.5, 0.0, NAN], [0.0, 0.0, 2.0], [1.0, NAN, NAN]],
                           dtype=dtype, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=dtype)
    values = torch.full((4, 3), 0.25, dtype=dtype, requires_grad=True)
    adv, ret, metrics = compute_advantage(
        name, rewards, mask, [0, 0, 1, 1], values=values,
        reward_baselines=torch.tensor([0.5, 0.5, 0.1, 0.1], dtype=dtype),
        policy=pol((4, 3)))
    for out in (adv, ret):
        assert out.shape == (4, 3) and out.dtype == dtype
        assert not out.requires_grad
        assert torch.isfinite(out).all()
        assert torch.equal(out[mask == 0], torch.zeros_like(out[mask == 0]))
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["rollout/num_groups"] == 2.0


# ------------------------------------------------------------------------------------------------
# hypothesis properties
# ------------------------------------------------------------------------------------------------

reward_value = st.sampled_from([0.0, 1.0, -1.0, 0.5, 0.1, 2.0, 0.3])


@st.composite
def grouped_batch(draw: st.DrawFn, min_len: int = 0):
    """(rewards, lengths, index, values, baselines) with groups of 2..4 sequences, T ≤ 4."""
    sizes = draw(st.lists(st.integers(2, 4), min_size=1, max_size=3))
    t = draw(st.integers(1, 4))
    index = [g for g, s in enumerate(sizes) for _ in range(s)]
    b = len(index)
    lengths = [draw(st.integers(min_len, t)) for _ in range(b)]
    rewards = [[draw(reward_value) for _ in range(t)] for _ in range(b)]
    values = [[draw(reward_value) for _ in range(t)] for _ in range(b)]
    baselines = [draw(reward_value) for _ in range(b)]
    return rewards, lengths, index, values, baselines


def _mask(lengths: list[int], t: int) -> torch.Tensor:
    return torch.tensor([[1 if j < n else 0 for j in range(t)] for n in lengths])


def _dirty(x: torch.Tensor, mask: torch.Tensor, garbage: float) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.full_like(x, garbage))


@settings(max_examples=50, deadline=None)
@given(batch=grouped_batch(), garbage=st.sampled_from(GARBAGE),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_masked_garbage_never_changes_outputs(batch, garbage, dtype) -> None:
    rewards, lengths, index, values, baselines = batch
    r = torch.tensor(rewards, dtype=dtype)
    v = torch.tensor(values, dtype=dtype)
    bl = torch.tensor(baselines, dtype=dtype)
    mask = _mask(lengths, r.shape[1])
    seq_valid = mask.any(dim=1)
    bl_dirty = torch.where(seq_valid, bl, torch.full_like(bl, garbage))
    for name in ALL_NAMES:
        try:
            clean = compute_advantage(name, r, mask, index, values=v, reward_baselines=bl,
                                      policy=pol(tuple(r.shape)))
        except ValueError:  # grpo_passk with < 2 non-empty members in a group
            assert name == "grpo_passk"
            with pytest.raises(ValueError):
                compute_advantage(name, _dirty(r, mask, garbage), mask, index)
            continue
        dirty = compute_advantage(name, _dirty(r, mask, garbage), mask, index,
                                  values=_dirty(v, mask, garbage), reward_baselines=bl_dirty,
                                  policy=pol(tuple(r.shape)))
        assert torch.equal(clean[0], dirty[0]), name
        assert torch.equal(clean[1], dirty[1]), name
        assert clean[2] == dirty[2]
        assert torch.isfinite(clean[0]).all() and torch.isfinite(clean[1]).all()
        assert (clean[0][mask == 0] == 0).all()


@settings(max_examples=50, deadline=None)
@given(batch=grouped_batch(min_len=1), dtype=st.sampled_from([torch.float32, torch.float64]),
       data=st.data())
def test_all_equal_groups_give_zero_advantages(batch, dtype, data) -> None:
    _, lengths, index, _, _ = batch
    t = max(lengths)
    # every group gets one constant score, placed on the last valid token
    n_groups = max(index) + 1
    group_score = [data.draw(reward_value) for _ in range(n_groups)]
    rewards = torch.zeros(len(index), t, dtype=dtype)
    for i, (g, n) in enumerate(zip(index, lengths, strict=True)):
        rewards[i, n - 1] = group_score[g]
    mask = _mask(lengths, t)
    for name in [*GROUP_RELATIVE, "reinforce_plus_plus_baseline"]:
        adv, _, metrics = compute_advantage(name, rewards, mask, index)
        assert torch.equal(adv, torch.zeros_like(adv)), name
        assert metrics["rollout/zero_variance_groups"] == float(n_groups)
        assert metrics["rollout/zero_variance_group_frac"] == 1.0


@settings(max_examples=50, deadline=None)
@given(batch=grouped_batch(min_len=1))
def test_float32_matches_float64(batch) -> None:
    rewards, lengths, index, values, baselines = batch
    mask = _mask(lengths, len(rewards[0]))
    # Near-ties (0.1 vs 1 + 0.1 − 1) round apart in float32 only; GRPO then divides that rounding
    # by std + ε and legitimately disagrees. Compare on groups that are exact ties or clearly apart.
    scores = (torch.tensor(rewards, dtype=torch.float64) * mask).sum(-1)
    for g in set(index):
        s = scores[[i for i, j in enumerate(index) if j == g]]
        spread = (s.max() - s.min()).item()
        assume(spread == 0.0 or spread > 1e-3)
    for name in ALL_NAMES:
        outs = [compute_advantage(name, torch.tensor(rewards, dtype=dt), mask, index,
                                  values=torch.tensor(values, dtype=dt),
                                  reward_baselines=torch.tensor(baselines, dtype=dt),
                                  policy=pol(tuple(mask.shape)))
                for dt in (torch.float32, torch.float64)]
        assert outs[0][0].dtype == torch.float32 and outs[1][0].dtype == torch.float64
        # global whitening divides by a std that may be tiny: compare relative to the scale
        scale = max(1.0, outs[1][0].abs().max().item())
        assert_close(outs[0][0].double(), outs[1][0], rtol=1e-3, atol=1e-3 * scale)
        assert_close(outs[0][1].double(), outs[1][1], rtol=1e-3, atol=1e-3 * scale)


def _passk_brute_force(scores: list[float], k: int) -> list[float]:
    """A_i = mean over size-k subsets S ∋ i of max(S) − max(S \\ {i})."""
    n = len(scores)
    out = []
    for i in range(n):
        others = [j for j in range(n) if j != i]
        credits = [max(scores[j] for j in (i, *rest)) - max(scores[j] for j in rest)
                   for rest in itertools.combinations(others, k - 1)]
        out.append(sum(credits) / len(credits))
    return out


@settings(max_examples=50, deadline=None)
@given(scores=st.lists(reward_value, min_size=2, max_size=6), data=st.data())
def test_grpo_passk_matches_subset_enumeration(scores, data) -> None:
    n = len(scores)
    k = data.draw(st.integers(2, n))
    cfg = AdvantageConfig(pass_k=k, norm_adv_by_std_in_grpo=False)
    rewards = torch.tensor(scores, dtype=torch.float64).unsqueeze(1)
    adv, _, _ = compute_advantage("grpo_passk", rewards, torch.ones(n, 1), [0] * n, cfg)
    expected = torch.tensor(_passk_brute_force(scores, k), dtype=torch.float64).unsqueeze(1)
    assert_close(adv, expected)
    if k == n:  # pass_k=None is k = group size
        default, _, _ = compute_advantage("grpo_passk", rewards, torch.ones(n, 1), [0] * n,
                                          AdvantageConfig(norm_adv_by_std_in_grpo=False))
        assert_close(default, expected)


# ------------------------------------------------------------------------------------------------
# OTB / TIR-OTB (seed 001 "IS-aware advantage estimators"; verl 0.9.1 parity in
# test_core_algos_verl_golden.py)
# ------------------------------------------------------------------------------------------------

OTB_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OTB_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
# π = 0.5 and Σπ² = 0.5 everywhere: w = 1 − 2·0.5 + 0.5 = 0.5 per token
OTB_POLICY = TokenPolicy(torch.full((2, 3), math.log(0.5), dtype=torch.float64),
                         torch.full((2, 3), 0.5, dtype=torch.float64))


def test_otb_hand_values_with_the_zero_tail() -> None:
    # G = [[1, 1, 1], [0, 0, 0]]; W = [[0.5, 1, 1.5], [0.5, 1, ·]]
    # B_0 = (1·0.5 + 0·0.5) / 1.0 = 0.5, B_1 = (1·1 + 0·1) / 2 = 0.5; at t = 2 only row 0 is
    # valid (B_2 = 1·1.5 / 1.5 = 1), but row 0 is the strictly longest member: its baseline is 0
    # from the second-longest length (2) on, so A_{0,2} = G = 1 instead of 0
    adv, ret, metrics = compute_advantage("optimal_token_baseline", OTB_REWARDS, OTB_MASK,
                                          ["g", "g"], policy=OTB_POLICY)
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    assert_close(adv, torch.tensor([[0.5, 0.5, 1.0], [-0.5, -0.5, 0.0]], dtype=torch.float64),
                 rtol=1e-7, atol=1e-7)
    assert metrics["rollout/num_groups"] == 1.0


def test_otb_is_weights_enter_squared() -> None:
    # ρ = 2 on row 0's first token: w_{0,0} = 0.5 · 4 = 2 → W_0 = [2, 2.5, 3], W_1 = [0.5, 1]
    # B_0 = 1·2 / 2.5 = 0.8, B_1 = 1·2.5 / 3.5 = 5/7
    rho = torch.ones(2, 3, dtype=torch.float64)
    rho[0, 0] = 2.0
    policy = TokenPolicy(OTB_POLICY.log_probs, OTB_POLICY.sum_pi_squared, rho)
    adv, _, _ = compute_advantage("optimal_token_baseline", OTB_REWARDS, OTB_MASK, [0, 0],
                                  policy=policy)
    expected = [[1 - 0.8, 1 - 5 / 7, 1.0], [-0.8, -5 / 7, 0.0]]
    assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-7, atol=1e-7)


def test_otb_singleton_keeps_the_return_and_needs_the_policy() -> None:
    adv, ret, _ = compute_advantage("optimal_token_baseline", OTB_REWARDS, OTB_MASK, [0, 1],
                                    policy=OTB_POLICY)
    assert torch.equal(adv, ret)
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        with pytest.raises(ValueError, match="Σπ²"):
            compute_advantage(name, OTB_REWARDS, OTB_MASK, [0, 0])


def test_tir_otb_aligns_by_valid_token_and_equals_otb_on_the_packed_layout() -> None:
    # row 0 has a tool span at positions 1–2 (mask 0): its model tokens are positions 0, 3, 4
    mask = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    rewards = torch.zeros(3, 5, dtype=torch.float64)
    rewards[0, 4], rewards[1, 2], rewards[2, 1] = 1.0, 0.5, 0.0
    g = torch.Generator().manual_seed(3)
    log_p = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    sum_sq = log_p.exp().square() + 0.1
    rho = torch.exp(0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64))
    adv, _, _ = compute_advantage("tir_optimal_token_baseline", rewards, mask, [0, 0, 0],
                                  policy=TokenPolicy(log_p, sum_sq, rho))
    # the same batch packed to the left by hand: OTB on it, scattered back, is TIR-OTB
    order = [[0, 3, 4], [0, 1, 2], [0, 1]]
    packed = [torch.zeros(3, 3, dtype=torch.float64) for _ in range(4)]
    packed_mask = torch.zeros(3, 3, dtype=torch.long)
    for i, cols in enumerate(order):
        for k, c in enumerate(cols):
            for x, src in zip(packed, (rewards, log_p, sum_sq, rho), strict=True):
                x[i, k] = src[i, c]
            packed_mask[i, k] = 1
    adv_p, _, _ = compute_advantage("optimal_token_baseline", packed[0], packed_mask, [0, 0, 0],
                                    policy=TokenPolicy(packed[1], packed[2], packed[3]))
    for i, cols in enumerate(order):
        assert_close(adv[i, cols], adv_p[i, : len(cols)])
    assert torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=torch.float64))
    # and OTB on the unpacked batch aligns by position, which differs here
    adv_otb, _, _ = compute_advantage("optimal_token_baseline", rewards, mask, [0, 0, 0],
                                      policy=TokenPolicy(log_p, sum_sq, rho))
    assert not torch.allclose(adv_otb, adv)


# ------------------------------------------------------------------------------------------------
# GDPO
# ------------------------------------------------------------------------------------------------


def test_gdpo_normalises_each_component_in_its_group_then_whitens_the_weighted_sum() -> None:
    # two groups of 2, one token each; component 1 = correctness, component 2 = format
    mask = torch.ones(4, 1)
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    config = AdvantageConfig(gdpo_weights=(1.0, 0.5))
    adv, ret, _ = compute_advantage("gdpo", torch.zeros(4, 1, dtype=torch.float64), mask,
                                    [0, 0, 1, 1], config, components=comps)
    # per group of 2 with scores (a, b), a ≠ b: std = |a − b|/√2, so A = ±(1/√2)/(1/√2 + ε)
    a = (1 / math.sqrt(2)) / (1 / math.sqrt(2) + EPS)
    c1 = [a, -a, 0.0, 0.0]  # group 1 of component 1 is all equal: exactly 0
    c2 = [-a, a, a, -a]
    summed = [x + 0.5 * y for x, y in zip(c1, c2, strict=True)]
    assert_close(adv.flatten(), torch.tensor(whiten(summed), dtype=torch.float64))
    assert torch.equal(adv, ret)
    # summed first (GRPO on r1 + r2), group 0 ties (1 + 0 = 0 + 1) and teaches nothing; GDPO
    # normalises each component apart and keeps the heavier correctness signal
    tie, _, _ = compute_advantage("grpo", comps.sum(1, keepdim=True), mask, [0, 0, 1, 1])
    assert tie[0, 0] == 0.0 and adv[0, 0] > 0


def test_gdpo_without_components_is_grpo_then_batch_whitening() -> None:
    rewards = torch.tensor([[1.0], [0.0], [0.5], [2.0]], dtype=torch.float64)
    mask = torch.ones(4, 1)
    adv, _, _ = compute_advantage("gdpo", rewards, mask, [0, 0, 1, 1])
    grpo, _, _ = compute_advantage("grpo", rewards, mask, [0, 0, 1, 1])
    assert_close(adv.flatten(), torch.tensor(whiten(grpo.flatten().tolist()),
                                             dtype=torch.float64))
    with pytest.raises(ValueError, match="gdpo_weights"):
        compute_advantage("gdpo", rewards, mask, [0, 0, 1, 1],
                          AdvantageConfig(gdpo_weights=(1.0, 2.0)))
