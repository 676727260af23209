"""Off-policy LLM RL math: IS/RS corrections, CompIS, policy losses, advantages, KL, diagnostics.

Pure tensor functions (torch only). Shapes: B sequences × T response tokens; every function takes
a (B, T) response mask and ignores whatever sits at masked positions. See docs/algorithms.md.

The package imports its submodules lazily (PEP 562): ``import training.algorithms.decision_tree``
or ``registry.gates`` (which reads the decision tree) does not load torch; ``from
training.algorithms import compute_advantage`` loads the submodule that defines it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE: dict[str, str] = {  # public name → the submodule that defines it
    "ADVANTAGE_ESTIMATORS": "advantages",
    "CORRECTION_METHODS": "is_correction",
    "CompISConfig": "is_correction",
    "Diagnosis": "decision_tree",
    "EWMAConfig": "is_correction",
    "EWMAState": "is_correction",
    "KL_ESTIMATORS": "kl",
    "LOSS_AGG_MODES": "policy_loss",
    "POLICY_LOSSES": "policy_loss",
    "PRESETS": "rollout_correction",
    "PolicyLossConfig": "policy_loss",
    "RS_MODES": "rollout_correction",
    "RolloutCorrectionConfig": "rollout_correction",
    "SourceCorrection": "is_correction",
    "Thresholds": "decision_tree",
    "agg_loss": "policy_loss",
    "compis_policy_loss": "is_correction",
    "compute_advantage": "advantages",
    "compute_compis_weights": "is_correction",
    "compute_is_correction": "is_correction",
    "compute_mismatch_metrics": "diagnostics",
    "compute_off_policy_diagnostics": "diagnostics",
    "compute_rollout_correction_and_rejection_mask": "rollout_correction",
    "decoupled_ppo_loss": "is_correction",
    "diagnose": "decision_tree",
    "effective_sample_size": "is_correction",
    "entropy_metrics": "diagnostics",
    "ewma_decay_from_staleness": "is_correction",
    "ewma_update": "is_correction",
    "kl_penalty": "kl",
    "linear_proximal_log_prob": "is_correction",
    "loglinear_proximal_log_prob": "is_correction",
    "m2po_mask": "masking",
    "opsm_mask": "masking",
    "token_entropy": "diagnostics",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'training.algorithms' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"training.algorithms.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

