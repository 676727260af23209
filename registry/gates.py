"""Stability gates: pure functions that judge one training run's metric history.

A campaign stage names gates (``GateSpec``: a gate name, parameters, optionally a reference stage);
the ``judge`` task reads the run's ``metrics.jsonl`` (``training.runtime.sinks.read_metrics``) and
calls :func:`evaluate_gates`. Each gate returns a :class:`GateResult` whose ``evidence`` sentence
carries the numbers a person needs to agree or disagree with the verdict.

The gates turn the diagnostics of the seeds into pass/fail rules:

===================================  ==========================================================
gate                                 source
===================================  ==========================================================
``logprob_diff_flat``                seed 000 "Diagnostic signals": train–rollout |Δ log p| must
                                     stay flat (healthy sync ≈ 0.025, a blown-up run reached 0.10)
``entropy_no_blowup``                seed 000: a sudden upward entropy spike preceded every collapse
``reward_not_collapsed``             seed 001 open problem 2: collapse = a ≥ 30 % reward drop that
                                     does not recover
``eval_tracks_reward``               seed 000: training reward up while eval down = simplicity bias
``is_health``                        seed 001 decision tree (ESS < 0.5, χ²_token > 1.0 → cause D)
                                     and its RS → IS → systems escalation (mask > 25 % → systems)
``no_length_surge``                  seed 001 cause F: response length +20 % within 100 steps
``rollout_logprob_not_decreasing``   seed 000: a falling rollout log-prob precedes entropy blow-up
``grad_norm_no_spike``               seed 001 open problem 2: grad-norm spike > 10× the rolling
                                     median followed by reward degradation
``staleness_within_bound``           the async mode's own bound (0 sync, 1 one-step,
                                     max_off_policy_steps fully async)
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
  caller resolves a gate spec's ``relative_to``); ``context`` carries run facts the metrics do not
  (``max_staleness``).

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
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from training.algorithms.decision_tree import (
    FIXES,
    METRIC_ALIASES,
    Diagnosis,
    Thresholds,
    diagnose,
)
from training.algorithms.registry import Registry

__all__ = [
    "GATES",
    "EntropyNoBlowupParams",
    "EvalTracksRewardParams",
    "GateResult",
    "GradNormNoSpikeParams",
    "IsHealthParams",
    "LogprobDiffFlatParams",
    "NoLengthSurgeParams",
    "RewardNotCollapsedParams",
    "RolloutLogprobNotDecreasingParams",
    "StalenessWithinBoundParams",
    "check_params",
    "diagnosis_for",
    "evaluate_gate",
    "evaluate_gates",
    "gate_names",
    "gate_params",
    "summarize",
]

LOGPROB_DIFF = "mismatch/logprob_abs_diff/mean"
ENTROPY = "policy/entropy/mean"
REWARD = "rollout/reward_mean"
EVAL_REWARD = "eval/reward_mean"
EVAL_BY_DIFFICULTY = "eval/reward/d"
RESPONSE_LENGTH = "rollout/response_length/mean"
ROLLOUT_LOGPROB = "rollout/logprob_mean"
GRAD_NORM = "policy/grad_norm"
STALENESS_MAX = "async/staleness/max"
STALENESS_MEAN = "async/staleness/mean"
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
# Parameters. A field's metadata holds its bounds: lo/hi inclusive, lo_open for "> lo".
# --------------------------------------------------------------------------------------------


def _p(default: Any, *, lo: float | None = None, hi: float | None = None,
       lo_open: bool = False) -> Any:
    return field(default=default, metadata={"lo": lo, "hi": hi, "lo_open": lo_open})


_REQUIRE_DATA_DOC = ("require_data: fail (instead of pass) when the run has too little data to "
                     "judge. Default False.")


@dataclass(frozen=True)
class LogprobDiffFlatParams:
    """``logprob_diff_flat``: mean |Δ log p| between trainer and rollout engine must not grow.

    Fails when the run's least-squares slope exceeds ``max_slope`` *and* the fitted rise over the
    run (slope × steps spanned) exceeds ``min_rise``, or when the level (mean of the last ``tail``
    fraction of points) exceeds ``max_ratio`` × the reference's level (reference given) or
    ``max_level`` (no reference).

    max_slope: 0.0005 per step. Seed 000's healthy sync baseline sat flat at ≈ 0.025 and its
        uncorrected one-step-async run blew up to 0.10; 0.0005/step doubles the healthy level
        within 50 steps.
    min_rise: 0.01 (40 % of the healthy 0.025): on a 10-step noisy run the slope alone is noise.
    max_level: 0.05, twice seed 000's healthy 0.025 and half its blow-up value 0.10.
    max_ratio: 1.5 × the reference stage's level.
    tail: 0.25, the fraction of points (≥ 1) whose mean is the level.
    """

    max_slope: float = _p(0.0005, lo=0.0)
    min_rise: float = _p(0.01, lo=0.0)
    max_level: float = _p(0.05, lo=0.0, lo_open=True)
    max_ratio: float = _p(1.5, lo=0.0, lo_open=True)
    tail: float = _p(0.25, lo=0.0, hi=1.0, lo_open=True)
    require_data: bool = _p(False)


@dataclass(frozen=True)
class EntropyNoBlowupParams:
    """``entropy_no_blowup``: no step whose ``policy/entropy/mean`` exceeds ``spike_factor`` × the
    median of the previous ``window`` points (seed 000: "a sudden upward spike", as opposed to the
    normal mild drift either way).

    spike_factor: 2.0 — a doubling within a few steps is a spike, not drift.
    window: 5 points; a step is checked once 5 earlier points exist.
    """

    spike_factor: float = _p(2.0, lo=1.0, lo_open=True)
    window: int = _p(5, lo=1)
    require_data: bool = _p(False)


@dataclass(frozen=True)
class RewardNotCollapsedParams:
    """``reward_not_collapsed``: seed 001's collapse — the smoothed ``rollout/reward_mean`` ends
    ≥ ``drop`` below its peak (a drop that recovered before the end passes).

    drop: 0.3 (seed 001: "a ≥ 30 % reward drop that does not recover").
    smooth: 3 — trailing mean over 3 points before the peak and drop are taken.
    """

    drop: float = _p(0.3, lo=0.0, hi=1.0, lo_open=True)
    smooth: int = _p(3, lo=1)
    require_data: bool = _p(False)


@dataclass(frozen=True)
class EvalTracksRewardParams:
    """``eval_tracks_reward``: no simplicity bias (seed 000: training reward up, eval down).

    Fails when the training reward rose by more than ``min_rise`` (mean of the last ``smooth``
    points minus mean of the first ``smooth``) while ``eval/reward_mean`` fell by more than
    ``max_eval_drop`` (first → last eval), or, with a reference, when the last eval is more than
    ``max_eval_drop`` below the reference's eval.

    min_rise: 0.0 — any rise of the training reward counts.
    max_eval_drop: 0.05 absolute reward.
    smooth: 3 points at each end of the training reward.
    """

    min_rise: float = _p(0.0, lo=0.0)
    max_eval_drop: float = _p(0.05, lo=0.0)
    smooth: int = _p(3, lo=1)
    require_data: bool = _p(False)


@dataclass(frozen=True)
class IsHealthParams:
    """``is_health``: the importance-sampling correction still works (seed 001 decision tree).

    Means over the last ``tail`` fraction of points: ESS (``is/combined/ess``, else
    ``is/engine/ess``, else ``rollout_corr/rollout_is_eff_sample_size``) ≥ ``min_ess``; mask
    fraction (``is/combined/mask_frac``, ``is/engine/mask_frac``, verl's RS masked fraction)
    ≤ ``max_mask_frac``; ``mismatch/chi2_token`` ≤ ``max_chi2_token``.

    min_ess: 0.5 — ``Thresholds.ess_min`` (seed 001: "ess < 0.5 → Cause D").
    max_mask_frac: 0.25 — ``Thresholds.rs_mask_high`` (seed 001: "RS would discard > 25 % of the
        batch" → systems fix; no algorithmic correction is cheaper beyond it).
    max_chi2_token: 1.0 — ``Thresholds.chi2_token_blowup`` (seed 001: "chi2_token > 1.0 → D").
    tail: 0.25.
    """

    min_ess: float = _p(_DEFAULT_THRESHOLDS.ess_min, lo=0.0, hi=1.0)
    max_mask_frac: float = _p(_DEFAULT_THRESHOLDS.rs_mask_high, lo=0.0, hi=1.0)
    max_chi2_token: float = _p(_DEFAULT_THRESHOLDS.chi2_token_blowup, lo=0.0)
    tail: float = _p(0.25, lo=0.0, hi=1.0, lo_open=True)
    require_data: bool = _p(False)


@dataclass(frozen=True)
class NoLengthSurgeParams:
    """``no_length_surge``: seed 001 cause F — the smoothed ``rollout/response_length/mean`` must
    not rise by more than ``max_rise`` over its minimum within the preceding ``window`` steps
    (a run shorter than ``window`` is one window).

    max_rise: 0.2 (seed 001: "response length rises > 20 % in 100 steps").
    window: 100 steps (``Thresholds.length_window_steps``).
    smooth: 3 — trailing mean over 3 points, so one batch of long answers is not a surge; 1
        reproduces seed 001's raw ``len / len_100_steps_ago`` rule.
    """

    max_rise: float = _p(0.2, lo=0.0, lo_open=True)  # Thresholds.length_surge_ratio − 1
    window: int = _p(_DEFAULT_THRESHOLDS.length_window_steps, lo=1)
    smooth: int = _p(3, lo=1)
    require_data: bool = _p(False)


@dataclass(frozen=True)
class RolloutLogprobNotDecreasingParams:
    """``rollout_logprob_not_decreasing``: seed 000 — in failed runs the mean log-prob of the
    policy's own samples kept falling; in stable runs it slowly rose. Fails when the least-squares
    slope of ``rollout/logprob_mean`` is below −``max_decline`` *and* the fitted fall over the run
    exceeds ``min_drop``.

    max_decline: 0.001 nats/token per step (−0.1 over 100 steps).
    min_drop: 0.05 nats/token over the run (per-step noise of a small batch is ≈ 0.05).
    """

    max_decline: float = _p(0.001, lo=0.0)
    min_drop: float = _p(0.05, lo=0.0)
    require_data: bool = _p(False)


@dataclass(frozen=True)
class GradNormNoSpikeParams:
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

    factor: float = _p(10.0, lo=1.0, lo_open=True)
    window: int = _p(5, lo=1)
    after: int = _p(5, lo=1)
    require_data: bool = _p(False)


@dataclass(frozen=True)
class StalenessWithinBoundParams:
    """``staleness_within_bound``: the largest ``async/staleness/max`` (policy versions between
    the weights that sampled a token and the weights trained on it) ≤ the bound.

    max_staleness: None — the bound comes from ``context["max_staleness"]`` (the runtime's: 0
        sync, 1 one-step, ``max_off_policy_steps`` fully async); a number here overrides it.
        With neither, the gate passes with "no bound configured".
    """

    max_staleness: float | None = _p(None, lo=0.0)
    require_data: bool = _p(False)


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

#: A gate: (run, params dataclass, reference summary or None, context) → GateResult.
GateFn = Callable[..., GateResult]

GATES: Registry[GateFn] = Registry("stability gate")
_PARAM_TYPES: dict[str, type] = {}


def _gate(name: str, params_type: type) -> Callable[[GateFn], GateFn]:
    def decorator(fn: GateFn) -> GateFn:
        GATES.register(name)(fn)
        _PARAM_TYPES[name] = params_type
        return fn

    return decorator


def _result(name: str, p: Any, passed: bool, value: float | None, threshold: float | None,
            window: tuple[int, int] | None, evidence: str) -> GateResult:
    return GateResult(name=name, passed=passed, value=value, threshold=threshold,
                      window=window, evidence=evidence, params=asdict(p))


def _not_enough(name: str, p: Any, n: int, what: str, need: int) -> GateResult:
    verdict = (" — require_data is set, so the gate fails" if p.require_data
               else "; passing by default (set require_data: true to fail instead)")
    return _result(name, p, not p.require_data, None, None, None,
                   f"not enough steps ({n}) with {what} to judge (need ≥ {need}){verdict}.")


def gate_names() -> list[str]:
    """Every registered gate, sorted."""
    return GATES.names()


def gate_params(name: str) -> dict[str, Any]:
    """A gate's parameters with their defaults (the params dataclass documents each)."""
    GATES.get(name)
    return asdict(_PARAM_TYPES[name]())


def _type_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")


def _check_value(gate: str, key: str, value: Any, annotation: Any, meta: Mapping[str, Any],
                 default: Any) -> Any:
    tname = _type_name(annotation)
    optional = "None" in tname
    fix = f"set {key} to a valid value or leave it out (default {default!r})"
    if value is None:
        if optional:
            return None
        raise ValueError(f"gate {gate!r}: parameter {key!r} must not be null; {fix}")
    if tname.startswith("bool"):
        if not isinstance(value, bool):
            raise ValueError(f"gate {gate!r}: parameter {key!r} must be true or false, got "
                             f"{value!r} ({type(value).__name__}); {fix}")
        return value
    num = _number(value)
    if num is None:
        raise ValueError(f"gate {gate!r}: parameter {key!r} must be a finite number, got "
                         f"{value!r} ({type(value).__name__}); {fix}")
    if tname.startswith("int"):
        if not num.is_integer():
            raise ValueError(f"gate {gate!r}: parameter {key!r} must be a whole number, got "
                             f"{value!r}; {fix}")
        num = int(num)
    lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open", False)
    too_low = lo is not None and (num <= lo if lo_open else num < lo)
    too_high = hi is not None and num > hi
    if too_low or too_high:
        bounds = []
        if lo is not None:
            bounds.append(f"{'>' if lo_open else '≥'} {lo:g}")
        if hi is not None:
            bounds.append(f"≤ {hi:g}")
        raise ValueError(f"gate {gate!r}: parameter {key!r} must be {' and '.join(bounds)}, "
                         f"got {value!r}; {fix}")
    return num


def check_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a gate's parameters; return them complete (defaults filled in).

    Raises:
        KeyError: unknown gate (the message lists the valid gates).
        ValueError: unknown parameter (with its valid names and the closest match) or a value of
            the wrong type or out of bounds (with the bounds and the default).
    """
    GATES.get(name)
    specs = {f.name: f for f in fields(_PARAM_TYPES[name])}
    out = gate_params(name)
    for key, value in dict(params or {}).items():
        if key not in specs:
            close = difflib.get_close_matches(str(key), list(specs), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"gate {name!r} has no parameter {key!r}; {hint}valid parameters: "
                f"{', '.join(specs)}. Fix: remove {key!r} or rename it to one of those "
                "(a gate's reference stage is the spec's relative_to, not a parameter).")
        spec = specs[key]
        out[key] = _check_value(name, key, value, spec.type, spec.metadata, spec.default)
    return out


def evaluate_gate(name: str, history: Sequence[Mapping[str, Any]],
                  params: Mapping[str, Any] | None = None, *,
                  reference: Mapping[str, float] | None = None,
                  context: Mapping[str, Any] | None = None) -> GateResult:
    """Run one gate on a metric history (records as ``read_metrics`` returns them).

    Args:
        name: a name from :func:`gate_names`.
        history: per-step dicts with ``"step"`` and metric keys (values float or None).
        params: overrides of the gate's defaults (validated by :func:`check_params`).
        reference: :func:`summarize` of the reference run, or None for absolute thresholds.
        context: run facts the metrics lack, e.g. ``{"max_staleness": 1}``.
    """
    return _evaluate(name, _Run(history), params, reference, context)


def evaluate_gates(specs: Sequence[tuple[str, Mapping[str, Any]]],
                   history: Sequence[Mapping[str, Any]], *,
                   reference: Mapping[str, float] | None = None,
                   context: Mapping[str, Any] | None = None) -> list[GateResult]:
    """Run several ``(name, params)`` gates on one history; every spec is validated before any
    gate runs, so a typo fails the whole call instead of a half-written report."""
    checked = [(name, check_params(name, params or {})) for name, params in specs]
    run = _Run(history)
    return [_evaluate(name, run, params, reference, context) for name, params in checked]


def _evaluate(name: str, run: _Run, params: Mapping[str, Any] | None,
              reference: Mapping[str, float] | None,
              context: Mapping[str, Any] | None) -> GateResult:
    fn = GATES.get(name)
    p = _PARAM_TYPES[name](**check_params(name, params or {}))
    return fn(run, p, reference, context or {})


def _ref_value(reference: Mapping[str, float] | None, key: str) -> float | None:
    return None if reference is None else _number(reference.get(key))


# --------------------------------------------------------------------------------------------
# The gates
# --------------------------------------------------------------------------------------------


@_gate("logprob_diff_flat", LogprobDiffFlatParams)
def _logprob_diff_flat(run: _Run, p: LogprobDiffFlatParams,
                       reference: Mapping[str, float] | None,
                       context: Mapping[str, Any]) -> GateResult:
    name = "logprob_diff_flat"
    pts = run.series(LOGPROB_DIFF)
    if len(pts) < 3:
        return _not_enough(name, p, len(pts), LOGPROB_DIFF, 3)
    head, tail = pts[:len(_tail(pts, p.tail))], _tail(pts, p.tail)
    first, level = _mean(head), _mean(tail)
    slope = _slope(pts)
    whole = _span(pts)
    rise = slope * (whole[1] - whole[0])
    growing = slope > p.max_slope and rise > p.min_rise
    ref = _ref_value(reference, LOGPROB_DIFF)
    if ref is not None and ref > 0:
        limit = p.max_ratio * ref
        basis = f"{_g(p.max_ratio)} × the reference level {_g(ref)}"
    else:
        limit = p.max_level
        basis = "max_level" + (" (the reference has no positive level)"
                               if reference is not None else "")
    too_high = level > limit
    if growing:
        value, threshold, window, verdict = slope, p.max_slope, whole, "is growing"
    elif too_high:
        value, threshold, window, verdict = level, limit, _span(tail), "is too high"
    else:
        value, threshold, window, verdict = slope, p.max_slope, whole, "stayed flat"
    evidence = (
        f"mean |Δlogp| {verdict}: it went from {_g(first)} (first {_points(len(head))}) to "
        f"{_g(level)} (last {_points(len(tail))}) over {_steps(whole)}, slope {_g(slope)}/step "
        f"{'>' if slope > p.max_slope else '≤'} {_g(p.max_slope)} with fitted rise {_g(rise)} "
        f"{'>' if rise > p.min_rise else '≤'} {_g(p.min_rise)}, level {_g(level)} "
        f"{'>' if too_high else '≤'} {_g(limit)} ({basis}).")
    return _result(name, p, not (growing or too_high), value, threshold, window, evidence)


@_gate("entropy_no_blowup", EntropyNoBlowupParams)
def _entropy_no_blowup(run: _Run, p: EntropyNoBlowupParams,
                       reference: Mapping[str, float] | None,
                       context: Mapping[str, Any]) -> GateResult:
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
    if worst is None:
        return _result(name, p, True, None, p.spike_factor, whole,
                       f"{ENTROPY} had a median of 0 before every step over {_steps(whole)}, "
                       "so no spike ratio could be formed.")
    ratio, step, v, med = worst
    if spikes:
        evidence = (f"{ENTROPY} spiked at {spikes} step(s); the worst, step {step}, reached "
                    f"{_g(v)} = {ratio:.2f}× the median {_g(med)} of the previous {p.window} "
                    f"points (> {_g(p.spike_factor)}×).")
    else:
        evidence = (f"no entropy spike over {_steps(whole)}: the largest jump was {ratio:.2f}× "
                    f"the median of the previous {p.window} points (step {step}: {_g(v)} vs "
                    f"{_g(med)}) ≤ {_g(p.spike_factor)}×.")
    return _result(name, p, spikes == 0, ratio, p.spike_factor, whole, evidence)


@_gate("reward_not_collapsed", RewardNotCollapsedParams)
def _reward_not_collapsed(run: _Run, p: RewardNotCollapsedParams,
                          reference: Mapping[str, float] | None,
                          context: Mapping[str, Any]) -> GateResult:
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


@_gate("eval_tracks_reward", EvalTracksRewardParams)
def _eval_tracks_reward(run: _Run, p: EvalTracksRewardParams,
                        reference: Mapping[str, float] | None,
                        context: Mapping[str, Any]) -> GateResult:
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


@_gate("is_health", IsHealthParams)
def _is_health(run: _Run, p: IsHealthParams, reference: Mapping[str, float] | None,
               context: Mapping[str, Any]) -> GateResult:
    name = "is_health"
    checks = (  # quantity, label, limit, ess-like (≥) or not (≤)
        ("ess", "ESS", p.min_ess, True),
        ("mask_frac", "mask fraction", p.max_mask_frac, False),
        ("chi2_token", "χ²_token", p.max_chi2_token, False),
    )
    measured = []
    for quantity, label, limit, at_least in checks:
        key, pts = run.first_series(METRIC_ALIASES[quantity])
        if pts:
            tail = _tail(pts, p.tail)
            measured.append((key, label, _mean(tail), limit, at_least, _span(tail)))
    if not measured:
        wanted = ", ".join(k for q in ("ess", "mask_frac", "chi2_token")
                           for k in METRIC_ALIASES[q])
        return _result(name, p, not p.require_data, None, None, None,
                       f"no IS metrics: none of {wanted} was logged"
                       + (" — require_data is set, so the gate fails."
                          if p.require_data else "; passing by default."))
    failed = [m for m in measured if (m[2] < m[3] if m[4] else m[2] > m[3])]
    key, _, value, limit, _, window = (failed or measured)[0]
    parts = []
    for k, label, v, lim, at_least, _ in measured:
        ok = v >= lim if at_least else v <= lim
        op = (("≥" if ok else "<") if at_least else ("≤" if ok else ">"))
        parts.append(f"{label} {_g(v)} {op} {_g(lim)} ({k})")
    rung = _diagnose_run(run).escalation
    evidence = (("IS correction is failing" if failed else "IS correction is healthy")
                + f" over the last {_pct(p.tail)} of points: " + ", ".join(parts)
                + (f"; seed 001's escalation rung: {rung}" if rung else "") + ".")
    return _result(name, p, not failed, value, limit, window, evidence)


@_gate("no_length_surge", NoLengthSurgeParams)
def _no_length_surge(run: _Run, p: NoLengthSurgeParams,
                     reference: Mapping[str, float] | None,
                     context: Mapping[str, Any]) -> GateResult:
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


@_gate("rollout_logprob_not_decreasing", RolloutLogprobNotDecreasingParams)
def _rollout_logprob_not_decreasing(run: _Run, p: RolloutLogprobNotDecreasingParams,
                                    reference: Mapping[str, float] | None,
                                    context: Mapping[str, Any]) -> GateResult:
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


@_gate("grad_norm_no_spike", GradNormNoSpikeParams)
def _grad_norm_no_spike(run: _Run, p: GradNormNoSpikeParams,
                        reference: Mapping[str, float] | None,
                        context: Mapping[str, Any]) -> GateResult:
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


@_gate("staleness_within_bound", StalenessWithinBoundParams)
def _staleness_within_bound(run: _Run, p: StalenessWithinBoundParams,
                            reference: Mapping[str, float] | None,
                            context: Mapping[str, Any]) -> GateResult:
    name = "staleness_within_bound"
    if p.max_staleness is not None:
        bound, source = p.max_staleness, "max_staleness parameter"
    elif context.get("max_staleness") is not None:
        raw = context["max_staleness"]
        bound = _number(raw)
        if bound is None or bound < 0:
            raise ValueError(f"context max_staleness must be a number ≥ 0, got {raw!r}; the "
                             "runtime passes 0 (sync), 1 (one_step) or max_off_policy_steps")
        source = "the run's async mode"
    else:
        bound, source = None, ""
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


# --------------------------------------------------------------------------------------------
# Reference summary and diagnosis
# --------------------------------------------------------------------------------------------


def summarize(history: Sequence[Mapping[str, Any]], tail: float = 0.25) -> dict[str, float]:
    """A run's summary, the ``reference`` later stages' gates compare against.

    For every numeric metric key: the mean of its last ``tail`` fraction of points (at least one),
    read like the gates read (training rows for training metrics, every row for ``eval/*``, None
    and non-numeric values skipped). With a metric logged every step this is the mean over the
    last 25 % of training steps; a sparse metric (eval every k steps) averages its own last 25 %
    of values. Plus ``"mismatch/logprob_abs_diff/mean/slope"``: the least-squares slope of the
    logprob diff over the whole run, per step (present with ≥ 2 points).
    """
    if not 0 < tail <= 1:
        raise ValueError(f"tail must be in (0, 1], got {tail!r}; 0.25 is the last quarter")
    run = _Run(history)
    out = _tail_means(run, run.metric_keys(), tail)
    pts = run.series(LOGPROB_DIFF)
    if len(pts) >= 2:
        out[f"{LOGPROB_DIFF}/slope"] = _slope(pts)
    return dict(sorted(out.items()))


def _diagnose_run(run: _Run, tail: float = 0.25) -> Diagnosis:
    metrics = _tail_means(run, run.metric_keys(), tail)
    series: dict[str, list[float]] = {}
    for quantity in ("response_length", "pg_clipfrac", "proxy3_pure_noise"):
        key, pts = run.first_series(METRIC_ALIASES[quantity])
        if pts:
            series[key] = [v for _, v in pts]
    return diagnose(metrics, _DEFAULT_THRESHOLDS, series)


_ESCALATION_TEXT = {
    "rs_only": "rejection sampling alone suffices (χ²_token < 2.0 and RS mask < 10%)",
    "rs_plus_token_tis": "add token-level TIS to RS (χ²_token in (2.0, 4.0] or RS mask 10–25%)",
    "systems_fix": "fix the system (RS would discard > 25%, ESS < 0.3 or Pearson < 0.95): no "
                   "algorithmic correction is cheaper than removing the divergence",
}


def diagnosis_for(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Seed 001's A–F decision tree on a run, as a JSON-ready dict (for a stage nobody passed).

    ``training.algorithms.decision_tree.diagnose`` gets the means of the last 25 % of points of
    every metric and the per-step series of response length, PPO clip fraction and proxy-3 noise.
    The tree does not read the train–rollout |Δ log p| that seed 000 watched first; when the
    ``logprob_diff_flat`` gate fails, its evidence joins cause A's finding, which is added if the
    tree did not name A (``mismatch/*`` compares the trainer and the rollout engine at
    the same weights in decoupled mode, so a growing gap is engine mismatch). The default gates
    that fail are listed under ``failed_gates``.

    Returns:
        ``{"causes", "findings": [{"cause", "title", "evidence", "fix"}], "healthy",
        "escalation", "escalation_text", "missing", "window", "failed_gates", "summary"}``.
    """
    run = _Run(history)
    d = _diagnose_run(run)
    findings = [{"cause": f.cause, "title": f.title, "evidence": [str(e) for e in f.evidence],
                 "fix": f.fix} for f in d.findings]
    lp = _evaluate("logprob_diff_flat", run, None, None, None)
    if not lp.passed:
        found_a = next((f for f in findings if f["cause"] == "A"), None)
        if found_a is not None:
            found_a["evidence"].append(lp.evidence)
        else:
            title, fix = FIXES["A"]
            findings.append({"cause": "A", "title": title, "evidence": [lp.evidence],
                             "fix": fix})
            findings.sort(key=lambda f: f["cause"])
    failed = [r for r in (_evaluate(n, run, None, None, None) for n in gate_names())
              if not r.passed]
    causes = [f["cause"] for f in findings]
    if causes:
        summary = ("the metrics point to cause(s) " + ", ".join(causes) + " of seed 001's "
                   "decision tree: " + "; ".join(f"{f['cause']} = {f['title']}" for f in findings)
                   + ".")
    elif failed:
        summary = ("no decision-tree cause matched, but gates failed: "
                   + ", ".join(r.name for r in failed) + ".")
    else:
        summary = "no decision-tree cause matched and every default gate passes."
    return {
        "causes": causes,
        "findings": findings,
        "healthy": d.healthy and not causes,
        "escalation": d.escalation,
        "escalation_text": _ESCALATION_TEXT.get(d.escalation or ""),
        "missing": list(d.missing),
        "window": [run.train[0][0], run.train[-1][0]] if run.train else None,
        "failed_gates": [r.to_dict() for r in failed],
        "summary": summary,
    }
