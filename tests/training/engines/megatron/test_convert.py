"""HF ↔ megatron weight conversion (TP / EP split and merge, pipeline stages) and the config
mapping."""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e '.[megatron]')")

import torch

from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.hf_io import state_dict_for_export
from training.engines.megatron.convert import (
    check_parallel_sizes,
    from_stages,
    gpt_model_kwargs,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
    stage_layers,
    to_stage,
    transformer_config,
)


def _hf(mg, experts=0, vocab=100, tie=False):
    model = EmbeddedTrainEngine.from_config(mg.cfg(experts, vocab, tie), seed=7).model
    return mg.cfg(experts, vocab, tie), state_dict_for_export(model)


def _assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(("experts", "tie"), [(0, False), (4, False), (0, True)],
                         ids=["dense", "moe", "tied"])
def test_round_trip_tp1_is_exact(mg, experts, tie):
    cfg, hf = _hf(mg, experts, tie=tie)
    meg = hf_to_megatron(hf, cfg)
    assert ("output_layer.weight" in meg) == (not tie)
    # the fused layouts megatron expects
    per_group = (cfg.num_heads // cfg.num_kv_heads + 2) * cfg.head_dim
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (cfg.num_kv_heads * per_group, cfg.hidden_size)
    assert torch.equal(qkv[: per_group - 2 * cfg.head_dim],
                       hf["model.layers.0.self_attn.q_proj.weight"][: 2 * cfg.head_dim])
    assert torch.equal(qkv[per_group - 2 * cfg.head_dim: per_group - cfg.head_dim],
                       hf["model.layers.0.self_attn.k_proj.weight"][: cfg.head_dim])
    if experts:
        fc1 = meg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
        e = "model.layers.1.block_sparse_moe.experts.3."
        assert torch.equal(fc1, torch.cat([hf[e + "w1.weight"], hf[e + "w3.weight"]]))
    else:
        fc1 = meg["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([hf["model.layers.1.mlp.gate_proj.weight"],
                                           hf["model.layers.1.mlp.up_proj.weight"]]))
    _assert_same(megatron_to_hf({(0, 0): meg}, cfg), hf)


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_tp2_split_and_merge_is_exact_with_vocab_padding(mg, experts):
    cfg, hf = _hf(mg, experts, vocab=101)  # odd vocabulary: padded to 102 over 2 ranks
    assert padded_vocab_size(101, 2) == 102
    # the local layout's norm names (the TE layout: test_convert_te.py)
    shards = {(t, 0): hf_to_megatron(hf, cfg, tp=2, tp_rank=t, layout="local")
              for t in range(2)}
    full = hf_to_megatron(hf, cfg, layout="local")
    for name, t in full.items():
        a, b = shards[(0, 0)][name], shards[(1, 0)][name]
        if name.endswith(("layernorm.weight", "router.weight")):
            assert torch.equal(a, t) and torch.equal(b, t), name  # replicated
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert a.shape[1] == t.shape[1] // 2, name  # row parallel
        elif name.endswith(("word_embeddings.weight", "output_layer.weight")):
            assert a.shape[0] == b.shape[0] == 51, name
            assert torch.equal(b[-1], torch.zeros_like(b[-1]))  # the padding row
        else:
            assert a.shape[0] == t.shape[0] // 2, name  # column parallel
    # rank t's fc1 is [gate_t; up_t], not a slice of [gate; up]
    g = hf["model.layers.0.mlp.gate_proj.weight" if not experts
           else "model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    key = ("decoder.layers.0.mlp.linear_fc1.weight" if not experts
           else "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")
    assert torch.equal(shards[(1, 0)][key][: g.shape[0] // 2], g[g.shape[0] // 2:])
    _assert_same(megatron_to_hf(shards, cfg, tp=2, layout="local"), hf)


def test_tp2_ep2_split_and_merge_is_exact(mg):
    cfg, hf = _hf(mg, experts=4)
    shards = {(t, e): hf_to_megatron(hf, cfg, tp=2, tp_rank=t, ep=2, ep_rank=e)
              for t in range(2) for e in range(2)}
    # EP rank 1 holds experts 2 and 3 as its local experts 0 and 1
    w2 = hf["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    local = shards[(0, 1)]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(local, w2[:, : w2.shape[1] // 2])
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight" not in shards[(0, 1)]
    _assert_same(megatron_to_hf(shards, cfg, tp=2, ep=2), hf)


def test_merge_needs_every_rank(mg):
    cfg, hf = _hf(mg)
    with pytest.raises(ValueError, match=r"missing \[\(1, 0\)\]"):
        megatron_to_hf({(0, 0): hf_to_megatron(hf, cfg, tp=2, tp_rank=0)}, cfg, tp=2)


def test_parallel_sizes_that_do_not_divide_the_model_name_the_fix(mg):
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide num_heads=4"):
        check_parallel_sizes(mg.cfg(), tp=3)
    with pytest.raises(ValueError, match="expert_parallel=3 must divide num_experts=4"):
        check_parallel_sizes(mg.cfg(4), ep=3)
    check_parallel_sizes(mg.cfg(4), tp=2, ep=2)


def test_transformer_config_mapping(mg):
    cfg = mg.cfg(4)
    tf = transformer_config(cfg, tp=2, on_cpu=True)
    assert (tf.num_layers, tf.hidden_size, tf.num_attention_heads, tf.num_query_groups,
            tf.kv_channels, tf.ffn_hidden_size) == (2, 32, 4, 2, 8, 48)
    assert tf.normalization == "RMSNorm" and tf.layernorm_epsilon == cfg.rms_norm_eps
    assert tf.gated_linear_unit and tf.activation_func is torch.nn.functional.silu
    assert not tf.add_bias_linear and not tf.add_qkv_bias
    assert tf.hidden_dropout == tf.attention_dropout == 0.0
    assert (tf.num_moe_experts, tf.moe_router_topk, tf.moe_router_pre_softmax,
            tf.moe_router_score_function, tf.moe_aux_loss_coeff) == (4, 2, False, "softmax", 0.0)
    assert tf.moe_enable_routing_replay and tf.calculate_per_token_loss
    kw = gpt_model_kwargs(cfg, tp=2)
    assert kw["rotary_base"] == cfg.rope_theta and kw["position_embedding_type"] == "rope"
    assert kw["vocab_size"] == 100 and not kw["share_embeddings_and_output_weights"]
    assert kw["parallel_output"] is False


def test_megatron_router_weights_equal_mixtral_softmax_topk_renormalised():
    """Mixtral: softmax over all experts, top-k, renormalise. Megatron (pre_softmax=False):
    top-k of the logits, softmax over those k. Same experts, same weights — also when the
    experts are replayed."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g)
    probs, routing_map = topk_routing_with_score_function(logits, 2)
    p = torch.softmax(logits, dim=-1)
    top_w, top_i = p.topk(2, dim=-1)
    mixtral = torch.zeros_like(p).scatter(1, top_i, top_w / top_w.sum(-1, keepdim=True))
    assert torch.equal(routing_map, mixtral > 0)
    torch.testing.assert_close(probs, mixtral, atol=1e-6, rtol=0)
    # replay: the given experts, weights renormalised over them
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    replay = RouterReplay()
    RouterReplay.global_router_replay_instances.remove(replay)
    forced = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(64)])
    replay.set_target_indices(forced)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, _ = topk_routing_with_score_function(logits, 2, router_replay=replay)
    w = p.gather(1, forced)
    torch.testing.assert_close(probs.gather(1, forced), w / w.sum(-1, keepdim=True),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_pipeline_stages_split_and_merge_exactly(mg, tie):
    cfg, hf = _hf(mg, experts=4, tie=tie)
    full = hf_to_megatron(hf, cfg, layout="local")
    first, last = (to_stage(full, cfg, pp=2, pp_rank=r) for r in range(2))
    assert stage_layers(cfg, 2, 1) == range(1, 2)
    # stage-local layer numbers; the embedding on the first stage, the head on the last
    assert torch.equal(first["decoder.layers.0.self_attention.linear_qkv.weight"],
                       full["decoder.layers.0.self_attention.linear_qkv.weight"])
    assert torch.equal(last["decoder.layers.0.self_attention.linear_qkv.weight"],
                       full["decoder.layers.1.self_attention.linear_qkv.weight"])
    assert not any(k.startswith("decoder.layers.1.") for k in (*first, *last))
    assert "embedding.word_embeddings.weight" not in last
    assert "decoder.final_layernorm.weight" not in first and "output_layer.weight" not in first
    # tied: the last stage's output layer is its own copy of the word embeddings
    head = last["output_layer.weight"]
    assert torch.equal(head, full["embedding.word_embeddings.weight"] if tie
                       else full["output_layer.weight"])
    assert len(first) + len(last) == len(full) + int(tie)
    _assert_same(from_stages({0: first, 1: last}, cfg, pp=2), full)
    assert to_stage(full, cfg, pp=1, pp_rank=0) == full
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        from_stages({0: first}, cfg, pp=2)
    with pytest.raises(ValueError, match="pipeline_parallel=3 must divide num_layers=2"):
        stage_layers(cfg, 3, 0)
