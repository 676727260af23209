"""Per-token KL estimators (by name, :data:`KL_ESTIMATORS`) and KL-coefficient controllers.

Seed 001, "KL estimator variants". With q = π_θ the current policy (the sampler of the tokens),
p = π_ref the reference policy and ``log_ratio = log q(y) − log p(y)`` (= −log ρ, ρ = p/q), every
estimator is a per-token sample whose expectation under q relates to KL(π_θ ‖ π_ref)
(Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html):

======  =========================================  ========================================
name    value                                      d value / d log_prob
======  =========================================  ========================================
k1      log_ratio                                  1
abs     |log_ratio|                                sign(log_ratio)
k2      ½ · log_ratio²                             log_ratio
k3      exp(−log_ratio) − 1 + log_ratio  (≤ 10)    1 − exp(−log_ratio)   (0 where clamped)
k1+     value of k1                                log_ratio   (gradient of k2)
abs+    value of abs                               log_ratio   (gradient of k2)
k3+     value of k3                                log_ratio   (gradient of k2)
======  =========================================  ========================================

* ``log_ratio`` is clamped to ±``LOG_RATIO_BOUND`` (20) first, like every ratio in this package.
* k3 is additionally clamped to [−10, 10] as verl does (k3 ≥ 0, so in effect ≤ 10); beyond the
  clamp its gradient is 0.
* The "+" variants are straight-through estimators: ``k2 − k2.detach() + forward.detach()``,
  forward value of k1 / abs / k3, gradient of k2 — an unbiased gradient of KL(π_θ ‖ π_ref) for
  on-policy samples. k2 "+" is k2 itself (its value and its gradient are k2's), so verl's
  spellings ``k2+`` and ``mse+`` are aliases of ``k2``. (Seed 001: at verl@70744059 k1+/k3+
  raise NotImplementedError because the "+" is never stripped before dispatch; verl 0.9.1 strips
  it, and its kl+/low_var_kl+ match ours in value and
  gradient — see tests/training/algorithms/test_core_algos_verl_golden.py.)
* verl's names are accepted as aliases by :func:`resolve_kl_estimator`: ``kl`` → k1,
  ``mse`` → k2, ``low_var_kl`` → k3, ``kl+`` → k1+, ``low_var_kl+`` → k3+, and ``k2+`` /
  ``mse+`` → k2.

Which to use (seed 001): k2 (or k1+/k3+) for KL in the loss on-policy; k3 for KL in an IS-weighted
loss; k1 for KL in the reward with stop-gradient.

KL as a loss term (:func:`kl_loss_term`, ``algorithm.kl.mode: in_loss``) with its own IS correction
(:data:`KL_IS_CORRECTIONS`). With ρ = π_θ/π_old the ratio the policy loss clips (``old_log_prob``
of the train step: π_θk of seed 004, the weights the step's data is measured against) and k the
per-token estimate of the table above:

===========  =====================================================  ===========================
name         per-token term                                         source
===========  =====================================================  ===========================
none         k                                                      verl's ``use_kl_loss``
clipped      min(ρ·k, clip(ρ, 1 − ε_low, 1 + ε_high)·k)             seed 004 ("KL as loss"
                                                                    needs its own IS
                                                                    correction; Liu et al.
                                                                    arXiv:2510.01555)
deepseek_k3  ρ·k3                                                   DeepSeek-V3.2 §3.1 Eq. 7
===========  =====================================================  ===========================

Gradients flow through ρ and through k (in ``clipped``'s clipped branch through k only). The
``min`` is the seed's, taken literally (it is the smaller of the two values of a term that is
minimised). Under ``deepseek_k3``, E_π_old[ρ·k3] = Σ_y π_θ(y)·k3(y) = KL(π_θ ‖ π_ref), and its
gradient is the KL's: the IS weight makes k3 unbiased off-policy (seed 001). DeepSeek weighs by the
sampling (rollout) policy; here the behaviour correction's rollout IS weights (π_old vs μ, when
the run applies one) multiply both IS-corrected terms, as they multiply the policy loss, so ρ·w is
π_θ/μ under an untruncated decoupled weight.

Controllers (seed 001, "KL controllers"): :class:`FixedKLController` (β constant) and
:class:`AdaptiveKLController` (Ziegler et al. 2019, arXiv:1909.08593).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from training.algorithms import names
from training.algorithms.masked import (
    LOG_RATIO_BOUND,
    as_bool_mask,
    clamped_log_ratio,
    masked_mean,
    sanitize,
    tail_stats,
)
from training.algorithms.registry import Registry

# verl clamps the k3 ("low_var_kl") estimate to [−K3_BOUND, K3_BOUND] for numerical stability.
K3_BOUND = 10.0

KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator")
"""Name → fn(log_ratio (B, T)) -> per-token KL estimate (B, T). ``log_ratio`` must already be
clamped and sanitized; use :func:`kl_penalty` rather than calling these directly."""

KL_ALIASES: dict[str, str] = {
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    "kl+": "k1+",
    "low_var_kl+": "k3+",
    "k2+": "k2",  # straight-through onto itself: value and gradient of k2
    "mse+": "k2",
}
"""verl's estimator names → ours."""


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """k1 = log q/p = log_ratio: unbiased value, high variance, biased gradient. Shape (B, T)."""
    return log_ratio


@KL_ESTIMATORS.register("abs")
def kl_abs(log_ratio: torch.Tensor) -> torch.Tensor:
    """abs = |log_ratio|: biased, low variance. Shape (B, T)."""
    return log_ratio.abs()


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """k2 = ½ log_ratio²: biased value, unbiased gradient (∂k2/∂log q = log_ratio). (B, T)."""
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = ρ − 1 − log ρ with ρ = p/q = exp(−log_ratio): unbiased, low variance, ≥ 0.

    Clamped to [−10, 10] like verl's ``low_var_kl``. Shape (B, T).
    """
    # k3 = exp(−log_ratio) − 1 + log_ratio
    k3 = torch.expm1(-log_ratio) + log_ratio
    return torch.clamp(k3, min=-K3_BOUND, max=K3_BOUND)


def straight_through(forward: torch.Tensor, backward: torch.Tensor) -> torch.Tensor:
    """Value of ``forward``, gradient of ``backward``: b − b.detach() + f.detach() (seed 001)."""
    return backward - backward.detach() + forward.detach()


@KL_ESTIMATORS.register("k1+")
def kl_k1_plus(log_ratio: torch.Tensor) -> torch.Tensor:
    """k1+: forward value of k1, gradient of k2 (straight-through). Shape (B, T)."""
    return straight_through(kl_k1(log_ratio), kl_k2(log_ratio))


@KL_ESTIMATORS.register("abs+")
def kl_abs_plus(log_ratio: torch.Tensor) -> torch.Tensor:
    """abs+: forward value |log_ratio|, gradient of k2 (straight-through). Shape (B, T)."""
    return straight_through(kl_abs(log_ratio), kl_k2(log_ratio))


@KL_ESTIMATORS.register("k3+")
def kl_k3_plus(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3+: forward value of k3 (clamped), gradient of k2 (straight-through). Shape (B, T)."""
    return straight_through(kl_k3(log_ratio), kl_k2(log_ratio))


def resolve_kl_estimator(kind: str) -> str:
    """Canonical estimator name for ``kind`` (our names, or verl's aliases in ``KL_ALIASES``).

    Raises:
        KeyError: listing the valid names and aliases when ``kind`` is unknown.
    """
    name = KL_ALIASES.get(kind, kind)
    if name not in KL_ESTIMATORS:
        valid = ", ".join(KL_ESTIMATORS.names())
        aliases = ", ".join(f"{a}→{c}" for a, c in KL_ALIASES.items())
        raise KeyError(f"unknown KL estimator {kind!r}; valid names: {valid} "
                       f"(verl aliases: {aliases})")
    return name


def get_kl_estimator(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The registered estimator for ``kind`` (verl aliases accepted, see ``KL_ALIASES``)."""
    return KL_ESTIMATORS.get(resolve_kl_estimator(kind))


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
               kind: str) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate.

    Args:
        log_prob (B, T): log-probs of the sampled tokens under the current policy π_θ (may
            require grad).
        ref_log_prob (B, T): log-probs under the reference policy (usually detached; gradients
            flow into it too if it requires grad).
        response_mask (B, T): response mask; garbage at masked positions is ignored.
        kind: estimator name or verl alias (k1, abs, k2, k3, k1+, abs+, k3+, kl, mse,
            low_var_kl, k2+, ...).
    Returns:
        (B, T) estimate, exactly 0 (and zero gradient) at masked positions; the log-ratio is
        clamped to ±LOG_RATIO_BOUND before the estimator is applied.
    """
    estimator = get_kl_estimator(kind)
    mask = as_bool_mask(response_mask)
    if log_prob.shape != ref_log_prob.shape or log_prob.shape != mask.shape:
        raise ValueError(f"log_prob {tuple(log_prob.shape)}, ref_log_prob "
                         f"{tuple(ref_log_prob.shape)} and response_mask {tuple(mask.shape)} "
                         "must share the shape (B, T)")
    log_ratio = clamped_log_ratio(log_prob, ref_log_prob, mask, bound=LOG_RATIO_BOUND)
    return sanitize(estimator(log_ratio), mask)


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
            kind: str) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token KL for the loss path (``use_kl_loss``), with token-level diagnostics.

    Aggregation over tokens (loss_agg_mode) and the coefficient are the caller's job.

    Args:
        log_prob (B, T), ref_log_prob (B, T), response_mask (B, T), kind: see :func:`kl_penalty`.
    Returns:
        (per-token KL (B, T), metrics) with ``policy/kl_loss/mean`` (mean over valid tokens) and
        the tails ``policy/kl_loss/{p50,p90,p99,max}`` over valid tokens.
    """
    kl = kl_penalty(log_prob, ref_log_prob, response_mask, kind)
    return kl, tail_stats(kl, as_bool_mask(response_mask), prefix="policy/kl_loss/")


KL_IS_CORRECTIONS: tuple[str, ...] = ("none", "clipped", "deepseek_k3")
"""IS corrections of the KL loss term (see the module docstring; ``algorithm.kl.is_correction``)."""


def kl_loss_term(log_prob: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                 response_mask: torch.Tensor, kind: str, is_correction: str = "none", *,
                 clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                 rollout_is_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token KL loss term with its IS correction (module docstring, "KL as a loss term").

    Args:
        log_prob (B, T): π_θ of the sampled tokens (with gradient).
        old_log_prob (B, T): π_old, the denominator of the policy loss's ratio (detached).
        ref_log_prob (B, T): π_ref (detached).
        response_mask (B, T): tokens that count.
        kind: KL estimator name or verl alias; ``deepseek_k3`` needs k3 (``low_var_kl``).
        is_correction: one of :data:`KL_IS_CORRECTIONS`.
        clip_ratio_low, clip_ratio_high: ε_low, ε_high of ``clipped``.
        rollout_is_weights (B, T) or None: the behaviour correction's weights; multiply the
            IS-corrected terms (not ``none``).
    Returns:
        (term (B, T), 0 at masked positions; metrics): ``policy/kl_loss/{mean,p50,p90,p99,max}``
        of the uncorrected estimate k and, for the IS-corrected terms,
        ``policy/kl_loss/is_ratio_mean`` (ρ over valid tokens) and, for ``clipped``,
        ``policy/kl_loss/clipfrac`` (tokens whose clipped branch is the smaller).
    """
    if is_correction not in KL_IS_CORRECTIONS:
        raise ValueError(f"unknown KL IS correction {is_correction!r}; use one of "
                         f"{', '.join(KL_IS_CORRECTIONS)}")
    if is_correction == "deepseek_k3" and resolve_kl_estimator(kind) != "k3":
        raise ValueError(f"is_correction=deepseek_k3 weights the k3 estimator, got {kind!r}; "
                         "use kind='k3' (low_var_kl)")
    kl, metrics = kl_loss(log_prob, ref_log_prob, response_mask, kind)
    if is_correction == "none":
        return kl, metrics
    mask = as_bool_mask(response_mask)
    # ρ = π_θ / π_old, through the same clamp as every ratio of this package
    ratio = torch.exp(clamped_log_ratio(log_prob, old_log_prob.detach(), mask,
                                        bound=LOG_RATIO_BOUND))
    if is_correction == "clipped":
        clipped = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
        # min(ρ·k, clip(ρ, 1 − ε_low, 1 + ε_high)·k)   (seed 004)
        term = torch.minimum(ratio * kl, clipped * kl)
        took_clip = mask & (clipped * kl < ratio * kl).detach()
        metrics["policy/kl_loss/clipfrac"] = float(took_clip.sum()) / max(int(mask.sum()), 1)
    else:
        term = ratio * kl  # ρ·k3  (DeepSeek-V3.2 Eq. 7)
    if rollout_is_weights is not None:
        term = term * rollout_is_weights.detach()
    metrics["policy/kl_loss/is_ratio_mean"] = float(masked_mean(ratio.detach(), mask))
    return sanitize(term, mask), metrics


# --------------------------------------------------------------------------------------------
# KL coefficient controllers
# --------------------------------------------------------------------------------------------


class KLController(Protocol):
    """Holds the KL coefficient β (``value``) and updates it once per training step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """β = const (seed 001): simple, but needs manual retuning when the dynamics change."""

    def __init__(self, kl_coef: float) -> None:
        if not (math.isfinite(kl_coef) and kl_coef >= 0.0):
            raise ValueError(f"kl_coef={kl_coef} must be a finite number ≥ 0 (e.g. 0.001)")
        self.value: float = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (β stays fixed); the arguments are accepted for interface parity."""


class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, arXiv:1909.08593; seed 001 "KL controllers").

    β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) · n / H): β grows when the observed KL exceeds
    the target and shrinks when it falls below, by at most ±20 % · n/H per update.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        """Args: init_kl_coef: initial β ≥ 0; target_kl: target KL > 0; horizon: H > 0 (samples)."""
        if not (math.isfinite(init_kl_coef) and init_kl_coef >= 0.0):
            raise ValueError(f"init_kl_coef={init_kl_coef} must be a finite number ≥ 0")
        if not (math.isfinite(target_kl) and target_kl > 0.0):
            raise ValueError(f"target_kl={target_kl} must be a finite number > 0 (e.g. 0.1)")
        if not (math.isfinite(horizon) and horizon > 0):
            raise ValueError(f"horizon={horizon} must be > 0 (e.g. 10000 samples)")
        self.value: float = float(init_kl_coef)
        self.target: float = float(target_kl)
        self.horizon: float = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Apply one update with the observed KL and n = ``n_steps`` samples since the last one.

        Raises ValueError for a non-finite ``current_kl`` (it would poison β for good) or a
        negative ``n_steps``.
        """
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl={current_kl} is not finite; skip the KL controller "
                             "update for this step")
        if n_steps < 0:
            raise ValueError(f"n_steps={n_steps} must be ≥ 0")
        # e = clip(KL / target − 1, −0.2, 0.2);  β ← β · (1 + e · n / H)
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


__all__ = [
    "K3_BOUND",
    "KL_ALIASES",
    "KL_ESTIMATORS",
    "KL_IS_CORRECTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "get_kl_estimator",
    "kl_loss",
    "kl_loss_term",
    "kl_penalty",
    "resolve_kl_estimator",
    "straight_through",
]

KL_ESTIMATORS.require(names.KL_ESTIMATORS)
