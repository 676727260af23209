"""Off-policy LLM RL math: IS/RS corrections, CompIS, policy losses, advantages, KL, diagnostics.

Pure tensor functions (torch only). Shapes: B sequences × T response tokens; every function takes
a (B, T) response mask and ignores whatever sits at masked positions. See README "Algorithms".
"""

from training.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantage
from training.algorithms.decision_tree import Diagnosis, Thresholds, diagnose
from training.algorithms.diagnostics import (
    compute_mismatch_metrics,
    compute_off_policy_diagnostics,
    entropy_metrics,
    token_entropy,
)
from training.algorithms.is_correction import (
    CORRECTION_METHODS,
    CompISConfig,
    EWMAConfig,
    EWMAState,
    SourceCorrection,
    compis_policy_loss,
    compute_compis_weights,
    compute_is_correction,
    decoupled_ppo_loss,
    effective_sample_size,
    ewma_decay_from_staleness,
    ewma_update,
    loglinear_proximal_log_prob,
)
from training.algorithms.kl import KL_ESTIMATORS, kl_penalty
from training.algorithms.masking import m2po_mask, opsm_mask
from training.algorithms.policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    agg_loss,
)
from training.algorithms.rollout_correction import (
    PRESETS,
    RS_MODES,
    RolloutCorrectionConfig,
    compute_rollout_correction_and_rejection_mask,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTION_METHODS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PRESETS",
    "RS_MODES",
    "CompISConfig",
    "Diagnosis",
    "EWMAConfig",
    "EWMAState",
    "PolicyLossConfig",
    "RolloutCorrectionConfig",
    "SourceCorrection",
    "Thresholds",
    "agg_loss",
    "compis_policy_loss",
    "compute_advantage",
    "compute_compis_weights",
    "compute_is_correction",
    "compute_mismatch_metrics",
    "compute_off_policy_diagnostics",
    "compute_rollout_correction_and_rejection_mask",
    "decoupled_ppo_loss",
    "diagnose",
    "effective_sample_size",
    "entropy_metrics",
    "ewma_decay_from_staleness",
    "ewma_update",
    "kl_penalty",
    "loglinear_proximal_log_prob",
    "m2po_mask",
    "opsm_mask",
    "token_entropy",
]
