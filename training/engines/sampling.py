"""Precision modes of the embedded rollout engine, and token sampling with honest log-probs.

The embedded rollout server must *compute differently* from the fp32 trainer, the way SGLang's
kernels differ from Megatron's, so the engine-mismatch machinery sees a real gap. The modes:

- ``fp32``: weights and activations fp32. Matches the trainer to ~1e-5 (the agreement test).
- ``bf16`` (default): weights and activations bfloat16; logits are cast to fp32 for sampling.
  The projections accumulate in fp32 and round their output to bf16, as GPU bf16 GEMMs do
  (:class:`~training.engines.model.Linear`).
- ``fp8``: *simulated* FP8 weights. Every attention and MLP/expert projection weight is quantised
  to float8_e4m3fn with one per-tensor scale (amax / 448) and immediately dequantised to bf16;
  compute stays bf16. Embeddings, the LM head, the MoE router and the norms stay bf16, as FP8
  serving stacks usually keep them. Real FP8 kernels also quantise activations; this does not —
  it reproduces the weight rounding only.
- ``logit_noise`` (any dtype): Gaussian noise N(0, σ²) added to the fp32 logits before sampling,
  drawn from a per-sequence generator seeded from (engine seed, request seed), to dial the
  mismatch into the 0.01–0.03 range real engines show. It is part of the distribution sampled
  from, so it enters the reported log-probs as engine error would.

Sampling (``sample_next_tokens``): for temperature T > 0 the distribution is
softmax(logits / T), then truncated to the top-k tokens and to the smallest most-likely prefix
whose mass reaches top_p (top-k first, then top-p on the top-k-renormalised mass), and
*renormalised over the kept set*: p'(t) = p(t) / Σ_kept p. The reported log-prob is log p'(sampled
token) — the distribution actually sampled from. (SGLang reports the untruncated
log_softmax(logits / T); the two agree when top_p = 1 and top_k = -1, the usual RL setting.) The
trainer reproduces it with :func:`sampling_log_probs`. Greedy (T = 0) picks the argmax and reports
log_softmax(logits) at T = 1, untruncated, since a point mass carries no information.

Draws use one uniform number per token from a per-request ``torch.Generator`` (inverse-CDF
sampling), so a seeded request gives the same tokens whatever else is in the batch (up to the
batch-dependent rounding of low-precision modes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.engines.model import CausalLM

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp8": torch.bfloat16}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Projections quantised in fp8 mode (HF Llama / Mixtral names).
FP8_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "w1", "w2", "w3")


@dataclass(frozen=True)
class PrecisionConfig:
    """Numerics of the rollout engine.

    dtype: "bf16" (default), "fp32" or "fp8" (simulated fp8 weights, bf16 compute).
    logit_noise: σ of Gaussian noise added to the logits before sampling (0 = off).
    seed: base seed of the engine's random draws (noise, and requests that bring no seed).
    """

    dtype: str = "bf16"
    logit_noise: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if not self.logit_noise >= 0.0:
            raise ValueError(f"logit_noise must be >= 0, got {self.logit_noise}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype weights and activations are held in."""
        return DTYPES[self.dtype]


def fake_quantize_fp8(weight: torch.Tensor) -> torch.Tensor:
    """Round ``weight`` through float8_e4m3fn with a per-tensor scale; same shape and dtype.

    scale = amax(|w|) / 448; w' = float(fp8(w / scale)) · scale.
    """
    w = weight.detach().to(torch.float32)
    amax = w.abs().max()
    if amax == 0:
        return weight.detach().clone()
    scale = amax / FP8_MAX
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).to(weight.dtype)


def apply_precision(model: CausalLM, precision: PrecisionConfig) -> CausalLM:
    """Put a loaded (fp32) model into the engine's precision, in place; returns it in eval mode.

    fp8 quantises from the fp32 master weights (before the cast to bf16), so the only rounding
    is the fp8 one followed by the bf16 storage of the dequantised value.
    """
    model.eval().requires_grad_(False)
    if precision.dtype == "fp8":
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in \
                        FP8_LINEAR_NAMES:
                    module.weight.copy_(fake_quantize_fp8(module.weight))
    return model.to(precision.torch_dtype)


# ------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------


def sampling_log_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       top_k: torch.Tensor) -> torch.Tensor:
    """Log-probs of the distribution sampled from (−inf outside the kept set), in fp32.

    Args:
        logits: (B, V) raw logits (any float dtype; computed in fp32).
        temperature: (B,) temperatures; rows with 0 are greedy and get log_softmax(logits).
        top_p: (B,) nucleus mass in (0, 1]; 1 keeps everything.
        top_k: (B,) int, <= 0 keeps everything.
    Returns:
        (B, V) log p'(t): softmax(logits / T) truncated to top-k then top-p and renormalised.
    """
    x = logits.to(torch.float32)
    b, v = x.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    logp = torch.log_softmax(x / t[:, None], dim=-1)
    if bool(((top_p >= 1.0) & ((top_k <= 0) | (top_k >= v)) | greedy).all()):
        return logp
    sorted_lp, order = logp.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=x.device).expand(b, v)
    k = torch.where(top_k <= 0, torch.full_like(top_k, v), top_k.clamp(max=v))
    keep = rank < k[:, None]
    # top-p on the top-k-renormalised mass: keep a token while the mass before it is < top_p
    p = torch.where(keep, sorted_lp, torch.full_like(sorted_lp, float("-inf")))
    p = (p - torch.logsumexp(p, dim=-1, keepdim=True)).exp()
    mass_before = p.cumsum(-1) - p
    keep &= mass_before < top_p[:, None].to(torch.float32)
    keep[:, 0] = True
    keep |= greedy[:, None]
    kept = torch.where(keep, sorted_lp, torch.full_like(sorted_lp, float("-inf")))
    kept = kept - torch.logsumexp(kept, dim=-1, keepdim=True)
    return torch.empty_like(kept).scatter_(-1, order, kept)


def sample_next_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       top_k: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse-CDF sampling; return it and its log-prob.

    Args:
        logits: (B, V) raw logits.
        temperature / top_p / top_k: (B,) per-row sampling parameters (see
            :func:`sampling_log_probs`).
        uniforms: (B,) U[0, 1) draws (from the requests' own generators).
    Returns:
        (tokens (B,) int64, logprobs (B,) fp32): the sampled ids and log p'(token).
    """
    logp = sampling_log_probs(logits, temperature, top_p, top_k)
    # inverse CDF over the sampled distribution; the clamp guards the cumsum's rounding at 1
    cdf = logp.exp().cumsum(-1)
    u = uniforms.to(torch.float32).clamp(0.0, 1.0)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=logp.shape[-1] - 1)
    # never land on a zero-probability token (searchsorted past the kept set's end)
    bad = torch.isinf(logp.gather(-1, tokens[:, None]).squeeze(-1))
    if bool(bad.any()):
        last_kept = (torch.isfinite(logp) * torch.arange(logp.shape[-1])).argmax(-1)
        tokens = torch.where(bad, last_kept, tokens)
    greedy = temperature <= 0
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.to(torch.float32).argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class SequenceRandom:
    """The random streams of one sequence: sampling uniforms and (optional) logit noise.

    Both are seeded from the request seed, so a seeded request is reproducible; the noise stream
    also mixes in the engine seed, so two engines with different seeds make different errors.
    """

    def __init__(self, seed: int, engine_seed: int = 0) -> None:
        self.seed = seed
        self._uniform = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF)
        self._noise = torch.Generator().manual_seed(
            (seed * 1_000_003 + engine_seed * 7_919 + 1) & 0xFFFF_FFFF_FFFF)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self._uniform))

    def noise(self, size: int, sigma: float) -> torch.Tensor:
        """(size,) fp32 Gaussian noise of standard deviation ``sigma``."""
        return torch.randn(size, generator=self._noise) * sigma
