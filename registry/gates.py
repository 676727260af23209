"""Stability gates: pure functions that judge one training run's metric history.

A campaign stage names gates (``GateSpec``: a gate name, parameters, optionally a reference stage);
the ``judge`` task reads the run's ``metrics.jsonl`` (``training.runtime.sinks.read_metrics``) and
calls :func:`evaluate_gates`. Each gate returns a :class:`GateResult` whose ``evidence`` sentence
carries the numbers a person needs to agree or disagree with the verdict.

The gates turn the diagnostics of the seeds into pass/fail rules:

===================================  ==========================================================
gate                                 source
===================================  ==========================================================
``logprob_diff_flat``                seed 000 "Diagnostic signals": the train–rollout |Δ log p|
                                     (π_current vs μ, staleness included) must stay flat —
                                     judged against the campaign's sync baseline when given
``entropy_no_blowup``                seed 000: a sudden upward entropy spike, or a sustained
                                     rise, preceded every collapse
``reward_not_collapsed``             seed 001 open problem 2: collapse = a ≥ 30 % reward drop that
                                     does not recover
``eval_tracks_reward``               seed 000: training reward up while eval down = simplicity bias
``is_health``                        seed 001 decision tree (ESS < 0.5, χ²_token > 1.0 → cause D)
                                     and its RS → IS → systems escalation (mask > 25 % → systems),
                                     per IS source (combined, engine, staleness)
``is_weight_mean_band``              seed 000 Fix 2: engine IS weight-mean dips to ≈ 0.992
                                     (judged on the raw ratio mean, method-independent)
``pg_clipfrac``                      seed 001 cause E: pg_clipfrac > 0.2 and rising
``repetition_rate``                  seed 000's failure cascade: entropy blow-up → repetition
                                     rate increase → test collapse
``zero_variance_groups``             seed 000: ~60 of 128 groups all-zero = wasted compute
``no_length_surge``                  seed 001 cause F: response length +20 % within 100 steps
``rollout_logprob_not_decreasing``   seed 000: a falling rollout log-prob precedes entropy blow-up
``grad_norm_no_spike``               seed 001 open problem 2: grad-norm spike > 10× the rolling
                                     median followed by reward degradation
``staleness_within_bound``           the async mode's own bound (0 sync, 1 one-step,
                                     max_off_policy_steps fully async); with drops configured,
                                     the fraction of samples dropped as too stale (and an
                                     explicit max_staleness, when given)
===================================  ==========================================================

Conventions shared by every gate:

* Training metrics are read from training rows only: rows marked ``"step/eval_only": 1.0`` (the
  evaluation before the first update) are skipped, and if a step appears twice (a resumed run
  redid it) the later row wins. ``eval/*`` metrics are read from every row, eval-only included.
* ``None`` (a non-finite value in the JSONL file), non-numeric values and missing keys are
  ignored: a series is the finite values of one key, in step order.
* "Points" are the entries of such a series; rolling windows (``window``, ``smooth``) count
  points, while ``no_length_surge``'s and ``grad_norm_no_spike``'s horizons count steps.
* Too little data never raises: the gate passes with evidence "not enough steps (N) …" unless
  its ``require_data`` parameter is true, in which case it fails with the same evidence.
* ``reference`` is the :func:`summarize` output of the reference stage's promoted run (the
  caller resolves a gate spec's ``relative_to``) — in a campaign, the sync baseline of the same
  campaign. Gates that take one judge relative to it (the seeds' absolute numbers come from their
  own stack: seed 000's Megatron + SGLang MoE at 16k–64k context, not ours); their absolute
  thresholds are the fallback when no reference is given. ``context`` carries run facts the
  metrics do not (``max_staleness``, ``max_off_policy_steps``).
* :func:`unmet_requirement` says, before training, when a recipe cannot produce what a gate
  needs (a campaign file is refused at load for it).

How this departs from the seeds: seed 001 waits 100 updates before calling a drop a collapse; a
stage cannot wait past its last step, so ``reward_not_collapsed`` judges the final value. The
slope gates also require the fitted change over the run to exceed a minimum (``min_rise``,
``min_drop``), because the least-squares slope of a short, noisy run is itself noisy.
"""

from __future__ import annotations

import difflib
import math
import numbers
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from training.algorithms.decision_tree import (
    ENGINE_DIFF,
    FIXES,
    METRIC_ALIASES,
    TRAIN_ROLLOUT_DIFF,
    UNSEPARATED,
    Diagnosis,
    Thresholds,
    diagnose,
    prescription,
)
from training.algorithms.registry import Registry

if TYPE_CHECKING:
    from training.recipe import Recipe

__all__ = [
    "GATES",
    "EntropyNoBlowupParams",
    "EvalTracksRewardParams",
    "GateContext",
    "GateParams",
    "GateResult",
    "GradNormNoSpikeParams",
    "IsHealthParams",
    "IsWeightMeanBandParams",
    "LogprobDiffFlatParams",
    "NoLengthSurgeParams",
    "PgClipfracParams",
    "RepetitionRateParams",
    "RewardNotCollapsedParams",
    "RolloutLogprobNotDecreasingParams",
    "StalenessWithinBoundParams",
    "ZeroVarianceGroupsParams",
    "check_params",
    "diagnosis_for",
    "evaluate_gate",
    "evaluate_gates",
    "gate_names",
    "gate_params",
    "params_model",
    "summarize",
    "unmet_requirement",
]

LOGPROB_DIFF = TRAIN_ROLLOUT_DIFF  # "mismatch/train_rollout/logprob_abs_diff/mean"
ENTROPY = "policy/entropy/mean"
REWARD = "rollout/reward_mean"
EVAL_REWARD = "eval/reward_mean"
EVAL_BY_DIFFICULTY = "eval/reward/d"
RESPONSE_LENGTH = "rollout/response_length/mean"
ROLLOUT_LOGPROB = "rollout/logprob_mean"
GRAD_NORM = "policy/grad_norm"
STALENESS_MAX = "async/staleness/max"
STALENESS_MEAN = "async/staleness/mean"
DROPPED_FRAC = "async/dropped_stale_frac"
PG_CLIPFRAC = "policy/pg_clipfrac"
REPETITION = "rollout/repetition_rate"
ZERO_VARIANCE = "rollout/zero_variance_group_frac"
IS_SOURCES = ("combined", "engine", "staleness")
RATIO_MEAN_SOURCES = ("engine", "staleness")
EVAL_ONLY = "step/eval_only"
_NOT_METRICS = frozenset({"step", "time", "_nonfinite", EVAL_ONLY})

_DEFAULT_THRESHOLDS = Thresholds()


# --------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateResult:
    """The verdict of one gate on one run.

    value/threshold: the quantity the verdict rests on and the limit it was compared with (which
        side is good depends on the gate; the evidence says). ``None`` when there was no data.
    window: first and last step of the points ``value`` was computed over.
    evidence: one sentence with the numbers, for a report.
    params: the parameters the gate ran with (defaults filled in).
    """

    name: str
    passed: bool
    value: float | None
    threshold: float | None
    window: tuple[int, int] | None
    evidence: str
    params: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the window as a list, non-finite numbers as ``None``."""
        return {
            "name": self.name,
            "passed": self.passed,
            "value": _finite_or_none(self.value),
            "threshold": _finite_or_none(self.threshold),
            "window": list(self.window) if self.window is not None else None,
            "evidence": self.evidence,
            "params": dict(self.params),
        }


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


# --------------------------------------------------------------------------------------------
# Parameters: one frozen pydantic model per gate, named by the gate function's ``p`` annotation
# --------------------------------------------------------------------------------------------


def _not_null(value: Any) -> Any:
    if value is None:
        raise ValueError("must not be null")
    return value


def _finite(value: Any) -> float:
    num = _number(_not_null(value))
    if num is None:
        raise ValueError(f"must be a finite number, got {value!r} ({type(value).__name__})")
    return num


def _finite_or_null(value: Any) -> float | None:
    return None if value is None else _finite(value)


def _whole(value: Any) -> int:
    num = _finite(value)
    if not num.is_integer():
        raise ValueError(f"must be a whole number, got {value!r}")
    return int(num)


def _true_or_false(value: Any) -> bool:
    if not isinstance(_not_null(value), bool):
        raise ValueError(f"must be true or false, got {value!r} ({type(value).__name__})")
    return value


# Pydantic's lax mode would take "3", True or NaN for a number and 1 or "yes" for a bool. A gate
# takes a number only from a finite real number (ints and numpy scalars too; 3.0 for an int,
# never 3.5) and a bool only from true/false. Each validator's message is the clause
# check_params puts after "parameter '<name>'".
_Float = Annotated[float, BeforeValidator(_finite)]
_OptFloat = Annotated[float | None, BeforeValidator(_finite_or_null)]
_Int = Annotated[int, BeforeValidator(_whole)]
_OptInt = Annotated[int | None, BeforeValidator(lambda v: None if v is None else _whole(v))]
_RequireData = Annotated[bool, BeforeValidator(_true_or_false), Field(description=(
    "Fail (instead of pass) when the run has too little data to judge."))]


class GateContext(BaseModel):
    """Run facts the metrics do not carry, given to every gate (and recorded in the gate report,
    so ``asyncrl gates RUN`` re-judges with them). :meth:`of` reads them from the recipe.

    mode: the recipe's ``async.mode`` (information: no gate branches on it).
    max_staleness: the staleness bound the mode implies (``Recipe.async_.staleness_bound``: 0
        sync, 1 one_step, ``max_off_policy_steps`` or none for fully_async).
    max_off_policy_steps: set when too-stale samples are dropped (``staleness_within_bound``
        then judges the dropped fraction: the bound holds by construction).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: str | None = None
    max_staleness: _OptInt = Field(None, ge=0)
    max_off_policy_steps: _OptInt = Field(None, ge=0)

    @classmethod
    def of(cls, recipe: Recipe) -> GateContext:
        a = recipe.async_
        return cls(mode=a.mode, max_staleness=a.staleness_bound,
                   max_off_policy_steps=a.max_off_policy_steps)

    @classmethod
    def read(cls, data: GateContext | Mapping[str, Any] | None) -> GateContext:
        """A context as given (a recorded report's plain data included); ValueError (one line)
        for one that is not."""
        if isinstance(data, GateContext):
            return data
        try:
            return cls.model_validate(dict(data or {}))
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ValueError(f"gate context {where}: {err['msg'].lower()} (got "
                             f"{err.get('input')!r}); the runtime passes max_staleness 0 (sync), "
                             "1 (one_step) or max_off_policy_steps") from None


class GateParams(BaseModel):
    """A gate's parameters: one subclass per gate, frozen, unknown names refused. The gate
    function registered with :func:`_gate` names its subclass in its ``p`` annotation."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class LogprobDiffFlatParams(GateParams):
    """``logprob_diff_flat``: seed 000's headline metric, the train–rollout |Δ log p|
    (``mismatch/train_rollout/logprob_abs_diff/mean``: the trainer at the weights it trains from
    vs the rollout engine, so staleness *and* engine mismatch), must not grow.

    With a reference (the campaign's sync baseline: same engines, no staleness) the judgement is
    relative, the preferred form: fails when the level (mean of the last ``tail`` fraction of
    points) exceeds ``max_ratio`` × the reference's level, or when the run's fitted rise (least-
    squares slope × steps spanned) exceeds the reference's total fitted rise (its own slope × its
    own span, :func:`summarize`'s ``.../rise``; a reference that fell counts as 0: a run is not
    growing for falling less than its baseline did) by more than ``max_rise_ratio`` × the
    reference's level. Total rises, not slopes, are compared because a campaign stage's
    ``samples`` gives both runs the same data over different step counts (a ¼-batch candidate
    runs 4× the steps); a summary without ``.../rise`` (written before it existed) falls back
    to the reference's slope × this run's span. Without a reference, the absolute fallback:
    fails when the slope exceeds ``max_slope`` *and* the fitted rise exceeds ``min_rise``, or the
    level exceeds ``max_level``.

    max_ratio: 1.5 × the reference's level. Seed 000's uncorrected one-step run ended 4× its sync
        baseline (0.025 → 0.10); 1.5× fails it long before.
    max_rise_ratio: 0.5 — a run may rise by at most half the reference's level more than the
        reference rose itself (seed 000's sync baseline "stays flat"; its failing runs rose by
        3× that level).
    max_slope: 0.0005 per step, min_rise: 0.01, max_level: 0.05 — absolute fallbacks from seed
        000's stack (Megatron vs SGLang, MoE, 16k context): healthy sync ≈ 0.025, blow-up 0.10;
        0.05 is twice the healthy level, 0.0005/step doubles it within 50 steps, 0.01 is 40 % of
        it. Our embedded engines sit near 0.002 (bf16 KV cache) – 0.006 (fp8), FACTS.md, where
        these fire only on a gross blow-up: give the gate a ``relative_to`` sync baseline.
    tail: 0.25, the fraction of points (≥ 1) whose mean is the level.
    """

    max_slope: _Float = Field(0.0005, ge=0.0, description=(
        "Without a reference: the largest least-squares slope of |Δlogp| per step (fails only "
        "with a fitted rise above min_rise too)."))
    min_rise: _Float = Field(0.01, ge=0.0, description=(
        "Without a reference: the fitted rise over the run a slope above max_slope must also "
        "exceed."))
    max_level: _Float = Field(0.05, gt=0.0, description=(
        "Without a reference: the largest level (mean of the last `tail` of the points)."))
    max_ratio: _Float = Field(1.5, gt=0.0, description=(
        "With a reference: the largest level, as a multiple of the reference's level."))
    max_rise_ratio: _Float = Field(0.5, ge=0.0, description=(
        "With a reference: how far the run's fitted rise may exceed the reference's, as a "
        "multiple of the reference's level."))
    tail: _Float = Field(0.25, gt=0.0, le=1.0, description=(
        "Fraction of the points (at least one) whose mean is the level."))
    require_data: _RequireData = False


class EntropyNoBlowupParams(GateParams):
    """``entropy_no_blowup``: ``policy/entropy/mean`` must neither spike nor rise for good
    (seed 000: "a sudden upward spike" preceded every collapse, while mild drift either way is
    normal; its 64k failure was a blow-up that stayed up).

    Fails on a spike — a step above ``spike_factor`` × the median of the previous ``window``
    points — or on a sustained rise — the mean of the last ``tail`` fraction of points above
    ``sustained_factor`` × the mean of the first ``tail`` fraction, or, with a reference, above
    ``sustained_factor`` × the reference's level.

    spike_factor: 2.0 — a doubling within a few steps is a spike, not drift.
    window: 5 points; a step is checked once 5 earlier points exist.
    sustained_factor: 1.5 — "mild" drift stays well inside ±50 %; a last quarter 1.5× the first
        is a blow-up that did not come back down (ours: the seed gives no number).
    tail: 0.25 — first and last quarter.
    """

    spike_factor: _Float = Field(2.0, gt=1.0, description=(
        "A step above this multiple of the median of the previous `window` points is a spike."))
    window: _Int = Field(5, ge=1, description=(
        "Points in the median a step is compared with."))
    sustained_factor: _Float = Field(1.5, gt=1.0, description=(
        "The last `tail` of the points above this multiple of the first `tail` (or of the "
        "reference's level) is a sustained rise."))
    tail: _Float = Field(0.25, gt=0.0, le=0.5, description=(
        "Fraction of the points at each end compared for a sustained rise."))
    require_data: _RequireData = False


class RewardNotCollapsedParams(GateParams):
    """``reward_not_collapsed``: seed 001's collapse — the smoothed ``rollout/reward_mean`` ends
    ≥ ``drop`` below its peak (a drop that recovered before the end passes).

    drop: 0.3 (seed 001: "a ≥ 30 % reward drop that does not recover").
    smooth: 3 — trailing mean over 3 points before the peak and drop are taken.
    """

    drop: _Float = Field(0.3, gt=0.0, le=1.0, description=(
        "Fraction below its peak at which the smoothed reward ending there has collapsed."))
    smooth: _Int = Field(3, ge=1, description=(
        "Points in the trailing mean taken before the peak and the drop."))
    require_data: _RequireData = False


class EvalTracksRewardParams(GateParams):
    """``eval_tracks_reward``: no simplicity bias (seed 000: training reward up, eval down).

    Fails when the training reward rose by more than ``min_rise`` (mean of the last ``smooth``
    points minus mean of the first ``smooth``) while ``eval/reward_mean`` fell by more than
    ``max_eval_drop`` (first → last eval), or, with a reference, when the last eval is more than
    ``max_eval_drop`` below the reference's eval.

    min_rise: 0.0 — any rise of the training reward counts.
    max_eval_drop: 0.05 absolute reward.
    smooth: 3 points at each end of the training reward.
    """

    min_rise: _Float = Field(0.0, ge=0.0, description=(
        "Training-reward rise (last vs first `smooth` points) above which a falling eval is "
        "simplicity bias."))
    max_eval_drop: _Float = Field(0.05, ge=0.0, description=(
        "Largest fall of eval/reward_mean, first to last eval (or below the reference's eval), "
        "in reward."))
    smooth: _Int = Field(3, ge=1, description=(
        "Points averaged at each end of the training reward."))
    require_data: _RequireData = False


class IsHealthParams(GateParams):
    """``is_health``: the importance-sampling correction still works (seed 001 decision tree),
    judged per source — ``is/combined/*`` (the weight actually applied), ``is/engine/*`` (π_old/μ)
    and ``is/staleness/*`` (π_current/π_old), each logged whether or not it corrects anything —
    so the source that fails is named (seed 000: "diagnose which source was causing trouble
    without guessing").

    Means over the last ``tail`` fraction of points, for every source logged: ESS ≥ ``min_ess``,
    mask fraction ≤ ``max_mask_frac``; and χ²_token (``mismatch/train_rollout/chi2_token``, the
    whole drift a correction must cover, else ``mismatch/engine/chi2_token``) ≤
    ``max_chi2_token``. A verl export (``rollout_corr/*``) is read when none of ours is logged.

    min_ess: 0.5 — ``Thresholds.ess_min`` (seed 001: "ess < 0.5 → Cause D").
    max_mask_frac: 0.25 — ``Thresholds.rs_mask_high`` (seed 001: "RS would discard > 25 % of the
        batch" → systems fix; no algorithmic correction is cheaper beyond it).
    max_chi2_token: 1.0 — ``Thresholds.chi2_token_blowup`` (seed 001: "chi2_token > 1.0 → D").
    tail: 0.25.
    """

    min_ess: _Float = Field(_DEFAULT_THRESHOLDS.ess_min, ge=0.0, le=1.0, description=(
        "Smallest mean ESS over the last `tail` of the points, per IS source."))
    max_mask_frac: _Float = Field(_DEFAULT_THRESHOLDS.rs_mask_high, ge=0.0, le=1.0, description=(
        "Largest mean mask fraction over the last `tail` of the points, per IS source."))
    max_chi2_token: _Float = Field(_DEFAULT_THRESHOLDS.chi2_token_blowup, ge=0.0, description=(
        "Largest mean χ²_token over the last `tail` of the points."))
    tail: _Float = Field(0.25, gt=0.0, le=1.0, description=(
        "Fraction of the points (at least one) averaged."))
    require_data: _RequireData = False


class IsWeightMeanBandParams(GateParams):
    """``is_weight_mean_band``: seed 000's Fix-2 trigger. The per-step mean of each source's raw
    IS ratio (``is/engine/ratio/mean``: π_old/μ; ``is/staleness/ratio/mean``: π_current/π_old)
    "should sit at 1.0"; at 64k the engine one showed frequent sharp downward spikes to ≈ 0.992,
    tokens the trainer finds far less likely than the engine did, which led to two-sided IcePop
    bounds. Fails when either source leaves [1 − ``delta``, 1 + ``delta``] on more than
    ``max_steps`` steps (dips and spikes both count).

    The raw ratio, not ``is/<source>/weight_mean``: the weight is the correction method's output
    and counts a token a cap/IcePop method rejects as 0, so the Fix-2 candidate's own rejections
    would read as dips and fail it; the ratio is the same whatever method corrects the source.
    The ratios are measured on every recipe, corrected or not; under ``old_logprob`` bypass,
    loglinear or linear_prox π_old is μ, so the engine source is identically 1
    (:func:`unmet_requirement` refuses the gate there).

    delta: 0.005 — the seed's dips (0.992, 0.8 % below 1) leave the band with margin, while a
        mean that "mostly sits at 1.0" stays inside (ours: the seed gives the dip, not a band).
    max_steps: 1 — one step outside can be one odd batch; the seed acted because the spikes were
        "frequent enough to matter".
    """

    delta: _Float = Field(0.005, gt=0.0, le=1.0, description=(
        "Half-width of the band [1 − delta, 1 + delta] each source's IS ratio mean must stay in."))
    max_steps: _Int = Field(1, ge=0, description=(
        "Steps outside the band allowed per source."))
    require_data: _RequireData = False


class PgClipfracParams(GateParams):
    """``pg_clipfrac``: seed 001 cause E (PPO clip saturation) — ``policy/pg_clipfrac`` above
    ``max_level`` *and* rising: the mean of the last ``tail`` fraction of points above the mean
    of the first ``tail`` fraction ("rising clip fraction across epochs signals excessive
    divergence from the sampling policy").

    max_level: 0.2 — ``Thresholds.pg_clipfrac_max`` (seed 001: "pg_clipfrac > 0.2 and rising").
    tail: 0.25. (Seed 000 Fix 3: with 1 PPO epoch the clip "effectively never activates", so on
        such recipes this gate passes at ≈ 0.)
    """

    max_level: _Float = Field(_DEFAULT_THRESHOLDS.pg_clipfrac_max, ge=0.0, le=1.0, description=(
        "Largest mean pg_clipfrac over the last `tail` of the points while it is rising."))
    tail: _Float = Field(0.25, gt=0.0, le=0.5, description=(
        "Fraction of the points at each end compared."))
    require_data: _RequireData = False


class RepetitionRateParams(GateParams):
    """``repetition_rate``: seed 000's failure cascade "entropy blowup → repetition rate increase
    → test performance collapse". ``rollout/repetition_rate`` (the fraction of responses with a
    repeated 4-gram) over the last ``tail`` fraction of points must not exceed the reference's
    level (reference given) — else the run's own first ``tail`` fraction — by more than
    ``max_increase``; ``max_level``, when set, is an absolute ceiling as well.

    max_increase: 0.1 — one response in ten more than the baseline repeats itself (ours: the
        seed names the increase, not its size; a task whose answers repeat n-grams by design,
        like running totals, has a high but steady level, which the relative form tolerates).
    max_level: None (no absolute ceiling).
    tail: 0.25.
    """

    max_increase: _Float = Field(0.1, ge=0.0, le=1.0, description=(
        "Largest rise of the repetition rate above the reference's level (else the run's first "
        "`tail` of the points)."))
    max_level: _OptFloat = Field(None, ge=0.0, le=1.0, description=(
        "Absolute ceiling on the repetition rate; null for none."))
    tail: _Float = Field(0.25, gt=0.0, le=0.5, description=(
        "Fraction of the points at each end compared."))
    require_data: _RequireData = False


class ZeroVarianceGroupsParams(GateParams):
    """``zero_variance_groups``: seed 000 stage 3 — "roughly 60 out of 128" groups (47 %) had
    all-zero rewards, so "GRPO produces zero advantage and the prompt contributes nothing to the
    gradient. That's a lot of wasted rollout compute." ``rollout/zero_variance_group_frac``
    (groups whose scores are all equal, all-fail or all-pass) over the last ``tail`` fraction of
    points must stay ≤ ``max_frac``, or, with a reference, ≤ the reference's level +
    ``max_increase``.

    max_frac: 0.45 — just under the seed's 47 %, which it called a warning sign. The embedded
        sum-digits task sits at 53–70 % from the start (FACTS.md: 30–47 % of groups have any
        reward variance), so on it give the gate a ``relative_to`` baseline.
    max_increase: 0.1 — ten points of the batch more than the baseline wasted (ours).
    tail: 0.25.
    """

    max_frac: _Float = Field(0.45, ge=0.0, le=1.0, description=(
        "Without a reference: the largest zero-variance group fraction over the last `tail` of "
        "the points."))
    max_increase: _Float = Field(0.1, ge=0.0, le=1.0, description=(
        "With a reference: the largest rise above the reference's level."))
    tail: _Float = Field(0.25, gt=0.0, le=1.0, description=(
        "Fraction of the points (at least one) averaged."))
    require_data: _RequireData = False


class NoLengthSurgeParams(GateParams):
    """``no_length_surge``: seed 001 cause F — the smoothed ``rollout/response_length/mean`` must
    not rise by more than ``max_rise`` over its minimum within the preceding ``window`` steps
    (a run shorter than ``window`` is one window).

    max_rise: 0.2 (seed 001: "response length rises > 20 % in 100 steps").
    window: 100 steps (``Thresholds.length_window_steps``).
    smooth: 3 — trailing mean over 3 points, so one batch of long answers is not a surge; 1
        reproduces seed 001's raw ``len / len_100_steps_ago`` rule.
    """

    # Thresholds.length_surge_ratio − 1
    max_rise: _Float = Field(0.2, gt=0.0, description=(
        "Largest relative rise of the smoothed response length over its minimum within `window` "
        "steps."))
    window: _Int = Field(_DEFAULT_THRESHOLDS.length_window_steps, ge=1, description=(
        "Steps back the minimum is taken over."))
    smooth: _Int = Field(3, ge=1, description=(
        "Points in the trailing mean of the response length."))
    require_data: _RequireData = False


class RolloutLogprobNotDecreasingParams(GateParams):
    """``rollout_logprob_not_decreasing``: seed 000 — in failed runs the mean log-prob of the
    policy's own samples kept falling; in stable runs it slowly rose. Fails when the least-squares
    slope of ``rollout/logprob_mean`` is below −``max_decline`` *and* the fitted fall over the run
    exceeds ``min_drop``.

    max_decline: 0.001 nats/token per step (−0.1 over 100 steps).
    min_drop: 0.05 nats/token over the run (per-step noise of a small batch is ≈ 0.05).
    """

    max_decline: _Float = Field(0.001, ge=0.0, description=(
        "Largest fall per step of the least-squares slope of rollout/logprob_mean (fails only "
        "with a fitted fall above min_drop too)."))
    min_drop: _Float = Field(0.05, ge=0.0, description=(
        "Fitted fall over the run a slope below −max_decline must also exceed."))
    require_data: _RequireData = False


class GradNormNoSpikeParams(GateParams):
    """``grad_norm_no_spike``: seed 001's second collapse signature — ``policy/grad_norm`` above
    ``factor`` × the median of the previous ``window`` points, followed by reward degradation:
    the mean reward over the ``after`` steps after the spike is below the mean over the steps
    from ``window`` steps before the spike up to the spike's own step (whose rollouts were drawn
    before that update). A spike the reward shrugs off passes, noted in the evidence.

    factor: 10 (seed 001: "> 10× the rolling median").
    window: 5 points. A grad norm of exactly 0 (no update: every group had zero advantage, or the
        step was skipped) is no baseline and is left out of the median.
    after: 5 steps.
    """

    factor: _Float = Field(10.0, gt=1.0, description=(
        "A grad norm above this multiple of the median of the previous `window` points is a "
        "spike."))
    window: _Int = Field(5, ge=1, description=(
        "Points in the median (zeros left out); also the steps of reward before a spike."))
    after: _Int = Field(5, ge=1, description=(
        "Steps of reward after a spike compared with the reward before it."))
    require_data: _RequireData = False


class StalenessWithinBoundParams(GateParams):
    """``staleness_within_bound``: the largest ``async/staleness/max`` (policy versions between
    the weights that sampled a token and the weights trained on it) ≤ the bound; and, when drops
    are configured (``async.max_off_policy_steps``, seen as ``context.max_off_policy_steps``
    or the ``async/dropped_stale_frac`` metric the runtime logs then), the cumulative fraction of
    samples dropped as too stale ≤ ``max_dropped_frac``. With drops configured the bound check
    alone is tautological — the runtime drops every sample beyond it — so the dropped fraction is
    what says whether the pipeline keeps up — unless ``max_staleness`` is set explicitly: then
    the peak is checked against it as well (a tighter bound than the runtime's is a real check),
    and the gate fails on either.

    max_staleness: None — the bound comes from ``context.max_staleness`` (the runtime's: 0
        sync, 1 one-step, ``max_off_policy_steps`` fully async); a number here overrides it,
        and is checked even with drops configured. With neither, the bound check passes with
        "no bound configured".
    max_dropped_frac: 0.25 — seed 001's limit for discarding data: "RS would discard > 25 % of
        the batch" → fix the system instead (``Thresholds.rs_mask_high``); dropping stale samples
        discards rollout compute the same way.
    """

    max_staleness: _OptFloat = Field(None, ge=0.0, description=(
        "Bound on async/staleness/max; null takes the run's own bound from the context."))
    max_dropped_frac: _Float = Field(_DEFAULT_THRESHOLDS.rs_mask_high, ge=0.0, le=1.0, description=(
        "With drops configured: the largest cumulative fraction of samples dropped as too stale."))
    require_data: _RequireData = False


# --------------------------------------------------------------------------------------------
# Reading a history
# --------------------------------------------------------------------------------------------

Point = tuple[int, float]


def _number(v: Any) -> float | None:
    """A finite float, or None (None, bool, non-numbers, NaN/inf)."""
    if type(v) is float:  # the common case, first
        return v if math.isfinite(v) else None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy scalars are Real
        return None
    f = float(v)
    return f if math.isfinite(f) else None


class _Run:
    """A metric history split into training rows (by step, later row wins) and all rows."""

    def __init__(self, history: Sequence[Mapping[str, Any]]) -> None:
        self.rows: list[tuple[int, Mapping[str, Any]]] = []
        train: dict[int, Mapping[str, Any]] = {}
        for row in history:
            step = row.get("step")
            if isinstance(step, bool) or not isinstance(step, int | float) \
                    or not math.isfinite(step):
                continue
            self.rows.append((int(step), row))
            if not row.get(EVAL_ONLY):
                train[int(step)] = row
        self.train = sorted(train.items())
        self._cols: dict[str, list[Point]] | None = None

    def _columns(self) -> dict[str, list[Point]]:
        """Every metric's series, built in one pass over the rows on first use."""
        if self._cols is None:
            cols: dict[str, dict[int, float]] = {}
            for step, row in self.train:
                for key, raw in row.items():
                    if key.startswith("eval/") or key in _NOT_METRICS:
                        continue
                    v = _number(raw)
                    if v is not None:
                        cols.setdefault(key, {})[step] = v
            for step, row in self.rows:  # eval/* from every row; a later row wins its step
                for key, raw in row.items():
                    if key.startswith("eval/"):
                        v = _number(raw)
                        if v is not None:
                            cols.setdefault(key, {})[step] = v
            self._cols = {k: sorted(by_step.items()) for k, by_step in cols.items()}
        return self._cols

    def series(self, key: str) -> list[Point]:
        """Finite values of ``key`` in step order (``eval/*`` from every row)."""
        return self._columns().get(key, [])

    def first_series(self, keys: Sequence[str]) -> tuple[str, list[Point]]:
        """The series of the first key that has any value (``(keys[0], [])`` if none)."""
        for key in keys:
            pts = self.series(key)
            if pts:
                return key, pts
        return keys[0], []

    def metric_keys(self) -> list[str]:
        """Keys with at least one finite value."""
        return list(self._columns())


def _tail(pts: Sequence[Point], frac: float) -> list[Point]:
    k = max(1, math.ceil(frac * len(pts) - 1e-9))
    return list(pts[-k:])


def _mean(pts: Sequence[Point]) -> float:
    return sum(v for _, v in pts) / len(pts)


def _span(pts: Sequence[Point]) -> tuple[int, int]:
    return pts[0][0], pts[-1][0]


def _slope(pts: Sequence[Point]) -> float:
    """Least-squares slope of value on step: Σ(x−x̄)(y−ȳ) / Σ(x−x̄)²; 0 for a single step."""
    n = len(pts)
    xbar = sum(s for s, _ in pts) / n
    ybar = sum(v for _, v in pts) / n
    sxx = sum((s - xbar) ** 2 for s, _ in pts)
    if sxx == 0:
        return 0.0
    return sum((s - xbar) * (v - ybar) for s, v in pts) / sxx


def _smooth(pts: Sequence[Point], k: int) -> list[Point]:
    """Trailing mean over ``k`` points, from the first full window on; step = the last point's."""
    out = []
    total = 0.0
    for i, (step, v) in enumerate(pts):
        total += v
        if i >= k:
            total -= pts[i - k][1]
        if i >= k - 1:
            out.append((step, total / k))
    return out


def _g(x: float | None) -> str:
    """A number for a sentence: 4 significant digits, no exponent for ordinary magnitudes."""
    if x is None:
        return "n/a"
    if x == 0:
        return "0"
    if 1e-4 <= abs(x) < 1e6:
        return f"{x:.4g}"
    return f"{x:.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if abs(100 * x) >= 10 else f"{100 * x:.1f}%"


def _points(n: int) -> str:
    return f"{n} point" if n == 1 else f"{n} points"


def _steps(window: tuple[int, int]) -> str:
    a, b = window
    return f"step {a}" if a == b else f"steps {a}–{b}"


# --------------------------------------------------------------------------------------------
# Registry plumbing
# --------------------------------------------------------------------------------------------

#: A gate: (run, its GateParams model, reference summary or None, GateContext) → GateResult.
GateFn = Callable[..., GateResult]

GATES: Registry[GateFn] = Registry("stability gate")


@cache
def _params_of(fn: GateFn) -> type[GateParams]:
    """The model a gate function's ``p`` argument is annotated with."""
    model = get_type_hints(fn).get("p")
    assert isinstance(model, type) and issubclass(model, GateParams), (
        f"gate function {fn.__qualname__} must annotate its argument p with its GateParams "
        f"subclass, got {model!r}")
    return model


def _gate(name: str) -> Callable[[GateFn], GateFn]:
    """Register a gate function under ``name``. Its parameters model is its ``p`` annotation,
    the one place the name → model link is declared (checked here, at import)."""

    def decorator(fn: GateFn) -> GateFn:
        _params_of(fn)
        return GATES.register(name)(fn)

    return decorator


def _result(name: str, p: GateParams, passed: bool, value: float | None,
            threshold: float | None, window: tuple[int, int] | None,
            evidence: str) -> GateResult:
    return GateResult(name=name, passed=passed, value=value, threshold=threshold,
                      window=window, evidence=evidence, params=p.model_dump())


def _not_enough(name: str, p: Any, n: int, what: str, need: int) -> GateResult:
    verdict = (" — require_data is set, so the gate fails" if p.require_data
               else "; passing by default (set require_data: true to fail instead)")
    return _result(name, p, not p.require_data, None, None, None,
                   f"not enough steps ({n}) with {what} to judge (need ≥ {need}){verdict}.")


def gate_names() -> list[str]:
    """Every registered gate, sorted."""
    return GATES.names()


def params_model(name: str) -> type[GateParams]:
    """Gate ``name``'s parameters model (a ``KeyError`` listing the valid gates if unknown)."""
    return _params_of(GATES.get(name))


def gate_params(name: str) -> dict[str, Any]:
    """A gate's parameters with their defaults (its params model documents each)."""
    return params_model(name)().model_dump()


_BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})
_BOUND_SIGNS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}


def _bounds(model: type[GateParams], key: str) -> str:
    """A field's bounds as a person reads them: ``"> 0 and ≤ 1"``."""
    return " and ".join(f"{sign} {getattr(m, attr):g}" for m in model.model_fields[key].metadata
                        for attr, sign in _BOUND_SIGNS.items() if hasattr(m, attr))


def _problem(gate: str, model: type[GateParams], given: Mapping[Any, Any],
             error: Mapping[str, Any]) -> str:
    """One pydantic error on one parameter as a sentence naming the gate, the parameter and the
    fix (the valid names for an unknown one; the bounds and the default for a bad value)."""
    key = error["loc"][0]
    names = list(model.model_fields)
    if key not in model.model_fields:  # extra_forbidden, or invalid_key for a non-string key
        close = difflib.get_close_matches(str(key), names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return (f"gate {gate!r} has no parameter {key!r}; {hint}valid parameters: "
                f"{', '.join(names)}. Fix: remove {key!r} or rename it to one of those "
                "(a gate's reference stage is the spec's relative_to, not a parameter).")
    if error["type"] == "value_error":  # the field type's own validator: the clause is its text
        clause = str(error["ctx"]["error"])
    elif error["type"] in _BOUND_ERRORS:
        clause = f"must be {_bounds(model, key)}, got {given[key]!r}"
    else:
        clause = f"is invalid ({error['msg']}), got {given[key]!r}"
    default = model.model_fields[key].default
    return (f"gate {gate!r}: parameter {key!r} {clause}; set {key} to a valid value or leave "
            f"it out (default {default!r})")


def _validated(name: str, params: Mapping[str, Any] | None) -> GateParams:
    """``params`` as gate ``name``'s model, defaults filled in; errors as :func:`check_params`.
    The first bad parameter (in the order given) is the message; any others are named after it."""
    model = params_model(name)
    given = dict(params or {})
    try:
        return model.model_validate(given)
    except ValidationError as err:
        order = {key: i for i, key in enumerate(given)}
        errors = sorted(err.errors(), key=lambda e: order.get(e["loc"][0], len(order)))
        first = errors[0]["loc"][0]
        others = [k for k in dict.fromkeys(e["loc"][0] for e in errors) if k != first]
        more = f" (+{len(others)} more: {', '.join(map(repr, others))})" if others else ""
        raise ValueError(_problem(name, model, given, errors[0]) + more) from None


def check_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a gate's parameters; return them complete (defaults filled in).

    Raises:
        KeyError: unknown gate (the message lists the valid gates).
        ValueError: unknown parameter (with its valid names and the closest match) or a value of
            the wrong type or out of bounds (with the bounds and the default), one line.
    """
    return _validated(name, params).model_dump()


def evaluate_gate(name: str, history: Sequence[Mapping[str, Any]],
                  params: Mapping[str, Any] | None = None, *,
                  reference: Mapping[str, float] | None = None,
                  context: GateContext | Mapping[str, Any] | None = None) -> GateResult:
    """Run one gate on a metric history (records as ``read_metrics`` returns them).

    Args:
        name: a name from :func:`gate_names`.
        history: per-step dicts with ``"step"`` and metric keys (values float or None).
        params: overrides of the gate's defaults (validated by :func:`check_params`).
        reference: :func:`summarize` of the reference run, or None for absolute thresholds.
        context: run facts the metrics lack (:class:`GateContext`, or its plain data, e.g.
            ``{"max_staleness": 1}``).
    """
    return _evaluate(name, _Run(history), _validated(name, params), reference, context)


def evaluate_gates(specs: Sequence[tuple[str, Mapping[str, Any]]],
                   history: Sequence[Mapping[str, Any]], *,
                   reference: Mapping[str, float] | None = None,
                   context: GateContext | Mapping[str, Any] | None = None
                   ) -> list[GateResult]:
    """Run several ``(name, params)`` gates on one history; every spec is validated before any
    gate runs, so a typo fails the whole call instead of a half-written report."""
    checked = [(name, _validated(name, params)) for name, params in specs]
    run = _Run(history)
    return [_evaluate(name, run, p, reference, context) for name, p in checked]


def _evaluate(name: str, run: _Run, p: GateParams, reference: Mapping[str, float] | None,
              context: GateContext | Mapping[str, Any] | None) -> GateResult:
    return GATES.get(name)(run, p, reference, GateContext.read(context))


def _ref_value(reference: Mapping[str, float] | None, key: str) -> float | None:
    return None if reference is None else _number(reference.get(key))


# --------------------------------------------------------------------------------------------
# The gates
# --------------------------------------------------------------------------------------------


@_gate("logprob_diff_flat")
def _logprob_diff_flat(run: _Run, p: LogprobDiffFlatParams,
                       reference: Mapping[str, float] | None,
                       context: GateContext) -> GateResult:
    name = "logprob_diff_flat"
    pts = run.series(LOGPROB_DIFF)
    if len(pts) < 3:
        return _not_enough(name, p, len(pts), LOGPROB_DIFF, 3)
    head, tail = pts[:len(_tail(pts, p.tail))], _tail(pts, p.tail)
    first, level = _mean(head), _mean(tail)
    slope = _slope(pts)
    whole = _span(pts)
    span = whole[1] - whole[0]
    rise = slope * span
    moved = (f"it went from {_g(first)} (first {_points(len(head))}) to {_g(level)} (last "
             f"{_points(len(tail))}) over {_steps(whole)}, slope {_g(slope)}/step")
    ref = _ref_value(reference, LOGPROB_DIFF)
    if ref is not None and ref > 0:
        # Relative judgement: the campaign's own baseline sets "normal" (seed 000: "You can't
        # pick good clip bounds if you don't know what normal looks like").
        # Total fitted rises are compared: under Stage.samples both runs saw the same samples
        # but a ¼-batch candidate spans 4× the steps, so the reference's slope × the
        # candidate's span would stretch the reference's rise 4×. Summaries written before
        # the rise key existed fall back to that slope × span.
        ref_rise = _ref_value(reference, f"{LOGPROB_DIFF}/rise")
        if ref_rise is not None:
            ref_basis = "over its whole run"
        else:
            ref_rise = (_ref_value(reference, f"{LOGPROB_DIFF}/slope") or 0.0) * span
            ref_basis = f"its slope over the same {span} steps"
        # a falling reference allows no fall-or-less: "must not grow" is judged against the
        # reference's rise only when it rose (a flat run beside a sharpening baseline whose
        # |Δlogp| fell is not growing)
        excess, rise_limit = rise - max(ref_rise, 0.0), p.max_rise_ratio * ref
        limit = p.max_ratio * ref
        growing = excess > rise_limit
        too_high = level > limit
        floor = "" if ref_rise >= 0 else ", a fall: counted as 0"
        detail = (f"fitted rise {_g(rise)} over {span} steps vs the reference's {_g(ref_rise)} "
                  f"({ref_basis}{floor}): excess {_g(excess)} {'>' if growing else '≤'} "
                  f"{_g(rise_limit)} "
                  f"({_g(p.max_rise_ratio)} × the reference level {_g(ref)}); level {_g(level)} "
                  f"{'>' if too_high else '≤'} {_g(limit)} ({_g(p.max_ratio)} × the reference "
                  f"level {_g(ref)})")
        grow_value, grow_limit = excess, rise_limit
    else:
        growing = slope > p.max_slope and rise > p.min_rise
        limit = p.max_level
        too_high = level > limit
        basis = "absolute max_level, the seed's stack" + (
            "; the reference has no positive level" if reference is not None else "")
        detail = (f"{'>' if slope > p.max_slope else '≤'} {_g(p.max_slope)} with fitted rise "
                  f"{_g(rise)} {'>' if rise > p.min_rise else '≤'} {_g(p.min_rise)}, level "
                  f"{_g(level)} {'>' if too_high else '≤'} {_g(limit)} ({basis})")
        grow_value, grow_limit = slope, p.max_slope
    if growing:
        value, threshold, window, verdict = grow_value, grow_limit, whole, "is growing"
    elif too_high:
        value, threshold, window, verdict = level, limit, _span(tail), "is too high"
    else:
        value, threshold, window, verdict = grow_value, grow_limit, whole, "stayed flat"
    sep = " " if ref is None or ref <= 0 else "; "
    evidence = f"train–rollout mean |Δlogp| {verdict}: {moved}{sep}{detail}."
    return _result(name, p, not (growing or too_high), value, threshold, window, evidence)


def _quarters(pts: Sequence[Point], frac: float) -> tuple[list[Point], list[Point]]:
    """The first and the last ``frac`` of the points (≥ 1 each)."""
    k = len(_tail(pts, frac))
    return list(pts[:k]), list(pts[-k:])


@_gate("entropy_no_blowup")
def _entropy_no_blowup(run: _Run, p: EntropyNoBlowupParams,
                       reference: Mapping[str, float] | None,
                       context: GateContext) -> GateResult:
    name = "entropy_no_blowup"
    pts = run.series(ENTROPY)
    if len(pts) < p.window + 1:
        return _not_enough(name, p, len(pts), ENTROPY, p.window + 1)
    worst: tuple[float, int, float, float] | None = None  # ratio, step, value, median
    spikes = 0
    for i in range(p.window, len(pts)):
        med = statistics.median(v for _, v in pts[i - p.window:i])
        if med <= 0:  # no ratio to a zero-entropy baseline
            continue
        step, v = pts[i]
        ratio = v / med
        spikes += ratio > p.spike_factor
        if worst is None or ratio > worst[0]:
            worst = (ratio, step, v, med)
    whole = _span(pts)
    head, tail = _quarters(pts, p.tail)
    level = _mean(tail)
    ref = _ref_value(reference, ENTROPY)
    base, base_label = ((ref, "the reference level") if ref is not None and ref > 0
                        else (_mean(head), f"the first {_points(len(head))}"))
    sustained_ratio = level / base if base > 0 else None
    sustained = sustained_ratio is not None and sustained_ratio > p.sustained_factor
    sustained_text = (
        f"the last {_points(len(tail))} average {_g(level)} = "
        f"{sustained_ratio:.2f}× {base_label} {_g(base)} "
        f"({'>' if sustained else '≤'} {_g(p.sustained_factor)}×)"
        if sustained_ratio is not None else f"{base_label} is 0, so no sustained ratio")
    if spikes:
        ratio, step, v, med = worst  # type: ignore[misc]
        evidence = (f"{ENTROPY} spiked at {spikes} step(s); the worst, step {step}, reached "
                    f"{_g(v)} = {ratio:.2f}× the median {_g(med)} of the previous {p.window} "
                    f"points (> {_g(p.spike_factor)}×); {sustained_text}.")
        return _result(name, p, False, ratio, p.spike_factor, whole, evidence)
    spike_text = (f"the largest jump was {worst[0]:.2f}× the median of the previous {p.window} "
                  f"points (step {worst[1]}: {_g(worst[2])} vs {_g(worst[3])}) ≤ "
                  f"{_g(p.spike_factor)}×" if worst is not None else
                  f"{ENTROPY} had a median of 0 before every step, so no spike ratio")
    if sustained:
        evidence = (f"sustained entropy rise over {_steps(whole)}: {sustained_text}; no one-step "
                    f"spike: {spike_text}.")
        return _result(name, p, False, sustained_ratio, p.sustained_factor, _span(tail),
                       evidence)
    evidence = f"no entropy spike over {_steps(whole)}: {spike_text}; no sustained rise: " \
               f"{sustained_text}."
    return _result(name, p, True, worst[0] if worst is not None else None, p.spike_factor,
                   whole, evidence)


@_gate("reward_not_collapsed")
def _reward_not_collapsed(run: _Run, p: RewardNotCollapsedParams,
                          reference: Mapping[str, float] | None,
                          context: GateContext) -> GateResult:
    name = "reward_not_collapsed"
    pts = run.series(REWARD)
    if len(pts) < p.smooth + 1:
        return _not_enough(name, p, len(pts), REWARD, p.smooth + 1)
    s = _smooth(pts, p.smooth)
    whole = _span(pts)
    peak_step, peak = s[0]
    worst = (0.0, s[0][0], s[0][1], peak_step, peak)  # drawdown, step, value, its peak step, peak
    for step, v in s:
        if v > peak:
            peak_step, peak = step, v
        if peak != 0:
            dd = (peak - v) / abs(peak)
            if dd > worst[0]:
                worst = (dd, step, v, peak_step, peak)
    last_step, last = s[-1]
    label = f"smoothed {REWARD} (trailing mean of {p.smooth})"
    if peak == 0:
        return _result(name, p, True, None, p.drop, whole,
                       f"{label} peaked at 0, so a relative drop is undefined; it ends at "
                       f"{_g(last)} (step {last_step}).")
    final_drop = (peak - last) / abs(peak)
    collapsed = final_drop >= p.drop
    if collapsed:
        evidence = (f"reward collapsed: {label} peaked at {_g(peak)} (step {peak_step}) and ends "
                    f"at {_g(last)} (step {last_step}), a {_pct(final_drop)} drop ≥ "
                    f"{_pct(p.drop)} that has not recovered.")
    elif worst[0] >= p.drop:
        dd, dd_step, dd_v, dd_peak_step, dd_peak = worst
        evidence = (f"reward recovered: {label} fell {_pct(dd)} from {_g(dd_peak)} (step "
                    f"{dd_peak_step}) to {_g(dd_v)} (step {dd_step}) but ends at {_g(last)} "
                    f"(step {last_step}), {_pct(final_drop)} below its peak {_g(peak)} "
                    f"(< {_pct(p.drop)}).")
    else:
        evidence = (f"no reward collapse: {label} never fell more than {_pct(worst[0])} below "
                    f"its running peak (< {_pct(p.drop)}) over {_steps(whole)}; it ends at "
                    f"{_g(last)}, {_pct(final_drop)} below the peak {_g(peak)}.")
    return _result(name, p, not collapsed, final_drop, p.drop, (peak_step, last_step), evidence)


def _difficulty_note(run: _Run) -> str:
    """The difficulty bucket whose eval fell most (first → last), as a clause, or ''."""
    worst: tuple[float, str, float, float] | None = None
    for key in run.metric_keys():
        if key.startswith(EVAL_BY_DIFFICULTY) and key[len(EVAL_BY_DIFFICULTY):].isdigit():
            pts = run.series(key)
            if len(pts) >= 2:
                fall = pts[0][1] - pts[-1][1]
                if worst is None or fall > worst[0]:
                    worst = (fall, key.rsplit("/", 1)[1], pts[0][1], pts[-1][1])
    if worst is None or worst[0] <= 0:
        return ""
    return f"; the largest fall by difficulty is {worst[1]}: {_g(worst[2])} → {_g(worst[3])}"


@_gate("eval_tracks_reward")
def _eval_tracks_reward(run: _Run, p: EvalTracksRewardParams,
                        reference: Mapping[str, float] | None,
                        context: GateContext) -> GateResult:
    name = "eval_tracks_reward"
    ev = run.series(EVAL_REWARD)
    if not ev:
        return _result(name, p, not p.require_data, None, p.max_eval_drop, None,
                       f"no eval data: {EVAL_REWARD} was never logged, so simplicity bias "
                       "cannot be checked" + (" — require_data is set, so the gate fails."
                                              if p.require_data else "; passing by default."))
    rw = run.series(REWARD)
    ref = _ref_value(reference, EVAL_REWARD)
    trend = len(ev) >= 2 and len(rw) >= 2
    if not trend and ref is None:
        return _not_enough(name, p, len(ev), f"{EVAL_REWARD} (and {REWARD})", 2)
    e_first, e_last = ev[0][1], ev[-1][1]
    e_drop = e_first - e_last
    clauses = []
    diverged = below_ref = False
    if trend:
        k = min(p.smooth, max(1, len(rw) // 2))
        r_first, r_last = _mean(rw[:k]), _mean(rw[-k:])
        rise = r_last - r_first
        diverged = rise > p.min_rise and e_drop > p.max_eval_drop
        clauses.append(
            f"training reward went {_g(r_first)} → {_g(r_last)} (mean of {_points(k)} at each "
            f"end, change {rise:+.4g} {'>' if rise > p.min_rise else '≤'} {_g(p.min_rise)}) "
            f"while {EVAL_REWARD} went {_g(e_first)} → {_g(e_last)} (fall {_g(e_drop)} "
            f"{'>' if e_drop > p.max_eval_drop else '≤'} {_g(p.max_eval_drop)})")
    ref_drop = None
    if ref is not None:
        ref_drop = ref - e_last
        below_ref = ref_drop > p.max_eval_drop
        clauses.append(f"last eval {_g(e_last)} is {_g(ref_drop)} below the reference eval "
                       f"{_g(ref)} ({'>' if below_ref else '≤'} {_g(p.max_eval_drop)})")
    if diverged:
        verdict, value = "simplicity bias: ", e_drop
    elif below_ref:
        verdict, value = "eval fell below the reference: ", ref_drop
    else:
        verdict, value = "eval tracks reward: ", e_drop if trend else ref_drop
    evidence = verdict + "; ".join(clauses) + _difficulty_note(run) + "."
    return _result(name, p, not (diverged or below_ref), value, p.max_eval_drop, _span(ev),
                   evidence)


def _tail_means(run: _Run, keys: Sequence[str], frac: float) -> dict[str, float]:
    out = {}
    for key in keys:
        pts = run.series(key)
        if pts:
            out[key] = _mean(_tail(pts, frac))
    return out


_VERL_IS = {"ess": "rollout_corr/rollout_is_eff_sample_size",
            "mask_frac": "rollout_corr/rollout_rs_masked_fraction"}
_CHI2_KEYS = ("mismatch/train_rollout/chi2_token", "mismatch/engine/chi2_token",
              "rollout_corr/chi2_token")


@_gate("is_health")
def _is_health(run: _Run, p: IsHealthParams, reference: Mapping[str, float] | None,
               context: GateContext) -> GateResult:
    name = "is_health"
    # (source, key, label, limit, at least (≥) or at most (≤))
    wanted: list[tuple[str, str, str, float, bool]] = []
    for src in IS_SOURCES:
        wanted.append((src, f"is/{src}/ess", "ESS", p.min_ess, True))
        wanted.append((src, f"is/{src}/mask_frac", "mask fraction", p.max_mask_frac, False))
    if not any(run.series(k) for _, k, *_ in wanted):  # a verl export
        wanted = [("verl", _VERL_IS["ess"], "ESS", p.min_ess, True),
                  ("verl", _VERL_IS["mask_frac"], "mask fraction", p.max_mask_frac, False)]
    chi2_key, _ = run.first_series(_CHI2_KEYS)
    wanted.append(("drift", chi2_key, "χ²_token", p.max_chi2_token, False))
    measured = []  # source, key, label, value, limit, at_least, window
    for src, key, label, limit, at_least in wanted:
        pts = run.series(key)
        if pts:
            tail = _tail(pts, p.tail)
            measured.append((src, key, label, _mean(tail), limit, at_least, _span(tail)))
    if not measured:
        keys = [f"is/{s}/{q}" for s in IS_SOURCES for q in ("ess", "mask_frac")]
        keys += list(_VERL_IS.values()) + list(_CHI2_KEYS)
        return _result(name, p, not p.require_data, None, None, None,
                       f"no IS metrics: none of {', '.join(keys)} was logged"
                       + (" — require_data is set, so the gate fails."
                          if p.require_data else "; passing by default."))
    failed = [m for m in measured if (m[3] < m[4] if m[5] else m[3] > m[4])]
    _, key, _, value, limit, _, window = (failed or measured)[0]
    by_source: dict[str, list[str]] = {}
    for src, k, label, v, lim, at_least, _ in measured:
        ok = v >= lim if at_least else v <= lim
        op = (("≥" if ok else "<") if at_least else ("≤" if ok else ">"))
        by_source.setdefault(src, []).append(f"{label} {_g(v)} {op} {_g(lim)} ({k})")
    rung = _diagnose_run(run).escalation
    bad = sorted({m[0] for m in failed}, key=lambda x: (x not in IS_SOURCES, x))
    evidence = ((f"IS correction is failing ({', '.join(bad)})" if failed
                 else "IS correction is healthy")
                + f" over the last {_pct(p.tail)} of points: "
                + "; ".join(f"{src}: " + ", ".join(parts) for src, parts in by_source.items())
                + (f"; seed 001's escalation rung: {rung}" if rung else "") + ".")
    return _result(name, p, not failed, value, limit, window, evidence)


@_gate("is_weight_mean_band")
def _is_weight_mean_band(run: _Run, p: IsWeightMeanBandParams,
                         reference: Mapping[str, float] | None,
                         context: GateContext) -> GateResult:
    name = "is_weight_mean_band"
    lo, hi = 1.0 - p.delta, 1.0 + p.delta
    found = []  # source, key, points, points outside the band
    for src in RATIO_MEAN_SOURCES:
        key = f"is/{src}/ratio/mean"
        pts = run.series(key)
        if pts:
            found.append((src, key, pts, [(s, v) for s, v in pts if not lo <= v <= hi]))
    if not found:
        keys = " or ".join(f"is/{s}/ratio/mean" for s in RATIO_MEAN_SOURCES)
        return _not_enough(name, p, 0, keys, 1)
    parts = []
    worst: tuple[int, float, str, list[Point]] | None = None  # outside count, |dev|, src, pts
    for src, key, pts, out in found:
        if out:
            s_far, v_far = max(out, key=lambda sv: abs(sv[1] - 1.0))
            parts.append(f"{key} left [{_g(lo)}, {_g(hi)}] on {len(out)} of {len(pts)} steps "
                         f"(the farthest {_g(v_far)} at step {s_far}; "
                         f"{'>' if len(out) > p.max_steps else '≤'} {p.max_steps} allowed)")
        else:
            parts.append(f"{key} stayed in [{_g(lo)}, {_g(hi)}] on all {len(pts)} steps "
                         f"(range {_g(min(v for _, v in pts))}–{_g(max(v for _, v in pts))})")
        dev = max((abs(v - 1.0) for _, v in out), default=0.0)
        if worst is None or (len(out), dev) > (worst[0], worst[1]):
            worst = (len(out), dev, src, pts)
    assert worst is not None
    failed = [f for f in found if len(f[3]) > p.max_steps]
    n_out, _, src, pts = worst
    verdict = (f"IS ratio mean left its band ({', '.join(f[0] for f in failed)}; seed 000's "
               "Fix-2 trigger → two-sided bounds)" if failed else "IS ratio means stayed at 1")
    return _result(name, p, not failed, float(n_out), float(p.max_steps), _span(pts),
                   f"{verdict}: " + "; ".join(parts) + ".")


@_gate("pg_clipfrac")
def _pg_clipfrac(run: _Run, p: PgClipfracParams, reference: Mapping[str, float] | None,
                 context: GateContext) -> GateResult:
    name = "pg_clipfrac"
    key, pts = run.first_series(METRIC_ALIASES["pg_clipfrac"])
    if len(pts) < 2:
        return _not_enough(name, p, len(pts), key, 2)
    head, tail = _quarters(pts, p.tail)
    first, level = _mean(head), _mean(tail)
    high, rising = level > p.max_level, level > first
    saturated = high and rising
    evidence = (f"{'PPO clip saturation (seed 001 cause E)' if saturated else 'no clip saturation'}"
                f": {key} averaged {_g(level)} over the last {_points(len(tail))} "
                f"({'>' if high else '≤'} {_g(p.max_level)}), "
                f"{'up' if rising else 'not up'} from {_g(first)} over the first "
                f"{_points(len(head))}, {_steps(_span(pts))}.")
    return _result(name, p, not saturated, level, p.max_level, _span(tail), evidence)


@_gate("repetition_rate")
def _repetition_rate(run: _Run, p: RepetitionRateParams, reference: Mapping[str, float] | None,
                     context: GateContext) -> GateResult:
    name = "repetition_rate"
    pts = run.series(REPETITION)
    ref = _ref_value(reference, REPETITION)
    if len(pts) < (1 if ref is not None else 2):
        return _not_enough(name, p, len(pts), REPETITION, 1 if ref is not None else 2)
    head, tail = _quarters(pts, p.tail)
    level = _mean(tail)
    base, base_label = ((ref, "the reference level") if ref is not None
                        else (_mean(head), f"the run's first {_points(len(head))}"))
    limit = base + p.max_increase
    rose = level > limit
    over = p.max_level is not None and level > p.max_level
    clauses = [f"{REPETITION} averaged {_g(level)} over the last {_points(len(tail))}, "
               f"{level - base:+.4g} vs {base_label} {_g(base)} "
               f"({'>' if rose else '≤'} +{_g(p.max_increase)})"]
    if p.max_level is not None:
        clauses.append(f"{'>' if over else '≤'} the ceiling {_g(p.max_level)}")
    verdict = "repetition rose" if rose or over else "no repetition rise"
    threshold = p.max_level if over and not rose else limit
    return _result(name, p, not (rose or over), level, threshold, _span(tail),
                   f"{verdict}: " + ", ".join(clauses) + ".")


@_gate("zero_variance_groups")
def _zero_variance_groups(run: _Run, p: ZeroVarianceGroupsParams,
                          reference: Mapping[str, float] | None,
                          context: GateContext) -> GateResult:
    name = "zero_variance_groups"
    pts = run.series(ZERO_VARIANCE)
    if not pts:
        return _not_enough(name, p, 0, ZERO_VARIANCE, 1)
    tail = _tail(pts, p.tail)
    level = _mean(tail)
    ref = _ref_value(reference, ZERO_VARIANCE)
    if ref is not None:
        limit, basis = ref + p.max_increase, (f"the reference level {_g(ref)} + "
                                              f"{_g(p.max_increase)}")
    else:
        limit, basis = p.max_frac, "max_frac, seed 000's ~60 of 128 groups"
    wasted = level > limit
    evidence = (f"{'too many' if wasted else 'acceptable'} zero-variance groups: "
                f"{ZERO_VARIANCE} averaged {_g(level)} over the last {_points(len(tail))} "
                f"({_pct(level)} of groups carry no gradient) {'>' if wasted else '≤'} "
                f"{_g(limit)} ({basis}).")
    return _result(name, p, not wasted, level, limit, _span(tail), evidence)


@_gate("no_length_surge")
def _no_length_surge(run: _Run, p: NoLengthSurgeParams,
                     reference: Mapping[str, float] | None,
                     context: GateContext) -> GateResult:
    name = "no_length_surge"
    pts = run.series(RESPONSE_LENGTH)
    if len(pts) < p.smooth + 1:
        return _not_enough(name, p, len(pts), RESPONSE_LENGTH, p.smooth + 1)
    s = _smooth(pts, p.smooth)
    # Sliding minimum over the previous `window` steps (monotone deque of indices).
    lows: deque[int] = deque()
    best: tuple[float, int, int] | None = None  # rise, index of the low, index of the high
    for j in range(len(s)):
        while lows and s[j][0] - s[lows[0]][0] > p.window:
            lows.popleft()
        if lows:
            i = lows[0]
            rise = s[j][1] / s[i][1] - 1.0
            if best is None or rise > best[0]:
                best = (rise, i, j)
        if s[j][1] > 0:
            while lows and s[lows[-1]][1] >= s[j][1]:
                lows.pop()
            lows.append(j)
    whole = _span(pts)
    label = f"smoothed {RESPONSE_LENGTH} (trailing mean of {p.smooth})"
    if best is None:
        return _result(name, p, True, None, p.max_rise, whole,
                       f"{label} had no positive baseline within {p.window} steps over "
                       f"{_steps(whole)}.")
    rise, i, j = best
    surged = rise > p.max_rise
    evidence = (f"{'response length surged' if surged else 'no response-length surge'}: "
                f"{label} rose at most {_pct(rise)}, from {_g(s[i][1])} (step {s[i][0]}) to "
                f"{_g(s[j][1])} (step {s[j][0]}), within a {p.window}-step window "
                f"({'>' if surged else '≤'} {_pct(p.max_rise)}).")
    return _result(name, p, not surged, rise, p.max_rise, (s[i][0], s[j][0]), evidence)


@_gate("rollout_logprob_not_decreasing")
def _rollout_logprob_not_decreasing(run: _Run, p: RolloutLogprobNotDecreasingParams,
                                    reference: Mapping[str, float] | None,
                                    context: GateContext) -> GateResult:
    name = "rollout_logprob_not_decreasing"
    pts = run.series(ROLLOUT_LOGPROB)
    if len(pts) < 3:
        return _not_enough(name, p, len(pts), ROLLOUT_LOGPROB, 3)
    slope = _slope(pts)
    whole = _span(pts)
    fall = -slope * (whole[1] - whole[0])
    declining = slope < -p.max_decline and fall > p.min_drop
    k = len(_tail(pts, 0.25))
    evidence = (f"{ROLLOUT_LOGPROB} {'is declining' if declining else 'is not declining'}: "
                f"it went from {_g(_mean(pts[:k]))} (first {_points(k)}) to "
                f"{_g(_mean(pts[-k:]))} (last {_points(k)}) over {_steps(whole)}, "
                f"slope {_g(slope)}/step "
                f"{'<' if slope < -p.max_decline else '≥'} {_g(-p.max_decline)} with fitted "
                f"fall {_g(fall)} {'>' if fall > p.min_drop else '≤'} {_g(p.min_drop)}.")
    return _result(name, p, not declining, slope, -p.max_decline, whole, evidence)


@_gate("grad_norm_no_spike")
def _grad_norm_no_spike(run: _Run, p: GradNormNoSpikeParams,
                        reference: Mapping[str, float] | None,
                        context: GateContext) -> GateResult:
    name = "grad_norm_no_spike"
    pts = run.series(GRAD_NORM)
    if len(pts) < p.window + 1:
        return _not_enough(name, p, len(pts), GRAD_NORM, p.window + 1)
    rewards = run.series(REWARD)

    def reward_mean(lo: int, hi: int) -> float | None:
        vals = [v for s, v in rewards if lo <= s <= hi]
        return sum(vals) / len(vals) if vals else None

    worst_ratio: tuple[float, int, float, float] | None = None
    harmful: list[tuple[float, int, float, float, float, float]] = []
    harmless: list[tuple[float, int, float, float, float | None, float | None]] = []
    for i in range(p.window, len(pts)):
        base = [v for _, v in pts[i - p.window:i] if v > 0]
        if not base:
            continue
        med = statistics.median(base)
        step, g = pts[i]
        ratio = g / med
        if worst_ratio is None or ratio > worst_ratio[0]:
            worst_ratio = (ratio, step, g, med)
        if ratio <= p.factor:
            continue
        before = reward_mean(step - p.window, step)
        after = reward_mean(step + 1, step + p.after)
        if before is not None and after is not None and after < before:
            harmful.append((ratio, step, g, med, before, after))
        else:
            harmless.append((ratio, step, g, med, before, after))
    whole = _span(pts)
    if harmful:  # a harmful spike has reward points after it, so `rewards` is not empty
        ratio, step, g, med, before, after = max(harmful)
        evidence = (f"grad-norm spike with reward loss: {GRAD_NORM} reached {_g(g)} at step "
                    f"{step}, {ratio:.1f}× the median {_g(med)} of the previous {p.window} "
                    f"points (> {_g(p.factor)}×), and mean reward fell from {_g(before)} "
                    f"(steps {step - p.window}–{step}) to {_g(after)} (steps {step + 1}–"
                    f"{step + p.after}).")
        window = (max(step - p.window, whole[0]), min(step + p.after, rewards[-1][0]))
        return _result(name, p, False, ratio, p.factor, window, evidence)
    if harmless:
        ratio, step, g, med, before, after = max(harmless, key=lambda h: h[0])
        if after is None:
            outcome = "the reward after it was not observed (the run ends there)"
        elif before is None:
            outcome = "no reward before it was logged to compare with"
        else:
            outcome = f"mean reward did not fall afterwards ({_g(before)} → {_g(after)})"
        evidence = (f"grad-norm spike without reward loss: {GRAD_NORM} reached {_g(g)} at step "
                    f"{step}, {ratio:.1f}× the median {_g(med)} of the previous {p.window} "
                    f"points (> {_g(p.factor)}×), but {outcome}; {len(harmless)} such spike(s), "
                    "not a collapse by seed 001's definition.")
        return _result(name, p, True, ratio, p.factor, whole, evidence)
    if worst_ratio is None:
        return _result(name, p, True, None, p.factor, whole,
                       f"{GRAD_NORM} had no positive baseline over {_steps(whole)}.")
    ratio, step, g, med = worst_ratio
    evidence = (f"no grad-norm spike over {_steps(whole)}: the largest was {_g(g)} at step "
                f"{step}, {ratio:.2f}× the median {_g(med)} of the previous {p.window} points "
                f"(≤ {_g(p.factor)}×).")
    return _result(name, p, True, ratio, p.factor, whole, evidence)


@_gate("staleness_within_bound")
def _staleness_within_bound(run: _Run, p: StalenessWithinBoundParams,
                            reference: Mapping[str, float] | None,
                            context: GateContext) -> GateResult:
    name = "staleness_within_bound"
    run_bound = context.max_staleness  # the runtime's
    if p.max_staleness is not None:
        bound, source = p.max_staleness, "max_staleness parameter"
    elif run_bound is not None:
        bound, source = run_bound, "the run's async mode"
    else:
        bound, source = None, ""
    dropped = run.series(DROPPED_FRAC)
    drops_configured = bool(dropped) or context.max_off_policy_steps is not None
    if drops_configured:
        drops = _dropped_fraction(name, p, run, dropped, run_bound)
        if p.max_staleness is None:
            return drops
        # An explicit bound is the user's, not the runtime's drop threshold (it may be
        # tighter), so drops do not make it hold by construction: check it too.
        peak = _staleness_peak(name, p, run, p.max_staleness, source)
        failed = [r for r in (peak, drops) if not r.passed]
        main = failed[0] if failed else drops
        return _result(name, p, not failed, main.value, main.threshold, main.window,
                       f"{drops.evidence[:-1]}; {peak.evidence}")
    return _staleness_peak(name, p, run, bound, source)


def _staleness_peak(name: str, p: StalenessWithinBoundParams, run: _Run,
                    bound: float | None, source: str) -> GateResult:
    """The peak ``async/staleness/max`` against ``bound`` (passes when there is none)."""
    pts = run.series(STALENESS_MAX)
    if bound is None:
        seen = f" (observed max {_g(max(v for _, v in pts))})" if pts else ""
        return _result(name, p, True, max((v for _, v in pts), default=None), None,
                       _span(pts) if pts else None,
                       f"no bound configured: neither the max_staleness parameter nor the "
                       f"run context sets one{seen}.")
    if not pts:
        return _not_enough(name, p, 0, STALENESS_MAX, 1)
    step, worst = max(pts, key=lambda sv: sv[1])
    mean = run.series(STALENESS_MEAN)
    mean_note = f", mean staleness {_g(_mean(mean))}" if mean else ""
    ok = worst <= bound
    evidence = (f"{STALENESS_MAX} peaked at {_g(worst)} (step {step}) "
                f"{'≤' if ok else '>'} the bound {_g(bound)} from {source} over "
                f"{_steps(_span(pts))}{mean_note}.")
    return _result(name, p, ok, worst, bound, _span(pts), evidence)


def _dropped_fraction(name: str, p: StalenessWithinBoundParams, run: _Run,
                      dropped: list[Point], bound: float | None) -> GateResult:
    """With max_off_policy_steps set the runtime drops what exceeds the bound, so the bound
    holds by construction; the cumulative dropped fraction is the verdict."""
    if not dropped:
        return _not_enough(name, p, 0, f"{DROPPED_FRAC} (drops are configured)", 1)
    step, frac = dropped[-1]  # cumulative: the last value covers the run
    ok = frac <= p.max_dropped_frac
    pts = run.series(STALENESS_MAX)
    seen = (f"; {STALENESS_MAX} peaked at {_g(max(v for _, v in pts))}" if pts else "")
    tautology = ("the staleness bound holds by construction — samples beyond it are dropped"
                 + (f" (bound {_g(bound)})" if bound is not None else "") + seen)
    evidence = (f"{'too many' if not ok else 'few enough'} samples dropped as too stale: "
                f"{DROPPED_FRAC} is {_g(frac)} ({_pct(frac)} of the samples, cumulative to step "
                f"{step}) {'>' if not ok else '≤'} {_g(p.max_dropped_frac)}; {tautology}.")
    return _result(name, p, ok, frac, p.max_dropped_frac, _span(dropped), evidence)


# --------------------------------------------------------------------------------------------
# Reference summary and diagnosis
# --------------------------------------------------------------------------------------------


def summarize(history: Sequence[Mapping[str, Any]], tail: float = 0.25) -> dict[str, float]:
    """A run's summary, the ``reference`` later stages' gates compare against.

    For every numeric metric key: the mean of its last ``tail`` fraction of points (at least one),
    read like the gates read (training rows for training metrics, every row for ``eval/*``, None
    and non-numeric values skipped). With a metric logged every step this is the mean over the
    last 25 % of training steps; a sparse metric (eval every k steps) averages its own last 25 %
    of values. Plus, for the headline |Δlogp| (present with ≥ 2 points):
    ``"mismatch/train_rollout/logprob_abs_diff/mean/slope"``, its least-squares slope over the
    whole run, per step, and ``".../rise"``, that slope × the run's own step span — the total
    fitted rise ``logprob_diff_flat`` compares a candidate's total rise with (runs of a
    ``samples`` stage see the same data over different step counts).
    """
    if not 0 < tail <= 1:
        raise ValueError(f"tail must be in (0, 1], got {tail!r}; 0.25 is the last quarter")
    run = _Run(history)
    out = _tail_means(run, run.metric_keys(), tail)
    pts = run.series(LOGPROB_DIFF)
    if len(pts) >= 2:
        slope = _slope(pts)
        first, last = _span(pts)
        out[f"{LOGPROB_DIFF}/slope"] = slope
        out[f"{LOGPROB_DIFF}/rise"] = slope * (last - first)
    return dict(sorted(out.items()))


def _diagnose_run(run: _Run, tail: float = 0.25) -> Diagnosis:
    metrics = _tail_means(run, run.metric_keys(), tail)
    series: dict[str, list[float]] = {}
    for quantity in ("response_length", "pg_clipfrac", "proxy3_pure_noise",
                     "train_rollout_diff", "engine_diff"):
        key, pts = run.first_series(METRIC_ALIASES[quantity])
        if pts:
            series[key] = [v for _, v in pts]
    return diagnose(metrics, _DEFAULT_THRESHOLDS, series)


#: Gates :func:`diagnosis_for` leaves out: without a reference their default is a number from
#: another task, so on ours they would fail every run and name nothing wrong with it.
#: (``repetition_rate`` without a reference compares with the run's own start, so it stays.)
_NEEDS_REFERENCE = {
    "zero_variance_groups": "its absolute max_frac 0.45 is seed 000's task; the embedded "
                            "sum-digits task sits at 0.53–0.70 from the start, so it is only "
                            "meaningful relative_to a baseline",
}


_ESCALATION_TEXT = {
    "rs_only": "rejection sampling alone suffices (χ²_token < 2.0 and RS mask < 10%)",
    "rs_plus_token_tis": "add token-level TIS to RS (χ²_token in (2.0, 4.0] or RS mask 10–25%)",
    "systems_fix": "fix the system (RS would discard > 25%, ESS < 0.3 or Pearson < 0.95): no "
                   "algorithmic correction is cheaper than removing the divergence",
}


def _recipe_facts(recipe: Recipe | None) -> dict[str, Any]:
    """What :func:`prescription` may tailor an override to (nothing without a recipe)."""
    if recipe is None:
        return {}
    model = recipe.model
    moe = getattr(model, "moe_experts", None)
    return {"moe": (moe > 0) if isinstance(moe, int) else None, "lr": recipe.optim.lr,
            "rollout": recipe.engines.rollout}


def _check_override(recipe: Recipe | None, override: Mapping[str, Any]) -> str | None:
    """Why ``override`` does not give a valid recipe on top of ``recipe`` (None if it does, or
    when there is no recipe to try it on)."""
    if recipe is None:
        return None
    from training.recipe import RecipeError, apply_overrides, recipe_from_dict

    try:
        recipe_from_dict(apply_overrides(recipe.to_dict(), override), "recipe + override")
    except RecipeError as e:
        return str(e)
    return None


def _attribute_logprob_failure(run: _Run, d: Diagnosis) -> str:
    """Which source a failing ``logprob_diff_flat`` belongs to: the cause the tree already gave
    the rise ("A"/"B"), else by the exact engine share of the level (engine |Δlogp| ≥ half the
    train–rollout |Δlogp| → "A", below → "B"), else "unseparated"."""
    for f in d.findings:
        if f.cause in ("A", "B") and any(e.metric.startswith(LOGPROB_DIFF) for e in f.evidence):
            return f.cause
    if d.engine_exact is None or d.engine_exact < 1.0 - 1e-9:
        return "unseparated"
    tr, en = run.series(LOGPROB_DIFF), run.series(ENGINE_DIFF)
    if not tr or not en:
        return "unseparated"
    tr_level, en_level = _mean(_tail(tr, 0.25)), _mean(_tail(en, 0.25))
    return "A" if en_level >= 0.5 * tr_level else "B"


def diagnosis_for(history: Sequence[Mapping[str, Any]],
                  recipe: Recipe | None = None) -> dict[str, Any]:
    """Seed 001's A–F decision tree on a run, as a JSON-ready dict (for a stage nobody passed).

    ``training.algorithms.decision_tree.diagnose`` gets the means of the last 25 % of points of
    every metric and the per-step series of response length, PPO clip fraction, proxy-3 noise
    and the train–rollout and engine |Δlogp|. It names A from ``mismatch/engine/*`` only when
    ``mismatch/engine/exact`` is 1, B from ``is/staleness/*`` and from a train–rollout rise the
    exact engine gap does not share. When ``logprob_diff_flat`` fails, its evidence joins the
    cause its source belongs to (see :func:`_attribute_logprob_failure`); a failure whose source
    cannot be separated under the run's old_logprob strategy is reported under
    ``unseparated`` with the prescription to rerun under ``snapshot`` — never forced into A.

    Every finding carries ``override``: its fix as a recipe override (dotted keys → values,
    :func:`training.algorithms.decision_tree.prescription`), tailored to ``recipe`` (MoE or
    dense, its LR) when given; with a recipe the override is applied and validated, and
    ``override_error`` says why it does not load (None when it does). Every gate runs at its
    defaults with no reference, except those whose default is only meaningful against one
    (``zero_variance_groups``), listed under ``skipped_gates`` with the reason and named in
    the summary; the gates that fail are listed under ``failed_gates``.

    Returns:
        ``{"causes", "findings": [{"cause", "title", "evidence", "fix", "override",
        "override_error"}], "unseparated": {...} | None, "engine_exact", "healthy",
        "escalation", "escalation_text", "missing", "window", "failed_gates",
        "skipped_gates": [{"name", "why"}], "summary"}``.
    """
    run = _Run(history)
    d = _diagnose_run(run)
    facts = _recipe_facts(recipe)

    def finding(cause: str, title: str, evidence: list[str], fix: str) -> dict[str, Any]:
        override = prescription(cause, **facts)
        return {"cause": cause, "title": title, "evidence": evidence, "fix": fix,
                "override": override, "override_error": _check_override(recipe, override)}

    findings = [finding(f.cause, f.title, [str(e) for e in f.evidence], f.fix)
                for f in d.findings]
    unseparated_ev = [str(e) for e in d.unseparated]
    lp = _evaluate("logprob_diff_flat", run, params_model("logprob_diff_flat")(), None, None)
    if not lp.passed:
        source = _attribute_logprob_failure(run, d)
        if source == "unseparated":
            unseparated_ev.append(lp.evidence)
        else:
            found = next((f for f in findings if f["cause"] == source), None)
            if found is not None:
                found["evidence"].append(lp.evidence)
            else:
                title, fix = FIXES[source]
                findings.append(finding(source, title, [lp.evidence], fix))
                findings.sort(key=lambda f: f["cause"])
    unseparated = None
    if unseparated_ev:
        unseparated = finding("unseparated", UNSEPARATED[0], unseparated_ev, UNSEPARATED[1])
        unseparated["engine_exact"] = d.engine_exact
    judged = [n for n in gate_names() if n not in _NEEDS_REFERENCE]
    skipped = [{"name": n, "why": why} for n, why in _NEEDS_REFERENCE.items()]
    failed = [r for r in (_evaluate(n, run, params_model(n)(), None, None) for n in judged)
              if not r.passed]
    causes = [f["cause"] for f in findings]
    parts = []
    if causes:
        parts.append("the metrics point to cause(s) " + ", ".join(causes) + " of seed 001's "
                     "decision tree: " + "; ".join(f"{f['cause']} = {f['title']}"
                                                   for f in findings))
    if unseparated is not None:
        parts.append("the train–rollout drift cannot be split into engine mismatch and staleness "
                     "under this run's old_logprob strategy (mismatch/engine/exact "
                     f"{_g(d.engine_exact)}): rerun with algorithm.old_logprob: snapshot")
    if parts:
        summary = "; ".join(parts) + "."
    elif failed:
        summary = ("no decision-tree cause matched, but gates failed: "
                   + ", ".join(r.name for r in failed) + ".")
    else:
        summary = "no decision-tree cause matched and every default gate passes."
    summary += (" Not judged without a reference: " + ", ".join(g["name"] for g in skipped)
                + " (give it relative_to a baseline in a campaign).")
    return {
        "causes": causes,
        "findings": findings,
        "unseparated": unseparated,
        "engine_exact": d.engine_exact,
        "healthy": d.healthy and not causes and unseparated is None,
        "escalation": d.escalation,
        "escalation_text": _ESCALATION_TEXT.get(d.escalation or ""),
        "missing": list(d.missing),
        "window": [run.train[0][0], run.train[-1][0]] if run.train else None,
        "failed_gates": [r.to_dict() for r in failed],
        "skipped_gates": skipped,
        "summary": summary,
    }


# --------------------------------------------------------------------------------------------
# What a recipe must produce for a gate
# --------------------------------------------------------------------------------------------


def unmet_requirement(name: str, params: Mapping[str, Any] | None,
                      recipe: Recipe) -> str | None:
    """Why ``recipe`` cannot produce what gate ``name`` (with ``params``) needs to judge — one
    line naming the fix — or None when it can. The campaign loader calls it for every candidate
    so a campaign is refused before anything trains.

    * ``eval_tracks_reward`` needs evaluation: ``eval.n`` > 0.
    * ``staleness_within_bound`` given ``max_dropped_frac`` needs ``async.max_off_policy_steps``
      (without it nothing is dropped and the parameter would silently never apply).
    * ``is_weight_mean_band`` needs π_old distinct from μ
      (:attr:`~training.recipe.AlgorithmConfig.has_distinct_old`): under ``old_logprob``
      bypass, loglinear or linear_prox (or a bypass preset, which forces bypass)
      ``is/engine/ratio/mean`` is identically 1. Every other recipe measures both sources,
      corrected or not.
    * ``zero_variance_groups`` needs groups: ``rollout.n`` ≥ 2.
    The other gates read metrics every recipe logs.

    Raises:
        KeyError / ValueError: an unknown gate or bad parameters (as :func:`check_params`).
    """
    check_params(name, params or {})
    given = dict(params or {})
    if name == "eval_tracks_reward" and recipe.eval.n == 0:
        return ("gate eval_tracks_reward needs evaluation but the recipe has eval.n: 0; set "
                "eval.n > 0 or drop the gate")
    if name == "staleness_within_bound" and "max_dropped_frac" in given \
            and recipe.async_.max_off_policy_steps is None:
        return ("gate staleness_within_bound: max_dropped_frac judges samples dropped as too "
                "stale, but the recipe keeps every sample (async.max_off_policy_steps is null); "
                "set async.max_off_policy_steps or remove max_dropped_frac")
    if name == "is_weight_mean_band":
        a = recipe.algorithm
        if not a.has_distinct_old:
            why = ("a bypass preset forces old_logprob bypass"
                   if a.effective_old_logprob != a.old_logprob
                   else f"old_logprob is {a.old_logprob}")
            return (f"gate is_weight_mean_band reads the engine IS ratio π_old/μ, but {why}, "
                    "so π_old is μ and the ratio is identically 1; use old_logprob snapshot "
                    "(or dedicated/recompute/ewma) or drop the gate")
    if name == "zero_variance_groups" and recipe.rollout.n < 2:
        return (f"gate zero_variance_groups needs groups of ≥ 2 samples, but rollout.n "
                f"is {recipe.rollout.n}; raise it or drop the gate")
    return None
