"""The backend-independent pieces of the train-engine protocol (training/engines/train.py)."""

import math

import pytest
import torch

from training.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig, agg_loss
from training.engines.train import (
    SEQUENCE_OBJECTIVE_LOSSES,
    OptimConfig,
    TokenBatch,
    loss_agg_mode_for,
    lr_multiplier,
    micro_batch_slices,
    micro_batch_weights,
    sequence_key,
)


def _batch(**kw):
    # prompt lengths 2, 3, 1; response lengths 3, 0, 2
    return TokenBatch.from_sequences([[1, 5], [1, 6, 7], [1]], [[8, 9, 2], [], [10, 2]],
                                     pad_token_id=0, **kw)


def test_from_sequences_layout():
    b = _batch()
    assert b.input_ids.tolist() == [[1, 5, 8, 9, 2], [1, 6, 7, 0, 0], [1, 10, 2, 0, 0]]
    assert b.attention_mask.long().tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert b.prompt_lens.tolist() == [2, 3, 1] and b.response_lens.tolist() == [3, 0, 2]
    assert b.response_mask.long().tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 0]]
    assert b.responses.tolist() == [[8, 9, 2], [0, 0, 0], [10, 2, 0]]
    # response token j of row b sits at P_b + j
    assert b.response_positions.tolist() == [[2, 3, 4], [0, 0, 0], [1, 2, 0]]
    assert (b.batch_size, b.seq_len, b.response_len) == (3, 5, 3)
    assert b.num_tokens == 5 + 3 + 3 and b.num_loss_tokens == 5
    assert b.sequence(0) == ([1, 5], [8, 9, 2]) and b.sequence(1) == ([1, 6, 7], [])


def test_loss_masks_routes_and_width():
    routes = [torch.zeros(4, 2, 1), None, [[[1], [0]], [[1], [1]]]]
    b = _batch(loss_masks=[[1, 0, 1], [], [0, 1]], routes=routes, response_len=6)
    assert b.response_mask.long().tolist() == [[1, 0, 1, 0, 0, 0], [0] * 6, [0, 1, 0, 0, 0, 0]]
    assert b.routes is not None and b.routes[1] is None
    assert b.routes[0].dtype == torch.int32 and b.routes[2].shape == (2, 2, 1)
    with pytest.raises(ValueError, match="loss_masks"):
        _batch(loss_masks=[[1], [], [0, 1]])
    with pytest.raises(ValueError, match="response_len"):
        _batch(response_len=2)


def test_select_and_split_keep_widths():
    b = _batch(routes=[torch.zeros(4, 1, 1), torch.ones(2, 1, 1), torch.zeros(2, 1, 1)])
    sub = b.select([2, 0])
    assert sub.input_ids.tolist() == [[1, 10, 2, 0, 0], [1, 5, 8, 9, 2]]
    assert sub.routes is not None and sub.routes[0].shape == (2, 1, 1)
    parts = b.split(2)
    assert [p.batch_size for p in parts] == [2, 1]
    assert all(p.seq_len == 5 and p.response_len == 3 for p in parts)


def test_validation_names_the_problem():
    b = _batch()
    bad_mask = b.response_mask.clone()
    bad_mask[1, 0] = True  # row 1 has no response
    with pytest.raises(ValueError, match="past a response's end"):
        TokenBatch(b.input_ids, b.attention_mask, b.prompt_lens, b.response_lens, bad_mask)
    with pytest.raises(ValueError, match="at least one token"):
        TokenBatch.from_sequences([[]], [[3]])
    with pytest.raises(ValueError, match="routes has 1 entries"):
        TokenBatch(b.input_ids, b.attention_mask, b.prompt_lens, b.response_lens,
                   b.response_mask, (None,))


def test_sequence_key_depends_on_tokens_only():
    # routes depend on the token sequence alone (not on the prompt/response split or padding)
    b = TokenBatch.from_sequences([[1, 5], [1, 5], [1], [1, 5]], [[6], [6], [5, 6], [7]],
                                  response_len=4)
    assert sequence_key(b, 0) == sequence_key(b, 1) == sequence_key(b, 2)
    assert sequence_key(b, 0) != sequence_key(b, 3)


def test_lr_schedules_by_hand():
    assert lr_multiplier(OptimConfig(), 123) == 1.0
    warm = OptimConfig(lr_schedule="linear_warmup", warmup_steps=4)
    assert [lr_multiplier(warm, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    # after warm-up p = (s − 2) / 4 ; factor = 0.1 + 0.9 · ½(1 + cos(π p))
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))
                             for p in (0.0, 0.25, 0.5, 0.75)] + [0.1, 0.1]
    got = [lr_multiplier(cos, s) for s in range(8)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_optim_config_validation():
    with pytest.raises(ValueError, match="no warm-up"):
        OptimConfig(warmup_steps=3)
    with pytest.raises(ValueError, match="total_steps"):
        OptimConfig(lr_schedule="cosine", warmup_steps=3, total_steps=3)
    with pytest.raises(ValueError, match="grad_clip"):
        OptimConfig(grad_clip=0.0)
    with pytest.raises(ValueError, match="lr_schedule"):
        OptimConfig(lr_schedule="step")


def test_micro_batch_slices():
    assert micro_batch_slices(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert micro_batch_slices(5, None) == [slice(0, 5)]
    assert micro_batch_slices(3, 10) == [slice(0, 3)]
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batch_slices(3, 0)


def test_micro_batch_weights_by_hand():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    slices = [slice(0, 2), slice(2, 4)]
    # token-mean: 3 tokens of 6 / 3 of 6 ; seq-mean: 1 non-empty sequence of 3 / 2 of 3
    assert micro_batch_weights(mask, slices, "token-mean") == [3 / 6, 3 / 6]
    assert micro_batch_weights(mask, slices, "seq-mean-token-mean") == [1 / 3, 2 / 3]
    assert micro_batch_weights(mask, slices, "token-sum") == [1.0, 1.0]  # a sum of sums
    assert micro_batch_weights(torch.zeros(2, 2, dtype=torch.bool), [slice(0, 2)],
                               "token-mean") == [0.0]


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum",
                                  "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_weighted_micro_batch_aggregates_equal_the_global_one(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(7, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(7, 5, generator=g) > 0.4
    mask[3] = False  # an empty sequence
    slices = micro_batch_slices(7, 3)
    weights = micro_batch_weights(mask, slices, mode)
    combined = sum(w * agg_loss(loss[s], mask[s], mode) for s, w in zip(slices, weights,
                                                                         strict=True))
    torch.testing.assert_close(combined, agg_loss(loss, mask, mode))


def test_loss_agg_mode_for_every_registered_loss():
    cfg = PolicyLossConfig(loss_agg_mode="token-mean",
                           sequence_objective_agg_mode="seq-mean-token-sum")
    for name in POLICY_LOSSES.names():
        want = "seq-mean-token-sum" if name in SEQUENCE_OBJECTIVE_LOSSES else "token-mean"
        assert loss_agg_mode_for(name, cfg) == want
    assert set(POLICY_LOSSES.names()) >= SEQUENCE_OBJECTIVE_LOSSES
