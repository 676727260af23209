import math

import pytest
import torch

from training.engines.model import CausalLM, ModelConfig
from training.engines.sampling import (
    FP8_MAX,
    PrecisionConfig,
    SequenceRandom,
    apply_precision,
    fake_quantize_fp8,
    sample_next_tokens,
    sampling_log_probs,
)

LOGITS = torch.tensor([[math.log(4.0), math.log(3.0), math.log(2.0), math.log(1.0)]])
# softmax at T = 1: p = [0.4, 0.3, 0.2, 0.1]


def _lp(temperature=1.0, top_p=1.0, top_k=-1, logits=LOGITS):
    return sampling_log_probs(logits, torch.tensor([temperature]), torch.tensor([top_p]),
                              torch.tensor([top_k]))[0]


def test_temperature_scales_logits():
    # T = 0.5 squares the odds: p ∝ [16, 9, 4, 1] / 30
    torch.testing.assert_close(_lp(temperature=0.5).exp(),
                               torch.tensor([16.0, 9.0, 4.0, 1.0]) / 30)


def test_top_k_renormalises_over_the_kept_tokens():
    # keep {0.4, 0.3}: p' = [0.4, 0.3] / 0.7
    p = _lp(top_k=2).exp()
    torch.testing.assert_close(p, torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0]))


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # mass before each token: [0, 0.4, 0.7, 0.9]; top_p = 0.65 keeps tokens with mass before < 0.65
    p = _lp(top_p=0.65).exp()
    torch.testing.assert_close(p, torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0]))
    # top_p = 0.75 also keeps the third token (mass before it 0.7 < 0.75): [0.4, 0.3, 0.2] / 0.9
    p = _lp(top_p=0.75).exp()
    torch.testing.assert_close(p, torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9)


def test_top_p_applies_to_the_top_k_renormalised_mass():
    # top-3 → [0.4, 0.3, 0.2]/0.9 = [.444, .333, .222]; mass before: [0, .444, .778];
    # top_p = 0.75 keeps two tokens (0.778 >= 0.75)
    p = _lp(top_k=3, top_p=0.75).exp()
    torch.testing.assert_close(p, torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0]))


def test_inverse_cdf_sampling_with_given_uniforms():
    # CDF of [0.4, 0.3, 0.2, 0.1] is [0.4, 0.7, 0.9, 1.0]
    u = torch.tensor([0.0, 0.39, 0.41, 0.71, 0.95, 0.999999])
    n = u.shape[0]
    tokens, lps = sample_next_tokens(LOGITS.expand(n, 4), torch.ones(n), torch.ones(n),
                                     torch.full((n,), -1), u)
    assert tokens.tolist() == [0, 0, 1, 2, 3, 3]
    torch.testing.assert_close(lps, torch.log(torch.tensor([0.4, 0.4, 0.3, 0.2, 0.1, 0.1])))


def test_sampled_log_prob_is_of_the_truncated_distribution():
    tokens, lps = sample_next_tokens(LOGITS, torch.ones(1), torch.ones(1), torch.tensor([2]),
                                     torch.tensor([0.99]))
    # top-2 CDF [0.571, 1.0]: u = 0.99 → token 1 with p' = 0.3 / 0.7, never a cut token
    assert tokens.tolist() == [1]
    torch.testing.assert_close(lps, torch.log(torch.tensor([0.3 / 0.7])))


def test_greedy_takes_argmax_and_reports_the_untruncated_t1_log_prob():
    tokens, lps = sample_next_tokens(LOGITS, torch.zeros(1), torch.tensor([0.1]),
                                     torch.tensor([1]), torch.tensor([0.9]))
    assert tokens.tolist() == [0]
    torch.testing.assert_close(lps, torch.log(torch.tensor([0.4])))


def test_mixed_rows_use_their_own_parameters():
    logits = LOGITS.expand(3, 4)
    lp = sampling_log_probs(logits, torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0]),
                            torch.tensor([-1, -1, 1]))
    torch.testing.assert_close(lp[0].exp(), torch.tensor([0.4, 0.3, 0.2, 0.1]))
    torch.testing.assert_close(lp[1].exp(), torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert lp[2].exp().tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sequence_random_is_reproducible_and_engine_seed_only_moves_noise():
    a, b, c = SequenceRandom(7), SequenceRandom(7), SequenceRandom(7, engine_seed=1)
    assert [a.uniform() for _ in range(3)] == [b.uniform() for _ in range(3)]
    assert c.uniform() == SequenceRandom(7).uniform()
    torch.testing.assert_close(a.noise(5, 0.1), b.noise(5, 0.1))
    assert not torch.equal(SequenceRandom(7).noise(5, 0.1), c.noise(5, 0.1))
    assert SequenceRandom(7).noise(10_000, 0.1).std().item() == pytest.approx(0.1, rel=0.05)


def test_fake_fp8_rounds_to_the_fp8_grid_with_a_per_tensor_scale():
    w = torch.tensor([0.0, 0.01, -0.3, 1.0, 0.123])
    q = fake_quantize_fp8(w)
    scale = 1.0 / FP8_MAX  # amax = 1.0
    grid = (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    torch.testing.assert_close(q, grid)
    assert q[3].item() == 1.0  # amax maps to 448 exactly
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4
    assert bool(((q - w).abs() <= 0.0625 * w.abs() + 1e-7).all())
    assert torch.equal(fake_quantize_fp8(torch.zeros(3)), torch.zeros(3))


def test_apply_precision_dtypes_and_fp8_weight_rounding():
    cfg = ModelConfig(vocab_size=20, hidden_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=2, intermediate_size=24, num_experts=2, num_experts_per_tok=1)
    base = CausalLM(cfg).init_weights(0, std=0.2)
    sd = {k: v.clone() for k, v in base.state_dict().items()}
    models = {}
    for dtype in ("fp32", "bf16", "fp8"):
        m = CausalLM(cfg)
        m.load_state_dict(sd)
        models[dtype] = apply_precision(m, PrecisionConfig(dtype=dtype))
    assert next(models["fp32"].parameters()).dtype == torch.float32
    assert next(models["fp8"].parameters()).dtype == torch.bfloat16
    assert not models["bf16"].training and not next(models["bf16"].parameters()).requires_grad
    q8 = models["fp8"].state_dict()
    b16 = models["bf16"].state_dict()
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(q8[w], b16[w])
    torch.testing.assert_close(q8[w].float(), fake_quantize_fp8(sd[w]).to(torch.bfloat16).float())
    for kept in ("lm_head.weight", "model.embed_tokens.weight",
                 "model.layers.0.block_sparse_moe.gate.weight"):
        assert torch.equal(q8[kept], b16[kept]), kept
    with pytest.raises(ValueError, match="dtype"):
        PrecisionConfig(dtype="fp16")
