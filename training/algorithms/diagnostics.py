"""Train–rollout mismatch diagnostics (seed 001 "Identifying mismatch"; seed 000 "Diagnostic
signals").

All names live in DESIGN.md's flat namespace and are the names gates and dashboards read
(``{tails}`` = ``{mean,p50,p90,p99,max}``):

    mismatch/logprob_abs_diff/{tails}        E|log π_old − log μ|  (slime's headline metric)
    mismatch/logprob_diff                    E[log π_old − log μ]  (signed)
    mismatch/kl_k1                           E[log μ − log π_old]  ≈ KL(μ ‖ π_old)
    mismatch/kl_k3                           E[ρ − log ρ − 1],  ρ = π_old/μ
    mismatch/kl_k3_token/{tails}
    mismatch/chi2_token                      E[ρ²] − 1
    mismatch/chi2_seq                        E[(Π_t ρ_t)²] − 1  (sequence log-ratio clamped ±20)
    mismatch/ratio/{tails}                   ρ over valid tokens
    mismatch/ppl_train, mismatch/ppl_rollout per-sequence perplexity, mean over sequences
    mismatch/ppl_gap, mismatch/ppl_ratio     PPL_old − PPL_rollout, PPL_old / PPL_rollout
    mismatch/probs_pearson                   Pearson correlation of token probabilities
    mismatch/probs_abs_diff/{tails}          |π_old − μ| on the sampled tokens
    mismatch/logprob_abs_diff_high_entropy/mean   tokens with entropy > 0.1 (entropy given)
    policy/entropy/{tails}                   (when entropy is given)

Every statistic is over valid tokens only. ``train_log_prob`` is whichever training-side log-prob
is compared with the rollout engine: π_old in decoupled mode (same weights, so the gap is pure
engine mismatch), the current policy in bypass mode.
"""

from __future__ import annotations

import torch

from training.algorithms.is_correction import CompISConfig, compute_compis_weights
from training.algorithms.masked import (
    LOG_RATIO_BOUND,
    as_bool_mask,
    clamped_log_ratio,
    masked_mean,
    masked_sum,
    sanitize,
    tail_stats,
)
from training.algorithms.masking import m2po_mask

HIGH_ENTROPY_THRESHOLD = 0.1


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position. logits (B, T, V) → (B, T)."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def probs_pearson(p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> float:
    """Pearson correlation of two probability tensors over valid positions.

    With zero variance on either side the correlation is undefined; we return 1.0 when the two
    agree exactly and 0.0 otherwise (an agreement metric, not a statistic to divide by).
    """
    valid = as_bool_mask(mask)
    x = p.detach()[valid].to(torch.float64)
    y = q.detach()[valid].to(torch.float64)
    if x.numel() == 0:
        return 1.0
    xc, yc = x - x.mean(), y - y.mean()
    denom = torch.sqrt((xc * xc).sum() * (yc * yc).sum())
    if denom.item() == 0.0:
        return 1.0 if torch.equal(x, y) else 0.0
    return float(((xc * yc).sum() / denom).item())


def compute_mismatch_metrics(
    train_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor | None = None,
    prefix: str = "mismatch/",
) -> dict[str, float]:
    """Training-engine vs rollout-engine agreement on the sampled tokens.

    Args:
        train_log_prob: (B, T) training-engine log-probs (π_old).
        rollout_log_prob: (B, T) rollout-engine log-probs (μ), same tokens.
        response_mask: (B, T).
        entropy: optional (B, T) training-side token entropy.
        prefix: metric namespace (default ``mismatch/``).
    Returns:
        dict of floats, keys listed in the module docstring.
    """
    valid = as_bool_mask(response_mask)
    train = sanitize(train_log_prob, valid).detach()
    rollout = sanitize(rollout_log_prob, valid).detach()
    log_ratio = clamped_log_ratio(train, rollout, valid)
    ratio = sanitize(torch.exp(log_ratio), valid)
    abs_diff = log_ratio.abs()
    k3 = sanitize(ratio - log_ratio - 1.0, valid)

    m: dict[str, float] = {}
    m.update(tail_stats(abs_diff, valid, prefix=f"{prefix}logprob_abs_diff/"))
    m[f"{prefix}logprob_diff"] = masked_mean(log_ratio, valid).item()
    m[f"{prefix}kl_k1"] = masked_mean(-log_ratio, valid).item()
    m[f"{prefix}kl_k3"] = masked_mean(k3, valid).item()
    m.update(tail_stats(k3, valid, prefix=f"{prefix}kl_k3_token/"))
    # With no valid token every statistic takes its "no mismatch" value (χ² 0, PPL ratio 1), so an
    # empty or fully rejected batch never reads as drift.
    any_valid = bool(valid.any())
    m[f"{prefix}chi2_token"] = (masked_mean(ratio * ratio, valid) - 1.0).item() if any_valid \
        else 0.0
    m.update(tail_stats(ratio, valid, prefix=f"{prefix}ratio/"))

    has_tokens = valid.any(dim=-1)
    seq_log_ratio = masked_sum(log_ratio, valid, dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    m[f"{prefix}chi2_seq"] = (
        (masked_mean(torch.exp(2.0 * seq_log_ratio), has_tokens) - 1.0).item() if any_valid
        else 0.0)

    ppl_train = torch.exp(-masked_mean(train, valid, dim=-1))
    ppl_rollout = torch.exp(-masked_mean(rollout, valid, dim=-1))
    m[f"{prefix}ppl_train"] = masked_mean(ppl_train, has_tokens).item()
    m[f"{prefix}ppl_rollout"] = masked_mean(ppl_rollout, has_tokens).item()
    m[f"{prefix}ppl_gap"] = masked_mean(ppl_train - ppl_rollout, has_tokens).item()
    m[f"{prefix}ppl_ratio"] = (masked_mean(ppl_train / ppl_rollout, has_tokens).item()
                               if any_valid else 1.0)

    p_train, p_rollout = sanitize(train.exp(), valid), sanitize(rollout.exp(), valid)
    m[f"{prefix}probs_pearson"] = probs_pearson(p_train, p_rollout, valid)
    m.update(tail_stats((p_train - p_rollout).abs(), valid, prefix=f"{prefix}probs_abs_diff/"))

    if entropy is not None:
        ent = sanitize(entropy, valid).detach()
        high = valid & (ent > HIGH_ENTROPY_THRESHOLD)
        m[f"{prefix}logprob_abs_diff_high_entropy/mean"] = masked_mean(abs_diff, high).item()
        m.update(entropy_metrics(ent, valid))
    return m


def entropy_metrics(entropy: torch.Tensor, response_mask: torch.Tensor,
                    prefix: str = "policy/entropy/") -> dict[str, float]:
    """Tails of the per-token entropy (seed 000: entropy spikes precede collapse)."""
    return tail_stats(sanitize(entropy, response_mask), response_mask, prefix=prefix)


def compute_off_policy_diagnostics(
    proximal_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor | None = None,
    compis: CompISConfig | None = None,
) -> dict[str, float]:
    """Everything one decoupled train step can measure before the loss.

    Engine mismatch (π_old vs μ) under ``mismatch/*``; per-source IS weight statistics of CompIS
    under ``is/staleness/*`` and ``is/engine/*``; M2PO's second-moment percentiles of the full
    behaviour gap (π_prox vs μ) under ``rs/m2po/*`` (the mask itself is not applied here).
    """
    metrics = compute_mismatch_metrics(old_log_prob, rollout_log_prob, response_mask, entropy)
    metrics.update(compute_compis_weights(proximal_log_prob, old_log_prob, rollout_log_prob,
                                          response_mask, compis).metrics)
    metrics.update(m2po_mask(proximal_log_prob, rollout_log_prob, response_mask).metrics)
    return metrics
