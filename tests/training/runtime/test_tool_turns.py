"""Turn-level options and the pre/post-tool split of tool trajectories, on hand-built tensors."""

from __future__ import annotations

import math

import torch

from training.algorithms.advantages import (
    AdvantageConfig,
    compute_advantage,
    turn_level_grpo_advantage,
)
from training.algorithms.rollout_correction import PRESETS
from training.recipe import recipe_from_dict
from training.runtime.learner import (
    _turn_tensor,
    apply_correction,
    apply_correction_per_turn,
    per_turn_rows,
    tool_split_masks,
)
from training.runtime.types import Sample


def _rewards_on_last(mask: torch.Tensor, r: list[float]) -> torch.Tensor:
    out = torch.zeros(mask.shape)
    for i, row in enumerate(mask):
        out[i, int(row.nonzero().max())] = r[i]
    return out


def test_turn_level_grpo_uses_the_samples_that_reached_each_turn():
    # one group of 3: sample 0 answers in turn 0; samples 1 and 2 call a tool, answer in turn 1
    # (position 2 is the observation: not a loss token)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 1, 1], [1, 1, 0, 1, 1]], dtype=torch.bool)
    turns = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]])
    r = [1.0, 0.0, 1.0]
    rewards = _rewards_on_last(mask, r)
    cfg = AdvantageConfig(norm_adv_by_std_in_grpo=False)
    adv, _, _ = turn_level_grpo_advantage(rewards, mask, turns, [0, 0, 0], cfg)
    # turn 0: every sample, mean 2/3; turn 1: samples 1 and 2, mean 1/2
    want = torch.tensor([[1 / 3, 1 / 3, 0, 0, 0],
                         [-2 / 3, -2 / 3, 0, -0.5, -0.5],
                         [1 / 3, 1 / 3, 0, 0.5, 0.5]])
    torch.testing.assert_close(adv, want)
    # with the std: turn 1 std (Bessel) = 0.7071…, turn 0 std = 0.5773…
    adv_std, _, _ = turn_level_grpo_advantage(rewards, mask, turns, [0, 0, 0],
                                              AdvantageConfig(epsilon=1e-12))
    assert math.isclose(float(adv_std[1, 3]), -0.5 / math.sqrt(0.5), rel_tol=1e-5)
    assert math.isclose(float(adv_std[0, 0]), (1 / 3) / math.sqrt(1 / 3), rel_tol=1e-5)
    # a single-turn batch: exactly grpo
    flat = torch.zeros_like(turns)
    grpo, _, _ = compute_advantage("grpo", rewards, mask, [0, 0, 0], cfg)
    same, _, _ = turn_level_grpo_advantage(rewards, mask, flat, [0, 0, 0], cfg)
    torch.testing.assert_close(same, grpo)


def test_per_turn_rows_and_the_pre_post_split():
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    turns = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
    rows, masks = per_turn_rows(turns, mask)
    assert rows.tolist() == [0, 0, 1, 2]
    assert masks.int().tolist() == [[1, 1, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]]
    split = tool_split_masks(turns, mask)
    assert split["pre_tool"].int().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert split["post_tool"].int().tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_turn_isolated_sequence_is_weights():
    # sequence TIS (C = 2): log-ratios 0.1, 0.2 in turn 0, −0.5 in turn 1; position 2 is the
    # observation (masked: its ratio must not count anywhere)
    recipe = recipe_from_dict({"algorithm": {"correction": {"kind": "preset",
                                                            "name": "decoupled_seq_is"}}})
    corr = recipe.algorithm.correction
    preset = PRESETS["decoupled_seq_is"]()
    mu = torch.zeros(1, 4)
    prox = torch.tensor([[0.1, 0.2, 5.0, -0.5]])
    mask = torch.tensor([[1, 1, 0, 1]], dtype=torch.bool)
    turns = torch.tensor([[0, 0, 0, 1]])
    whole = apply_correction(corr, preset, prox, prox, mu, mask)
    assert whole.weights is not None
    torch.testing.assert_close(whole.weights[mask], torch.full((3,), math.exp(-0.2)))
    per = apply_correction_per_turn(corr, preset, prox, prox, mu, mask, turns)
    assert per.weights is not None
    torch.testing.assert_close(per.weights[mask], torch.tensor(
        [math.exp(0.3), math.exp(0.3), math.exp(-0.5)]))
    assert per.keep.tolist() == mask.tolist()


def test_turn_tensor_of_a_batch():
    def sample(turn_ids, n):
        return Sample(group_id=0, sample_index=0, prompt_id="p", prompt_ids=[1],
                      response_ids=[5] * n, rollout_log_probs=[0.0] * n,
                      token_versions=[0] * n, loss_mask=[1] * n, reward=0.0, turn_ids=turn_ids)

    assert _turn_tensor([sample([], 2)], (1, 3)) is None
    t = _turn_tensor([sample([0, 0, 1], 3), sample([], 1)], (2, 4))
    assert t is not None and t.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
