"""Policy losses as staleness mechanisms.

Spec: seed 001 §"Policy loss functions as staleness mechanisms"; seed 004 "How Corrections
Compose".

Every loss in :data:`POLICY_LOSSES` shares one signature::

    loss_fn(old_log_prob (B, T), log_prob (B, T), advantages (B, T), response_mask (B, T),
            config: PolicyLossConfig, rollout_is_weights: (B, T) | None = None)
        -> (scalar loss to MINIMISE, dict[str, float] metrics)

Notation: ``r_t = π_θ(y_t) / π_old(y_t) = exp(log_prob - old_log_prob)`` (the staleness ratio
of seed 001's notation map; in bypass mode ``π_old`` *is* the rollout policy), ``A_t`` the
advantage, ``w_t`` the (detached) rollout importance weight handed in by a correction module.

Composition with correction modules (seed 004 "How Corrections Compose", seed 000 CompIS): the IS
weights multiply the *per-token* loss before aggregation, ``loss_t = w_t · ℓ_t``, for every loss.
For the sequence-level losses (gspo, gspo_token, gmpo) the per-sequence term is broadcast to the
sequence's tokens and the weight still multiplies per token, so a sequence contributes
``ℓ_i · mean_t(w_t)`` under ``seq-mean-token-mean`` (verl's ``compute_policy_loss_geo_mean``
instead takes a geometric mean of the weights; we keep the one rule "w multiplies per token").

Conventions shared by all losses (documented once here):
  * inputs are sanitised first (masked garbage, NaN/±inf included, never reaches an output or a
    gradient); ``old_log_prob``, ``advantages`` and the IS weights are treated as constants
    (detached), gradients flow to ``log_prob`` only;
  * per-token log-ratios are clamped to ±``LOG_RATIO_BOUND`` (=20) before ``exp`` (seed 001);
  * metric keys: ``policy/pg_loss``, ``policy/pg_clipfrac``, ``policy/pg_clipfrac_lower``,
    ``policy/ppo_kl`` (= masked mean of ``old_log_prob − log_prob``, the k1 estimate of
    KL(π_old‖π_θ)), the tail of the ratio ``policy/ratio/{mean,p50,p90,p99,max}`` and
    loss-specific keys under ``policy/<loss>/``. Fractions are over valid tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import names
from .masked import (
    as_bool_mask,
    clamped_log_ratio,
    masked_count,
    masked_mean,
    masked_sum,
    sanitize,
    sequence_mask,
    tail_stats,
    valid_values,
)
from .registry import Registry

if TYPE_CHECKING:  # imported lazily at run time (see compute_policy_loss_bypass_mode)
    from .rollout_correction import RolloutCorrectionConfig

__all__ = [
    "BYPASS_LOSS_TYPES",
    "KL_COV_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PPOClipTerms",
    "PolicyLossConfig",
    "PolicyLossFn",
    "agg_loss",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_gmpo",
    "compute_policy_loss_gspo",
    "compute_policy_loss_gspo_token",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_ppo_clip_terms",
    "resolve_clip_range",
    "sapo_gate",
    "sapo_shape",
]

LOSS_AGG_MODES: tuple[str, ...] = names.LOSS_AGG_MODES
BYPASS_LOSS_TYPES: tuple[str, ...] = ("ppo_clip", "reinforce")
KL_COV_ESTIMATORS: tuple[str, ...] = ("abs", "k3")

# GSPO: upper clamp on the (sequence) log-ratio before exp, as verl's compute_policy_loss_gspo.
GSPO_LOG_RATIO_MAX = 10.0
# DPPO-KL: binary KL uses log((1 - p_old + eps) / (1 - p + eps)) (verl compute_policy_loss_dppo_kl).
DPPO_KL_EPS = 1e-8


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar.

    Args:
        loss_mat: (B, T) per-token loss; values at masked positions are ignored (even NaN/inf).
        loss_mask: (B, T) bool or 0/1 mask of tokens that count.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`:

            * ``token-mean``: Σ_{b,t} m·ℓ / Σ_{b,t} m  (every valid token weighs the same; DAPO).
            * ``token-sum``: Σ_{b,t} m·ℓ — no normaliser (seed 001; verl's ``token-sum``, whose
              × dp_size only undoes its ranks' gradient averaging: one process here). The
              gradient grows with the batch's token count, so the learning rate carries the
              scale.
            * ``seq-mean-token-sum``: (1/S) Σ_b Σ_t m·ℓ.
            * ``seq-mean-token-mean``: (1/S) Σ_b (Σ_t m·ℓ / Σ_t m)  (GRPO's original objective).
            * ``seq-mean-token-sum-norm``: seq-mean-token-sum / K — Dr.GRPO (arXiv:2503.20783)
              divides by a *constant* instead of the sequence length. K = ``loss_scale_factor``;
              when None, K = T = ``loss_mask.shape[-1]`` (the padded response length), which is
              verl's default in ``agg_loss`` (set a fixed value to keep the scale constant when T
              varies between micro-batches).

            S is the number of sequences with at least one valid token: fully masked sequences are
            excluded from every seq-mean denominator (as verl's ``agg_loss``), so padding rows or
            rows emptied by rejection sampling never dilute the loss.
        loss_scale_factor: K for ``seq-mean-token-sum-norm`` (> 0); ignored by the other modes.

    Returns:
        Scalar tensor (dtype of ``loss_mat``). 0 when no token is valid (never NaN); gradients
        at masked positions are exactly 0.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"invalid loss_agg_mode {loss_agg_mode!r}; use one of {', '.join(LOSS_AGG_MODES)}"
        )
    if loss_scale_factor is not None and not (
        math.isfinite(loss_scale_factor) and loss_scale_factor > 0
    ):
        raise ValueError(
            f"loss_scale_factor must be a finite number > 0 or None, got {loss_scale_factor}"
        )
    if loss_mat.shape != loss_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must both be "
            "(B, T)"
        )
    mask = as_bool_mask(loss_mask)
    values = sanitize(loss_mat, mask)
    if loss_agg_mode == "token-mean":
        return masked_mean(values, mask)
    if loss_agg_mode == "token-sum":
        return masked_sum(values, mask)

    # number of non-empty sequences S (clamped to 1 so that an all-masked batch gives 0, not NaN)
    num_seqs = sequence_mask(mask).sum().to(values.dtype).clamp(min=1)
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked_mean(values, mask, dim=-1)  # (B,), 0 for empty sequences
        return per_seq.sum() / num_seqs
    per_seq = masked_sum(values, mask, dim=-1)  # (B,) token-sum, 0 for empty sequences
    loss = per_seq.sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        # Dr.GRPO: divide by a constant K (default: the padded length T, at least 1)
        scale = loss_scale_factor if loss_scale_factor is not None else max(mask.shape[-1], 1)
        loss = loss / float(scale)
    return loss


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def _check_nonneg(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _check_pos(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Hyper-parameters of every policy loss in :data:`POLICY_LOSSES` (one object for all).

    Defaults are the papers'/verl's (see each field). Only the fields a loss reads matter to it.
    """

    loss_agg_mode: str = "token-mean"
    """Aggregation (see :func:`agg_loss`) used by the token-level losses (vanilla, cispo, gpg/
    reinforce, clip_cov, kl_cov, dppo_tv, dppo_kl, bypass_mode). verl's actor default."""

    sequence_objective_agg_mode: str = "seq-mean-token-mean"
    """Aggregation used by the losses whose paper objective is a per-sequence mean: gspo,
    gspo_token, sapo and gmpo. verl hard-codes ``seq-mean-token-mean`` for gspo and sapo
    (``compute_policy_loss_gspo`` / ``_sapo``) and a plain mean over sequences for geo_mean; here it
    is explicit and overridable."""

    clip_ratio: float = 0.2
    """PPO ε (arXiv:1707.06347); fallback for ``clip_ratio_low`` / ``clip_ratio_high``."""

    clip_ratio_low: float | None = None
    """ε_low: ratio lower clip bound ``1 − ε_low`` (vanilla, clip_cov). None → ``clip_ratio``."""

    clip_ratio_high: float | None = None
    """ε_high: ratio upper clip bound ``1 + ε_high`` ("clip-higher", DAPO arXiv:2503.14476).
    None → ``clip_ratio``."""

    clip_ratio_c: float = 3.0
    """Dual-clip constant c > 1 (Ye et al. 2020, arXiv:1912.09729): for A < 0 the per-token loss
    is capped at ``−c·A`` (vanilla and bypass ppo_clip). verl default 3.0."""

    tau_pos: float = 1.0
    """SAPO temperature for A > 0 (arXiv:2511.20347; paper/verl default 1.0)."""

    tau_neg: float = 1.05
    """SAPO temperature for A ≤ 0 (paper/verl default 1.05; > tau_pos damps negative updates
    faster)."""

    cispo_clip_ratio_low: float = 10.0
    """CISPO lower bound: the IS weight is clipped below at ``1 − cispo_clip_ratio_low``. verl's
    CISPO example uses 10 (≥ 1 → no lower clip, as in MiniMax-M1 arXiv:2506.13585)."""

    cispo_clip_ratio_high: float = 0.2
    """CISPO upper bound: IS weight clipped above at ``1 + cispo_clip_ratio_high`` (verl example
    0.2)."""

    gspo_clip_ratio_low: float = 3e-4
    """GSPO ε_low on the sequence ratio (arXiv:2507.18071 and verl's GSPO recipe: 3e-4). Also used
    by gspo_token."""

    gspo_clip_ratio_high: float = 4e-4
    """GSPO ε_high on the sequence ratio (paper / verl recipe: 4e-4)."""

    gmpo_clip_ratio_low: float = 0.4
    """GMPO ε_low, in *log* space: for A < 0 the token log-ratio is floored at −ε_low
    (arXiv:2507.20673; verl GMPO example 0.4)."""

    gmpo_clip_ratio_high: float = 0.4
    """GMPO ε_high, in log space: for A > 0 the token log-ratio is capped at +ε_high (0.4)."""

    clip_cov_ratio: float = 2e-4
    """Clip-Cov (arXiv:2505.22617): fraction of valid tokens whose loss is zeroed,
    ``max(int(ratio·N), 1)`` tokens drawn from the candidates (verl default 2e-4)."""

    clip_cov_lb: float = 1.0
    """Clip-Cov: candidates have centred covariance ``cov_t > clip_cov_lb`` (verl default 1.0)."""

    clip_cov_ub: float = 5.0
    """Clip-Cov: candidates have ``cov_t < clip_cov_ub`` (verl default 5.0)."""

    clip_cov_seed: int = 0
    """Clip-Cov randomness when ``clip_cov_generator`` is None: a fresh CPU generator seeded with
    this value is created per call, so the draw is a deterministic function of the inputs."""

    clip_cov_generator: torch.Generator | None = field(default=None, compare=False, repr=False)
    """Optional CPU ``torch.Generator`` used for Clip-Cov's random draw; it advances across calls
    (fresh randomness every step, reproducible from its seed). Takes precedence over
    ``clip_cov_seed``."""

    kl_cov_ratio: float = 2e-4
    """KL-Cov (arXiv:2505.22617): fraction of valid tokens (top covariance, at least 1) that get
    the KL penalty (verl default 2e-4)."""

    ppo_kl_coef: float = 0.1
    """KL-Cov penalty coefficient β (verl ``policy_loss.ppo_kl_coef`` default 0.1)."""

    kl_cov_estimator: str = "abs"
    """Per-token estimate of KL(π_old‖π_θ) used by KL-Cov: ``abs`` = |log r| (verl / the paper's
    released code) or ``k3`` = r − 1 − log r (unbiased for the formal KL of the paper's eq. 14
    under samples from π_old; seed 001 notes the paper uses formal KL)."""

    dppo_tv_low: float = 0.15
    """DPPO-Binary-TV (arXiv:2602.04879): for A ≤ 0 a token is masked when π_θ − π_old < −δ_low
    (verl DPPO example 0.15)."""

    dppo_tv_high: float = 0.15
    """DPPO-Binary-TV: for A > 0 a token is masked when π_θ − π_old > δ_high (0.15)."""

    dppo_kl_low: float = 0.05
    """DPPO-Binary-KL: for A ≤ 0 a token is masked when its binary KL > δ_low and π_θ < π_old
    (verl DPPO example 0.05)."""

    dppo_kl_high: float = 0.05
    """DPPO-Binary-KL: for A > 0 a token is masked when its binary KL > δ_high and π_θ > π_old."""

    dppo_is_cap: float = 20.0
    """DPPO truncated IS: the detached ratio is capped at this value (seed 001: "truncated IS
    (threshold 20.0)"). verl's DPPO falls back to 20.0 only when ``clip_ratio_c`` is unset; its
    default actor config sets ``clip_ratio_c = 3.0``, so a stock verl run caps at 3.0."""

    loss_scale_factor: float | None = None
    """Constant K of ``seq-mean-token-sum-norm`` (Dr.GRPO); None → the padded length T."""

    rollout_correction: RolloutCorrectionConfig | None = None
    """``training.algorithms.rollout_correction.RolloutCorrectionConfig`` for the ``bypass_mode``
    loss (IS / RS settings between π_θ and the rollout policy). Required by bypass_mode only."""

    dro_beta: float | None = None
    """DRO: β of the quadratic log-ratio penalty ½β(log π_θ − log π_old)². No default, as in
    verl (``policy_loss.dro_beta``): the ``dro`` loss refuses to run without a value > 0."""

    bypass_loss_type: str | None = None
    """Loss used by ``bypass_mode``: ``ppo_clip`` or ``reinforce``. None (recommended) → the
    rollout-correction config's ``loss_type`` (verl reads it there; default ``ppo_clip``). When both
    are set they must agree (ValueError otherwise), so a ``bypass_pg_*`` preset cannot silently
    lose its IS weights."""

    def __post_init__(self) -> None:
        for name in ("loss_agg_mode", "sequence_objective_agg_mode"):
            mode = getattr(self, name)
            if mode not in LOSS_AGG_MODES:
                raise ValueError(
                    f"{name}={mode!r} is not a loss aggregation mode; use one of "
                    f"{', '.join(LOSS_AGG_MODES)}"
                )
        _check_nonneg("clip_ratio", self.clip_ratio)
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None:
                _check_nonneg(name, value)
        if not (math.isfinite(self.clip_ratio_c) and self.clip_ratio_c > 1.0):
            raise ValueError(
                f"clip_ratio_c must be > 1 (dual-clip lower bound on the ratio), got "
                f"{self.clip_ratio_c}; use e.g. 3.0, or a large value such as 1e4 to disable it"
            )
        for name in ("tau_pos", "tau_neg"):
            _check_pos(name, getattr(self, name))
        for name in (
            "cispo_clip_ratio_low",
            "cispo_clip_ratio_high",
            "gspo_clip_ratio_low",
            "gspo_clip_ratio_high",
            "gmpo_clip_ratio_low",
            "gmpo_clip_ratio_high",
            "ppo_kl_coef",
        ):
            _check_nonneg(name, getattr(self, name))
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not (self.clip_cov_lb < self.clip_cov_ub):
            raise ValueError(
                f"clip_cov_lb ({self.clip_cov_lb}) must be < clip_cov_ub ({self.clip_cov_ub})"
            )
        if self.clip_cov_generator is not None and not isinstance(
            self.clip_cov_generator, torch.Generator
        ):
            raise ValueError("clip_cov_generator must be a torch.Generator or None")
        if self.kl_cov_estimator not in KL_COV_ESTIMATORS:
            raise ValueError(
                f"kl_cov_estimator={self.kl_cov_estimator!r}; use one of "
                f"{', '.join(KL_COV_ESTIMATORS)}"
            )
        for name in ("dppo_tv_low", "dppo_tv_high", "dppo_kl_low", "dppo_kl_high", "dppo_is_cap"):
            _check_pos(name, getattr(self, name))
        if self.loss_scale_factor is not None:
            _check_pos("loss_scale_factor", self.loss_scale_factor)
        if self.dro_beta is not None:
            _check_pos("dro_beta", self.dro_beta)
        if self.bypass_loss_type is not None and self.bypass_loss_type not in BYPASS_LOSS_TYPES:
            raise ValueError(
                f"bypass_loss_type={self.bypass_loss_type!r}; use one of "
                f"{', '.join(BYPASS_LOSS_TYPES)} or None"
            )
        rc_type = getattr(self.rollout_correction, "loss_type", None)
        if (
            self.bypass_loss_type is not None
            and rc_type is not None
            and rc_type != self.bypass_loss_type
        ):
            raise ValueError(
                f"bypass_loss_type={self.bypass_loss_type!r} contradicts "
                f"rollout_correction.loss_type={rc_type!r}; set rollout_correction.loss_type "
                "(e.g. a bypass_pg_* preset for reinforce) and leave bypass_loss_type None"
            )

    @property
    def resolved_bypass_loss_type(self) -> str:
        """The loss ``bypass_mode`` dispatches to (see ``bypass_loss_type``)."""
        if self.bypass_loss_type is not None:
            return self.bypass_loss_type
        rc_type = getattr(self.rollout_correction, "loss_type", None)
        return rc_type if rc_type is not None else "ppo_clip"


def resolve_clip_range(config: PolicyLossConfig) -> tuple[float, float]:
    """(ε_low, ε_high) with the ``clip_ratio`` fallback applied."""
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


class _Inputs(NamedTuple):
    old_log_prob: torch.Tensor  # (B, T) sanitised, detached
    log_prob: torch.Tensor  # (B, T) sanitised, carries the graph
    advantages: torch.Tensor  # (B, T) sanitised, detached
    mask: torch.Tensor  # (B, T) bool
    is_weights: torch.Tensor | None  # (B, T) sanitised, detached


def _prepare(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> _Inputs:
    shape = log_prob.shape
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be (B, T), got shape {tuple(shape)}")
    named = {
        "old_log_prob": old_log_prob,
        "advantages": advantages,
        "response_mask": response_mask,
    }
    if rollout_is_weights is not None:
        named["rollout_is_weights"] = rollout_is_weights
    for name, tensor in named.items():
        if tensor.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but log_prob has {tuple(shape)}; all "
                "per-token inputs must be (B, T)"
            )
    mask = as_bool_mask(response_mask)
    weights = None
    if rollout_is_weights is not None:
        weights = sanitize(rollout_is_weights.detach().to(log_prob.dtype), mask)
    return _Inputs(
        old_log_prob=sanitize(old_log_prob.detach().to(log_prob.dtype), mask),
        log_prob=sanitize(log_prob, mask),
        advantages=sanitize(advantages.detach().to(log_prob.dtype), mask),
        mask=mask,
        is_weights=weights,
    )


def _apply_is_weights(token_loss: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    # loss_t = w_t · ℓ_t  (seed 004 "TIS × Multi-Epoch": L = r_TIS · PPO_t; w detached)
    return token_loss if weights is None else token_loss * weights


def _frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of valid tokens where ``flags`` holds (0.0 when there is no valid token)."""
    return float(masked_mean(flags.to(torch.float64), mask).item())


def _base_metrics(
    pg_loss: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    clipfrac: float = 0.0,
    clipfrac_lower: float = 0.0,
) -> dict[str, float]:
    """The keys every loss reports; ``log_ratio`` (B, T) is log(π_θ/π_old) (clamped)."""
    metrics = {
        "policy/pg_loss": float(pg_loss.detach().item()),
        "policy/pg_clipfrac": clipfrac,
        "policy/pg_clipfrac_lower": clipfrac_lower,
        # k1 estimate of KL(π_old ‖ π_θ): mean over valid tokens of (log π_old − log π_θ)
        "policy/ppo_kl": float(masked_mean(-log_ratio.detach(), mask).item()),
    }
    metrics.update(tail_stats(torch.exp(log_ratio.detach()), mask, prefix="policy/ratio/"))
    return metrics


class PPOClipTerms(NamedTuple):
    """Per-token pieces of the (dual-)clipped PPO surrogate, all (B, T)."""

    token_loss: torch.Tensor
    """ℓ_t to minimise (before IS weights and aggregation)."""
    clipped: torch.Tensor
    """bool: the ε-clip is active (the clipped branch is strictly larger: zero gradient)."""
    clipped_lower: torch.Tensor
    """bool: A < 0 and the dual-clip cap −c·A is active (zero gradient)."""


def compute_ppo_clip_terms(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
) -> PPOClipTerms:
    """Clipped PPO surrogate per token (Schulman et al. 2017, arXiv:1707.06347), optional dual clip.

    Args:
        ratio: (B, T) r_t = π_θ/π_old (carries the gradient).
        advantages: (B, T) A_t.
        clip_ratio_low: ε_low, lower bound 1 − ε_low.
        clip_ratio_high: ε_high, upper bound 1 + ε_high.
        clip_ratio_c: dual-clip constant c > 1 (arXiv:1912.09729) or None for no dual clip.

    Inputs must already be sanitised (this helper does no masking; callers aggregate with the
    response mask).

    Returns:
        :class:`PPOClipTerms`. Selection uses ``torch.where`` so that ties give the unclipped branch
        its full gradient.
    """
    # ℓ¹ = −A·r ; ℓ² = −A·clip(r, 1−ε_low, 1+ε_high) ; ℓ = max(ℓ¹, ℓ²)  (= −min(rA, clip(r)A))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = loss_clipped > loss_unclipped
    token_loss = torch.where(clipped, loss_clipped, loss_unclipped)
    clipped_lower = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        # dual clip, A < 0 only: ℓ = min(ℓ, −c·A)  (caps the loss when r ≫ 1 on a bad token)
        cap = -advantages * clip_ratio_c
        clipped_lower = (advantages < 0) & (token_loss > cap)
        token_loss = torch.where(clipped_lower, cap, token_loss)
    return PPOClipTerms(token_loss=token_loss, clipped=clipped, clipped_lower=clipped_lower)


def sapo_shape(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """SAPO objective shape g(r, τ) = σ(τ(r − 1))·4/τ (arXiv:2511.20347; seed 001).

    Monotone in r, g(1, τ) = 2/τ, asymptote 4/τ. It is the *objective*, not a gradient gate.
    """
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """SAPO gate g'(r, τ) = ∂g/∂r = 4·σ(τ(r−1))·(1 − σ(τ(r−1))), peak 1 at r = 1 (seed 001).

    Since ∂r/∂log π_θ = r, the gradient of −A·g(r) w.r.t. log π_θ is −A·g'(r)·r.
    """
    s = torch.sigmoid(tau * (ratio - 1.0))
    return 4.0 * s * (1.0 - s)


def _seq_lengths(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B,) number of valid tokens per sequence, clamped to ≥ 1 (safe divisor)."""
    return masked_count(mask, dim=-1).to(dtype).clamp(min=1)


def _broadcast_seq(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) → (B, T) by repetition along tokens."""
    return values.unsqueeze(-1).expand_as(like)


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


@POLICY_LOSSES.register("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO with asymmetric ε (clip-higher) and dual clip on negative advantages.

    ``ℓ_t = w_t · max(−A r, −A clip(r, 1−ε_low, 1+ε_high))``, and for A < 0 additionally
    ``min(·, −c·A)`` (arXiv:1707.06347, arXiv:1912.09729, arXiv:2503.14476). Same semantics as
    verl ``compute_policy_loss_vanilla``.

    Args:
        old_log_prob: (B, T) log π_old of the sampled tokens (detached).
        log_prob: (B, T) log π_θ (carries the gradient).
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses clip_ratio(_low/_high), clip_ratio_c, loss_agg_mode, loss_scale_factor.
        rollout_is_weights: (B, T) detached IS weights multiplying ℓ_t, or None.

    Returns:
        (scalar loss, metrics); ``policy/pg_clipfrac`` = ε-clip active, ``policy/pg_clipfrac_lower``
        = dual clip active.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    ratio = torch.exp(log_ratio)
    low, high = resolve_clip_range(config)
    terms = compute_ppo_clip_terms(ratio, x.advantages, low, high, config.clip_ratio_c)
    token_loss = _apply_is_weights(terms.token_loss, x.is_weights)
    pg_loss = agg_loss(token_loss, x.mask, config.loss_agg_mode, config.loss_scale_factor)
    metrics = _base_metrics(
        pg_loss,
        log_ratio,
        x.mask,
        clipfrac=_frac(terms.clipped, x.mask),
        clipfrac_lower=_frac(terms.clipped_lower, x.mask),
    )
    return pg_loss, metrics


def _gspo_common(
    x: _Inputs, config: PolicyLossConfig, token_level: bool
) -> tuple[torch.Tensor, dict[str, float]]:
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    lengths = _seq_lengths(x.mask, log_ratio.dtype)
    # log s_i = (1/|y_i|) Σ_t log r_{i,t}   (geometric mean of the token ratios)
    seq_log_ratio = masked_sum(log_ratio, x.mask, dim=-1) / lengths  # (B,)
    if token_level:
        # GSPO-token (§4.3): log s_{i,t} = sg[log s_i] + log π_θ(y_t) − sg[log π_θ(y_t)]
        # value = log s_i, gradient reaches log π_θ only through the token's own factor.
        log_s = _broadcast_seq(seq_log_ratio.detach(), log_ratio) + x.log_prob - x.log_prob.detach()
    else:
        # GSPO: ordinary gradient through log s_i (seed 001: no stop-gradient in vanilla GSPO)
        log_s = _broadcast_seq(seq_log_ratio, log_ratio)
    log_s = torch.clamp(log_s, max=GSPO_LOG_RATIO_MAX)
    s = torch.exp(log_s)  # (B, T): s_i repeated on the sequence's tokens
    terms = compute_ppo_clip_terms(
        s, x.advantages, config.gspo_clip_ratio_low, config.gspo_clip_ratio_high, None
    )
    token_loss = _apply_is_weights(terms.token_loss, x.is_weights)
    pg_loss = agg_loss(
        token_loss, x.mask, config.sequence_objective_agg_mode, config.loss_scale_factor
    )
    metrics = _base_metrics(pg_loss, log_ratio, x.mask, clipfrac=_frac(terms.clipped, x.mask))
    prefix = "policy/gspo_token/" if token_level else "policy/gspo/"
    seq_ratio = torch.exp(torch.clamp(seq_log_ratio.detach(), max=GSPO_LOG_RATIO_MAX))
    metrics.update(tail_stats(seq_ratio, sequence_mask(x.mask), prefix=f"{prefix}seq_ratio/"))
    return pg_loss, metrics


@POLICY_LOSSES.register("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO, sequence-level ratio with ordinary gradient (Zheng et al. 2025, arXiv:2507.18071).

    ``s_i = exp((1/|y_i|) Σ_t log r_{i,t})`` (log clamped ≤ 10 as verl), then per token
    ``ℓ_{i,t} = w_t · max(−A_t s_i, −A_t clip(s_i, 1−ε_low, 1+ε_high))`` with the GSPO ε
    (``gspo_clip_ratio_low/high``), aggregated with ``sequence_objective_agg_mode``
    (seq-mean-token-mean → ``−(1/G) Σ_i min(s_i A_i, clip(s_i) A_i)`` for sequence-level A).
    Gradient flows through log s_i, i.e. every token of sequence i receives
    ``−Ā_i s_i / |y_i|`` (seed 001: only GSPO-token has the stop-gradient). Note: verl's
    ``compute_policy_loss_gspo`` implements the GSPO-token form; this is the paper's eq. (5).

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages (normally constant along a sequence).
        response_mask: (B, T) tokens that count.
        config: uses gspo_clip_ratio_low/high, sequence_objective_agg_mode.
        rollout_is_weights: (B, T) detached IS weights, multiplied per token.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    return _gspo_common(x, config, token_level=False)


@POLICY_LOSSES.register("gspo_token")
def compute_policy_loss_gspo_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token (arXiv:2507.18071 §4.3): ``s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)]`` per token.

    Same value as GSPO; the gradient reaches log π_θ(y_t) only through the token's own factor:
    ``∂ℓ/∂log π_θ(y_{i,t}) = −A_{i,t} s_i`` (per token, before aggregation) when unclipped, so
    per-token advantages get per-token credit. With A constant along a sequence the gradient equals
    GSPO's. Clipping uses the GSPO ε on s_{i,t} (whose value is s_i); verl
    ``compute_policy_loss_gspo`` semantics.

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) per-token advantages.
        response_mask: (B, T) tokens that count.
        config: uses gspo_clip_ratio_low/high, sequence_objective_agg_mode.
        rollout_is_weights: (B, T) detached IS weights, multiplied per token.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    return _gspo_common(x, config, token_level=True)


@POLICY_LOSSES.register("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO, smooth objective shaping (Gao et al. 2025, arXiv:2511.20347).

    ``ℓ_t = −w_t · A_t · g(r_t, τ_t)`` with ``g(r, τ) = σ(τ(r−1))·4/τ`` and ``τ_t = τ_pos`` if
    A_t > 0 else ``τ_neg``; aggregated with ``sequence_objective_agg_mode`` (verl
    ``compute_policy_loss_sapo`` forces seq-mean-token-mean). The gradient weight is the gate
    ``g'(r) = 4σ(1−σ)`` (peak at r = 1): ``∂ℓ_t/∂log π_θ = −w_t A_t g'(r_t) r_t``. No hard clip, so
    ``policy/pg_clipfrac`` is 0; ``policy/sapo/gate_*`` report g'(r) over valid tokens.

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses tau_pos, tau_neg, sequence_objective_agg_mode.
        rollout_is_weights: (B, T) detached IS weights.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        x.advantages > 0,
        torch.full_like(ratio, config.tau_pos),
        torch.full_like(ratio, config.tau_neg),
    )
    token_loss = _apply_is_weights(-x.advantages * sapo_shape(ratio, tau), x.is_weights)
    pg_loss = agg_loss(
        token_loss, x.mask, config.sequence_objective_agg_mode, config.loss_scale_factor
    )
    metrics = _base_metrics(pg_loss, log_ratio, x.mask)
    gate = sapo_gate(ratio.detach(), tau)
    gate_valid = valid_values(gate, x.mask)
    metrics["policy/sapo/gate_mean"] = float(masked_mean(gate, x.mask).item())
    metrics["policy/sapo/gate_min"] = float(gate_valid.min().item()) if gate_valid.numel() else 0.0
    metrics["policy/sapo/pos_adv_frac"] = _frac(x.advantages > 0, x.mask)
    return pg_loss, metrics


@POLICY_LOSSES.register("gmpo")
@POLICY_LOSSES.register("geo_mean")
def compute_policy_loss_gmpo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv:2507.20673).

    Sign-aware token clipping in log space: ``x_t = log r_t``; A_t > 0 → ``min(x_t, ε_high)``;
    A_t < 0 → ``max(x_t, −ε_low)``; A_t = 0 → 0 (verl ``compute_policy_loss_geo_mean`` multiplies
    by sign(A)). Then ``ρ_i = exp(mean_t x̃_t)``, ``Ā_i = mean_t A_t`` and the sequence loss
    ``ℓ_i = −Ā_i ρ_i`` is broadcast to the sequence's tokens, multiplied by w_t and aggregated
    with ``sequence_objective_agg_mode`` (default → mean over non-empty sequences of
    ``ℓ_i · mean_t w_t``). GMPO assumes sequence-level advantages.

    Metrics: ``pg_clipfrac`` = fraction of tokens whose log-ratio was actually capped (A > 0),
    ``pg_clipfrac_lower`` = actually floored (A < 0). verl's ``geo_mean`` also counts tokens outside
    the band on the side the sign-aware clamp leaves alone, so its fractions are larger.

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages (constant along a sequence).
        response_mask: (B, T) tokens that count.
        config: uses gmpo_clip_ratio_low/high, sequence_objective_agg_mode.
        rollout_is_weights: (B, T) detached IS weights.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    high, low = config.gmpo_clip_ratio_high, config.gmpo_clip_ratio_low
    capped = (x.advantages > 0) & (log_ratio > high)
    floored = (x.advantages < 0) & (log_ratio < -low)
    clipped_log = torch.where(capped, torch.full_like(log_ratio, high), log_ratio)
    clipped_log = torch.where(floored, torch.full_like(log_ratio, -low), clipped_log)
    clipped_log = torch.where(x.advantages == 0, torch.zeros_like(log_ratio), clipped_log)
    lengths = _seq_lengths(x.mask, log_ratio.dtype)
    # ρ_i = exp((1/|y_i|) Σ_t x̃_t) ;  Ā_i = (1/|y_i|) Σ_t A_t ;  ℓ_i = −Ā_i ρ_i
    seq_ratio = torch.exp(masked_sum(clipped_log, x.mask, dim=-1) / lengths)
    seq_adv = masked_sum(x.advantages, x.mask, dim=-1) / lengths
    token_loss = _apply_is_weights(_broadcast_seq(-seq_adv * seq_ratio, log_ratio), x.is_weights)
    pg_loss = agg_loss(
        token_loss, x.mask, config.sequence_objective_agg_mode, config.loss_scale_factor
    )
    metrics = _base_metrics(
        pg_loss,
        log_ratio,
        x.mask,
        clipfrac=_frac(capped, x.mask),
        clipfrac_lower=_frac(floored, x.mask),
    )
    metrics.update(tail_stats(seq_ratio, sequence_mask(x.mask), prefix="policy/gmpo/seq_ratio/"))
    return pg_loss, metrics


@POLICY_LOSSES.register("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO, clipped IS weight with stop-gradient (MiniMax-M1, arXiv:2506.13585).

    ``ℓ_t = −w_t · sg(clip(r_t, 1−ε_low, 1+ε_high)) · A_t · log π_θ(y_t)`` with the CISPO bounds
    (``cispo_clip_ratio_low/high``). The gradient flows only through log π_θ:
    ``∂ℓ_t/∂log π_θ = −w_t sg(clip(r_t)) A_t`` — no token is ever dropped (seed 001). The loss
    *value* is not a surrogate of the return (it contains log π_θ), only its gradient matters.
    ``policy/pg_clipfrac`` = ``policy/cispo/clipfrac`` = fraction of tokens with clip(r) ≠ r.

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses cispo_clip_ratio_low/high, loss_agg_mode, loss_scale_factor.
        rollout_is_weights: (B, T) detached IS weights.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    ratio = torch.exp(log_ratio).detach()
    clipped_ratio = torch.clamp(
        ratio, 1.0 - config.cispo_clip_ratio_low, 1.0 + config.cispo_clip_ratio_high
    )
    token_loss = _apply_is_weights(-clipped_ratio * x.advantages * x.log_prob, x.is_weights)
    pg_loss = agg_loss(token_loss, x.mask, config.loss_agg_mode, config.loss_scale_factor)
    clipfrac = _frac(clipped_ratio != ratio, x.mask)
    metrics = _base_metrics(pg_loss, log_ratio, x.mask, clipfrac=clipfrac)
    metrics["policy/cispo/clipfrac"] = clipfrac
    return pg_loss, metrics


@POLICY_LOSSES.register("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO, a policy gradient with a quadratic log-ratio penalty (verl 0.9.1's ``dro`` loss).

    ``ℓ_t = −w_t · (A_t · log π_θ(y_t) − ½ β (log π_θ(y_t) − log π_old(y_t))²)`` with β =
    ``dro_beta``: no ratio and no clipping; the penalty pulls π_θ back towards π_old with a
    force that grows with the distance, ``∂ℓ_t/∂log π_θ = w_t (−A_t + β (log π_θ − log π_old))``.
    The penalty's log-ratio is not clamped (it is never exponentiated; a clamp would remove the
    restoring force exactly where it is largest); the ratio metrics use the clamped one.
    ``policy/dro/penalty`` is the mean over valid tokens of ½β (log π_θ − log π_old)².

    Args:
        old_log_prob: (B, T) log π_old (detached): the anchor of the penalty.
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses dro_beta (required, > 0), loss_agg_mode, loss_scale_factor.
        rollout_is_weights: (B, T) detached IS weights (multiply the whole ℓ_t).

    Raises:
        ValueError: ``config.dro_beta`` is None.
    """
    if config.dro_beta is None:
        raise ValueError("the dro policy loss needs dro_beta > 0 (β of its quadratic "
                         "log-ratio penalty); set it in PolicyLossConfig / algorithm.loss")
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    delta = x.log_prob - x.old_log_prob
    penalty = 0.5 * config.dro_beta * delta.square()
    token_loss = _apply_is_weights(-(x.advantages * x.log_prob - penalty), x.is_weights)
    pg_loss = agg_loss(token_loss, x.mask, config.loss_agg_mode, config.loss_scale_factor)
    metrics = _base_metrics(pg_loss, clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask),
                            x.mask)
    metrics["policy/dro/penalty"] = float(masked_mean(penalty.detach(), x.mask).item())
    return pg_loss, metrics


@POLICY_LOSSES.register("gpg")
@POLICY_LOSSES.register("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain policy gradient (REINFORCE; GPG, Chu et al. 2025, arXiv:2504.02546).

    ``ℓ_t = −w_t · A_t · log π_θ(y_t)``: no ratio, no clipping; IS weights (if any) are explicit
    multipliers (seed 001 "GPG"). Registered as ``gpg`` and ``reinforce``. ``old_log_prob`` is used
    for the ``policy/ppo_kl`` metric only (verl ``compute_policy_loss_gpg`` /
    ``compute_policy_loss_reinforce``).

    Args:
        old_log_prob: (B, T) log π_old or rollout log-probs (metrics only).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses loss_agg_mode, loss_scale_factor.
        rollout_is_weights: (B, T) detached IS weights.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    token_loss = _apply_is_weights(-x.advantages * x.log_prob, x.is_weights)
    pg_loss = agg_loss(token_loss, x.mask, config.loss_agg_mode, config.loss_scale_factor)
    return pg_loss, _base_metrics(pg_loss, log_ratio, x.mask)


def _centred_covariance(x: _Inputs) -> torch.Tensor:
    """(B, T) cov_t = (A_t − mean A)·(log π_θ(y_t) − mean log π_θ), means over valid tokens.

    Detached (selection only). Entropy-mechanism paper arXiv:2505.22617 eq. for Cov(log π, A).
    """
    adv = x.advantages
    logp = x.log_prob.detach()
    cov = (adv - masked_mean(adv, x.mask)) * (logp - masked_mean(logp, x.mask))
    return sanitize(cov, x.mask)


@POLICY_LOSSES.register("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617): PPO clip + random zeroing of high-cov tokens.

    Candidates: valid tokens not already clipped by the ε-clip with
    ``clip_cov_lb < cov_t < clip_cov_ub``; ``max(int(clip_cov_ratio·N), 1)`` of them (N = valid
    tokens) are drawn uniformly without replacement and their loss is set to 0 (verl
    ``compute_policy_loss_clip_cov``; no dual clip). The draw uses ``config.clip_cov_generator``
    if given (advances per call), else a CPU generator seeded with ``config.clip_cov_seed`` (the
    result is then a deterministic function of the inputs).

    Metrics: ``policy/pg_clipfrac`` = ε-clip fraction (as for vanilla; verl reports the cov
    fraction under that key), ``policy/clip_cov/clipfrac`` = zeroed fraction,
    ``policy/clip_cov/candidate_frac``.

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses clip_ratio(_low/_high), clip_cov_*, loss_agg_mode, loss_scale_factor.
        rollout_is_weights: (B, T) detached IS weights.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    ratio = torch.exp(log_ratio)
    low, high = resolve_clip_range(config)
    terms = compute_ppo_clip_terms(ratio, x.advantages, low, high, None)
    cov = _centred_covariance(x)
    candidates = x.mask & ~terms.clipped & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    n_valid = int(masked_count(x.mask).item())
    n_clip = max(int(config.clip_cov_ratio * n_valid), 1)
    flat_idx = torch.nonzero(candidates.reshape(-1), as_tuple=False).reshape(-1)
    zeroed = torch.zeros_like(candidates)
    if flat_idx.numel() > 0:
        generator = config.clip_cov_generator
        if generator is None:
            generator = torch.Generator(device="cpu").manual_seed(config.clip_cov_seed)
        perm = torch.randperm(flat_idx.numel(), generator=generator, device="cpu")
        chosen = flat_idx[perm[: min(n_clip, flat_idx.numel())].to(flat_idx.device)]
        zeroed.view(-1)[chosen] = True
    token_loss = torch.where(zeroed, torch.zeros_like(terms.token_loss), terms.token_loss)
    token_loss = _apply_is_weights(token_loss, x.is_weights)
    pg_loss = agg_loss(token_loss, x.mask, config.loss_agg_mode, config.loss_scale_factor)
    metrics = _base_metrics(pg_loss, log_ratio, x.mask, clipfrac=_frac(terms.clipped, x.mask))
    metrics["policy/clip_cov/clipfrac"] = _frac(zeroed, x.mask)
    metrics["policy/clip_cov/candidate_frac"] = _frac(candidates, x.mask)
    return pg_loss, metrics


@POLICY_LOSSES.register("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): KL penalty on the top-covariance tokens.

    ``ℓ_t = w_t · (−A_t r_t + β·k_t·[t ∈ top-k cov])`` with k = ``max(1, int(kl_cov_ratio·N))``
    valid tokens of largest centred covariance, β = ``ppo_kl_coef`` and k_t the per-token estimate
    of KL(π_old‖π_θ): ``abs`` → |log r_t| (verl ``compute_policy_loss_kl_cov``) or ``k3`` →
    r_t − 1 − log r_t. No ratio clipping (the penalty replaces it), so ``pg_clipfrac`` is 0.
    Deterministic (top-k; ties broken by torch.topk). ``policy/ppo_kl`` is the package-wide k1
    mean; the mean |log r| that verl reports as ``ppo_kl`` for this loss is
    ``policy/kl_cov/abs_kl``.

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses kl_cov_ratio, ppo_kl_coef, kl_cov_estimator, loss_agg_mode, loss_scale_factor.
        rollout_is_weights: (B, T) detached IS weights.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    ratio = torch.exp(log_ratio)
    # abs: |log r| ; k3: r − 1 − log r  (E_{π_old}[k3] = KL(π_old ‖ π_θ))
    kl_est = log_ratio.abs() if config.kl_cov_estimator == "abs" else ratio - 1.0 - log_ratio
    selected = torch.zeros_like(x.mask)
    n_valid = int(masked_count(x.mask).item())
    if n_valid > 0:
        k = max(1, int(n_valid * config.kl_cov_ratio))
        cov = torch.where(
            x.mask, _centred_covariance(x), torch.full_like(log_ratio, -math.inf)
        ).reshape(-1)
        top = torch.topk(cov, k, largest=True).indices
        selected.view(-1)[top] = True
    pg = -x.advantages * ratio
    token_loss = torch.where(selected, pg + config.ppo_kl_coef * kl_est, pg)
    token_loss = _apply_is_weights(token_loss, x.is_weights)
    pg_loss = agg_loss(token_loss, x.mask, config.loss_agg_mode, config.loss_scale_factor)
    metrics = _base_metrics(pg_loss, log_ratio, x.mask)
    metrics["policy/kl_cov/selected_frac"] = _frac(selected, x.mask)
    metrics["policy/kl_cov/abs_kl"] = float(masked_mean(log_ratio.detach().abs(), x.mask).item())
    return pg_loss, metrics


def _dppo_loss(
    x: _Inputs,
    config: PolicyLossConfig,
    keep: torch.Tensor,
    log_ratio: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Shared DPPO tail: ``ℓ_t = −w_t · A_t · sg(min(r_t, C)) · log π_θ · keep_t``."""
    ratio = torch.exp(log_ratio).detach()
    truncated = torch.clamp(ratio, max=config.dppo_is_cap)
    pg = -x.advantages * truncated * x.log_prob
    token_loss = torch.where(keep, pg, torch.zeros_like(pg))
    token_loss = _apply_is_weights(token_loss, x.is_weights)
    pg_loss = agg_loss(token_loss, x.mask, config.loss_agg_mode, config.loss_scale_factor)
    return pg_loss, _base_metrics(
        pg_loss,
        log_ratio,
        x.mask,
        clipfrac=_frac(~keep, x.mask),
        clipfrac_lower=_frac(keep & (ratio > config.dppo_is_cap), x.mask),
    )


@POLICY_LOSSES.register("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (Qi et al. 2026, arXiv:2602.04879): trust region on π_θ − π_old per token.

    A token is kept unless it would move *further* outside the TV region in the direction its
    advantage pushes: A > 0 → keep iff ``π_θ − π_old ≤ δ_high``; A ≤ 0 → keep iff
    ``π_θ − π_old ≥ −δ_low`` (probabilities, not ratios). Kept tokens get the truncated-IS policy
    gradient ``ℓ_t = −w_t A_t sg(min(r_t, C)) log π_θ`` with C = ``dppo_is_cap`` (20), so
    ``∂ℓ_t/∂log π_θ = −w_t A_t min(r_t, C)``. verl ``compute_policy_loss_dppo_tv`` semantics.

    Metrics: ``policy/pg_clipfrac`` = masked (outside trust region) fraction;
    ``policy/pg_clipfrac_lower`` = kept tokens whose IS ratio was truncated at C (as verl);
    ``policy/dppo/tv_mean`` = mean |π_θ − π_old|.

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses dppo_tv_low/high, dppo_is_cap, loss_agg_mode, loss_scale_factor.
        rollout_is_weights: (B, T) detached IS weights.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    with torch.no_grad():
        # probabilities from log-probs clamped at 0 (p ≤ 1 even with numerical noise)
        prob_diff = torch.exp(x.log_prob.clamp(max=0.0)) - torch.exp(x.old_log_prob.clamp(max=0.0))
        keep = torch.where(
            x.advantages > 0, prob_diff <= config.dppo_tv_high, prob_diff >= -config.dppo_tv_low
        )
    pg_loss, metrics = _dppo_loss(x, config, keep, log_ratio)
    metrics["policy/dppo/tv_mean"] = float(masked_mean(prob_diff.abs(), x.mask).item())
    return pg_loss, metrics


@POLICY_LOSSES.register("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL (arXiv:2602.04879): trust region on the binary KL of the sampled token.

    ``D_t = p_old log(p_old/p) + (1−p_old) log((1−p_old+ε)/(1−p+ε))`` with p = π_θ(y_t),
    p_old = π_old(y_t), ε = 1e-8 (the KL between the Bernoulli "this token vs the rest"
    distributions). A > 0 → keep iff ``D_t ≤ δ_high or p ≤ p_old``; A ≤ 0 → keep iff
    ``D_t ≤ δ_low or p ≥ p_old``. Kept tokens: ``ℓ_t = −w_t A_t sg(min(r_t, C)) log π_θ``
    (verl ``compute_policy_loss_dppo_kl``). Metrics as dppo_tv plus
    ``policy/dppo/binary_kl_mean``.

    Args:
        old_log_prob: (B, T) log π_old (detached).
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count.
        config: uses dppo_kl_low/high, dppo_is_cap, loss_agg_mode, loss_scale_factor.
        rollout_is_weights: (B, T) detached IS weights.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    log_ratio = clamped_log_ratio(x.log_prob, x.old_log_prob, x.mask)
    with torch.no_grad():
        # log-probs clamped at 0 so that p ≤ 1 even with numerical noise
        logp, logp_old = x.log_prob.detach().clamp(max=0.0), x.old_log_prob.clamp(max=0.0)
        prob, prob_old = torch.exp(logp), torch.exp(logp_old)
        binary_kl = prob_old * (logp_old - logp) + (1.0 - prob_old) * (
            torch.log(1.0 - prob_old + DPPO_KL_EPS) - torch.log(1.0 - prob + DPPO_KL_EPS)
        )
        keep_pos = (binary_kl <= config.dppo_kl_high) | (prob <= prob_old)
        keep_neg = (binary_kl <= config.dppo_kl_low) | (prob >= prob_old)
        keep = torch.where(x.advantages > 0, keep_pos, keep_neg)
    pg_loss, metrics = _dppo_loss(x, config, keep, log_ratio)
    metrics["policy/dppo/binary_kl_mean"] = float(masked_mean(binary_kl, x.mask).item())
    return pg_loss, metrics


@POLICY_LOSSES.register("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass-mode loss (seed 001 "Bypass mode loss"; verl ``compute_policy_loss_bypass_mode``).

    In bypass mode π_old *is* the rollout policy: ``old_log_prob`` holds the rollout log-probs.
    The rollout-correction module computes IS weights and the RS mask between the current policy
    (``log_prob.detach()``) and the rollout policy, then the loss dispatches on
    ``config.resolved_bypass_loss_type``:

      * ``reinforce``: ``ℓ_t = −w_t A_t log π_θ`` — the IS weights multiply the policy gradient;
      * ``ppo_clip``: vanilla PPO on ``r = π_θ/π_rollout`` *without* IS weights (the ratio already
        carries the full shift; a weight would double-count).

    The RS mask (``modified_response_mask``) restricts the tokens in both cases. Rollout-correction
    metrics are merged into the returned metrics unchanged.

    Args:
        old_log_prob: (B, T) rollout (behaviour) log-probs.
        log_prob: (B, T) log π_θ.
        advantages: (B, T) advantages.
        response_mask: (B, T) tokens that count (before RS).
        config: needs ``rollout_correction``; uses bypass_loss_type and the vanilla/aggregation
            fields.
        rollout_is_weights: must be None — bypass mode computes its own weights.

    Raises:
        ValueError: no ``config.rollout_correction``, it is not in bypass mode, or external IS
            weights were given.
    """
    if config.rollout_correction is None:
        raise ValueError(
            "bypass_mode needs PolicyLossConfig.rollout_correction (a RolloutCorrectionConfig, "
            "e.g. RolloutCorrectionConfig.bypass_pg_geo_rs()); set it or pick another loss"
        )
    if not getattr(config.rollout_correction, "bypass_mode", True):
        raise ValueError(
            "bypass_mode loss got a decoupled-mode RolloutCorrectionConfig (bypass_mode=False); "
            "use a bypass_* preset, or a token-level loss with the decoupled IS weights"
        )
    if rollout_is_weights is not None:
        raise ValueError(
            "bypass_mode computes its own IS weights from old_log_prob (= rollout log-probs); "
            "pass rollout_is_weights=None"
        )
    from .rollout_correction import compute_rollout_correction_and_rejection_mask

    x = _prepare(old_log_prob, log_prob, advantages, response_mask, None)
    with torch.no_grad():
        is_weights, rs_mask, rc_metrics = compute_rollout_correction_and_rejection_mask(
            x.log_prob.detach(), x.old_log_prob, x.mask, config.rollout_correction
        )
    effective_mask = as_bool_mask(rs_mask).to(x.mask.device) & x.mask
    loss_type = config.resolved_bypass_loss_type
    if loss_type == "reinforce":
        pg_loss, metrics = compute_policy_loss_reinforce(
            x.old_log_prob, x.log_prob, x.advantages, effective_mask, config, is_weights
        )
    else:
        pg_loss, metrics = compute_policy_loss_vanilla(
            x.old_log_prob, x.log_prob, x.advantages, effective_mask, config, None
        )
    metrics["policy/bypass/kept_token_frac"] = _frac(effective_mask, x.mask)
    metrics.update({k: float(v) for k, v in rc_metrics.items()})
    return pg_loss, metrics


def compute_policy_loss(
    loss_name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Look up ``loss_name`` in :data:`POLICY_LOSSES` and call it (KeyError lists valid names)."""
    fn = POLICY_LOSSES.get(loss_name)
    return fn(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights)


POLICY_LOSSES.require(names.POLICY_LOSSES)
