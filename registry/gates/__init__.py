"""Stability gates: pure functions that judge one training run's metric history.

A campaign stage names gates (``GateSpec``: a gate name, parameters, optionally a reference stage);
the ``judge`` task reads the run's ``metrics.jsonl`` and calls :func:`evaluate_gate`. Each gate
returns a :class:`GateResult` whose ``evidence`` names the criterion that decided, its value, its
limit and how the limit was made (an effect size from the seeds or a noise floor from the run's
own spread, :mod:`registry.gates.stats`).

The package: :mod:`~registry.gates.core` (results, parameters, the registry, reading a history),
:mod:`~registry.gates.stats` (the noise model), one module per family with its parameters beside
its gates — :mod:`~registry.gates.mismatch`, :mod:`~registry.gates.reward`,
:mod:`~registry.gates.policy`, :mod:`~registry.gates.runtime` — and
:mod:`~registry.gates.diagnosis` (reference summaries, the decision tree on a run, what a recipe
must log for a gate).

===================================  ==========================================================
gate                                 source
===================================  ==========================================================
``logprob_diff_flat``                seed 000: the train–rollout |Δlogp| must not grow (lagged
                                     modes: growth only, lag-0 steps left out; else also level)
``engine_mismatch_flat``             seed 004's engine source alone (exact π_old): level and
                                     growth against the sync reference
``entropy_no_blowup``                seed 000: a spike or sustained rise preceded every collapse
``reward_not_collapsed``             seed 001: a ≥ 30 % reward drop that does not recover
``eval_tracks_reward``               seed 000: training reward up while eval down
``eval_not_degraded``                the run loses held-out accuracy beyond noise
``is_health``                        seed 001's decision tree per IS source (ESS, mask, χ²)
``is_weight_mean_band``              seed 000 Fix 2: engine IS weight-mean dips
``pg_clipfrac``                      seed 001 cause E: clip fraction > 0.2 and rising
``repetition_rate``                  seed 000's cascade: entropy → repetition → collapse
``zero_variance_groups``             seed 000: all-equal groups waste rollout compute
``no_length_surge``                  seed 001 cause F: response length +20 % within 100 steps
``rollout_logprob_not_decreasing``   seed 000: falling rollout log-prob precedes blow-up
``grad_norm_no_spike``               seed 001: grad-norm spike followed by reward loss
``staleness_within_bound``           the async mode's own bound and the dropped fraction
===================================  ==========================================================

Conventions shared by every gate:

* Training metrics are read from training rows only (``"step/eval_only": 1.0`` rows are skipped;
  a step logged twice keeps its later row); ``eval/*`` from every row. Non-finite and non-numeric
  values are ignored. A metric absent under our name is read under another framework's name
  (:data:`~registry.gates.core.ALIASES`).
* Too little data never raises: the gate passes with "not enough steps …" unless its
  ``require_data`` is true. A criterion whose metric is absent says so and does not decide.
* ``reference`` is :func:`summarize` of the reference run (the campaign's sync baseline);
  ``context`` carries run facts the metrics do not (:class:`GateContext`).
"""

from registry.gates import mismatch, policy, reward, runtime  # noqa: F401  (registers the gates)
from registry.gates.core import (
    ALIASES,
    GATES,
    GateContext,
    GateParams,
    GateResult,
    check_params,
    evaluate_gate,
    evaluate_gates,
    gate_names,
    gate_params,
    params_model,
)
from registry.gates.diagnosis import (
    Prescribed,
    RunDiagnosis,
    SkippedGate,
    diagnosis_as_judged,
    diagnosis_for,
    summarize,
    unmet_requirement,
)
from registry.gates.mismatch import (
    EngineMismatchFlatParams,
    IsHealthParams,
    IsWeightMeanBandParams,
    LogprobDiffFlatParams,
)
from registry.gates.policy import (
    EntropyNoBlowupParams,
    GradNormNoSpikeParams,
    NoLengthSurgeParams,
    PgClipfracParams,
    RepetitionRateParams,
    RolloutLogprobNotDecreasingParams,
)
from registry.gates.reward import (
    EvalNotDegradedParams,
    EvalTracksRewardParams,
    RewardNotCollapsedParams,
    ZeroVarianceGroupsParams,
)
from registry.gates.runtime import StalenessWithinBoundParams

__all__ = [
    "ALIASES",
    "GATES",
    "EngineMismatchFlatParams",
    "EntropyNoBlowupParams",
    "EvalNotDegradedParams",
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
    "Prescribed",
    "RepetitionRateParams",
    "RewardNotCollapsedParams",
    "RolloutLogprobNotDecreasingParams",
    "RunDiagnosis",
    "SkippedGate",
    "StalenessWithinBoundParams",
    "ZeroVarianceGroupsParams",
    "check_params",
    "diagnosis_as_judged",
    "diagnosis_for",
    "evaluate_gate",
    "evaluate_gates",
    "gate_names",
    "gate_params",
    "params_model",
    "summarize",
    "unmet_requirement",
]
