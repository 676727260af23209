"""A small Llama-style decoder (RMSNorm, RoPE, SwiGLU), dense or Mixture-of-Experts, in plain torch.

Both embedded engines run this module: the rollout server in bf16 (optionally fp8-simulated weights
and logit noise) with a KV cache, the trainer in fp32 over whole sequences. Parameter names are
Hugging Face's (``LlamaForCausalLM`` for dense, ``MixtralForCausalLM`` for MoE), so a checkpoint
is an HF directory that ``transformers`` and SGLang can load, and a weight sync is one call for
every rollout backend.

The maths follows the HF implementations so the same weights give the same log-probs: RoPE with
the rotate-half convention, RMSNorm computed in fp32, SwiGLU ``down(silu(gate(x)) * up(x))``,
grouped-query attention, and Mixtral's router (softmax over experts in fp32, top-k, top-k weights
renormalised to sum to 1).

MoE routing can be *recorded* (every forward returns the experts chosen at every position and layer)
and *replayed* (pass ``replay_routes``): the replayed experts are used while the mixing weights
still come from the router's softmax, so the router keeps its gradient (R2/R3, seed 004).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the embedded model (serialised as an HF ``config.json``).

    vocab_size: number of token ids (task vocabulary incl. special tokens).
    hidden_size: model width d.
    num_layers: decoder layers.
    num_heads: attention heads (head_dim = hidden_size / num_heads).
    num_kv_heads: key/value heads (grouped-query attention); must divide num_heads.
    intermediate_size: SwiGLU width of a dense MLP or of each expert.
    max_position_embeddings: longest sequence (prompt + response).
    rope_theta: RoPE base.
    rms_norm_eps: RMSNorm epsilon.
    tie_word_embeddings: share the input embedding and the LM head.
    num_experts: 0 for a dense model, else the number of experts per MoE layer.
    num_experts_per_tok: experts each token is routed to (top-k).
    bos_token_id / eos_token_id / pad_token_id: special token ids.
    """

    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 344
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 2
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads "
                             f"{self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide num_heads "
                             f"{self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head_dim must be even for RoPE; change hidden_size or num_heads")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]")
        if self.num_experts < 0 or self.vocab_size < 1 or self.num_layers < 1:
            raise ValueError("num_experts must be >= 0, vocab_size and num_layers >= 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # --- Hugging Face config.json -------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        common = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
        }
        if self.is_moe:
            return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "num_local_experts": self.num_experts,
                    "num_experts_per_tok": self.num_experts_per_tok,
                    "sliding_window": None, "router_aux_loss_coef": 0.0,
                    "output_router_logits": False}
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "mlp_bias": False, "pretraining_tp": 1}

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in ("llama", "mixtral"):
            raise ValueError(f"unsupported model_type {model_type!r}: the embedded engines load "
                             "'llama' (dense) or 'mixtral' (MoE) checkpoints")
        kwargs = {
            "vocab_size": d["vocab_size"], "hidden_size": d["hidden_size"],
            "num_layers": d["num_hidden_layers"], "num_heads": d["num_attention_heads"],
            "num_kv_heads": d.get("num_key_value_heads", d["num_attention_heads"]),
            "intermediate_size": d["intermediate_size"],
            "max_position_embeddings": d.get("max_position_embeddings", 256),
            "rope_theta": d.get("rope_theta", 10000.0), "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
            "tie_word_embeddings": d.get("tie_word_embeddings", False),
            "bos_token_id": d.get("bos_token_id", 1), "eos_token_id": d.get("eos_token_id", 2),
            "pad_token_id": d.get("pad_token_id", 0),
        }
        if model_type == "mixtral":
            kwargs["num_experts"] = d["num_local_experts"]
            kwargs["num_experts_per_tok"] = d["num_experts_per_tok"]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ------------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------------


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``; for bf16 on CPU computed in fp32 and rounded to bf16, as :class:`Linear`."""
    if a.dtype == torch.bfloat16 and a.device.type == "cpu":
        return (a.float() @ b.float()).to(torch.bfloat16)
    return a @ b


class Linear(nn.Linear):
    """``nn.Linear`` whose bf16 product on CPU accumulates in fp32.

    bf16 input and bf16-valued weight, upcast; the product in fp32; the output rounded to bf16 —
    a bf16 GEMM as GPUs run it (fp32 accumulation). Only the summation order differs from
    torch's own CPU bf16 kernel, which on a CPU without bf16 units is 2–3× slower (the embedded
    engine in-process, batch 64 × 64 new tokens, 1 thread, with :func:`matmul` in attention:
    dense 1263 → ~3700 tokens/s, MoE 920 → ~4000). The upcast is made per call (as fast as
    keeping a copy, which would have to follow every in-place weight load). Differentiable; any
    other dtype or device is plain ``nn.Linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(torch.bfloat16)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (…, S, head_dim) for integer ``positions`` (…, S), HF's rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D); cos/sin (B, S, D)."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = Linear(cfg.num_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_bias: torch.Tensor, cache: KVCache | None, layer: int) -> torch.Tensor:
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, s, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(layer, k, v)
        rep = cfg.num_heads // cfg.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        # Plain matmul + softmax: on CPU it beats the fused kernel for one-token decode (FACTS.md).
        scores = matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(cfg.head_dim))
        scores = scores + attn_bias.to(scores.dtype)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = matmul(probs, v).transpose(1, 2).reshape(b, s, cfg.num_heads * cfg.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU MLP with Llama's names (gate_proj, up_proj, down_proj)."""

    def __init__(self, d: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Linear(d, inter, bias=False)
        self.up_proj = Linear(d, inter, bias=False)
        self.down_proj = Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One Mixtral expert: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, d: int, inter: int) -> None:
        super().__init__()
        self.w1 = Linear(d, inter, bias=False)
        self.w2 = Linear(inter, d, bias=False)
        self.w3 = Linear(d, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Mixtral's sparse MoE block: router softmax (fp32) → top-k → renormalised weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor,
                replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, S, d); replay (B, S, k) expert ids or None. Returns (out, chosen (B, S, k))."""
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        if replay is None:
            top_w, top_i = probs.topk(self.top_k, dim=-1)
        else:
            top_i = replay.reshape(-1, self.top_k).to(torch.long)
            top_w = probs.gather(-1, top_i)
        top_w = (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * top_w[rows, slot].unsqueeze(-1))
        return out.view(b, s, d), top_i.view(b, s, self.top_k)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe:
            self.block_sparse_moe = SparseMoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, attn_bias, cache, layer, replay=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_bias, cache, layer)
        h = self.post_attention_layernorm(x)
        if hasattr(self, "block_sparse_moe"):
            out, routes = self.block_sparse_moe(h, replay)
            return x + out, routes
        return x + self.mlp(h), None


class KVCache:
    """Per-layer key/value tensors (B, H_kv, S, D) grown by concatenation."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]


class _Inner(nn.Module):
    """``model.*`` in HF naming."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The embedded model. ``state_dict()`` keys are the HF checkpoint keys."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Inner(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int, std: float = 0.02) -> CausalLM:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        replay_routes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position.

        Args:
            input_ids: (B, S) token ids.
            positions: (B, S) RoPE positions; default 0..S-1 (+ cache length).
            attention_mask: (B, S_total) 1 for real tokens, 0 for padding, over the cached plus the
                new tokens; default all ones. Attention is causal on top of it.
            cache: a :class:`KVCache` to extend (decode) or None (full forward).
            replay_routes: (B, S, L, k) expert ids to use instead of the router's top-k (MoE).
        Returns:
            (logits (B, S, V), routes (B, S, L, k) chosen experts, or None for a dense model).
        """
        b, s = input_ids.shape
        past = cache.length if cache is not None else 0
        device = input_ids.device
        if positions is None:
            positions = torch.arange(past, past + s, device=device).unsqueeze(0).expand(b, s)
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        total = past + s
        causal = torch.ones(s, total, dtype=torch.bool, device=device).tril(diagonal=past)
        allowed = causal.unsqueeze(0).expand(b, s, total)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        # A fully padded query row (left padding) would softmax over nothing: let it see itself.
        eye = torch.zeros(s, total, dtype=torch.bool, device=device)
        eye[torch.arange(s), past + torch.arange(s)] = True
        allowed = allowed | (eye.unsqueeze(0) & ~allowed.any(-1, keepdim=True))
        attn_bias = torch.zeros(b, 1, s, total, dtype=torch.float32, device=device)
        attn_bias = attn_bias.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        routes = []
        for i, layer in enumerate(self.model.layers):
            replay = replay_routes[:, :, i] if replay_routes is not None else None
            h, r = layer(h, cos, sin, attn_bias, cache, i, replay)
            if r is not None:
                routes.append(r)
        logits = self.lm_head(self.model.norm(h))
        return logits, (torch.stack(routes, dim=2) if routes else None)
