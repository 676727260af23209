"""Importance-sampling primitives and CompIS, the per-source IS decomposition.

Notation (seed 001's notation map; seed 000's CompIS table):
    rollout_log_prob   μ(θ_j): the rollout engine (SGLang / embedded server) at the rollout
                       weights θ_j.
    old_log_prob       π_old = π(θ_j): the training engine at the same rollout weights θ_j.
    proximal_log_prob  π_prox = π(θ_k): the training engine at the weights the train step started
                       from (the trust-region centre; decoupled PPO's proximal policy).
    log_prob           π_θ: the training engine at the current weights (carries gradients).

CompIS (seed 000 "From DPPO to CompIS"; seed 004 "How corrections compose") splits the full ratio
π_θ/μ into three factors, each with its own correction:

    r1 = π_θ / π_prox        within-step drift → PPO clip (the policy loss)
    r3 = π_prox / π_old      staleness          → f_s ∈ {cap, clip, icepop, none}   (1 when k = j)
    r2 = π_old / μ           engine mismatch    → f_e ∈ {cap, clip, icepop, none}

    L_t = PPO(r1_t, A_t) · f_s(r3_t) · f_e(r2_t)

Departures from the textbook: every ratio is formed in log space and clamped to ±20 before
exponentiation (seed 001); weights are detached; rejected tokens (cap / icepop) get weight 0 *and*
are removed from the loss mask, so they count neither in the numerator nor in token-mean
denominators.

Also here: decoupled PPO (AReaL, arXiv:2505.24298), A-3PO's log-linear proximal interpolation
(arXiv:2512.06547) and the revised PPO-EWMA reference of seed 003 (arXiv:2605.12070, after Hilton
et al. arXiv:2110.00641).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from training.algorithms.masked import (
    as_bool_mask,
    clamped_log_ratio,
    masked_count,
    masked_mean,
    sanitize,
    tail_stats,
)

CORRECTION_METHODS = ("cap", "clip", "icepop", "none")

# Defaults per method when a bound is not given. cap 5.0 is AReaL's behaviour-weight cap (seed 000);
# the IcePop band [0.5, 5.0] is Ring-1T's reasoning-RL default (seed 001); clip's [0, 2.0] is
# truncated IS with seed 001's preset threshold C = 2.0 and no lower clamp.
DEFAULT_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "cap": (None, 5.0),
    "clip": (0.0, 2.0),
    "icepop": (0.5, 5.0),
    "none": (None, None),
}


@dataclass(frozen=True)
class SourceCorrection:
    """How one mismatch source's ratio becomes a weight (seed 000's CompIS method table).

    method: ``cap`` zeroes (and masks) tokens with ratio > upper; ``clip`` clamps the ratio to
        [lower, upper] (TIS-style, every token contributes); ``icepop`` zeroes (and masks) tokens
        outside [lower, upper]; ``none`` uses the raw ratio (measure without correcting).
    lower: lower bound on the ratio (clip, icepop); None → the method's default.
    upper: upper bound on the ratio (cap, clip, icepop); None → the method's default.
    """

    method: str = "none"
    lower: float | None = None
    upper: float | None = None

    def __post_init__(self) -> None:
        if self.method not in CORRECTION_METHODS:
            raise ValueError(
                f"unknown IS correction method {self.method!r}; use one of {CORRECTION_METHODS}"
            )
        lo, hi = self.bounds()
        if self.method == "cap" and self.lower is not None:
            raise ValueError("cap is one-sided: it takes only an upper bound; use clip or icepop "
                             "for a lower bound")
        if lo is not None and lo < 0:
            raise ValueError(f"lower bound must be >= 0, got {lo}")
        if hi is not None and hi <= 0:
            raise ValueError(f"upper bound must be > 0, got {hi}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"lower bound {lo} is above upper bound {hi}; swap them")

    def bounds(self) -> tuple[float | None, float | None]:
        d_lo, d_hi = DEFAULT_BOUNDS[self.method]
        return (d_lo if self.lower is None else self.lower,
                d_hi if self.upper is None else self.upper)


@dataclass(frozen=True)
class ISCorrection:
    """Result of one per-source correction.

    weight: (B, T) detached IS weight; 0 at masked and rejected positions.
    keep_mask: (B, T) bool; valid tokens that the correction did not reject.
    metrics: dict of floats (see :func:`compute_is_correction`).
    """

    weight: torch.Tensor
    keep_mask: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalised ESS = 1 / E[w̃²], w̃ = w / E[w] over valid positions (seed 001), in [0, 1].

    Args:
        weights: (B, T) or (B,) non-negative weights.
        mask: same shape as ``weights``.
    Returns:
        scalar tensor; 1 when all weights are equal (and, by convention, when nothing is valid:
        no sample, no variance), 0 when every weight is 0.
    """
    w = sanitize(weights.detach(), mask)
    if not bool(as_bool_mask(mask).any()):
        return torch.ones((), dtype=w.dtype)
    mean = masked_mean(w, mask)
    if mean <= 0:
        return torch.zeros((), dtype=w.dtype)
    normalised = w / mean
    return 1.0 / masked_mean(normalised * normalised, mask)


def compute_is_correction(
    numerator_log_probs: torch.Tensor,
    denominator_log_probs: torch.Tensor,
    mask: torch.Tensor,
    method: str | SourceCorrection = "none",
    bounds: tuple[float | None, float | None] | None = None,
    prefix: str = "",
) -> ISCorrection:
    """One source's IS ratio numerator/denominator, corrected by ``method``.

    Args:
        numerator_log_probs: (B, T) log-probs of the sampled tokens under the numerator policy.
        denominator_log_probs: (B, T) log-probs under the denominator policy.
        mask: (B, T) response mask.
        method: a name from ``CORRECTION_METHODS`` or a :class:`SourceCorrection`.
        bounds: (lower, upper) overriding the method's defaults (None entries keep the default).
        prefix: prepended to every metric key, e.g. ``"is/engine/"``.
    Returns:
        :class:`ISCorrection`. Metrics (over valid tokens): ``weight_mean/std/min/max`` of the
        final weight (rejected tokens count as 0), ``ess``, ``clip_frac`` (clamped by ``clip``),
        ``mask_frac`` (rejected by ``cap``/``icepop``), ``clip_frac_upper/lower``, ``kl_k1`` and
        ``kl_k3`` of the ratio, and tails ``ratio/{mean,p50,p90,p99,max}``.
    """
    if isinstance(method, SourceCorrection):
        cfg = method
        if bounds is not None:
            cfg = SourceCorrection(method.method,
                                   method.lower if bounds[0] is None else bounds[0],
                                   method.upper if bounds[1] is None else bounds[1])
    else:
        cfg = SourceCorrection(method, *(bounds or (None, None)))
    lower, upper = cfg.bounds()
    valid = as_bool_mask(mask)
    log_ratio = clamped_log_ratio(numerator_log_probs, denominator_log_probs, valid).detach()
    ratio = sanitize(torch.exp(log_ratio), valid)

    above = valid & (ratio > upper) if upper is not None else torch.zeros_like(valid)
    below = valid & (ratio < lower) if lower is not None else torch.zeros_like(valid)
    if cfg.method == "none":
        keep, weight = valid, ratio
        clipped = torch.zeros_like(valid)
    elif cfg.method == "clip":
        lo = -math.inf if lower is None else lower
        hi = math.inf if upper is None else upper
        keep, weight = valid, ratio.clamp(min=lo, max=hi)
        clipped = above | below
    elif cfg.method == "cap":
        keep = valid & ~above
        weight = ratio
        clipped = torch.zeros_like(valid)
    else:  # icepop: two-sided hard rejection, M(k) = k inside [lower, upper], 0 outside
        keep = valid & ~above & ~below
        weight = ratio
        clipped = torch.zeros_like(valid)
    weight = torch.where(keep, weight, torch.zeros_like(weight)).detach()

    n = masked_count(valid).clamp(min=1).to(ratio.dtype)
    w_valid = weight[valid]
    metrics: dict[str, float] = {
        "weight_mean": masked_mean(weight, valid).item(),
        "weight_std": (w_valid.std(unbiased=False).item() if w_valid.numel() > 1 else 0.0),
        "weight_min": (w_valid.min().item() if w_valid.numel() else 0.0),
        "weight_max": (w_valid.max().item() if w_valid.numel() else 0.0),
        "ess": effective_sample_size(weight, valid).item(),
        "clip_frac": (masked_count(clipped) / n).item(),
        "clip_frac_upper": (masked_count(clipped & above) / n).item(),
        "clip_frac_lower": (masked_count(clipped & below) / n).item(),
        "mask_frac": (masked_count(valid & ~keep) / n).item(),
        # KL(denominator || numerator) estimates from the sampled tokens (seed 001's k1 and k3).
        "kl_k1": masked_mean(-log_ratio, valid).item(),
        "kl_k3": masked_mean(ratio - log_ratio - 1.0, valid).item(),
    }
    metrics.update(tail_stats(ratio, valid, prefix="ratio/"))
    return ISCorrection(weight=weight, keep_mask=keep,
                        metrics={f"{prefix}{k}": v for k, v in metrics.items()})


# ----------------------------------------------------------------------------------------------
# CompIS: the three-ratio decomposition
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompISConfig:
    """Per-source corrections of CompIS (seed 000). r1 (trust region) is the policy loss's clip.

    staleness: correction of r3 = π_prox/π_old. Default: one-sided cap at 5.0 (AReaL's behaviour
        weight cap, seed 000's default configuration).
    engine: correction of r2 = π_old/μ. Default: ``none`` (measured, not corrected), seed 000's
        default configuration "following the AReaL codebase". Its stage-4 "Fix 2" — needed at
        64k context — is ``SourceCorrection("icepop")``, two-sided rejection in [0.5, 5.0].
    """

    staleness: SourceCorrection = field(default_factory=lambda: SourceCorrection("cap"))
    engine: SourceCorrection = field(default_factory=lambda: SourceCorrection("none"))


@dataclass(frozen=True)
class CompISWeights:
    """weight: (B, T) detached f_s(r3)·f_e(r2); keep_mask: (B, T) tokens kept by both sources."""

    weight: torch.Tensor
    keep_mask: torch.Tensor
    staleness: ISCorrection
    engine: ISCorrection
    metrics: dict[str, float]


def compute_compis_weights(
    proximal_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: CompISConfig | None = None,
) -> CompISWeights:
    """Staleness (r3) and engine (r2) weights of CompIS, each corrected independently.

    Args:
        proximal_log_prob: (B, T) training engine at the train-step weights θ_k (π_prox).
        old_log_prob: (B, T) training engine at the rollout weights θ_j (π_old). In a synchronous
            run θ_k = θ_j, so pass the same tensor as ``proximal_log_prob`` and r3 ≡ 1.
        rollout_log_prob: (B, T) rollout engine at θ_j (μ).
        response_mask: (B, T).
        config: per-source methods and bounds.
    Returns:
        :class:`CompISWeights`; metrics under ``is/staleness/*`` and ``is/engine/*`` plus
        ``is/combined/{weight_mean,ess,mask_frac}``. Its ``is/staleness/*`` is CompIS's own
        factor π_prox/π_old (≡ 1 when π_prox = π_old, as under the ewma strategy); the learner
        logs the measured π_current/π_old under that name instead and takes only
        ``is/combined/*`` from here (issue 14's contract).
    """
    cfg = config or CompISConfig()
    valid = as_bool_mask(response_mask)
    stale = compute_is_correction(proximal_log_prob, old_log_prob, valid, cfg.staleness,
                                  prefix="is/staleness/")
    engine = compute_is_correction(old_log_prob, rollout_log_prob, valid, cfg.engine,
                                   prefix="is/engine/")
    keep = stale.keep_mask & engine.keep_mask
    weight = torch.where(keep, stale.weight * engine.weight, torch.zeros_like(stale.weight))
    metrics = {**stale.metrics, **engine.metrics, **applied_weight_metrics(weight, keep, valid)}
    return CompISWeights(weight=weight.detach(), keep_mask=keep, staleness=stale, engine=engine,
                         metrics=metrics)


def applied_weight_metrics(weight: torch.Tensor | None, keep: torch.Tensor, mask: torch.Tensor,
                           prefix: str = "is/combined/") -> dict[str, float]:
    """``weight_mean``, ``ess`` and ``mask_frac`` of the IS weight a loss actually applies.

    Args:
        weight: (B, T) applied weight (None: the loss applies none → weight 1 on kept tokens).
        keep: (B, T) tokens the loss keeps.
        mask: (B, T) loss tokens before the correction.
    Returns:
        Over the loss tokens, with rejected tokens counting as weight 0: the mean weight, the
        normalised ESS, and ``mask_frac`` = the fraction rejected (dropped from ``keep``, or kept
        with weight exactly 0, as an IcePop band in a rollout-correction preset leaves them).
    """
    valid = as_bool_mask(mask)
    kept = as_bool_mask(keep) & valid
    w = kept.to(torch.float64) if weight is None else sanitize(weight.detach().to(torch.float64),
                                                               kept)
    rejected = valid & (~kept | (w == 0))
    n = masked_count(valid).clamp(min=1).to(torch.float64)
    return {f"{prefix}weight_mean": masked_mean(w, valid).item(),
            f"{prefix}ess": effective_sample_size(w, valid).item(),
            f"{prefix}mask_frac": (masked_count(rejected) / n).item()}


def compis_policy_loss(
    log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: CompISConfig | None = None,
    loss_config: object | None = None,
    loss_name: str = "vanilla",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The full CompIS loss: PPO-clip on r1 = π_θ/π_prox, times f_s(r3) · f_e(r2) per token.

    Args:
        log_prob: (B, T) current policy (with gradients).
        proximal_log_prob, old_log_prob, rollout_log_prob: (B, T), see module notation.
        advantages: (B, T).
        response_mask: (B, T).
        config: :class:`CompISConfig`.
        loss_config: a ``policy_loss.PolicyLossConfig`` (clip eps, dual-clip, aggregation).
        loss_name: the registered policy loss used for r1 (default PPO clip, "vanilla").
    Returns:
        (scalar loss to minimise, metrics of the loss and of both IS sources).
    """
    from training.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig

    weights = compute_compis_weights(proximal_log_prob, old_log_prob, rollout_log_prob,
                                     response_mask, config)
    loss_fn = POLICY_LOSSES.get(loss_name)
    loss, loss_metrics = loss_fn(
        proximal_log_prob, log_prob, advantages, weights.keep_mask,
        loss_config if loss_config is not None else PolicyLossConfig(),
        rollout_is_weights=weights.weight,
    )
    return loss, {**weights.metrics, **loss_metrics}


# ----------------------------------------------------------------------------------------------
# Decoupled PPO (AReaL) and its cheap proximal policy (A-3PO)
# ----------------------------------------------------------------------------------------------


def decoupled_ppo_loss(
    log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_config: object | None = None,
    behaviour_weight_cap: float | None = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (seed 004 "Correction: Decoupled PPO"; AReaL arXiv:2505.24298).

        J = E[ (π_prox/π_behav) · min(u·A, clip(u, 1-ε, 1+ε)·A) ],  u = π_θ/π_prox

    The behaviour weight π_prox/π_behav is detached and unclipped; tokens whose weight exceeds
    ``behaviour_weight_cap`` are masked (AReaL's cap, seed 000); ``None`` disables the cap.

    Args:
        log_prob: (B, T) current policy. proximal_log_prob: (B, T) trust-region centre.
        behaviour_log_prob: (B, T) the policy that generated the tokens.
        advantages, response_mask: (B, T).
    Returns:
        (loss, metrics incl. ``is/combined/*`` of the behaviour weight: it is the only IS
        weight applied, neither the staleness nor the engine ratio alone).
    """
    from training.algorithms.policy_loss import POLICY_LOSSES, PolicyLossConfig

    if behaviour_weight_cap is not None and not behaviour_weight_cap > 0:
        raise ValueError(f"behaviour_weight_cap must be > 0 or None, got {behaviour_weight_cap}")
    method = (SourceCorrection("none") if behaviour_weight_cap is None
              else SourceCorrection("cap", upper=behaviour_weight_cap))
    corr = compute_is_correction(proximal_log_prob, behaviour_log_prob, response_mask, method,
                                 prefix="is/combined/")
    loss, metrics = POLICY_LOSSES.get("vanilla")(
        proximal_log_prob, log_prob, advantages, corr.keep_mask,
        loss_config if loss_config is not None else PolicyLossConfig(),
        rollout_is_weights=corr.weight,
    )
    return loss, {**corr.metrics, **metrics}


def loglinear_proximal_log_prob(
    behaviour_log_prob: torch.Tensor,
    current_log_prob: torch.Tensor,
    behaviour_version: torch.Tensor,
    current_version: int,
    response_mask: torch.Tensor,
    proximal_version: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A-3PO's proximal log-probs by log-linear interpolation (arXiv:2512.06547), no forward pass.

        α_t = (v_prox − v_behav,t) / (v_θ − v_behav,t),   clamped to [0, 1]
        log π_prox,t = log π_behav,t + α_t · (log π_θ,t − log π_behav,t)

    A token generated at or after the proximal version (v_behav ≥ v_prox) gets α = 0: its own
    behaviour policy is the proximal policy. Seed 003 (Proposition 1) shows that this proxy only
    re-parameterises the clip boundaries of the total ratio; it is not a recovery of π_old.

    Args:
        behaviour_log_prob: (B, T) log-probs recorded at generation.
        current_log_prob: (B, T) current policy (detached inside).
        behaviour_version: (B, T) integer policy version that generated each token.
        current_version: version of the current weights v_θ.
        response_mask: (B, T).
        proximal_version: v_prox; default ``current_version - 1`` (one step behind, as in AReaL).
    Returns:
        (proximal log-probs (B, T) detached, α (B, T)); both 0 at masked positions.
    """
    valid = as_bool_mask(response_mask)
    behav = sanitize(behaviour_log_prob, valid).detach()
    cur = sanitize(current_log_prob, valid).detach()
    alpha = _interpolation_alpha(behaviour_version, current_version, valid, proximal_version,
                                 behav.dtype)
    prox = sanitize(behav + alpha * (cur - behav), valid)
    return prox, alpha


def _interpolation_alpha(behaviour_version: torch.Tensor, current_version: int,
                         valid: torch.Tensor, proximal_version: int | None,
                         dtype: torch.dtype) -> torch.Tensor:
    """(B, T) α_t = (v_prox − v_behav,t) / (v_θ − v_behav,t) clamped to [0, 1]; 0 where
    v_behav ≥ v_θ and at masked positions (A-3PO / AReaL's proximal weight)."""
    v_prox = current_version - 1 if proximal_version is None else proximal_version
    v_b = sanitize(behaviour_version.to(dtype), valid)
    num = v_prox - v_b
    den = current_version - v_b
    alpha = torch.where(den > 0, num / den.clamp(min=1e-12), torch.zeros_like(num))
    return sanitize(alpha.clamp(0.0, 1.0), valid)


def linear_proximal_log_prob(
    behaviour_log_prob: torch.Tensor,
    current_log_prob: torch.Tensor,
    behaviour_version: torch.Tensor,
    current_version: int,
    response_mask: torch.Tensor,
    proximal_version: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's ``linear_prox``: the proximal policy by arithmetic interpolation in probability
    space, no forward pass. Same α as :func:`loglinear_proximal_log_prob`; only the space differs.

        π_prox,t = (1 − α_t) · π_behav,t + α_t · π_θ,t
        log π_prox,t = logaddexp(log(1 − α_t) + log π_behav,t, log α_t + log π_θ,t)

    (log-sum-exp form: no probability underflows for very unlikely tokens). By the AM–GM
    inequality it is never below the log-linear proxy at the same α. Seed 003 (Proposition 1):
    like the log-linear proxy it only re-parameterises the clip boundaries of the total ratio.

    Args:
        behaviour_log_prob: (B, T) log-probs recorded at generation (μ).
        current_log_prob: (B, T) current policy (detached inside).
        behaviour_version: (B, T) integer policy version that generated each token.
        current_version: version of the current weights v_θ.
        response_mask: (B, T).
        proximal_version: v_prox; default ``current_version - 1``.
    Returns:
        (proximal log-probs (B, T) detached, α (B, T)); both 0 at masked positions.
    """
    valid = as_bool_mask(response_mask)
    behav = sanitize(behaviour_log_prob, valid).detach()
    cur = sanitize(current_log_prob, valid).detach()
    alpha = _interpolation_alpha(behaviour_version, current_version, valid, proximal_version,
                                 behav.dtype)
    # log 0 = −inf drops a term exactly (α = 0 → μ, α = 1 → π_θ)
    prox = torch.logaddexp(torch.log1p(-alpha) + behav, torch.log(alpha) + cur)
    return sanitize(prox, valid), alpha


# ----------------------------------------------------------------------------------------------
# Revised PPO-EWMA reference (seed 003 §5.2)
# ----------------------------------------------------------------------------------------------


def ewma_decay_from_staleness(staleness_window: float) -> float:
    """Decay β placing the EWMA reference at the middle of the staleness window (seed 003 §5.2).

    An EWMA ref ← β·ref + (1−β)·θ averages past versions with weights (1−β)β^i at age i, so its
    centre of mass (mean age, Hilton et al. arXiv:2110.00641) is β/(1−β). Asking for the centre
    of a window that spans ages 0..W (W = the expected staleness in optimizer steps) gives
    β/(1−β) = W/2, i.e. β = W / (W + 2). W = 0 (synchronous) gives β = 0: the reference is the
    current policy.
    """
    if staleness_window < 0:
        raise ValueError(f"staleness_window must be >= 0, got {staleness_window}")
    return staleness_window / (staleness_window + 2.0)


@dataclass(frozen=True)
class EWMAConfig:
    """Revised PPO-EWMA (seed 003).

    staleness_window: expected staleness W in optimizer steps; sets β = W/(W+2).
    reset_interval: reset the reference to the current policy after this many updates since the
        last reset (None: never by count). Bounds how many stale versions the average holds.
    reset_mask_frac: reset when the train–infer mask rejects more than this fraction of tokens
        (seed 003: a drifting EWMA reference makes the discrepancy ratio leave 1 and the mask
        reject many tokens). None: never by mask rate.
    """

    staleness_window: float = 2.0
    reset_interval: int | None = None
    reset_mask_frac: float | None = 0.1

    def __post_init__(self) -> None:
        if self.staleness_window < 0:
            raise ValueError("staleness_window must be >= 0 (expected staleness in steps)")
        if self.reset_interval is not None and self.reset_interval < 1:
            raise ValueError("reset_interval must be >= 1 or None")
        if self.reset_mask_frac is not None and not 0.0 < self.reset_mask_frac <= 1.0:
            raise ValueError("reset_mask_frac must be in (0, 1] or None")

    @property
    def beta(self) -> float:
        return ewma_decay_from_staleness(self.staleness_window)


@dataclass(frozen=True)
class EWMAState:
    """reference: a tensor (log-probs) or a name → tensor mapping (parameters)."""

    reference: torch.Tensor | Mapping[str, torch.Tensor]
    updates_since_reset: int = 0


def _blend(ref: torch.Tensor, cur: torch.Tensor, beta: float) -> torch.Tensor:
    return beta * ref.detach() + (1.0 - beta) * cur.detach()


def ewma_update(
    state: EWMAState | None,
    current: torch.Tensor | Mapping[str, torch.Tensor],
    config: EWMAConfig,
    mask_frac: float | None = None,
) -> tuple[EWMAState, bool]:
    """One step of the revised PPO-EWMA reference: ref ← β·ref + (1−β)·current, or a reset.

    Pure: returns a new state, never mutates its inputs. Works on a log-prob tensor or on a
    parameter mapping (same keys and shapes).

    Args:
        state: previous state (None: initialise to ``current``).
        current: the actor's current log-probs or parameters after this update.
        config: :class:`EWMAConfig`.
        mask_frac: the train–infer mask rejection rate measured with the current reference.
    Returns:
        (new state, whether a reset happened).
    """
    if state is None:
        return EWMAState(_clone(current), 0), True
    by_count = (config.reset_interval is not None
                and state.updates_since_reset + 1 >= config.reset_interval)
    by_mask = (config.reset_mask_frac is not None and mask_frac is not None
               and mask_frac > config.reset_mask_frac)
    reset = by_count or by_mask
    if reset:
        return EWMAState(_clone(current), 0), True
    beta = config.beta
    if isinstance(current, torch.Tensor):
        assert isinstance(state.reference, torch.Tensor), "reference and current kinds differ"
        new_ref: torch.Tensor | dict[str, torch.Tensor] = _blend(state.reference, current, beta)
    else:
        assert isinstance(state.reference, Mapping), "reference and current kinds differ"
        if set(state.reference) != set(current):
            raise ValueError("EWMA reference and current parameters have different names")
        new_ref = {k: _blend(state.reference[k], v, beta) for k, v in current.items()}
    return EWMAState(new_ref, state.updates_since_reset + 1), False


def _clone(x: torch.Tensor | Mapping[str, torch.Tensor]):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return {k: v.detach().clone() for k, v in x.items()}

