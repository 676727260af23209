"""Turn-level options and the pre/post-tool split of tool trajectories, on hand-built tensors."""

from __future__ import annotations

import math

import pytest
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


def test_learner_splits_every_family_at_the_first_tool_observation():
    """Hand-built tool trajectories through a real learner step: each tool/{pre,post}_tool/*
    figure equals the same statistic recomputed from the step's own tensors on that part."""
    from training.engines.embedded.trainer import EmbeddedTrainEngine
    from training.engines.model import ModelConfig
    from training.engines.train import OptimConfig, TokenBatch
    from training.runtime.learner import Learner
    from training.runtime.types import Group

    v = 100
    engine = EmbeddedTrainEngine.from_config(
        ModelConfig(vocab_size=v, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                    intermediate_size=40), seed=0, optim=OptimConfig(lr=1e-2))
    g = torch.Generator().manual_seed(0)
    # response: turn 0 (3 tokens), observation (2 tokens, mask 0), turn 1 (3 tokens incl. eos)
    mask = [1, 1, 1, 0, 0, 1, 1, 1]
    turn_ids = [0, 0, 0, 0, 0, 1, 1, 1]
    groups = []
    for gi in range(2):
        samples = []
        for j in range(3):
            response = [*torch.randint(4, v, (7,), generator=g).tolist(), 2]
            samples.append(Sample(
                group_id=gi, sample_index=j, prompt_id=f"p{gi}", prompt_ids=[1, 5, 6],
                response_ids=response, rollout_log_probs=[0.0] * 8,
                token_versions=[engine.weight_version] * 8, loss_mask=mask,
                reward=float((gi + j) % 2), turn_ids=turn_ids, tool_calls=1,
                tool_errors=int(j == 0)))
        groups.append(Group(group_id=gi, prompt_id=f"p{gi}", difficulty=0, answer="",
                            submit_step=0, samples=samples))
    flat = [s for grp in groups for s in grp.samples]
    batch = TokenBatch.from_sequences([s.prompt_ids for s in flat], [s.response_ids for s in flat])
    lps = engine.compute_log_probs(batch).log_probs
    noise = torch.Generator().manual_seed(1)
    for i, s in enumerate(flat):  # μ off by a little before the call, by more after it
        jitter = torch.randn(8, generator=noise) * torch.tensor([0.02] * 5 + [0.3] * 3)
        s.rollout_log_probs = (lps[i, :8] + jitter).tolist()
    recipe = recipe_from_dict({"rollout": {"n": 3},
                               "algorithm": {"old_logprob": "recompute",
                                             "correction": {"kind": "compis"}}})
    result = Learner(engine, recipe, keep_tensors=True).step(groups, step=0)
    assert result.trained
    m, dbg = result.metrics, result.debug
    assert dbg is not None
    loss_mask = torch.tensor([mask] * 6, dtype=torch.bool)
    pre = loss_mask & (torch.tensor([turn_ids] * 6) == 0)
    post = loss_mask & ~pre
    for name, part in (("pre_tool", pre), ("post_tool", post)):
        diff = (dbg["old_log_prob"] - dbg["rollout_log_prob"]).abs()
        assert m[f"tool/{name}/tokens"] == float(part.sum())
        assert m[f"tool/{name}/mismatch/engine/logprob_abs_diff/mean"] == pytest.approx(
            float(diff[part].mean()), rel=1e-5)
        ratio = torch.exp(dbg["current_log_prob"] - dbg["rollout_log_prob"])
        outside = ((ratio < 0.8) | (ratio > 1.2)) & part
        assert m[f"tool/{name}/clip_frac_vs_rollout"] == pytest.approx(
            float(outside.sum()) / float(part.sum()))
        engine_ratio = torch.exp(dbg["old_log_prob"] - dbg["rollout_log_prob"])[part]
        assert m[f"tool/{name}/is/engine/ratio/max"] == pytest.approx(float(engine_ratio.max()),
                                                                     rel=1e-5)
    assert m["tool/post_tool/mismatch/engine/logprob_abs_diff/mean"] > \
        m["tool/pre_tool/mismatch/engine/logprob_abs_diff/mean"]
    assert m["tool/calls_per_sample"] == 1.0
    assert m["tool/error_rate"] == pytest.approx(2 / 6)
    assert m["tool/turns_mean"] == 2.0
    assert (m["tool/partial_within_turn"], m["tool/partial_between_turns"]) == (0.0, 0.0)
