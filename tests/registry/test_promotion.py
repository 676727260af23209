"""best_eval promotes a later candidate only beyond noise (issue 26); arithmetic by hand."""

import math

import pytest

from registry.gates.stats import proportion_se, z_limit
from registry.promotion import Contender, choose


def test_first_passing_takes_the_first():
    c = choose("first_passing", [Contender("a", 0.5, 58), Contender("b", 0.9, 58)])
    assert c.index == 0


def test_a_better_eval_inside_the_noise_keeps_the_first_passing_candidate():
    # the seed ladder's one-step stage: 0.517 vs 0.655 on 58 prompts is ≈ 1.5 SE < z_{1−0.05/1}
    c = choose("best_eval", [Contender("r3", 0.517, 58), Contender("r3-m2po", 0.655, 58)])
    se = math.hypot(proportion_se(0.517, 58), proportion_se(0.655, 58))
    assert c.index == 0
    assert f"r3-m2po not distinguishable from r3 (+0.138, SE {se:.3f}" in c.reason


def test_a_better_eval_beyond_the_noise_wins():
    # 0.40 vs 0.75 on 128 prompts each: ≈ 5.9 SE > z_{1−0.05/2} = 1.96 (two comparisons)
    c = choose("best_eval", [Contender("a", 0.40, 128), Contender("b", 0.75, 128),
                             Contender("c", 0.76, 128)])
    assert c.index == 1, c.reason
    assert "b better than a beyond noise" in c.reason and "c not distinguishable from b" \
        in c.reason
    assert f"> {z_limit(0.05, 2):.2f}" in c.reason


def test_a_worse_eval_beyond_the_noise_is_called_worse_not_a_tie():
    # the replayed ladder's one-step stage: r3-dppo 0.114 below no-correction on 114 prompts is
    # far past the limit on the wrong side; it is not chosen, and the reason says why
    c = choose("best_eval", [Contender("a", 0.70, 128), Contender("b", 0.35, 128)])
    se = math.hypot(proportion_se(0.70, 128), proportion_se(0.35, 128))
    assert c.index == 0
    assert f"b worse than a beyond noise (-0.350 = {-0.35 / se:.2f} SE < -1.64" in c.reason
    assert "not distinguishable" not in c.reason


def test_without_eval_n_the_higher_eval_wins_and_says_the_noise_is_unknown():
    c = choose("best_eval", [Contender("a", 0.5, None), Contender("b", 0.6, None)])
    assert c.index == 1 and "noise unknown" in c.reason
    assert choose("best_eval", []).index is None


@pytest.mark.parametrize("rule", ["first_passing", "best_eval"])
def test_one_passing_candidate_is_promoted(rule):
    assert choose(rule, [Contender("only", None, None)]).index == 0
