"""response_log_probs: log-probs, entropy and Σ_v π_v² of the response tokens, by hand."""

import math

import torch

from training.engines.objective import micro_batch_log_probs, response_log_probs
from training.engines.train import TokenBatch


def _three_token_case():
    # prompt [0], response [2, 1]: response token j is predicted at position j (P − 1 + j)
    batch = TokenBatch.from_sequences([[0]], [[2, 1]])
    probs = torch.tensor([[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]]])
    return batch, probs.log()  # logits = log p: softmax(logits) = p


def test_sum_pi_squared_by_hand_on_a_three_token_vocab():
    batch, logits = _three_token_case()
    out = response_log_probs(logits, batch, 1.0, with_entropy=True, with_sum_pi_squared=True)
    # position 0: .25 + .0625 + .0625 ; position 1: .04 + .09 + .25
    torch.testing.assert_close(out.sum_pi_squared, torch.tensor([[0.375, 0.38]]))
    torch.testing.assert_close(out.log_probs, torch.tensor([[math.log(0.25), math.log(0.3)]]))
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    h1 = -(0.2 * math.log(0.2) + 0.3 * math.log(0.3) + 0.5 * math.log(0.5))
    torch.testing.assert_close(out.entropy, torch.tensor([[h0, h1]]))
    # W's per-token term 1 − 2 π(y) + Σπ² is ‖e_y − π‖²: (.5² + .75² + .25²) at position 0
    w0 = 1 - 2 * 0.25 + 0.375
    assert w0 == 0.5 ** 2 + 0.75 ** 2 + 0.25 ** 2


def test_temperature_and_not_asked():
    batch, logits = _three_token_case()
    # T = 2: softmax(log p / 2) ∝ √p
    out = response_log_probs(logits, batch, 2.0, with_entropy=False, with_sum_pi_squared=True)
    q = torch.tensor([0.5, 0.25, 0.25]).sqrt()
    q = q / q.sum()
    assert out.entropy is None
    torch.testing.assert_close(out.sum_pi_squared[0, 0], (q * q).sum())
    out = response_log_probs(logits, batch, 1.0, with_entropy=True)
    assert out.sum_pi_squared is None and out.entropy is not None


def test_sum_pi_squared_is_zero_past_the_response_and_gathered_over_micro_batches():
    batch = TokenBatch.from_sequences([[0], [0]], [[2, 1], [1]])
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    logits = probs.log().expand(2, 3, 3).clone()

    def forward(rows):
        b = batch.select(rows)
        out = response_log_probs(logits[rows], b, 1.0, True, True)
        return out.log_probs, out.entropy, out.sum_pi_squared, None

    res = micro_batch_log_probs(forward, batch, micro_batch_size=1, with_entropy=True,
                                is_moe=False, weight_version=3)
    torch.testing.assert_close(res.sum_pi_squared, torch.tensor([[0.375, 0.38], [0.375, 0.0]]))
    # a forward without Σπ² (an engine that does not compute it): None, never a partial tensor
    res = micro_batch_log_probs(lambda r: (*forward(r)[:2], None, None), batch,
                                micro_batch_size=1, with_entropy=True, is_moe=False,
                                weight_version=3)
    assert res.sum_pi_squared is None
