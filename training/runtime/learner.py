"""The learner: one trainer (global) step of the RL algorithm over a list of completed groups.

:class:`Learner` turns the groups the rollouter delivered into optimizer steps on a
:class:`~training.engines.train.TrainEngine`. No Ray, no I/O (except loading the KL reference
model once). One :meth:`Learner.step`:

1. **Rejects bad data** (seed 000 stage 1: never train on garbage): a non-finite reward, a
   non-finite rollout log-prob on a loss token, missing R3 routes, or trainer log-probs that come
   back non-finite → ``trained=False`` with a one-line reason, ``async/rejected_batch = 1``, a
   WARNING on the ``asyncrl.runtime`` logger, and the engine's weights and version untouched.
2. **Packs** the samples (group order kept) into a :class:`~training.engines.train.TokenBatch`
   and (B, T) tensors: μ (rollout log-probs), per-token weight versions (long; padded with the
   sample's last version), and the rewards.
3. **π_current**: the trainer's log-probs at the weights the step starts from (routing ``r3`` for
   R3, else free; for R2 this free forward records the routes that later mini-batches replay).
4. **π_prox and π_old** by the run's :class:`~training.runtime.old_policy.OldPolicy`, the object
   of the ``algorithm.old_logprob`` strategy built once by
   :func:`~training.runtime.old_policy.old_policy` from the recipe's
   :attr:`~training.recipe.AlgorithmConfig.effective_old_logprob` (a bypass rollout-correction
   preset forces bypass: π_prox = π_old = μ). :mod:`training.runtime.old_policy` gives each
   strategy's π_prox and π_old (recompute, snapshot, dedicated, interrupt, ewma, loglinear,
   linear_prox, bypass); the ``decoupled_mis`` correction sets π_prox := π_old
   (:func:`~training.runtime.old_policy.proximal_and_old`).
5. **Rewards**: the scalar reward sits on the last loss token of the response; with
   ``kl.mode: in_reward`` the token reward loses β·KL(π_old ‖ π_ref) per token (fixed β, or the
   adaptive controller when ``kl.target`` is set). ``kl.mode: in_loss`` leaves the reward alone:
   the train steps get π_ref and add β·agg(KL term) with ``kl.is_correction`` to the loss
   (:func:`training.algorithms.kl.kl_loss_term`, differentiated through π_θ by the engine).
6. **Advantages** by the recipe's estimator, grouped by ``group_id``.
7. **Correction** by ``algorithm.correction`` (:func:`apply_correction`): ``none``; ``compis``
   (r3 = π_prox/π_old and r2 = π_old/μ, each with its own method); ``preset`` (seed 001's table:
   decoupled presets give IS weights / an RS mask from π_prox vs μ, so they cover the lag as
   verl's decoupled mode does; bypass presets switch the loss to ``bypass_mode`` with the
   preset's config, which computes IS/RS between π_θ and μ itself); ``decoupled`` (AReaL's
   behaviour weight π_prox/μ, capped); ``decoupled_mis`` (seed 003 Eq. 4: clip around π_old, the
   discrepancy π_old/μ repaired by its own method). The applied weight is reported under
   ``is/combined/*``. M2PO and OPSM then restrict the kept tokens further. The loss's Dr.GRPO
   constant is ``loss_scale_factor`` or ``rollout.max_response_tokens``
   (:func:`policy_loss_config`).
8. **Trains**: for each epoch, one ``train_step`` per mini-batch of consecutive groups
   (``async.require_batches`` mini-batches; the last takes the remainder), with
   ``old_log_prob = π_prox`` and the run's :class:`~training.engines.train.StepConfig`
   (:func:`build_step`, built once with the rest of the step's settings); R2 replays the routes
   of the step's start version. The reactive guards (``optim.vcpo``,
   ``optim.length_surge_guard``, :mod:`training.algorithms.guards`) set the ``lr_scale`` of the
   step's optimizer steps first: VCPO's ESS of the applied IS weights (else of π_current/μ), and
   the length-surge halving from the batch's mean response length; a halving is a line in
   :attr:`StepResult.events` (the run logs it) and its state is :meth:`Learner.state_dict`, kept
   in the trainer checkpoint. Routing: ``Recipe.routing_replay`` (``auto`` resolved there).
9. **Metrics**: one flat dict of floats (DESIGN.md "Metrics"), see :meth:`Learner.step`.
10. **The strategy's own update** (:meth:`~training.runtime.old_policy.OldPolicy.after_step`;
    ``ewma``: the reference takes the new parameters).

Definitions used in the metrics:

* ``rollout/repetition_rate``: the fraction of responses in which some 4-gram of consecutive
  response token ids occurs at least twice (occurrences may overlap; every response token counts,
  whatever its loss mask).
* ``async/partial_samples``: samples whose tokens came from more than one weight version.
* ``async/batch_tokens``: real tokens of the batch, Σ (prompt + response).
* ``kl/value``: the batch mean over sequences of the per-sequence token mean of the KL estimate.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.algorithms.advantages import (
    AdvantageConfig,
    TokenPolicy,
    compute_advantage,
    turn_level_grpo_advantage,
)
from training.algorithms.diagnostics import compute_mismatch_metrics, variance_proxy_metrics
from training.algorithms.guards import LengthSurgeGuard, vcpo_lr_scale
from training.algorithms.is_correction import (
    CompISConfig,
    SourceCorrection,
    applied_weight_metrics,
    compute_compis_weights,
    compute_is_correction,
)
from training.algorithms.kl import AdaptiveKLController, FixedKLController, kl_penalty
from training.algorithms.masked import masked_mean, sanitize, tail_stats
from training.algorithms.masking import m2po_mask, opsm_mask, second_moment
from training.algorithms.policy_loss import PolicyLossConfig
from training.algorithms.rollout_correction import (
    PRESETS,
    RolloutCorrectionConfig,
    compute_rollout_correction_and_rejection_mask,
)
from training.engines.train import (
    OptimConfig,
    StepConfig,
    TokenBatch,
    TrainEngine,
)
from training.recipe import (
    CompISCorrection,
    CorrectionSpec,
    DecoupledCorrection,
    DecoupledMISCorrection,
    NoCorrection,
    PresetCorrection,
    Recipe,
    SourceSpec,
)
from training.runtime.old_policy import OldPolicy, forward_routing, old_policy
from training.runtime.types import Group, RolloutTrace, Sample

__all__ = [
    "AppliedCorrection",
    "Learner",
    "StepPlan",
    "StepResult",
    "apply_correction",
    "build_step",
    "engine_optim_config",
    "policy_loss_config",
    "repetition_rate",
]

log = logging.getLogger("asyncrl.runtime")

REPETITION_NGRAM = 4
_MAX_LISTED = 4  # offending samples named in a rejection reason


# ------------------------------------------------------------------------------------------------
# Results and small helpers
# ------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """Outcome of :meth:`Learner.step`.

    trained: True when at least one optimizer step was applied.
    rejected_reason: one line saying why nothing was trained (None when trained).
    metrics: flat dict of floats (DESIGN.md namespaces).
    weight_version: the engine's version after the step.
    time_s: wall time of the step in the trainer actor (set by ``TrainerWorker.step``; 0 here).
    debug: the step's (B, T) tensors when the learner keeps them (``keep_tensors=True``): keys
        ``rollout_log_prob`` (μ), ``current_log_prob``, ``proximal_log_prob``, ``old_log_prob``,
        ``token_versions``, ``response_mask`` (loss mask), ``keep_mask`` (trained tokens),
        ``token_level_rewards``, ``advantages``, ``entropy``, and when they exist
        ``is_weights``, ``ref_log_prob``, ``loglinear_alpha`` (loglinear and linear_prox),
        ``snapshot_fallback_mask``, ``dedicated_fallback_mask``, ``interrupt_fallback_mask``.
    """

    trained: bool
    rejected_reason: str | None
    metrics: dict[str, float]
    weight_version: int
    debug: dict[str, torch.Tensor] | None = None
    time_s: float = 0.0
    events: tuple[str, ...] = ()
    """Lines for the run's log: what a reactive guard did this step (an LR halving)."""
    traces: tuple[RolloutTrace, ...] = ()
    """Up to :data:`TRACES_PER_STEP` of the step's trajectories with their per-token
    diagnostics (:meth:`Learner._traces`), for the run's ``rollouts.jsonl``."""


#: Trajectories a trained step hands back for people to read: the one with the largest
#: train–rollout |Δlogp| on a loss token, and the highest-reward one (when another).
TRACES_PER_STEP = 2


@dataclass(frozen=True)
class _Packed:
    """The step's samples as tensors (B sequences, T response width)."""

    batch: TokenBatch
    samples: list[Sample]
    rollout_log_prob: torch.Tensor  # (B, T) μ, 0 outside the loss mask
    token_versions: torch.Tensor  # (B, T) long, padded with each sample's last version
    rewards: torch.Tensor  # (B,) float
    group_index: list[int]  # (B,) group ids
    minibatch_rows: list[slice]  # consecutive rows of each mini-batch
    turns: torch.Tensor | None = None  # (B, T) long turn of each token; None: single-turn batch


@dataclass
class _Policies:
    """Log-probs of the step, (B, T) each; ``exact``, ``extra`` and ``metrics`` are the old
    policy's (:class:`~training.runtime.old_policy.OldEstimate`)."""

    current: torch.Tensor
    entropy: torch.Tensor
    proximal: torch.Tensor
    old: torch.Tensor
    extra: dict[str, torch.Tensor]
    metrics: dict[str, float]
    exact: torch.Tensor | None = None


@dataclass
class _Correction:
    """IS weights (or None), kept tokens and metrics."""

    weights: torch.Tensor | None
    keep: torch.Tensor
    metrics: dict[str, float]


def engine_optim_config(recipe: Recipe) -> OptimConfig:
    """The engine :class:`OptimConfig` a recipe's ``optim`` section asks for (cosine decays over
    every optimizer step of the run: steps × require_batches × epochs)."""
    o = recipe.optim
    total = recipe.steps * recipe.async_.require_batches * o.epochs
    return OptimConfig(lr=o.lr, weight_decay=o.weight_decay, grad_clip=o.grad_clip,
                       lr_schedule=o.lr_schedule, warmup_steps=o.warmup_steps,
                       total_steps=total if o.lr_schedule == "cosine" else None)


def policy_loss_config(recipe: Recipe,
                       rollout_correction: RolloutCorrectionConfig | None = None
                       ) -> PolicyLossConfig:
    """The :class:`PolicyLossConfig` of a recipe's ``algorithm.loss``. Dr.GRPO's constant K of
    ``seq-mean-token-sum-norm`` is ``loss_scale_factor``, else ``rollout.max_response_tokens``:
    never the padded width of the batch, which would make a sequence's loss depend on the
    longest response it was batched with."""
    loss = recipe.algorithm.loss
    scale = (loss.loss_scale_factor if loss.loss_scale_factor is not None
             else float(recipe.rollout.max_response_tokens))
    return PolicyLossConfig(loss_agg_mode=loss.agg, clip_ratio=loss.clip_ratio,
                            clip_ratio_low=loss.clip_ratio_low,
                            clip_ratio_high=loss.clip_ratio_high,
                            clip_ratio_c=loss.clip_ratio_c, loss_scale_factor=scale,
                            dro_beta=loss.dro_beta, rollout_correction=rollout_correction)


@dataclass(frozen=True)
class StepPlan:
    """What every trainer step of a run takes from the recipe, built once (:func:`build_step`).

    config: the engine :class:`StepConfig` of every ``train_step``.
    correction: ``algorithm.correction``.
    preset: the built :class:`RolloutCorrectionConfig` of a ``{kind: preset}`` correction, else
        None.
    forward_routing: routing of the no-grad forwards (``r3`` for R3, else ``free``).
    replay: ``Recipe.routing_replay`` (``auto`` resolved).
    """

    config: StepConfig
    correction: CorrectionSpec
    preset: RolloutCorrectionConfig | None
    forward_routing: str
    replay: str

    @property
    def loss(self) -> PolicyLossConfig:
        """The policy-loss config the steps train with (a bypass preset's in ``bypass_mode``)."""
        return self.config.loss_config


def build_step(recipe: Recipe) -> StepPlan:
    """The :class:`StepPlan` of a recipe. The step config: the recipe's loss (a bypass
    rollout-correction preset switches it to ``bypass_mode`` with the preset's IS/RS settings),
    the train routing of ``Recipe.routing_replay`` (``auto`` resolved), ``rollout.temperature``,
    ``optim.micro_batch_size``, the loss's ``entropy_coeff`` and, with ``algorithm.kl.mode:
    in_loss``, the KL loss term (estimator, β, IS correction).

    Raises:
        ValueError: ``algorithm.loss.name: bypass_mode`` without a bypass preset.
    """
    alg = recipe.algorithm
    correction = alg.correction
    preset = (PRESETS[correction.name](**correction.args)
              if isinstance(correction, PresetCorrection) else None)
    bypass = preset is not None and preset.bypass_mode
    if alg.loss.name == "bypass_mode" and not bypass:
        raise ValueError("algorithm.loss.name=bypass_mode takes its IS/RS settings from a "
                         "bypass rollout-correction preset: set algorithm.correction to "
                         "{kind: preset, name: bypass_ppo_clip} (or another bypass_* preset)")
    loss_name, loss_cfg = alg.loss.name, policy_loss_config(recipe)
    if bypass:  # bypass_mode computes IS/RS between π_θ and μ
        loss_name, loss_cfg = "bypass_mode", policy_loss_config(recipe, preset)
    replay = recipe.routing_replay
    config = StepConfig(loss_name=loss_name, loss_config=loss_cfg,
                        routing={"r3": "r3", "r2": "r2"}.get(replay, "free"),
                        temperature=recipe.rollout.temperature,
                        micro_batch_size=recipe.optim.micro_batch_size,
                        entropy_coeff=alg.loss.entropy_coeff,
                        kl_estimator=alg.kl.estimator if alg.kl.mode == "in_loss" else None,
                        kl_coef=alg.kl.coef if alg.kl.mode == "in_loss" else 0.0,
                        kl_is_correction=alg.kl.is_correction)
    return StepPlan(config, correction, preset, forward_routing(recipe), replay)


def repetition_rate(responses: Sequence[Sequence[int]], n: int = REPETITION_NGRAM) -> float:
    """Fraction of responses containing some n-gram of token ids at least twice (0 if none)."""
    if not responses:
        return 0.0
    hits = 0
    for ids in responses:
        seen: set[tuple[int, ...]] = set()
        for i in range(len(ids) - n + 1):
            gram = tuple(ids[i : i + n])
            if gram in seen:
                hits += 1
                break
            seen.add(gram)
    return hits / len(responses)


def _where(samples: Sequence[Sample]) -> str:
    names = [f"group {s.group_id} sample {s.sample_index}" for s in samples[:_MAX_LISTED]]
    if len(samples) > _MAX_LISTED:
        names.append("...")
    return ", ".join(names)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _bad_sample_reason(samples: Sequence[Sample], need_routes: bool) -> str | None:
    """One-line reason naming the samples that must not be trained on, or None."""
    parts = []
    bad_reward = [s for s in samples if not math.isfinite(s.reward)]
    if bad_reward:
        parts.append(f"{_count(len(bad_reward), 'sample')} with NaN/inf reward "
                     f"({_where(bad_reward)})")
    bad_lp = [s for s in samples if math.isfinite(s.reward) and not s.finite()]
    if bad_lp:
        parts.append(f"{_count(len(bad_lp), 'sample')} with NaN/inf rollout log-probs on loss "
                     f"tokens ({_where(bad_lp)})")
    if need_routes:
        no_routes = [s for s in samples if s.routes is None]
        if no_routes:
            parts.append(f"{_count(len(no_routes), 'sample')} without rollout routes for R3 "
                         f"({_where(no_routes)})")
    return "; ".join(parts) if parts else None


def _nonfinite_reason(named: Mapping[str, torch.Tensor], mask: torch.Tensor,
                      samples: Sequence[Sample]) -> str | None:
    """Reason when a trainer-side (B, T) log-prob tensor is NaN/inf on a loss token, else None."""
    for name, values in named.items():
        bad = mask & ~torch.isfinite(values)
        if bool(bad.any()):
            rows = bad.any(dim=1).nonzero().reshape(-1).tolist()
            return (f"trainer {name} log-probs are NaN/inf on {int(bad.sum())} loss tokens of "
                    f"{_count(len(rows), 'sample')} ({_where([samples[i] for i in rows])})")
    return None


def _turn_tensor(samples: Sequence[Sample], shape: tuple[int, int]) -> torch.Tensor | None:
    """(B, T) turn of every response token (padding: the row's last turn), or None when no
    sample is a multi-turn trajectory."""
    if not any(s.turn_ids for s in samples):
        return None
    turns = torch.zeros(shape, dtype=torch.long)
    for i, s in enumerate(samples):
        if s.turn_ids:
            turns[i, :] = s.turn_ids[-1]
            turns[i, :len(s.turn_ids)] = torch.tensor(s.turn_ids, dtype=torch.long)
    return turns


def tool_split_masks(turns: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Seed 004 source 5's split of the loss tokens: ``pre_tool`` (turn 0, before any tool
    observation) and ``post_tool`` (every later turn: conditioned on a tool's output)."""
    mask = mask.bool()
    return {"pre_tool": mask & (turns == 0), "post_tool": mask & (turns > 0)}


def per_turn_rows(turns: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level ratio isolation: one row per (sequence, turn with loss tokens) — ``rows`` (R,)
    the sequence of each, ``masks`` (R, T) its turn's loss tokens — so a sequence-level IS
    statistic computed on the rows is a per-turn one. A sequence without loss tokens keeps one
    empty row."""
    mask = mask.bool()
    rows: list[int] = []
    masks: list[torch.Tensor] = []
    for b in range(mask.shape[0]):
        present = torch.unique(turns[b][mask[b]]).tolist()
        for t in present or [None]:
            rows.append(b)
            masks.append(mask[b] & (turns[b] == t) if t is not None else mask[b])
    return torch.tensor(rows, dtype=torch.long), torch.stack(masks)


def apply_correction_per_turn(correction: CorrectionSpec,
                              preset: RolloutCorrectionConfig | None, proximal: torch.Tensor,
                              old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
                              turns: torch.Tensor) -> AppliedCorrection:
    """:func:`apply_correction` with every turn of a trajectory as its own sequence
    (``algorithm.turns.is_ratio: turn``): sequence-level weights, vetoes and aggregates are
    formed per turn and put back on that turn's tokens; token-level ones are unchanged. The
    metrics count turns as sequences."""
    rows, masks = per_turn_rows(turns, mask)
    res = apply_correction(correction, preset, proximal[rows], old[rows], mu[rows], masks)
    keep = torch.zeros(mask.shape, dtype=torch.long)
    keep.index_add_(0, rows, (res.keep & masks).long())
    weights = None
    if res.weights is not None:
        weights = torch.ones(mask.shape, dtype=res.weights.dtype)
        placed = torch.zeros(mask.shape, dtype=res.weights.dtype)
        placed.index_add_(0, rows, torch.where(masks, res.weights, torch.zeros_like(res.weights)))
        weights = torch.where(mask.bool(), placed, weights)
    return AppliedCorrection(weights, keep > 0, res.metrics, res.engine_rejects)


def _minibatch_groups(n_groups: int, n_minibatches: int) -> list[range]:
    """Consecutive group ranges; the last mini-batch takes the remainder."""
    if n_groups < n_minibatches:
        raise ValueError(f"{n_groups} groups cannot fill async.require_batches={n_minibatches} "
                         "mini-batches; pass at least one group per mini-batch")
    size = n_groups // n_minibatches
    bounds = [i * size for i in range(n_minibatches)] + [n_groups]
    return [range(bounds[i], bounds[i + 1]) for i in range(n_minibatches)]


def _mean_metrics(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine per-optimizer-step metrics: ``*/max`` → max, ``*/min`` → min, counters that are
    states (``train/weight_version``, ``train/step``, ``train/lr``) → last, else the mean."""
    last_keys = {"train/weight_version", "train/step", "train/lr"}
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in steps for k in m):
        values = [float(m[key]) for m in steps if key in m]
        if key in last_keys:
            out[key] = values[-1]
        elif key.endswith("/max"):
            out[key] = max(values)
        elif key.endswith("/min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


# ------------------------------------------------------------------------------------------------
# Which weights a correction gives (pure; tested on hand-built tensors)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppliedCorrection:
    """What a correction kind does to the loss (before M2PO / OPSM).

    weights: (B, T) detached IS weights the loss multiplies by, or None.
    keep: (B, T) tokens kept.
    metrics: ``is/combined/*`` of the applied weight (every kind that applies one or masks: a
        decoupled preset with rejection sampling only counts as weight 1 on its kept tokens; the
        AReaL ``decoupled`` kind all of :func:`compute_is_correction`'s keys there),
        ``rollout_corr/*`` of a decoupled preset. The per-source ratios (``is/staleness/*``,
        ``is/engine/*``) are measured elsewhere, on π_current/π_old and π_old/μ, whatever the
        kind.
    engine_rejects: whether the kind can reject tokens by their π_prox/μ ratio with a mask (the
        train–inference mask of the EWMA reset, where π_prox = π_old).
    """

    weights: torch.Tensor | None
    keep: torch.Tensor
    metrics: dict[str, float]
    engine_rejects: bool


def _source(spec: SourceSpec) -> SourceCorrection:
    return SourceCorrection(spec.method, spec.lower, spec.upper)


def apply_correction(correction: CorrectionSpec, preset: RolloutCorrectionConfig | None,
                     proximal: torch.Tensor, old: torch.Tensor, mu: torch.Tensor,
                     mask: torch.Tensor) -> AppliedCorrection:
    """The IS weights and kept tokens of ``algorithm.correction`` (a recipe correction spec).

    ====================  =================================================================
    kind                  weight applied to the PPO loss (clip centred at ``proximal``)
    ====================  =================================================================
    none                  none
    compis                f_s(π_prox/π_old) · f_e(π_old/μ)                  (seed 000)
    preset (decoupled)    the preset's IS/RS of π_prox/μ: the lag and the engine mismatch
                          (verl's decoupled mode); a bypass preset: none here — the
                          ``bypass_mode`` loss weighs π_θ/μ itself
    decoupled             π_prox/μ, tokens above ``behaviour_weight_cap`` masked (AReaL)
    decoupled_mis         f_e(π_old/μ); the caller passes π_prox = π_old (seed 003 Eq. 4)
    ====================  =================================================================

    ``preset`` is the built preset config (kind ``preset`` only). ``is/combined/*`` is logged for
    every kind but none and the bypass presets, a decoupled preset with rejection sampling only
    included (weight 1 on the tokens it keeps).
    """
    valid = mask.bool()
    if isinstance(correction, NoCorrection) or (
            isinstance(correction, PresetCorrection) and preset is not None
            and preset.bypass_mode):
        return AppliedCorrection(None, valid.clone(), {}, False)
    metrics: dict[str, float] = {}
    weights: torch.Tensor | None
    if isinstance(correction, CompISCorrection):
        res = compute_compis_weights(proximal, old, mu, valid, CompISConfig(
            staleness=_source(correction.staleness), engine=_source(correction.engine)))
        # only the applied weight (is/combined/*, below): CompIS's own is/staleness/* is
        # π_prox/π_old, ≡ 1 under ewma (π_prox = π_old); the contract's measured π_current/π_old
        # with CompIS's methods comes from Learner._diagnostics and must not be overwritten
        weights, keep = res.weight, res.keep_mask
        rejects = correction.engine.method in ("cap", "icepop")
    elif isinstance(correction, DecoupledMISCorrection):
        res1 = compute_is_correction(old, mu, valid, _source(correction.engine))
        weights, keep = res1.weight, res1.keep_mask
        rejects = correction.engine.method in ("cap", "icepop")
    elif isinstance(correction, DecoupledCorrection):
        cap = correction.behaviour_weight_cap
        method = SourceCorrection("none") if cap is None else SourceCorrection("cap", upper=cap)
        res1 = compute_is_correction(proximal, mu, valid, method, prefix="is/combined/")
        weights, keep = res1.weight, res1.keep_mask
        metrics.update(res1.metrics)
        rejects = cap is not None
    elif isinstance(correction, PresetCorrection):
        assert preset is not None
        weights, keep, metrics = compute_rollout_correction_and_rejection_mask(
            proximal, mu, valid, preset)
        rejects = preset.rollout_rs is not None or preset.uses_icepop
    else:
        raise ValueError(f"unknown correction kind {correction.kind!r}")
    # a preset with rejection sampling only applies weight 1 on the tokens it keeps: its mask
    # must still reach is/combined/* (is_health and the decision tree read it there)
    if weights is not None or isinstance(correction, PresetCorrection):
        metrics.update(applied_weight_metrics(weights, keep, valid))
    return AppliedCorrection(weights, keep, metrics, rejects)


# ------------------------------------------------------------------------------------------------
# Learner
# ------------------------------------------------------------------------------------------------


class Learner:
    """One trainer step of the recipe's RL algorithm on a :class:`TrainEngine`.

    Args:
        engine: the trainer (the ``ewma`` strategy needs an engine with ``model`` and
            ``compute_log_probs_with_weights``, e.g. the embedded one).
        recipe: the validated recipe (reads ``algorithm``, ``optim``, ``rollout.temperature``,
            ``async``).
        reference_dir: the initial HF checkpoint, loaded as the frozen KL reference when
            ``algorithm.kl.mode`` is ``in_reward`` or ``in_loss`` (required then, ignored
            otherwise).
        pad_token_id: padding id of the packed batches.
        keep_tensors: fill :attr:`StepResult.debug` with the step's tensors (tests, debugging).
    """

    def __init__(self, engine: TrainEngine, recipe: Recipe, *,
                 reference_dir: str | Path | None = None, pad_token_id: int = 0,
                 keep_tensors: bool = False) -> None:
        self.engine = engine
        self.recipe = recipe
        self.pad_token_id = int(pad_token_id)
        self.keep_tensors = bool(keep_tensors)
        alg = recipe.algorithm
        self.plan = build_step(recipe)
        self._kl_ctrl: FixedKLController | AdaptiveKLController | None = None
        self._reference: TrainEngine | None = None
        if alg.kl.mode == "in_reward":
            self._kl_ctrl = (FixedKLController(alg.kl.coef) if alg.kl.target is None else
                             AdaptiveKLController(alg.kl.coef, alg.kl.target, alg.kl.horizon))
        if alg.kl.mode in ("in_reward", "in_loss"):
            self._reference = self._load_reference(recipe, reference_dir)
        surge = recipe.optim.length_surge_guard
        self.length_guard = None if surge is None else LengthSurgeGuard(
            surge.ratio, surge.window_steps, surge.factor, surge.max_halvings)
        self.old_policy: OldPolicy = old_policy(recipe, engine)

    # --- set-up ---------------------------------------------------------------------------------
    @staticmethod
    def _load_reference(recipe: Recipe, reference_dir: str | Path | None) -> TrainEngine:
        """The frozen fp32 reference policy of the KL penalty (the run's initial weights), on
        the recipe's train backend (:func:`training.engines.factory.make_reference_engine`)."""
        from training.engines.factory import make_reference_engine

        return make_reference_engine(recipe, reference_dir)

    def weights_synced(self, version: int, referenced: Sequence[int]) -> None:
        """The trainer's current weights went to the rollout engines as ``version``
        (``referenced``: the synced versions still referenced): the dedicated old-logit model
        loads them and forgets the rest (:meth:`OldPolicy.weights_synced`; no-op for the other
        strategies)."""
        self.old_policy.weights_synced(version, referenced)

    # --- routing ----------------------------------------------------------------------------------
    @property
    def _replay(self) -> str:
        return self.plan.replay

    @property
    def _forward_routing(self) -> str:
        """Routing of the no-grad forwards: rollout routes for R3, the router's own otherwise."""
        return self.plan.forward_routing

    def _is_moe(self) -> bool:
        cfg = getattr(self.engine, "config", None)
        return bool(getattr(cfg, "is_moe", self.recipe.is_moe))

    # --- the step -----------------------------------------------------------------------------
    def step(self, groups: list[Group], step: int, *,
             version_to_step: Callable[[int], int] | None = None) -> StepResult:
        """Train on ``groups`` (ordered); see the module docstring for the algorithm.

        Args:
            groups: completed groups, in the order the runtime drained them; split into
                ``async.require_batches`` mini-batches of consecutive groups.
            step: the trainer (global) step number (log messages; the token-lag metric).
            version_to_step: maps a weight version to the trainer step that produced it; when
                given, ``old/token_lag_steps/{mean,p50,p90,p99,max}`` = step − that step over the
                loss tokens, and ``loglinear`` interpolates in steps (A-3PO's policy versions)
                instead of optimizer-step weight versions.
        Returns:
            :class:`StepResult`. Metric families (every step, whatever the strategy and
            correction): ``mismatch/train_rollout/*`` (π_current vs μ),
            ``mismatch/engine/*`` (π_old vs μ) and ``mismatch/engine/exact`` (see
            :mod:`training.algorithms.diagnostics`); ``is/staleness/*`` (π_current/π_old) and
            ``is/engine/*`` (π_old/μ) measured with method ``none``, replaced by the
            correction's own values where it applies that source; ``rs/m2po/m2/*`` and
            ``rs/m2po/m2_mean`` (π_prox vs μ); ``policy/proxy{1,2,3}_*`` (gradient-variance
            proxies, :func:`~training.algorithms.diagnostics.variance_proxy_metrics`);
            ``policy/entropy/*``, ``is/*`` | ``rollout_corr/*``, ``rs/*``, ``policy/*`` and
            ``train/*`` (averaged over optimizer steps; ``policy/grad_norm`` and
            ``policy/grad_norm_max``, ``policy/lr``, ``policy/approx_kl``), ``old/*``,
            ``kl/value``, ``kl/coef``, ``rollout/*``
            (reward mean/std, logprob mean, response length tails, truncation, zero-variance
            groups, repetition, reward by difficulty), ``async/partial_samples``,
            ``async/batch_samples``, ``async/batch_tokens``, ``async/rejected_batch``,
            ``moe/replay_mode`` (MoE only), ``step/weight_version``.
        Raises:
            ValueError: fewer groups than mini-batches.
        """
        self._sum_pi_squared: torch.Tensor | None = None
        row_groups = _minibatch_groups(len(groups), self.recipe.async_.require_batches)
        samples = [s for g in groups for s in g.samples]
        reason = _bad_sample_reason(samples, need_routes=self._replay == "r3")
        if reason is not None:
            return self._reject(reason, samples, step)
        packed = self._pack(groups, row_groups)
        start_version = self.engine.weight_version
        policies = self._policies(packed, int(step), version_to_step)
        ref = self._reference_log_probs(packed)
        trainer_lps = {"current": policies.current, "old": policies.old,
                       **({} if ref is None else {"reference": ref})}
        reason = _nonfinite_reason(trainer_lps, packed.batch.response_mask, samples)
        if reason is not None:
            return self._reject(reason, samples, step)

        metrics: dict[str, float] = {"async/rejected_batch": 0.0}
        rewards, kl_metrics = self._token_rewards(packed, policies.old, ref)
        metrics.update(kl_metrics)
        mask = packed.batch.response_mask
        est = self.recipe.algorithm.advantage
        applied = self._apply_correction(packed, policies)
        # the IS-aware estimators (OTB) read π and Σπ² of one forward (π_current's, the step's
        # start weights: π_old under recompute, as verl's actor pass gives them) and the
        # correction's IS weights; the other estimators ignore them
        policy = (None if self._sum_pi_squared is None else
                  TokenPolicy(policies.current, self._sum_pi_squared, applied.weights))
        adv_config = AdvantageConfig(norm_adv_by_std_in_grpo=est.norm_by_std, gamma=est.gamma,
                                     lam=est.lam)
        if self.recipe.algorithm.turns.advantage == "turn" and packed.turns is not None:
            advantages, _, adv_metrics = turn_level_grpo_advantage(
                rewards, mask, packed.turns, packed.group_index, adv_config)
        else:
            advantages, _, adv_metrics = compute_advantage(
                est.estimator, rewards, mask, index=packed.group_index, config=adv_config,
                policy=policy)
        correction = self._correct(packed, policies, applied, advantages)
        lr_scale, guard_metrics, events = self._guards(packed, policies, correction, step)
        metrics.update(guard_metrics)
        train_metrics = self._train(packed, policies.proximal, advantages, correction,
                                    start_version, ref=ref, lr_scale=lr_scale)
        trained = train_metrics.get("train/skipped_step", 0.0) < 1.0
        metrics.update(self.old_policy.after_step(trained, correction.metrics))

        if trained:
            metrics.update(self._update_size(packed, policies))
        # measured first, so the correction's applied versions of the same keys win
        metrics.update(self._diagnostics(packed, policies))
        metrics.update(policies.metrics)
        metrics.update(self._held_bytes_metrics())
        metrics.update(adv_metrics)
        metrics.update(correction.metrics)
        metrics.update(train_metrics)
        metrics.update(self._proxy_metrics(packed, policies, advantages, correction,
                                           train_metrics))
        metrics.update(self._rollout_metrics(packed))
        if packed.turns is not None:
            metrics.update(self._tool_metrics(packed, policies, applied))
        if version_to_step is not None:
            metrics.update(self._lag_metrics(packed, step, version_to_step))
        metrics["step/weight_version"] = float(self.engine.weight_version)
        debug = self._debug(packed, policies, rewards, advantages, correction, ref)
        traces = self._traces(packed, policies, correction, start_version) if trained else ()
        if not trained:
            reason = (f"step {step}: every optimizer step was skipped (non-finite loss or "
                      "gradient norm); the weights are unchanged")
            log.warning(reason)
            return StepResult(False, reason, metrics, self.engine.weight_version, debug,
                              events=events)
        return StepResult(True, None, metrics, self.engine.weight_version, debug, events=events,
                          traces=traces)

    def _reject(self, reason: str, samples: Sequence[Sample], step: int) -> StepResult:
        log.warning("step %d: batch rejected, nothing trained: %s", step, reason)
        metrics = {"async/rejected_batch": 1.0, "async/batch_samples": float(len(samples)),
                   "step/weight_version": float(self.engine.weight_version)}
        return StepResult(False, reason, metrics, self.engine.weight_version, None)

    # --- packing ------------------------------------------------------------------------------
    def _pack(self, groups: Sequence[Group], row_groups: Sequence[range]) -> _Packed:
        """Samples → TokenBatch and (B, T) tensors; mini-batch row slices from group ranges."""
        samples = [s for g in groups for s in g.samples]
        loss_masks = [[int(m) for m in s.loss_mask] for s in samples]
        batch = TokenBatch.from_sequences(
            [s.prompt_ids for s in samples], [s.response_ids for s in samples],
            pad_token_id=self.pad_token_id, loss_masks=loss_masks,
            routes=[s.routes for s in samples] if self._replay == "r3" else None)
        shape = (batch.batch_size, batch.response_len)
        mu = torch.zeros(shape)
        versions = torch.zeros(shape, dtype=torch.long)
        for i, s in enumerate(samples):
            o = s.response_len
            mu[i, :o] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
            last = s.token_versions[-1] if s.token_versions else 0
            versions[i, :] = last
            versions[i, :o] = torch.tensor(s.token_versions, dtype=torch.long)
        starts = [0]
        for g in groups:
            starts.append(starts[-1] + g.n)
        rows = [slice(starts[r.start], starts[r.stop]) for r in row_groups]
        return _Packed(batch=batch, samples=samples,
                       rollout_log_prob=sanitize(mu, batch.response_mask),
                       token_versions=versions,
                       rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
                       group_index=[s.group_id for s in samples], minibatch_rows=rows,
                       turns=_turn_tensor(samples, shape))

    # --- π_current, π_prox, π_old ---------------------------------------------------------------
    def _policies(self, packed: _Packed, step: int,
                  version_to_step: Callable[[int], int] | None) -> _Policies:
        """π_current (one forward at the step's start weights), then π_prox / π_old from the
        run's :class:`~training.runtime.old_policy.OldPolicy`."""
        res = self.engine.compute_log_probs(
            packed.batch, routing=self._forward_routing,
            temperature=self.recipe.rollout.temperature, with_entropy=True)
        self._sum_pi_squared = res.sum_pi_squared  # the variance proxies' W (_proxy_metrics)
        current = res.log_probs
        entropy = res.entropy if res.entropy is not None else torch.zeros_like(current)
        est = self.old_policy.reference(packed, current, step=step,
                                        version_to_step=version_to_step)
        return _Policies(current, entropy, est.proximal, est.old, est.extra, est.metrics,
                         est.exact)

    def _held_bytes_metrics(self) -> dict[str, float]:
        """``old/held_bytes``: bytes of the parameter copies held for old policies besides the
        trainer's live weights — its retained snapshots and the shadow model that runs them or
        the EWMA reference, and what the old policy holds itself (the EWMA reference kept here,
        the dedicated old-logit model) — measured after this step's update. Engines that do not
        count their copies (``parameter_bytes``: the Megatron ranks) report nothing."""
        if not hasattr(self.engine, "parameter_bytes"):
            return {}
        live = sum(p.numel() * p.element_size()
                   for p in self.engine.model.parameters())  # type: ignore[attr-defined]
        held = self.engine.parameter_bytes() - live  # type: ignore[attr-defined]
        held += self.old_policy.held_bytes()
        return {"old/held_bytes": float(held)}

    # --- rewards, KL ----------------------------------------------------------------------------
    def _reference_log_probs(self, packed: _Packed) -> torch.Tensor | None:
        if self._reference is None:
            return None
        ref_moe = bool(getattr(getattr(self._reference, "config", None), "is_moe", False))
        return self._reference.compute_log_probs(
            packed.batch, routing=self._forward_routing if ref_moe else "free",
            temperature=self.recipe.rollout.temperature, with_entropy=False).log_probs

    def _token_rewards(self, packed: _Packed, old: torch.Tensor, ref: torch.Tensor | None
                       ) -> tuple[torch.Tensor, dict[str, float]]:
        """(B, T) token rewards: the reward on the last loss token, minus β·KL when in_reward."""
        mask = packed.batch.response_mask
        rewards = torch.zeros(mask.shape)
        positions = torch.arange(mask.shape[1]).expand_as(mask)
        last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
        rows = (last >= 0).nonzero().reshape(-1)
        rewards[rows, last[rows]] = packed.rewards[rows]
        if ref is None or self._kl_ctrl is None:
            return rewards, {}
        kl = kl_penalty(old, ref, mask, self.recipe.algorithm.kl.estimator).detach()
        beta = self._kl_ctrl.value
        has = mask.any(dim=1)
        value = float(masked_mean(masked_mean(kl, mask, dim=-1), has))
        if math.isfinite(value):
            self._kl_ctrl.update(value, packed.batch.batch_size)
        return rewards - beta * kl, {"kl/value": value, "kl/coef": beta}

    # --- correction -----------------------------------------------------------------------------
    def _apply_correction(self, packed: _Packed, p: _Policies) -> AppliedCorrection:
        """IS weights and kept tokens of ``algorithm.correction`` (:func:`apply_correction`)."""
        if self.recipe.algorithm.turns.is_ratio == "turn" and packed.turns is not None:
            return apply_correction_per_turn(
                self.plan.correction, self.plan.preset, p.proximal, p.old,
                packed.rollout_log_prob, packed.batch.response_mask, packed.turns)
        return apply_correction(self.plan.correction, self.plan.preset, p.proximal,
                                p.old, packed.rollout_log_prob, packed.batch.response_mask)

    def _correct(self, packed: _Packed, p: _Policies, applied: AppliedCorrection,
                 advantages: torch.Tensor) -> _Correction:
        """``applied`` (:meth:`_apply_correction`) then M2PO / OPSM; the old policy's own
        measure of the correction first (ewma: ``old/ewma_mask_frac`` for the reference's
        reset)."""
        alg = self.recipe.algorithm
        mask = packed.batch.response_mask
        mu = packed.rollout_log_prob
        weights, keep, metrics = applied.weights, applied.keep, dict(applied.metrics)
        metrics.update(self.old_policy.correction_metrics(
            applied.keep, applied.weights, applied.engine_rejects, p.old, mu, mask))
        if alg.m2po is not None:
            m2 = m2po_mask(p.proximal, mu, keep, alg.m2po.threshold, alg.m2po.max_cutoff)
            keep = keep & m2.keep_mask
            metrics.update(m2.metrics)
        if alg.opsm is not None:
            op = opsm_mask(p.proximal, mu, advantages, keep, alg.opsm.delta)
            keep = keep & op.keep_mask
            metrics.update(op.metrics)
        metrics["rs/keep_frac"] = int(keep.sum()) / max(int(mask.sum()), 1)
        return _Correction(weights, keep, metrics)

    # --- training -------------------------------------------------------------------------------
    def _train(self, packed: _Packed, proximal: torch.Tensor, advantages: torch.Tensor,
               corr: _Correction, start_version: int, *, ref: torch.Tensor | None = None,
               lr_scale: float = 1.0) -> dict[str, float]:
        """epochs × mini-batches optimizer steps; per-step metrics combined. ``ref``: π_ref for
        the KL loss term (``kl.mode: in_loss``); ``lr_scale``: the guards' LR factor."""
        with_ref = self.plan.config.kl_estimator is not None
        batch = dataclasses.replace(packed.batch, response_mask=corr.keep)
        optim = self.recipe.optim
        steps: list[dict[str, float]] = []
        for _ in range(optim.epochs):
            for rows in packed.minibatch_rows:
                steps.append(self.engine.train_step(
                    batch.select(rows), advantages[rows], proximal[rows],
                    rollout_is_weights=None if corr.weights is None else corr.weights[rows],
                    r2_version=start_version if self._replay == "r2" else None,
                    config=self.plan.config,
                    **({"ref_log_prob": ref[rows]} if with_ref and ref is not None else {}),
                    **({"lr_scale": lr_scale} if lr_scale != 1.0 else {})))
        return self._policy_metrics(steps)

    def _update_size(self, packed: _Packed, p: _Policies) -> dict[str, float]:
        """The size of the step just taken, on the tokens it trained: π_current (the start
        weights) vs π_next (one more forward at the new weights). ``policy/update/*`` are
        :func:`compute_mismatch_metrics` of log π_next vs log π_current and ``policy/update_kl``
        = KL(π_current ‖ π_next) by the k3 estimator (non-negative, low variance). One update
        of lag costs a lagged run about this much |Δlogp| (issue 26: "one step of lag" as a
        measured quantity; the gates' expected level of a lagged run reads it)."""
        mask = packed.batch.response_mask
        nxt = self.engine.compute_log_probs(
            packed.batch, routing=self._forward_routing,
            temperature=self.recipe.rollout.temperature, with_entropy=False).log_probs
        m = compute_mismatch_metrics(nxt, p.current, mask, prefix="policy/update/")
        out = {k: v for k, v in m.items() if "logprob_abs_diff/" in k or k.endswith("kl_k3")}
        out["policy/update_kl"] = m["policy/update/kl_k3"]
        return out

    # --- reactive LR guards --------------------------------------------------------------------
    def _guards(self, packed: _Packed, p: _Policies, corr: _Correction, step: int
                ) -> tuple[float, dict[str, float], tuple[str, ...]]:
        """The LR factor of this step's optimizer steps from ``optim.vcpo`` and
        ``optim.length_surge_guard`` (:mod:`training.algorithms.guards`), their ``guard/*``
        metrics and the log lines of what they did (a halving)."""
        optim = self.recipe.optim
        scale, metrics, events = 1.0, {}, []
        if optim.vcpo is not None:
            # the weights the correction applies (rejected tokens count as 0, as in
            # is/combined/ess), else the behaviour ratio π_current/μ the loss's data carries
            mask = packed.batch.response_mask
            w = corr.weights if corr.weights is not None else torch.exp(
                (p.current - packed.rollout_log_prob).clamp(-20.0, 20.0))
            w = torch.where(corr.keep & mask, w, torch.zeros_like(w))
            vcpo, ess = vcpo_lr_scale(w, mask, optim.vcpo.min_scale)
            scale *= vcpo
            metrics.update({"guard/vcpo_lr_scale": vcpo, "guard/vcpo_ess": ess})
        if self.length_guard is not None:
            g = self.length_guard
            lengths = [s.response_len for s in packed.samples]
            halving = g.observe(step, sum(lengths) / max(len(lengths), 1))
            if halving is not None:
                events.append(halving.message(g.lr_scale))
                log.warning(events[-1])
            scale *= g.lr_scale
            metrics.update({"guard/lr_halvings": float(g.halvings),
                            "guard/length_surge_lr_scale": g.lr_scale,
                            "guard/lr_halved": 0.0 if halving is None else 1.0})
            if g.last_ratio is not None:
                metrics["guard/length_surge_ratio"] = g.last_ratio
        if metrics:
            metrics["guard/lr_scale"] = scale
        return scale, metrics, tuple(events)

    def state_dict(self) -> dict[str, Any]:
        """The learner's own state a checkpoint must keep (JSON-able): the length-surge
        guard's halvings and length window, and the old policy's state when it has any
        (``old_policy``; none today: :mod:`training.runtime.old_policy`)."""
        out: dict[str, Any] = {} if self.length_guard is None else {
            "length_surge_guard": self.length_guard.state_dict()}
        old = self.old_policy.state_dict()
        if old:
            out["old_policy"] = old
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (keys of a guard the recipe does not use are ignored)."""
        if self.length_guard is not None and "length_surge_guard" in state:
            self.length_guard.load_state_dict(state["length_surge_guard"])
        if "old_policy" in state:
            self.old_policy.load_state_dict(state["old_policy"])

    @staticmethod
    def _policy_metrics(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
        out = _mean_metrics(steps)
        norms = [float(m["train/grad_norm"]) for m in steps if "train/grad_norm" in m]
        if norms:
            out["policy/grad_norm"] = sum(norms) / len(norms)
            out["policy/grad_norm_max"] = max(norms)
        # seed 001's proxy1 ‖ḡ‖²: one mini-batch gradient per optimizer step (skipped steps'
        # non-finite norms carry no signal)
        finite = [n * n for n in norms if math.isfinite(n)]
        out["policy/proxy1_signal_strength"] = sum(finite) / len(finite) if finite else 0.0
        if "train/lr" in out:
            out["policy/lr"] = out["train/lr"]
        if "policy/ppo_kl" in out:
            out["policy/approx_kl"] = out["policy/ppo_kl"]
        out["train/optimizer_steps"] = float(len(steps))
        return out

    # --- metrics ----------------------------------------------------------------------------------
    def _diagnostics(self, packed: _Packed, p: _Policies) -> dict[str, float]:
        """What tells the mismatch sources apart, measured every step (issue 14's contract).

        ``mismatch/train_rollout/*`` (π_current vs μ, with the entropy tails),
        ``mismatch/engine/*`` (π_old vs μ) and ``mismatch/engine/exact``; the measured ratios
        ``is/staleness/*`` = π_current/π_old and ``is/engine/*`` = π_old/μ, each with the
        correction's own method where the correction applies that source (compis: both;
        decoupled_mis: engine), else ``none``; M2PO's second-moment tails of π_prox vs μ
        (``rs/m2po/m2/*``, ``rs/m2po/m2_mean``) without applying its mask.
        """
        mask = packed.batch.response_mask
        mu = packed.rollout_log_prob
        corr = self.recipe.algorithm.correction
        stale = self._source_method(corr, "staleness", ("compis",))
        engine = self._source_method(corr, "engine", ("compis", "decoupled_mis"))
        m = compute_mismatch_metrics(p.current, mu, mask, p.entropy,
                                     prefix="mismatch/train_rollout/")
        m.update(compute_mismatch_metrics(p.old, mu, mask, prefix="mismatch/engine/"))
        if self.recipe.algorithm.old_is_exact:
            # the staleness component alone (π_current vs π_old), where π_old is the trainer at
            # each token's behaviour version (snapshot, dedicated, interrupt)
            m.update({k: v for k, v in compute_mismatch_metrics(
                p.current, p.old, mask, prefix="mismatch/staleness/").items()
                if "logprob_abs_diff/" in k or k.endswith(("kl_k1", "kl_k3"))})
        exact = p.exact  # π_old is the trainer at the token's own version (OldEstimate.exact)
        n_loss = int(mask.sum())
        m["old/exact_frac"] = (0.0 if exact is None else
                               int((exact & mask).sum()) / n_loss if n_loss else 1.0)
        m["mismatch/engine/exact"] = (
            0.0 if exact is None or bool((mask & ~exact).any()) else 1.0)
        m.update(compute_is_correction(p.current, p.old, mask, stale,
                                       prefix="is/staleness/").metrics)
        m.update(compute_is_correction(p.old, mu, mask, engine, prefix="is/engine/").metrics)
        m2 = second_moment(p.proximal, mu, mask)
        m.update(tail_stats(m2, mask, prefix="rs/m2po/m2/"))
        m["rs/m2po/m2_mean"] = float(masked_mean(m2, mask))
        return m

    def _tool_metrics(self, packed: _Packed, p: _Policies, applied: AppliedCorrection
                      ) -> dict[str, float]:
        """Seed 004 source 5: every mismatch and IS family of :meth:`_diagnostics` and the
        applied correction's ``is/combined/*`` again on the pre-tool and on the post-tool loss
        tokens (``tool/pre_tool/...``, ``tool/post_tool/...``; post-tool tokens are expected to
        show larger ratios and more clipping), their token counts, and the batch's tool use
        (``tool/calls_per_sample``, ``tool/error_rate``, ``tool/timeout_rate``,
        ``tool/turns_mean``), and the trajectories partial rollout cut inside a turn
        (``tool/partial_within_turn``) and between turns (``tool/partial_between_turns``: the
        turn after a call went on under newer weights)."""
        assert packed.turns is not None
        mask = packed.batch.response_mask
        mu = packed.rollout_log_prob
        corr = self.recipe.algorithm.correction
        stale = self._source_method(corr, "staleness", ("compis",))
        engine = self._source_method(corr, "engine", ("compis", "decoupled_mis"))
        loss = self.recipe.algorithm.loss
        low = loss.clip_ratio_low if loss.clip_ratio_low is not None else loss.clip_ratio
        high = loss.clip_ratio_high if loss.clip_ratio_high is not None else loss.clip_ratio
        out: dict[str, float] = {}
        for name, part in tool_split_masks(packed.turns, mask).items():
            pre = f"tool/{name}/"
            out[pre + "tokens"] = float(part.sum())
            if not bool(part.any()):
                continue
            out.update(compute_mismatch_metrics(p.current, mu, part, p.entropy,
                                                prefix=pre + "mismatch/train_rollout/"))
            out.update(compute_mismatch_metrics(p.old, mu, part, prefix=pre + "mismatch/engine/"))
            out.update(compute_is_correction(p.current, p.old, part, stale,
                                             prefix=pre + "is/staleness/").metrics)
            out.update(compute_is_correction(p.old, mu, part, engine,
                                             prefix=pre + "is/engine/").metrics)
            if applied.weights is not None or applied.metrics:
                out.update(applied_weight_metrics(applied.weights, applied.keep & part, part,
                                                  prefix=pre + "is/combined/"))
            # the PPO clip band around μ: how much of each part a clip at the rollout policy
            # would cut (seed 004: more on post-tool tokens)
            ratio = torch.exp((p.current - mu).clamp(-20, 20))
            outside = (ratio < 1 - low) | (ratio > 1 + high)
            out[pre + "clip_frac_vs_rollout"] = float((outside & part).sum()) / float(part.sum())
        samples = packed.samples
        calls = sum(s.tool_calls for s in samples)
        out["tool/calls_per_sample"] = calls / max(len(samples), 1)
        out["tool/error_rate"] = sum(s.tool_errors for s in samples) / max(calls, 1)
        out["tool/timeout_rate"] = sum(s.tool_timeouts for s in samples) / max(calls, 1)
        out["tool/turns_mean"] = sum(s.turns for s in samples) / max(len(samples), 1)
        within = between = 0
        for s in samples:  # where partial rollout cut a trajectory: inside a turn, or at a call
            cut = [a for a in range(1, s.response_len) if s.loss_mask[a]
                   and s.token_versions[a] != s.token_versions[a - 1]]
            within += any(s.turn_ids[a] == s.turn_ids[a - 1] for a in cut)
            between += any(s.turn_ids[a] != s.turn_ids[a - 1] for a in cut)
        out["tool/partial_within_turn"] = float(within)
        out["tool/partial_between_turns"] = float(between)
        return out

    @staticmethod
    def _source_method(correction: CorrectionSpec, source: str, kinds: tuple[str, ...]
                       ) -> SourceCorrection:
        """The correction's method for ``source`` when its kind applies it, else ``none``."""
        spec = getattr(correction, source, None)
        if correction.kind not in kinds or spec is None:
            return SourceCorrection("none")
        return SourceCorrection(spec.method, spec.lower, spec.upper)

    def _proxy_metrics(self, packed: _Packed, p: _Policies, advantages: torch.Tensor,
                       corr: _Correction, train_metrics: Mapping[str, float]
                       ) -> dict[str, float]:
        """Seed 001's gradient-variance proxies on the trained tokens, π = π_current, ρ̄ from the
        IS weights handed to the loss (a bypass preset's in-loss weights are not seen: ρ̄ = 1);
        none when the engine gave no Σ_v π_v²."""
        if self._sum_pi_squared is None:
            return {}
        n = packed.batch.batch_size / max(len(packed.minibatch_rows), 1)
        return variance_proxy_metrics(
            p.current, self._sum_pi_squared, advantages, corr.keep,
            signal_strength=float(train_metrics.get("policy/proxy1_signal_strength", 0.0)),
            sequences_per_minibatch=n, is_weights=corr.weights)

    def _rollout_metrics(self, packed: _Packed) -> dict[str, float]:
        samples = packed.samples
        batch = packed.batch
        mask = batch.response_mask
        r = packed.rewards.to(torch.float64)
        m: dict[str, float] = {
            "rollout/reward_mean": float(r.mean()) if len(samples) else 0.0,
            "rollout/reward_std": float(r.std(unbiased=False)) if len(samples) else 0.0,
            "rollout/logprob_mean": float(masked_mean(packed.rollout_log_prob, mask)),
            "rollout/truncation_rate": sum(s.truncated for s in samples) / max(len(samples), 1),
            "rollout/repetition_rate": repetition_rate([s.response_ids for s in samples]),
            "async/partial_samples": float(sum(s.spans_sync for s in samples)),
            "async/batch_samples": float(len(samples)),
            "async/batch_tokens": float(batch.num_tokens),
        }
        m.update(tail_stats(batch.response_lens.to(torch.float64),
                            prefix="rollout/response_length/"))
        by_bucket: dict[int, list[float]] = {}
        for s in samples:
            if s.difficulty is not None:
                by_bucket.setdefault(int(s.difficulty), []).append(s.reward)
        for k, values in sorted(by_bucket.items()):
            m[f"rollout/reward_by_difficulty/{k}"] = sum(values) / len(values)
        if self._is_moe():
            m["moe/replay_mode"] = {"none": 0.0, "r2": 2.0, "r3": 3.0}[self._replay]
        return m

    @staticmethod
    def _lag_metrics(packed: _Packed, step: int, version_to_step: Callable[[int], int]
                     ) -> dict[str, float]:
        """Trainer steps between each loss token's producing version and ``step``."""
        mask = packed.batch.response_mask
        versions = packed.token_versions
        lag = torch.zeros(versions.shape, dtype=torch.float64)
        for v in set(versions[mask].tolist()):
            lag[versions == v] = float(step - version_to_step(int(v)))
        return tail_stats(lag, mask, prefix="old/token_lag_steps/")

    def _traces(self, packed: _Packed, p: _Policies, corr: _Correction, start_version: int
                ) -> tuple[RolloutTrace, ...]:
        """:data:`TRACES_PER_STEP` trajectories of the batch: the one whose loss tokens have the
        largest train–rollout |Δlogp|, then the highest-reward other one."""
        mask = packed.batch.response_mask
        gap = ((p.current - packed.rollout_log_prob).abs() * mask).detach()
        worst = int(gap.max(dim=1).values.argmax())
        best = max((i for i in range(len(packed.samples)) if i != worst),
                   key=lambda i: packed.samples[i].reward, default=None)
        picks = [(worst, "largest |Δlogp|")] + ([(best, "highest reward")] if best is not None
                                                 else [])
        out = []
        for row, why in picks[:TRACES_PER_STEP]:
            s = packed.samples[row]
            n = len(s.response_ids)
            w = corr.weights[row] if corr.weights is not None else None
            weights = ([1.0] * n if w is None else w[:n].tolist() if w.dim()
                       else [float(w)] * n)
            out.append(RolloutTrace(
                why=why, group_id=s.group_id, sample_index=s.sample_index,
                prompt_ids=tuple(s.prompt_ids), response_ids=tuple(s.response_ids),
                reward=float(s.reward), finish_reason=s.finish_reason, tool_calls=s.tool_calls,
                dlogp=tuple(round(float(x), 5) for x in gap[row, :n].tolist()),
                is_weight=tuple(round(float(x), 5) for x in weights),
                staleness=tuple(start_version - int(v) for v in s.token_versions),
                loss_mask=tuple(int(x) for x in s.loss_mask)))
        return tuple(out)

    def _debug(self, packed: _Packed, p: _Policies, rewards: torch.Tensor,
               advantages: torch.Tensor, corr: _Correction, ref: torch.Tensor | None
               ) -> dict[str, torch.Tensor] | None:
        if not self.keep_tensors:
            return None
        out: dict[str, Any] = {
            "rollout_log_prob": packed.rollout_log_prob, "current_log_prob": p.current,
            "proximal_log_prob": p.proximal, "old_log_prob": p.old,
            "token_versions": packed.token_versions,
            "response_mask": packed.batch.response_mask, "keep_mask": corr.keep,
            "token_level_rewards": rewards, "advantages": advantages, "entropy": p.entropy,
            **p.extra,
        }
        if corr.weights is not None:
            out["is_weights"] = corr.weights
        if self._sum_pi_squared is not None:
            out["sum_pi_squared"] = self._sum_pi_squared
        if ref is not None:
            out["ref_log_prob"] = ref
        return out
