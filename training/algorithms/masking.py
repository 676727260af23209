"""Masking corrections: M2PO and OPSM.

Both remove tokens or sequences from the loss instead of reweighting them. Seed 000 ("Why did M2PO
fail?") explains why masking alone fails on heavy-tailed staleness: the mean-threshold rule never
fires when a handful of extreme tokens barely move the mean, and a per-token cutoff low enough to
matter throws away the hardest tokens. These functions reproduce the published rules exactly —
including that behaviour — rather than "fixing" it; use CompIS reweighting to correct the mass of
moderately stale tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.algorithms.masked import (
    as_bool_mask,
    clamped_log_ratio,
    masked_count,
    masked_mean,
    sanitize,
    tail_stats,
)

# M2PO's default second-moment budget τ_M2 (Zheng et al. arXiv:2510.01161; seed 000 quotes 0.04
# as the "too high" end of its sweep).
M2PO_DEFAULT_THRESHOLD = 0.04
# OPSM's δ default (slime's --opsm-delta default); DeepSeek-V3.2 (arXiv:2512.02556, Eq. 8-9)
# leaves δ as a hyper-parameter.
OPSM_DEFAULT_DELTA = 1e-4


@dataclass(frozen=True)
class MaskResult:
    """keep_mask: (B, T) bool valid tokens that survive; metrics: dict of floats."""

    keep_mask: torch.Tensor
    metrics: dict[str, float]


def second_moment(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                  response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token m2 = (log π_prox − log π_behav)², 0 at masked positions. Shape (B, T)."""
    d = clamped_log_ratio(proximal_log_prob, behaviour_log_prob, response_mask)
    return sanitize(d * d, response_mask).detach()


def m2po_mask(
    proximal_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float = M2PO_DEFAULT_THRESHOLD,
    max_cutoff: float | None = None,
) -> MaskResult:
    """M2PO second-moment masking (arXiv:2510.01161; seed 000 stage 2).

    Mean-threshold rule: sort the valid tokens' m2 in descending order and mask the k largest,
    with k the smallest count such that the mean m2 of the remaining tokens is at or below
    ``threshold``
    (k = 0 when the batch mean is already within budget). The mean is over the whole batch of
    valid tokens. With ``max_cutoff`` set, the per-token variant is used instead: every token
    with m2 > max_cutoff is masked (seed 000's ``--m2-max-cutoff``).

    Args:
        proximal_log_prob: (B, T) training-side log-probs (π_prox).
        behaviour_log_prob: (B, T) log-probs of the policy that generated the tokens (π_behav).
        response_mask: (B, T).
        threshold: τ_M2, the budget on the mean second moment.
        max_cutoff: per-token hard cutoff on m2 (variant), or None for the mean rule.
    Returns:
        :class:`MaskResult`; metrics ``rs/m2po/mask_frac``, ``rs/m2po/masked_tokens``,
        ``rs/m2po/m2_mean`` (before masking), ``rs/m2po/m2_mean_kept`` and the tails
        ``rs/m2po/m2/{mean,p50,p90,p99,max}``.
    """
    if not threshold >= 0:
        raise ValueError(f"M2PO threshold must be >= 0, got {threshold}")
    if max_cutoff is not None and not max_cutoff >= 0:
        raise ValueError(f"M2PO max_cutoff must be >= 0 or None, got {max_cutoff}")
    valid = as_bool_mask(response_mask)
    m2 = second_moment(proximal_log_prob, behaviour_log_prob, valid)
    keep = valid.clone()
    if max_cutoff is not None:
        keep = valid & ~(m2 > max_cutoff)
    else:
        flat_idx = valid.reshape(-1).nonzero(as_tuple=True)[0]
        values = m2.reshape(-1)[flat_idx]
        n = values.numel()
        if n > 0:
            order = torch.sort(values, descending=True, stable=True).indices
            sorted_vals = values[order]
            # suffix_mean[k] = mean of sorted_vals[k:], k = 0..n-1 (k = n would leave nothing).
            suffix_sum = torch.flip(torch.cumsum(torch.flip(sorted_vals, [0]), 0), [0])
            counts = torch.arange(n, 0, -1, dtype=values.dtype, device=values.device)
            suffix_mean = suffix_sum / counts
            within = (suffix_mean <= threshold).nonzero(as_tuple=True)[0]
            k = int(within[0].item()) if within.numel() else n
            if k > 0:
                drop = flat_idx[order[:k]]
                keep_flat = keep.reshape(-1).clone()
                keep_flat[drop] = False
                keep = keep_flat.reshape(valid.shape)
    n_valid = masked_count(valid).clamp(min=1).to(m2.dtype)
    masked = valid & ~keep
    metrics = {
        "rs/m2po/mask_frac": (masked_count(masked) / n_valid).item(),
        "rs/m2po/masked_tokens": float(masked_count(masked).item()),
        "rs/m2po/m2_mean": masked_mean(m2, valid).item(),
        "rs/m2po/m2_mean_kept": masked_mean(m2, keep).item(),
    }
    metrics.update(tail_stats(m2, valid, prefix="rs/m2po/m2/"))
    return MaskResult(keep_mask=keep, metrics=metrics)


def opsm_mask(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta: float = OPSM_DEFAULT_DELTA,
) -> MaskResult:
    """Off-policy sequence masking (DeepSeek-V3.2 arXiv:2512.02556 §3.1, Eq. 8–9; seed 001).

        KL_i = (1/|o_i|) Σ_t [log μ(o_t) − log π_θ(o_t)]        (sampling-engine log-probs μ)
        M_i  = 0  if  A_i < 0  and  KL_i > δ,   else 1

    Using the inference engine's log-probs μ is the load-bearing detail: the one gate catches both
    engine mismatch and minibatch staleness. Only negative-advantage sequences are masked.

    Args:
        log_prob: (B, T) current policy log-probs (detached inside; the mask carries no gradient).
        rollout_log_prob: (B, T) log-probs returned by the rollout engine.
        advantages: (B, T) or (B,) advantages; a sequence's sign is that of its mean advantage
            over valid tokens (outcome advantages are constant along a sequence).
        response_mask: (B, T).
        delta: δ, the KL threshold.
    Returns:
        :class:`MaskResult`; metrics ``rs/opsm/masked_seq_frac``, ``rs/opsm/masked_seqs``,
        ``rs/opsm/kl/{mean,p50,p90,p99,max}`` over sequences.
    """
    if not delta >= 0:
        raise ValueError(f"OPSM delta must be >= 0, got {delta}")
    valid = as_bool_mask(response_mask)
    diff = clamped_log_ratio(rollout_log_prob, log_prob.detach(), valid)
    seq_kl = masked_mean(diff, valid, dim=-1)
    adv = advantages.detach()
    seq_adv = masked_mean(adv, valid, dim=-1) if adv.dim() == 2 else adv
    has_tokens = valid.any(dim=-1)
    reject = has_tokens & (seq_adv < 0) & (seq_kl > delta)
    keep = valid & ~reject.unsqueeze(-1)
    n_seq = int(has_tokens.sum().item())
    metrics = {
        "rs/opsm/masked_seq_frac": float(reject.sum().item()) / max(n_seq, 1),
        "rs/opsm/masked_seqs": float(reject.sum().item()),
    }
    metrics.update(tail_stats(seq_kl, has_tokens, prefix="rs/opsm/kl/"))
    return MaskResult(keep_mask=keep, metrics=metrics)
