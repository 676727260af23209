"""The names of everything a recipe selects by name: policy losses, loss aggregation modes,
advantage estimators, KL estimators, rollout-correction presets and tasks.

Torch-free, so that checking a recipe (``asyncrl validate``, :mod:`training.recipe`) imports no
torch. The registries, which live in torch modules, import these sets and refuse to end their
module with a different set of names (:meth:`training.algorithms.registry.Registry.require`):
adding a loss means registering it and listing it here, and a mismatch is an error on import,
not a recipe that validates and then fails to build.
"""

from __future__ import annotations

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGG_MODES", "NAMES", "POLICY_LOSSES",
           "PRESETS", "TASKS"]

POLICY_LOSSES = frozenset({
    "bypass_mode", "cispo", "clip_cov", "dppo_kl", "dppo_tv", "dro", "geo_mean", "gmpo", "gpg",
    "gspo", "gspo_token", "kl_cov", "reinforce", "sapo", "vanilla"})

#: In the order the docs list them (``token-mean`` is the default).
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
    "seq-mean-token-sum-norm")

ADVANTAGE_ESTIMATORS = frozenset({
    "dr_grpo", "gae", "gdpo", "gpg", "grpo", "grpo_passk", "opo", "optimal_token_baseline",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo",
    "tir_optimal_token_baseline"})

KL_ESTIMATORS = frozenset({"abs", "abs+", "k1", "k1+", "k2", "k3", "k3+"})

#: Seed 001's preset table, in its order.
PRESETS: tuple[str, ...] = (
    "bypass_ppo_clip", "bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs", "bypass_pg_is",
    "bypass_pg_geo_rs", "bypass_pg_geo_rs_seq_tis", "bypass_pg_geo_rs_token_tis",
    "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs",
    "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis", "decoupled_k3_rs",
    "decoupled_k3_rs_seq_tis", "decoupled_k3_rs_token_tis", "decoupled_token_icepop",
    "bypass_pg_token_icepop", "disabled")

TASKS = frozenset({"calc_chain", "jsonl", "sum_digits"})

#: By the kind a recipe field names (the ``kind`` of :func:`training.recipe` name checks).
NAMES: dict[str, frozenset[str]] = {
    "loss": POLICY_LOSSES,
    "agg": frozenset(LOSS_AGG_MODES),
    "advantage": ADVANTAGE_ESTIMATORS,
    "kl": KL_ESTIMATORS,
    "preset": frozenset(PRESETS),
    "task": TASKS,
}
