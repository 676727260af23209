"""HF ↔ megatron weight conversion for the TransformerEngine layer spec (layout "te").

The expected names are read off megatron-core 0.16.1's source, not computed: with
``get_gpt_layer_with_transformer_engine_spec`` the attention's input norm is fused into
``linear_qkv`` (``TELayerNormColumnParallelLinear.layer_norm_weight``) and ``input_layernorm`` is
an ``IdentityOp``; a dense MLP's norm is fused into ``linear_fc1`` and ``pre_mlp_layernorm`` is an
``IdentityOp``; an MoE layer keeps ``pre_mlp_layernorm`` (a ``TENorm``) and, without grouped GEMM,
its ``SequentialMLP`` of ``local_experts.{j}``; the final norm is a ``TENorm`` (``weight``).
These tests run without TransformerEngine and without a GPU; the last one builds the TE model
itself and is skipped unless both are present.
"""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e '.[megatron]')")

import torch

from training.engines.hf_io import read_state_dict
from training.engines.megatron.convert import (
    LAYOUTS,
    default_layout,
    gpt_model_kwargs,
    hf_to_megatron,
    megatron_to_hf,
)

DENSE_TE = {
    "embedding.word_embeddings.weight",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
    "decoder.layers.0.mlp.linear_fc1.weight",
    "decoder.layers.0.mlp.linear_fc2.weight",
    "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.1.self_attention.linear_qkv.weight",
    "decoder.layers.1.self_attention.linear_proj.weight",
    "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
    "decoder.layers.1.mlp.linear_fc1.weight",
    "decoder.layers.1.mlp.linear_fc2.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
}

MOE_TE = {  # 4 experts, expert_parallel 1
    "embedding.word_embeddings.weight",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.self_attention.linear_proj.weight",
    "decoder.layers.0.pre_mlp_layernorm.weight",
    "decoder.layers.0.mlp.router.weight",
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
    "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight",
    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
    "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.1.self_attention.linear_qkv.weight",
    "decoder.layers.1.self_attention.linear_proj.weight",
    "decoder.layers.1.pre_mlp_layernorm.weight",
    "decoder.layers.1.mlp.router.weight",
    "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
    "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight",
    "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight",
    "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
    "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
    "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
    "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
    "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
}

# local name → te name, per layer (everything else is named alike)
RENAMED = {
    False: {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"},
    True: {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"},
}


def _cfg_hf(mg, experts=0, vocab=100, tie=False):
    """The tiny config and its HF weights, from the session's HF directory (conftest), with
    distinct random norm weights (freshly initialised ones are all 1: a swap would not show)."""
    hf = read_state_dict(mg.hf_dir(experts, vocab, tie))
    g = torch.Generator().manual_seed(5)
    return mg.cfg(experts, vocab, tie), {
        k: torch.randn(v.shape, generator=g) if "norm" in k else v for k, v in hf.items()}


def _exact(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # same keys, equal tensors


@pytest.mark.parametrize(("experts", "expected"), [(0, DENSE_TE), (4, MOE_TE)],
                         ids=["dense", "moe"])
def test_te_names_are_the_te_specs_parameters(mg, experts, expected):
    cfg, hf = _cfg_hf(mg, experts)
    meg = hf_to_megatron(hf, cfg, layout="te")
    assert set(meg) == expected
    tied = hf_to_megatron(_cfg_hf(mg, experts, tie=True)[1], mg.cfg(experts, tie=True),
                          layout="te")
    assert set(tied) == expected - {"output_layer.weight"}
    # fused norms are replicated whole over TP ranks, like the standalone ones
    for t in range(2):
        shard = hf_to_megatron(hf, cfg, tp=2, tp_rank=t, layout="te")
        assert set(shard) == expected
        norm = shard["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"]
        assert norm.shape == (cfg.hidden_size,)
    if experts:  # EP rank 1 holds experts 2 and 3 as its local experts 0 and 1
        shard = hf_to_megatron(hf, cfg, ep=2, ep_rank=1, layout="te")
        assert set(shard) == {n for n in expected if ".local_experts.2." not in n
                              and ".local_experts.3." not in n}


@pytest.mark.parametrize(("experts", "tie"), [(0, False), (0, True), (4, False), (4, True)],
                         ids=["dense", "dense-tied", "moe", "moe-tied"])
def test_te_round_trip_is_exact(mg, experts, tie):
    cfg, hf = _cfg_hf(mg, experts, tie=tie)
    _exact(megatron_to_hf({(0, 0): hf_to_megatron(hf, cfg, layout="te")}, cfg, layout="te"), hf)
    # TP=2 with an odd vocabulary (padded to 102)
    cfg, hf = _cfg_hf(mg, experts, vocab=101, tie=tie)
    shards = {(t, 0): hf_to_megatron(hf, cfg, tp=2, tp_rank=t, layout="te") for t in range(2)}
    _exact(megatron_to_hf(shards, cfg, tp=2, layout="te"), hf)
    if experts:  # TP=2 × EP=2
        cfg, hf = _cfg_hf(mg, experts, tie=tie)
        shards = {(t, e): hf_to_megatron(hf, cfg, tp=2, tp_rank=t, ep=2, ep_rank=e, layout="te")
                  for t in range(2) for e in range(2)}
        _exact(megatron_to_hf(shards, cfg, tp=2, ep=2, layout="te"), hf)


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_te_and_local_hold_the_same_tensors_under_the_renamed_norms(mg, experts):
    cfg, hf = _cfg_hf(mg, experts)
    for tp, t in ((1, 0), (2, 1)):
        local = hf_to_megatron(hf, cfg, tp=tp, tp_rank=t, layout="local")
        te = hf_to_megatron(hf, cfg, tp=tp, tp_rank=t, layout="te")
        renamed = {}
        for name, tensor in local.items():
            layer, sep, tail = name.partition(".layers.")
            if sep:
                i, _, rest = tail.partition(".")
                name = f"{layer}.layers.{i}.{RENAMED[bool(experts)].get(rest, rest)}"
            renamed[name] = tensor
        _exact(te, renamed)
    # by hand: layer 1's HF norms land in the fused modules (dense) / the standalone norm (MoE)
    te = hf_to_megatron(hf, cfg, layout="te")
    assert torch.equal(te["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"],
                       hf["model.layers.1.input_layernorm.weight"])
    post = hf["model.layers.1.post_attention_layernorm.weight"]
    if experts:
        assert torch.equal(te["decoder.layers.1.pre_mlp_layernorm.weight"], post)
        assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" not in te
    else:
        assert torch.equal(te["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"], post)
        assert "decoder.layers.1.pre_mlp_layernorm.weight" not in te
    assert "decoder.layers.1.input_layernorm.weight" not in te
    assert torch.equal(te["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    assert not torch.equal(hf["model.layers.1.input_layernorm.weight"], post)  # a swap shows


def test_default_layout_is_local_without_transformer_engine_or_cuda(mg):
    try:
        import transformer_engine.pytorch  # noqa: F401

        have_te = True
    except (ImportError, OSError):
        have_te = False
    if have_te and torch.cuda.is_available():
        pytest.skip("TransformerEngine and CUDA are present: the default is 'te'")
    assert default_layout() == "local"
    assert LAYOUTS == ("local", "te")
    # None means the default, for the model and the weights alike
    cfg, hf = _cfg_hf(mg)
    _exact(hf_to_megatron(hf, cfg), hf_to_megatron(hf, cfg, layout="local"))
    assert "decoder.layers.0.input_layernorm.weight" in hf_to_megatron(hf, cfg, layout=None)
    from megatron.core.transformer.identity_op import IdentityOp

    spec = gpt_model_kwargs(cfg)["transformer_layer_spec"]
    assert spec.submodules.input_layernorm is not IdentityOp  # the local spec's standalone norm
    if not have_te:
        with pytest.raises(ImportError, match="layout 'te' needs TransformerEngine"):
            gpt_model_kwargs(cfg, layout="te")


def test_unknown_layout_names_the_allowed_ones(mg):
    cfg, hf = _cfg_hf(mg)
    msg = r"unknown megatron layer layout 'fused'; use one of \('local', 'te'\)"
    with pytest.raises(ValueError, match=msg):
        hf_to_megatron(hf, cfg, layout="fused")
    with pytest.raises(ValueError, match=msg):
        megatron_to_hf({(0, 0): hf_to_megatron(hf, cfg)}, cfg, layout="fused")
    with pytest.raises(ValueError, match=msg):
        gpt_model_kwargs(cfg, layout="fused")


@pytest.mark.skipif(default_layout() != "te", reason="needs TransformerEngine and a CUDA device")
@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_te_engine_loads_and_exports_hf_weights_exactly(mg, experts):
    """On a GPU with TE the in-process engine builds the TE spec; loading checks the converted
    names against the model's parameters exactly, exporting reverses the conversion."""
    from training.engines.megatron.engine import MegatronTrainEngine

    d = mg.hf_dir(experts)
    engine = MegatronTrainEngine.from_pretrained(d, optim=mg.OPTIM, launcher="local")
    try:
        _exact(engine.hf_state_dict(), read_state_dict(d))
    finally:
        engine.close()
