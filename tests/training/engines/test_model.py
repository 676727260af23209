import pytest
import torch

from training.engines.model import CausalLM, KVCache, ModelConfig, apply_rope, rope_cos_sin

CFG = dict(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
           intermediate_size=40)


@pytest.fixture(params=[0, 4], ids=["dense", "moe"])
def model(request):
    return CausalLM(ModelConfig(**CFG, num_experts=request.param)).init_weights(0, std=0.2)


def test_rope_is_a_rotation_hand_checked():
    # head_dim 2: position p rotates (x0, x1) by angle p·θ^0 = p
    cos, sin = rope_cos_sin(torch.tensor([[0, 1]]), head_dim=2, theta=10000.0,
                            dtype=torch.float64)
    x = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]], dtype=torch.float64)   # (B, H, S, D)
    out = apply_rope(x, cos, sin)
    c1, s1 = torch.cos(torch.tensor(1.0)).item(), torch.sin(torch.tensor(1.0)).item()
    assert out[0, 0, 0].tolist() == pytest.approx([1.0, 0.0])
    assert out[0, 0, 1].tolist() == pytest.approx([c1, s1])


def test_kv_cache_decode_equals_full_forward(model):
    ids = torch.randint(4, 30, (2, 9))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0  # left padding
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full, _ = model(ids, positions=pos, attention_mask=am)
        cache = KVCache(model.config.num_layers)
        outs = [model(ids[:, :5], positions=pos[:, :5], attention_mask=am[:, :5], cache=cache)[0]]
        for t in range(5, 9):
            outs.append(model(ids[:, t:t + 1], positions=pos[:, t:t + 1],
                              attention_mask=am[:, :t + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(outs, 1)[am.bool()], full[am.bool()],
                               atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_real_tokens(model):
    ids = torch.randint(4, 30, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    am = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        a, _ = model(ids)
        b, _ = model(padded, positions=(am.cumsum(-1) - 1).clamp(min=0), attention_mask=am)
    torch.testing.assert_close(a[0], b[0, 3:], atol=1e-5, rtol=1e-5)


def test_routes_recorded_and_replayed():
    m = CausalLM(ModelConfig(**CFG, num_experts=4, num_experts_per_tok=2)).init_weights(1, 0.2)
    ids = torch.randint(4, 30, (2, 7))
    logits, routes = m(ids)
    assert routes.shape == (2, 7, 2, 2) and routes.dtype == torch.long
    again, replayed = m(ids, replay_routes=routes)
    assert torch.equal(replayed, routes) and torch.equal(again, logits)
    forced = torch.zeros_like(routes)
    forced[..., 1] = 1                       # route everything to experts 0 and 1
    other, used = m(ids, replay_routes=forced)
    assert torch.equal(used, forced) and not torch.allclose(other, logits)
    # replay keeps the router's gradient (R3 keeps the softmax over routing logits trainable)
    other.sum().backward()
    assert m.model.layers[0].block_sparse_moe.gate.weight.grad.abs().sum() > 0


def test_config_validation_and_hf_round_trip():
    cfg = ModelConfig(**CFG, num_experts=4)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.to_hf_dict()["architectures"] == ["MixtralForCausalLM"]
    assert ModelConfig(**CFG).to_hf_dict()["model_type"] == "llama"
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(**{**CFG, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})


# --- bf16 projections on CPU (issue 16) ----------------------------------------------------------

def test_bf16_linear_accumulates_in_fp32_and_rounds_its_output():
    """Hand-made case where a bf16 accumulator and an fp32 one disagree: 1 + 2^-8 + 2^-8.

    Each term is exact in bf16 (8 bits of mantissa); their fp32 sum 1 + 2^-7 is exact in bf16
    too, while adding 2^-8 to 1 in bf16 rounds back to 1 (ties to even)."""
    from training.engines.model import Linear

    lin = Linear(3, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0**-8, 2.0**-8]]))
    lin = lin.to(torch.bfloat16)
    x = torch.ones(1, 3, dtype=torch.bfloat16)
    out = lin(x)
    assert out.dtype == torch.bfloat16
    assert out.item() == 1.0 + 2.0**-7
    # rounding of the output: 1 + 2^-9 (fp32 sum) is not a bf16 number and rounds to 1
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0**-10, 2.0**-10]], dtype=torch.bfloat16))
    assert lin(x).item() == 1.0


def test_bf16_linear_is_the_fp32_product_of_the_bf16_values_and_differentiable():
    from training.engines.model import Linear

    torch.manual_seed(0)
    lin = Linear(16, 8, bias=True).to(torch.bfloat16)
    x = torch.randn(4, 5, 16).to(torch.bfloat16).requires_grad_(True)
    out = lin(x)
    want = (x.float() @ lin.weight.float().T + lin.bias.float()).to(torch.bfloat16)
    assert torch.equal(out, want)
    out.float().sum().backward()  # gradients reach the input and the weight
    assert x.grad is not None and lin.weight.grad is not None
    assert torch.equal(lin.weight.grad.float(),
                       (torch.ones(20, 8).T @ x.detach().float()
                        .reshape(-1, 16)).to(torch.bfloat16).float())


def test_fp32_linear_is_plain_nn_linear(model):
    from training.engines.model import Linear

    torch.manual_seed(1)
    lin = Linear(16, 8, bias=False)
    x = torch.randn(3, 16)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
    assert all(type(m) is Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_bf16_matmul_accumulates_in_fp32_like_linear():
    from training.engines.model import matmul

    a = torch.tensor([[1.0, 2.0**-8, 2.0**-8]], dtype=torch.bfloat16)
    b = torch.ones(3, 1, dtype=torch.bfloat16)
    assert matmul(a, b).dtype == torch.bfloat16 and matmul(a, b).item() == 1.0 + 2.0**-7
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8)  # batched, as in attention
    assert torch.equal(matmul(q, k.transpose(-1, -2)), q @ k.transpose(-1, -2))  # fp32: plain
    qb, kb = q.bfloat16(), k.bfloat16()
    assert torch.equal(matmul(qb, kb.transpose(-1, -2)),
                       (q.bfloat16().float() @ k.bfloat16().float().transpose(-1, -2))
                       .bfloat16())
