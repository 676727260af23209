"""Weights and config between our HF layout and megatron-core's GPTModel.

Two layer specs ("layouts", :data:`LAYOUTS`): ``"local"`` (``get_gpt_layer_local_spec``, torch and
megatron modules, runs on CPUs) and ``"te"`` (``get_gpt_layer_with_transformer_engine_spec``,
TransformerEngine modules, CUDA only). :func:`default_layout` is ``"te"`` when TransformerEngine
imports and a CUDA device exists, else ``"local"``. The model (:func:`gpt_model_kwargs`) and the
weights (:func:`hf_to_megatron`, :func:`megatron_to_hf`) must use the same layout; all three
default to :func:`default_layout`.

Hugging Face names (what :mod:`training.engines.model` and every checkpoint directory use) on the
left, megatron-core 0.16.1's GPTModel names on the right (``L.`` = ``model.layers.{i}.`` /
``decoder.layers.{i}.``). The layouts differ only in where a layer's two RMSNorm weights live:
the TE spec fuses a norm into the linear layer after it (``TELayerNormColumnParallelLinear``,
whose norm weight is ``layer_norm_weight``) — except before an MoE block, which keeps a
standalone norm module. Everything else, ``decoder.final_layernorm.weight`` included, is named
alike:

================================================  ===============================================
``model.embed_tokens.weight`` (V, d)              ``embedding.word_embeddings.weight`` (Vp, d)
``L.input_layernorm.weight``                      ``L.input_layernorm.weight`` (local),
                                                  ``L.self_attention.linear_qkv.layer_norm_weight``
                                                  (te)
``L.self_attn.{q,k,v}_proj.weight``               ``L.self_attention.linear_qkv.weight``
``L.self_attn.o_proj.weight``                     ``L.self_attention.linear_proj.weight``
``L.post_attention_layernorm.weight``             ``L.pre_mlp_layernorm.weight`` (local; te MoE),
                                                  ``L.mlp.linear_fc1.layer_norm_weight`` (te dense)
``L.mlp.{gate,up}_proj.weight`` (dense)           ``L.mlp.linear_fc1.weight`` = [gate; up]
``L.mlp.down_proj.weight`` (dense)                ``L.mlp.linear_fc2.weight``
``L.block_sparse_moe.gate.weight`` (MoE)          ``L.mlp.router.weight``
``L.block_sparse_moe.experts.{e}.w1/w3/w2``       ``L.mlp.experts.local_experts.{j}.linear_fc1`` =
                                                  [w1; w3], ``.linear_fc2`` = w2
``model.norm.weight``                             ``decoder.final_layernorm.weight``
``lm_head.weight`` (absent when tied)             ``output_layer.weight`` (Vp, d; absent when tied)
================================================  ===============================================

Both layouts build the experts without grouped GEMM (``moe_grouped_gemm=False``): one
``SequentialMLP`` of per-expert MLPs named ``local_experts.{j}``. TE's grouped experts
(``TEGroupedMLP``) would instead hold every local expert in one module as
``mlp.experts.linear_fc1.weight{j}`` / ``linear_fc2.weight{j}``, a third naming this module does
not convert; ``transformer_config`` keeps ``moe_grouped_gemm=False`` to match.

``linear_qkv`` is laid out *per query group*: for each of the G = num_kv_heads groups, the
group's H/G query heads, then its key head, then its value head (rows of head_dim each) — HF's
grouped-query attention pairs query head h with kv head h // (H/G), the same grouping.

Tensor parallelism (TP ranks t = 0..T−1) shards, like megatron's parallel layers do:
column-parallel weights along dim 0 (``linear_qkv`` by whole query groups; ``linear_fc1`` as
[gate_t; up_t], i.e. gate and up split separately; the vocabulary of the embedding and the output
layer), row-parallel weights along dim 1 (``linear_proj``, ``linear_fc2``); norms and the router are
replicated. Expert parallelism (EP ranks) gives rank r the experts r·E/EP … (r+1)·E/EP − 1 as
local experts 0 … E/EP − 1; each expert is sharded over TP like a dense MLP (megatron's default
expert-tensor-parallel size = TP). The vocabulary is padded with zero rows to a multiple of T
(Vp); engines drop the padded logits, so they never change a distribution. Pipeline stages
(:func:`to_stage` / :func:`from_stages`) take an equal share of the layers, renumbered from 0 as
megatron names a stage's modules; the first stage keeps the embedding, the last the final norm and
the output layer (with tied embeddings a copy of the word embeddings).

Config: :func:`transformer_config` maps :class:`~training.engines.model.ModelConfig` to a
``TransformerConfig`` — RMSNorm with our epsilon, SwiGLU (``gated_linear_unit`` + SiLU), no
biases, no dropout, RoPE (rotate-half, ``rotary_base = rope_theta``) set on the GPTModel, GQA via
``num_query_groups``. MoE router: Mixtral takes p = softmax(logits) over all experts, keeps the
top-k and renormalises, w_i = p_i / Σ_{j∈top-k} p_j = exp(l_i) / Σ_{j∈top-k} exp(l_j). Megatron's
default (``moe_router_pre_softmax=False``, score function softmax) takes the top-k of the logits
(the same set: softmax is monotonic) and applies softmax over those k logits — the same weights.
Replayed experts (R3) gather the replayed logits and softmax over them — again Mixtral's replay.
No auxiliary or z-loss (Mixtral's ``router_aux_loss_coef`` is 0 in our configs), no capacity
dropping.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from training.engines.model import ModelConfig

__all__ = [
    "LAYOUTS",
    "check_parallel_sizes",
    "default_layout",
    "from_stages",
    "gpt_model_kwargs",
    "hf_to_megatron",
    "megatron_to_hf",
    "padded_vocab_size",
    "stage_layers",
    "to_stage",
    "transformer_config",
]

Weights = dict[str, torch.Tensor]

LAYOUTS = ("local", "te")
"""The layer specs the conversion knows (see the module docstring)."""


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------


@functools.cache
def _te_importable() -> bool:
    """Whether TransformerEngine imports and megatron-core took it up (its TE layer spec
    needs both)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):  # OSError: the package is there but its CUDA libraries are not
        return False
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def default_layout() -> str:
    """``"te"`` when TransformerEngine imports (and megatron-core can use it) and a CUDA device
    exists — TE does not run on CPUs — else ``"local"``."""
    return "te" if _te_importable() and torch.cuda.is_available() else "local"


def _resolve_layout(layout: str | None) -> str:
    """``layout``, or :func:`default_layout` for None; ValueError for an unknown one."""
    if layout is None:
        return default_layout()
    if layout not in LAYOUTS:
        raise ValueError(f"unknown megatron layer layout {layout!r}; use one of {LAYOUTS}")
    return layout


def _norm_names(layout: str, moe: bool) -> tuple[str, str]:
    """Megatron names, relative to ``decoder.layers.{i}.``, of a layer's (attention-input,
    pre-MLP) RMSNorm weights — HF's ``input_layernorm`` and ``post_attention_layernorm``."""
    if layout == "local":
        return "input_layernorm.weight", "pre_mlp_layernorm.weight"
    # TE: the attention norm is fused into linear_qkv; the pre-MLP norm into linear_fc1 of a dense
    # MLP, but stays a standalone TENorm before an MoE block (its router and experts all read it)
    return ("self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight")


# ------------------------------------------------------------------------------------------------
# Sizes
# ------------------------------------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The smallest multiple of ``tp`` ≥ ``vocab_size`` (megatron splits the vocabulary evenly)."""
    return -(-vocab_size // tp) * tp


def check_parallel_sizes(cfg: ModelConfig, tp: int = 1, ep: int = 1, pp: int = 1) -> None:
    """ValueError naming the fix unless ``cfg`` can be split over ``tp`` TP, ``ep`` EP and ``pp``
    pipeline ranks."""
    if tp < 1 or ep < 1 or pp < 1:
        raise ValueError(f"tensor_parallel={tp}, expert_parallel={ep} and pipeline_parallel={pp} "
                         "must be >= 1")
    if cfg.num_layers % pp:
        raise ValueError(f"engines.megatron.pipeline_parallel={pp} must divide num_layers="
                         f"{cfg.num_layers} (every stage holds the same number of layers); pick "
                         "a divisor of the layer count")
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_heads={cfg.num_heads}")
    if cfg.num_kv_heads % tp:
        problems.append(f"num_kv_heads={cfg.num_kv_heads}")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if problems:
        raise ValueError(f"engines.megatron.tensor_parallel={tp} must divide "
                         f"{', '.join(problems)}; pick a tensor_parallel that divides them")
    if ep > 1 and (not cfg.is_moe or cfg.num_experts % ep):
        raise ValueError(f"engines.megatron.expert_parallel={ep} must divide num_experts="
                         f"{cfg.num_experts} (and needs an MoE model); set expert_parallel: 1 "
                         "or a divisor of the expert count")


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


def transformer_config(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, ep: int = 1,
                       routing_replay: bool = True, on_cpu: bool = False,
                       precision: str = "fp32", **overrides: Any) -> Any:
    """megatron ``TransformerConfig`` of ``cfg`` (see the module docstring for the mapping).

    Args:
        cfg: our architecture.
        tp, pp, ep: tensor-, pipeline- and expert-parallel sizes.
        routing_replay: build MoE routers with megatron's RouterReplay (R2/R3 and route
            recording).
        on_cpu: initialise on the CPU (no CUDA).
        precision: ``"fp32"``, or ``"bf16"`` (bf16 parameters and activations; the caller wraps
            the model in megatron's ``Float16Module`` and builds a bf16 optimizer, whose master
            weights stay fp32).
        overrides: any other TransformerConfig field.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_parallel_sizes(cfg, tp, ep, pp)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if precision not in dtypes:
        raise ValueError(f"engines.megatron.precision={precision!r}; use one of "
                         f"{', '.join(dtypes)}")
    dtype = dtypes[precision]
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads, num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype if pp > 1 else None,
        expert_model_parallel_size=ep,
        params_dtype=dtype, fp16=False, bf16=precision == "bf16",
        use_cpu_initialization=on_cpu,
        # keep megatron's init although the weights are overwritten from an HF directory or a
        # checkpoint: with perform_initialization=False megatron 0.16.1 never marks its parallel
        # layers' weights `tensor_model_parallel`, so TP ranks > 0 drop them from the grad norm
        perform_initialization=True,
        # the fused kernels below need CUDA / apex / TransformerEngine
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        # data-parallel gradients are summed, not averaged: each rank's loss already carries its
        # share of the global normaliser (training.engines.objective)
        calculate_per_token_loss=True,
    )
    if cfg.is_moe:
        kwargs.update(
            num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.intermediate_size,
            moe_router_pre_softmax=False, moe_router_score_function="softmax",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None,
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
            moe_permute_fusion=False, moe_router_fusion=False,
            moe_enable_routing_replay=routing_replay,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_model_kwargs(cfg: ModelConfig, tp: int = 1, layout: str | None = None) -> dict[str, Any]:
    """GPTModel arguments besides the TransformerConfig (layer spec, vocabulary, RoPE, tying).

    ``layout`` picks the layer spec (:data:`LAYOUTS`; None: :func:`default_layout`). Both build
    MoE experts without grouped GEMM (see the module docstring); the TE spec takes RMSNorm from
    the TransformerConfig's ``normalization``.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    layout = _resolve_layout(layout)
    num_experts = cfg.num_experts if cfg.is_moe else None
    if layout == "te":
        if not gpt_layer_specs.HAVE_TE:
            raise ImportError("megatron layer layout 'te' needs TransformerEngine (pip install "
                              "transformer-engine[pytorch]); use layout='local' without it")
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm")
    return dict(
        transformer_layer_spec=spec, vocab_size=padded_vocab_size(cfg.vocab_size, tp),
        max_sequence_length=cfg.max_position_embeddings, pre_process=True, post_process=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=cfg.rope_theta,
        # the engine computes log-probs over the full vocabulary: gather the logits
        parallel_output=False,
    )


# ------------------------------------------------------------------------------------------------
# HF → megatron
# ------------------------------------------------------------------------------------------------


def _chunk(t: torch.Tensor, n: int, i: int, dim: int) -> torch.Tensor:
    return t.chunk(n, dim=dim)[i].clone()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """(G·(H/G + 2)·hd, d) megatron rows: per group its queries, key, value."""
    g, hd, d = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    per = cfg.num_heads // g
    return torch.cat([q.reshape(g, per * hd, d), k.reshape(g, hd, d), v.reshape(g, hd, d)],
                     dim=1).reshape(-1, d)


def _split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    g, hd, d = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    per = cfg.num_heads // g
    grouped = qkv.reshape(g, (per + 2) * hd, d)
    q, k, v = grouped.split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)


def _fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    return torch.cat([_chunk(gate, tp, t, 0), _chunk(up, tp, t, 0)])


def hf_to_megatron(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, *, tp: int = 1,
                   tp_rank: int = 0, ep: int = 1, ep_rank: int = 0,
                   layout: str | None = None) -> Weights:
    """The GPTModel parameters of TP rank ``tp_rank`` / EP rank ``ep_rank`` from HF weights.

    Args:
        hf: HF-named full weights (``lm_head.weight`` may be absent when tied).
        cfg: the architecture.
        tp, tp_rank: tensor-parallel size and this rank.
        ep, ep_rank: expert-parallel size and this rank.
        layout: the model's layer spec (:data:`LAYOUTS`; None: :func:`default_layout`).
    Returns:
        megatron parameter name → tensor (new tensors; the input is not modified).
    """
    check_parallel_sizes(cfg, tp, ep)
    attn_norm, mlp_norm = _norm_names(_resolve_layout(layout), cfg.is_moe)
    vp = padded_vocab_size(cfg.vocab_size, tp)
    out: Weights = {"embedding.word_embeddings.weight":
                    _chunk(_pad_rows(hf["model.embed_tokens.weight"], vp), tp, tp_rank, 0)}
    for i in range(cfg.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = _qkv(hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
                   hf[h + "self_attn.v_proj.weight"], cfg)
        out[m + attn_norm] = hf[h + "input_layernorm.weight"].clone()
        # whole query groups per rank: the groups are contiguous row blocks
        out[m + "self_attention.linear_qkv.weight"] = _chunk(qkv, tp, tp_rank, 0)
        out[m + "self_attention.linear_proj.weight"] = _chunk(
            hf[h + "self_attn.o_proj.weight"], tp, tp_rank, 1)
        out[m + mlp_norm] = hf[h + "post_attention_layernorm.weight"].clone()
        if cfg.is_moe:
            out[m + "mlp.router.weight"] = hf[h + "block_sparse_moe.gate.weight"].clone()
            local = cfg.num_experts // ep
            for j in range(local):
                e = f"{h}block_sparse_moe.experts.{ep_rank * local + j}."
                x = f"{m}mlp.experts.local_experts.{j}."
                out[x + "linear_fc1.weight"] = _fc1_shard(hf[e + "w1.weight"], hf[e + "w3.weight"],
                                                          tp, tp_rank)
                out[x + "linear_fc2.weight"] = _chunk(hf[e + "w2.weight"], tp, tp_rank, 1)
        else:
            out[m + "mlp.linear_fc1.weight"] = _fc1_shard(
                hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"], tp, tp_rank)
            out[m + "mlp.linear_fc2.weight"] = _chunk(hf[h + "mlp.down_proj.weight"], tp,
                                                      tp_rank, 1)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = _chunk(_pad_rows(hf["lm_head.weight"], vp), tp, tp_rank, 0)
    return out


# ------------------------------------------------------------------------------------------------
# Pipeline stages
# ------------------------------------------------------------------------------------------------


def stage_layers(cfg: ModelConfig, pp: int, pp_rank: int) -> range:
    """The (global) decoder layers pipeline stage ``pp_rank`` of ``pp`` holds: an equal share."""
    check_parallel_sizes(cfg, pp=pp)
    n = cfg.num_layers // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def _layer_of(name: str) -> tuple[int, str] | None:
    """(layer, rest) of ``decoder.layers.{layer}.{rest}``; None for other names."""
    if not name.startswith("decoder.layers."):
        return None
    layer, rest = name[len("decoder.layers."):].split(".", 1)
    return int(layer), rest


def to_stage(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, *, pp: int,
             pp_rank: int) -> Weights:
    """The parameters pipeline stage ``pp_rank`` holds, from a whole model's megatron
    parameters (:func:`hf_to_megatron`'s output, possibly a TP / EP shard).

    A stage numbers its layers from 0 (megatron's module names are stage-local); the first stage
    holds the embedding, the last the final norm and ``output_layer`` — with tied embeddings (and
    ``pp`` > 1) the last stage's ``output_layer.weight`` is its copy of the word embeddings, which
    megatron keeps equal to the first stage's by summing their gradients.
    """
    layers = stage_layers(cfg, pp, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: Weights = {}
    for name, t in weights.items():
        at = _layer_of(name)
        if at is not None:
            if at[0] in layers:
                out[f"decoder.layers.{at[0] - layers.start}.{at[1]}"] = t
        elif name == "embedding.word_embeddings.weight":
            if first:
                out[name] = t
            if last and not first and cfg.tie_word_embeddings:
                out["output_layer.weight"] = t.clone()
        elif last:  # decoder.final_layernorm.weight, output_layer.weight
            out[name] = t
    return out


def from_stages(stages: Mapping[int, Mapping[str, torch.Tensor]], cfg: ModelConfig, *,
                pp: int) -> Weights:
    """The whole model's megatron parameters from every pipeline stage's (:func:`to_stage`
    inverted; a tied last stage's embedding copy is dropped)."""
    missing = [r for r in range(pp) if r not in stages]
    if missing:
        raise ValueError(f"from_stages needs every pipeline stage; missing {missing}")
    out: Weights = {}
    for r in range(pp):
        offset = stage_layers(cfg, pp, r).start
        for name, t in stages[r].items():
            at = _layer_of(name)
            if at is not None:
                out[f"decoder.layers.{at[0] + offset}.{at[1]}"] = t
            elif not (name == "output_layer.weight" and cfg.tie_word_embeddings):
                out[name] = t
    return out


# ------------------------------------------------------------------------------------------------
# megatron → HF
# ------------------------------------------------------------------------------------------------


def megatron_to_hf(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                   cfg: ModelConfig, *, tp: int = 1, ep: int = 1,
                   layout: str | None = None) -> Weights:
    """Full HF weights from the GPTModel parameters of every (tp_rank, ep_rank).

    Args:
        shards: ``(tp_rank, ep_rank)`` → that rank's megatron parameters (every pair present).
            Non-expert parameters are read from ``ep_rank`` 0.
        cfg: the architecture.
        tp, ep: tensor- and expert-parallel sizes.
        layout: the layer spec the shards come from (:data:`LAYOUTS`; None:
            :func:`default_layout`).
    Returns:
        HF name → full fp32 CPU tensor; no ``lm_head.weight`` when the embeddings are tied.
    """
    attn_norm, mlp_norm = _norm_names(_resolve_layout(layout), cfg.is_moe)
    missing = [(t, e) for t in range(tp) for e in range(ep) if (t, e) not in shards]
    if missing:
        raise ValueError(f"megatron_to_hf needs the parameters of every (tp_rank, ep_rank); "
                         f"missing {missing}")

    def dense(name: str) -> list[torch.Tensor]:
        return [shards[(t, 0)][name].detach().to("cpu", torch.float32) for t in range(tp)]

    def expert(ep_rank: int, name: str) -> list[torch.Tensor]:
        return [shards[(t, ep_rank)][name].detach().to("cpu", torch.float32) for t in range(tp)]

    def fc1(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])

    v = cfg.vocab_size
    hf: Weights = {"model.embed_tokens.weight":
                   torch.cat(dense("embedding.word_embeddings.weight"))[:v].clone()}
    for i in range(cfg.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, vv = _split_qkv(torch.cat(dense(m + "self_attention.linear_qkv.weight")), cfg)
        hf[h + "self_attn.q_proj.weight"] = q.contiguous()
        hf[h + "self_attn.k_proj.weight"] = k.contiguous()
        hf[h + "self_attn.v_proj.weight"] = vv.contiguous()
        hf[h + "self_attn.o_proj.weight"] = torch.cat(
            dense(m + "self_attention.linear_proj.weight"), dim=1)
        hf[h + "input_layernorm.weight"] = dense(m + attn_norm)[0].clone()
        hf[h + "post_attention_layernorm.weight"] = dense(m + mlp_norm)[0].clone()
        if cfg.is_moe:
            hf[h + "block_sparse_moe.gate.weight"] = dense(m + "mlp.router.weight")[0].clone()
            local = cfg.num_experts // ep
            for r in range(ep):
                for j in range(local):
                    x = f"{m}mlp.experts.local_experts.{j}."
                    e = f"{h}block_sparse_moe.experts.{r * local + j}."
                    gate, up = fc1(expert(r, x + "linear_fc1.weight"))
                    hf[e + "w1.weight"], hf[e + "w3.weight"] = gate, up
                    hf[e + "w2.weight"] = torch.cat(expert(r, x + "linear_fc2.weight"), dim=1)
        else:
            gate, up = fc1(dense(m + "mlp.linear_fc1.weight"))
            hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"] = gate, up
            hf[h + "mlp.down_proj.weight"] = torch.cat(dense(m + "mlp.linear_fc2.weight"), dim=1)
    hf["model.norm.weight"] = dense("decoder.final_layernorm.weight")[0].clone()
    if not cfg.tie_word_embeddings:
        hf["lm_head.weight"] = torch.cat(dense("output_layer.weight"))[:v].clone()
    return hf
