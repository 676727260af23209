"""Train–rollout mismatch diagnostics (seed 001 "Identifying mismatch"; seed 000 "Diagnostic
signals").

:func:`compute_mismatch_metrics` compares one training-side log-prob with the rollout engine's (μ)
on the sampled tokens and names every statistic under a caller-chosen ``prefix`` (``{tails}`` =
``{mean,p50,p90,p99,max}``):

    <prefix>logprob_abs_diff/{tails}         |log π − log μ| over valid tokens (slime's headline)
    <prefix>logprob_abs_diff_seq/{tails}     per-sequence token mean of |log π − log μ|, over
                                             sequences with a valid token (a few bad sequences
                                             hide in the token mean; seed 000: check the tails)
    <prefix>logprob_diff                     E[log π − log μ]  (signed)
    <prefix>kl_k1                            E[log μ − log π]  ≈ KL(μ ‖ π)
    <prefix>kl_k3                            E[ρ − log ρ − 1],  ρ = π/μ
    <prefix>kl_k3_token/{tails}
    <prefix>chi2_token                       E[ρ²] − 1
    <prefix>chi2_seq                         E[(Π_t ρ_t)²] − 1  (sequence log-ratio clamped ±20)
    <prefix>ratio/{tails}                    ρ over valid tokens
    <prefix>ppl_train, <prefix>ppl_rollout   per-sequence perplexity, mean over sequences
    <prefix>ppl_gap, <prefix>ppl_ratio       PPL_train − PPL_rollout, PPL_train / PPL_rollout
    <prefix>probs_pearson                    Pearson correlation of token probabilities
    <prefix>probs_abs_diff/{tails}           |π − μ| on the sampled tokens
    <prefix>logprob_abs_diff_high_entropy/mean   tokens with entropy > 0.1 (entropy given)
    policy/entropy/{tails}                   (when entropy is given)

The learner calls it twice per step (issue 14; the bare ``mismatch/<stat>`` names of earlier
releases were renamed to these two families, not aliased):

* ``mismatch/train_rollout/*`` — π_current (the trainer at the weights the step starts from) vs μ:
  seed 000's "train-rollout logprob absolute difference", so it holds staleness *and* engine
  mismatch. Headline key ``mismatch/train_rollout/logprob_abs_diff/mean``.
* ``mismatch/engine/*`` — π_old (the trainer at the behaviour version) vs μ, plus
  ``mismatch/engine/exact`` (1.0 when π_old is the exact behaviour version on every loss token).
  What π_old is, and so what this family measures, depends on ``algorithm.old_logprob``:

  ==========  ============================  =================================================
  strategy    π_old                         ``mismatch/engine/*`` measures
  ==========  ============================  =================================================
  recompute   π_current                     the same as train_rollout (staleness + engine in
                                            one number; exact only when every token is of the
                                            current version, e.g. sync)
  snapshot    each token's own version      pure engine mismatch (exact unless a version was
                                            evicted: ``old/snapshot_fallback_frac``)
  dedicated   each token's own version      pure engine mismatch (exact unless the old-logit
              (a separate model copy)       model no longer held the version:
                                            ``old/dedicated_fallback_frac``)
  interrupt   each token's own version      pure engine mismatch (exact unless a sample
              (by the rollouter, before     came without them:
              the version left)             ``old/interrupt_fallback_frac``)
  ewma        the EWMA reference            engine mismatch + the EWMA's distance from the
                                            behaviour versions (never exact)
  loglinear   μ                             nothing: π_old ≡ μ, every statistic is "no gap"
  linear_prox μ                             nothing: π_old ≡ μ, every statistic is "no gap"
  bypass      μ                             nothing: π_old ≡ μ, every statistic is "no gap"
  ==========  ============================  =================================================

  Under loglinear, linear_prox and bypass the engine gap is unmeasured; read train_rollout.
  The recipe says which case a run is in (``AlgorithmConfig.old_is_exact``, ``old_is_current``,
  ``has_distinct_old``); the learner logs ``old/exact_frac``, the share of loss tokens whose
  π_old is exact.

The zero-staleness check (:mod:`training.engines.mismatch`) has no staleness, so it reports its
gap under ``mismatch/engine/*``.

:func:`variance_proxy_metrics` gives seed 001's gradient-variance proxies
(``policy/proxy1_signal_strength``, ``policy/proxy2_total_power``, ``policy/proxy3_pure_noise``)
with verl's definitions.
"""

from __future__ import annotations

import torch

from training.algorithms.is_correction import (
    CompISConfig,
    compute_compis_weights,
    compute_is_correction,
)
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
    *,
    prefix: str,
) -> dict[str, float]:
    """Training-engine vs rollout-engine agreement on the sampled tokens.

    Args:
        train_log_prob: (B, T) training-engine log-probs (π_current or π_old).
        rollout_log_prob: (B, T) rollout-engine log-probs (μ), same tokens.
        response_mask: (B, T).
        entropy: optional (B, T) training-side token entropy.
        prefix: metric namespace, e.g. ``mismatch/train_rollout/`` or ``mismatch/engine/``
            (required: the two comparisons must never share names).
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
    has_tokens = valid.any(dim=-1)
    m.update(tail_stats(masked_mean(abs_diff, valid, dim=-1), has_tokens,
                        prefix=f"{prefix}logprob_abs_diff_seq/"))
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
    *,
    current_log_prob: torch.Tensor | None = None,
) -> dict[str, float]:
    """Everything one decoupled train step can measure before the loss, under the learner's
    names (issue 14's contract).

    ``mismatch/train_rollout/*``: π_current vs μ (``current_log_prob``; None = π_prox, which is
    π_current under the recompute, snapshot, dedicated and interrupt strategies — pass it under
    ewma, loglinear and linear_prox, where π_prox is the EWMA reference or an interpolation).
    ``mismatch/engine/*``: π_old vs μ. ``is/staleness/*``: the measured π_current/π_old with
    CompIS's staleness method; ``is/engine/*``: π_old/μ with its engine method;
    ``is/combined/*``: the weight CompIS would apply, f_s(π_prox/π_old)·f_e(π_old/μ).
    ``rs/m2po/*``: M2PO's second-moment percentiles of π_prox vs μ (the mask itself is not
    applied here).

    No ``mismatch/engine/exact``: whether π_old is the exact behaviour version needs each
    token's version and the strategy, which only the learner has
    (``training.runtime.old_policy.OldEstimate.exact``).
    """
    current = proximal_log_prob if current_log_prob is None else current_log_prob
    cfg = compis or CompISConfig()
    metrics = compute_mismatch_metrics(current, rollout_log_prob, response_mask, entropy,
                                       prefix="mismatch/train_rollout/")
    metrics.update(compute_mismatch_metrics(old_log_prob, rollout_log_prob, response_mask,
                                            prefix="mismatch/engine/"))
    metrics.update(compute_compis_weights(proximal_log_prob, old_log_prob, rollout_log_prob,
                                          response_mask, cfg).metrics)
    if current_log_prob is not None:  # CompIS's own staleness ratio is π_prox/π_old
        metrics.update(compute_is_correction(current, old_log_prob, response_mask,
                                             cfg.staleness, prefix="is/staleness/").metrics)
    metrics.update(m2po_mask(proximal_log_prob, rollout_log_prob, response_mask).metrics)
    return metrics


def variance_proxy_metrics(
    log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    signal_strength: float,
    sequences_per_minibatch: float,
    is_weights: torch.Tensor | None = None,
) -> dict[str, float]:
    """Seed 001's gradient-variance proxies, as verl's ``compute_variance_proxy_metrics``.

    With π the policy the tokens are scored under, per sequence i over its valid tokens:
    W_i = max(0, Σ_t [1 − 2 π_t(y_t) + Σ_v π_v²]) (the squared score norm ‖e_y − π‖² summed),
    Ā_i = token mean of the advantages, ρ̄_i = token mean of the IS weights (1 without weights).

        policy/proxy1_signal_strength = ``signal_strength`` (‖ḡ‖²: mean over the step's optimizer
                                        steps of the pre-clip gradient norm squared)
        policy/proxy2_total_power     = mean over all B sequences of ρ̄_i² Ā_i² W_i
        policy/proxy3_pure_noise      = max(0, (proxy2 − proxy1) / (N − 1)), N =
                                        ``sequences_per_minibatch`` (0 when N ≤ 1)

    Args:
        log_prob: (B, T) log π(y_t) (the learner passes π_current).
        sum_pi_squared: (B, T) Σ_v π_v² of the same distribution.
        advantages: (B, T).
        response_mask: (B, T) the tokens trained on.
        signal_strength: proxy1.
        sequences_per_minibatch: N, sequences per optimizer step's gradient.
        is_weights: (B, T) IS weights applied in the loss, or None.
    """
    valid = as_bool_mask(response_mask)
    lp = sanitize(log_prob, valid).detach().to(torch.float64)
    s2 = sanitize(sum_pi_squared, valid).detach().to(torch.float64)
    w_tok = sanitize(1.0 - 2.0 * lp.exp() + s2, valid)
    w_seq = masked_sum(w_tok, valid, dim=-1).clamp(min=0.0)
    a_bar = masked_mean(sanitize(advantages, valid).detach().to(torch.float64), valid, dim=-1)
    if is_weights is None:
        rho_bar = torch.ones_like(a_bar)
    else:
        rho_bar = masked_mean(sanitize(is_weights, valid).detach().to(torch.float64), valid,
                              dim=-1)
    proxy2 = float((rho_bar ** 2 * a_bar ** 2 * w_seq).mean()) if w_seq.numel() else 0.0
    proxy1 = float(signal_strength)
    n = float(sequences_per_minibatch)
    proxy3 = max(0.0, (proxy2 - proxy1) / (n - 1.0)) if n > 1.0 else 0.0
    return {"policy/proxy1_signal_strength": proxy1,
            "policy/proxy2_total_power": proxy2,
            "policy/proxy3_pure_noise": proxy3}
