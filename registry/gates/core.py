"""The core of the stability gates: results, parameters, the gate registry and reading a history.

A gate is a pure function ``(run, params, reference, context) -> GateResult`` registered with
:func:`gate` under its name; its parameters model is the annotation of its ``p`` argument. The
families live beside this module (``mismatch``, ``reward``, ``policy``, ``runtime``), each with
its parameters next to its gates; :mod:`registry.gates.stats` holds the noise model every
threshold is stated in.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from training.algorithms.decision_tree import (
    ENGINE_DIFF as ENGINE_DIFF,  # re-exported for the families
)
from training.algorithms.decision_tree import (
    METRIC_ALIASES,
    TRAIN_ROLLOUT_DIFF,
    Diagnosis,
    Thresholds,
    diagnose,
)
from training.algorithms.registry import Registry
from training.evals import EvalOutcome

if TYPE_CHECKING:
    from training.recipe import Recipe

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
EVAL_N = "eval/n"
STALENESS_LAG = "async/staleness/mean"
ENGINE_EXACT = "mismatch/engine/exact"
UPDATE_DIFF = "policy/update/logprob_abs_diff/mean"

#: Other frameworks' names for the metrics the gates read, so a run trained elsewhere and written
#: to JSONL under its own names is judged (ours win when both are present). verl logs ``actor/*``,
#: ``critic/score/mean`` and ``response_length/mean``; slime logs ``train/*`` (among them the
#: headline ``train/train_rollout_logprob_abs_diff``), ``rollout/raw_reward`` and
#: ``rollout/response_len/mean``. verl's ``training/rollout_probs_diff_mean`` is a difference of
#: probabilities, not of log-probs, so it is deliberately not an alias of the headline.
ALIASES: dict[str, tuple[str, ...]] = {
    "mismatch/train_rollout/logprob_abs_diff/mean": ("train/train_rollout_logprob_abs_diff",),
    "policy/entropy/mean": ("actor/entropy", "train/entropy_loss"),
    "policy/pg_clipfrac": ("actor/pg_clipfrac", "train/pg_clipfrac"),
    "policy/grad_norm": ("actor/grad_norm", "train/grad_norm"),
    "policy/approx_kl": ("actor/ppo_kl", "train/ppo_kl"),
    "rollout/reward_mean": ("critic/score/mean", "rollout/raw_reward"),
    "rollout/response_length/mean": ("response_length/mean", "rollout/response_len/mean"),
    "rollout/repetition_rate": ("rollout/repetition_frac",),
}
_NOT_METRICS = frozenset({"step", "time", "_nonfinite", EVAL_ONLY})

DEFAULT_THRESHOLDS = Thresholds()


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
    noise: the standard error of ``value`` that the gate's noise floor is built from, where the
        gate has a noise model (the reward, eval and |Δlogp| gates), so (value − threshold) /
        noise is the margin in noise units; ``None`` otherwise.
    """

    name: str
    passed: bool
    value: float | None
    threshold: float | None
    window: tuple[int, int] | None
    evidence: str
    params: dict[str, Any]
    noise: float | None = None

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
            "noise": _finite_or_none(self.noise),
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
    num = number(_not_null(value))
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
Float = Annotated[float, BeforeValidator(_finite)]
OptFloat = Annotated[float | None, BeforeValidator(_finite_or_null)]
Int = Annotated[int, BeforeValidator(_whole)]
OptInt = Annotated[int | None, BeforeValidator(lambda v: None if v is None else _whole(v))]
RequireData = Annotated[bool, BeforeValidator(_true_or_false), Field(description=(
    "Fail (instead of pass) when the run has too little data to judge."))]


class GateContext(BaseModel):
    """Run facts the metrics do not carry, given to every gate (and recorded in the gate report,
    so ``asyncrl gates RUN`` re-judges with them). :meth:`of` reads them from the recipe.

    mode: the recipe's ``async.mode`` (information: no gate branches on it).
    max_staleness: the staleness bound the mode implies (``Recipe.async_.staleness_bound``: 0
        sync, 1 one_step, ``max_off_policy_steps`` or none for fully_async).
    candidates: how many candidates the stage judges together; the eval gates' z limits are
        Bonferroni-corrected for it (:func:`registry.gates.stats.z_limit`), so a stage of six
        candidates does not fail one of them by chance 6 × as often as a stage of one.
    max_off_policy_steps: set when too-stale samples are dropped (``staleness_within_bound``
        then judges the dropped fraction: the bound holds by construction).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: str | None = None
    max_staleness: OptInt = Field(None, ge=0)
    max_off_policy_steps: OptInt = Field(None, ge=0)
    candidates: Int = Field(1, ge=1, le=10_000)

    @classmethod
    def of(cls, recipe: Recipe, candidates: int = 1) -> GateContext:
        a = recipe.async_
        return cls(mode=a.mode, max_staleness=a.staleness_bound,
                   max_off_policy_steps=a.max_off_policy_steps, candidates=candidates)

    @property
    def lagged(self) -> bool | None:
        """Whether the run trains on samples from older weights (None: not known)."""
        return None if self.max_staleness is None else self.max_staleness > 0

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
    function registered with :func:`gate` names its subclass in its ``p`` annotation."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------------------------
# Reading a history
# --------------------------------------------------------------------------------------------

Point = tuple[int, float]


def number(v: Any) -> float | None:
    """A finite float, or None (None, bool, non-numbers, NaN/inf)."""
    if type(v) is float:  # the common case, first
        return v if math.isfinite(v) else None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy scalars are Real
        return None
    f = float(v)
    return f if math.isfinite(f) else None


class Run:
    """A metric history split into training rows (by step, later row wins) and all rows; and,
    where the run wrote ``eval.jsonl``, each eval's per-prompt rewards (``evals``, by step, a
    later record wins its step as in the history) and the reference run's last eval
    (``reference_eval``) for paired eval comparisons (:mod:`training.evals`)."""

    def __init__(self, history: Sequence[Mapping[str, Any]], *,
                 evals: Sequence[EvalOutcome] = (),
                 reference_eval: EvalOutcome | None = None) -> None:
        self.evals: dict[int, EvalOutcome] = {o.step: o for o in evals}
        self.reference_eval = reference_eval
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
                    v = number(raw)
                    if v is not None:
                        cols.setdefault(key, {})[step] = v
            for step, row in self.rows:  # eval/* from every row; a later row wins its step
                for key, raw in row.items():
                    if key.startswith("eval/"):
                        v = number(raw)
                        if v is not None:
                            cols.setdefault(key, {})[step] = v
            self._cols = {k: sorted(by_step.items()) for k, by_step in cols.items()}
        return self._cols

    def series(self, key: str) -> list[Point]:
        """Finite values of ``key`` in step order (``eval/*`` from every row); for a run logged
        under another framework's names, the first of :data:`ALIASES` ``[key]`` that it has."""
        cols = self._columns()
        pts = cols.get(key)
        if pts:
            return pts
        for alias in ALIASES.get(key, ()):
            if cols.get(alias):
                return cols[alias]
        return []

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


def tail_points(pts: Sequence[Point], frac: float) -> list[Point]:
    k = max(1, math.ceil(frac * len(pts) - 1e-9))
    return list(pts[-k:])


def mean_of(pts: Sequence[Point]) -> float:
    return sum(v for _, v in pts) / len(pts)


def span_of(pts: Sequence[Point]) -> tuple[int, int]:
    return pts[0][0], pts[-1][0]


def slope_of(pts: Sequence[Point]) -> float:
    """Least-squares slope of value on step: Σ(x−x̄)(y−ȳ) / Σ(x−x̄)²; 0 for a single step."""
    n = len(pts)
    xbar = sum(s for s, _ in pts) / n
    ybar = sum(v for _, v in pts) / n
    sxx = sum((s - xbar) ** 2 for s, _ in pts)
    if sxx == 0:
        return 0.0
    return sum((s - xbar) * (v - ybar) for s, v in pts) / sxx


def smooth(pts: Sequence[Point], k: int) -> list[Point]:
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


def fmt(x: float | None) -> str:
    """A number for a sentence: 4 significant digits, no exponent for ordinary magnitudes."""
    if x is None:
        return "n/a"
    if x == 0:
        return "0"
    if 1e-4 <= abs(x) < 1e6:
        return f"{x:.4g}"
    return f"{x:.3g}"


def pct(x: float) -> str:
    return f"{100 * x:.0f}%" if abs(100 * x) >= 10 else f"{100 * x:.1f}%"


def points(n: int) -> str:
    return f"{n} point" if n == 1 else f"{n} points"


def steps_text(window: tuple[int, int]) -> str:
    a, b = window
    return f"step {a}" if a == b else f"steps {a}–{b}"


# --------------------------------------------------------------------------------------------
# Registry plumbing
# --------------------------------------------------------------------------------------------

#: A gate: (run, its GateParams model, reference summary or None, GateContext) → GateResult.
GateFn = Callable[..., GateResult]

GATES: Registry[GateFn] = Registry("stability gate")


@cache
def params_of(fn: GateFn) -> type[GateParams]:
    """The model a gate function's ``p`` argument is annotated with."""
    model = get_type_hints(fn).get("p")
    assert isinstance(model, type) and issubclass(model, GateParams), (
        f"gate function {fn.__qualname__} must annotate its argument p with its GateParams "
        f"subclass, got {model!r}")
    return model


def gate(name: str) -> Callable[[GateFn], GateFn]:
    """Register a gate function under ``name``. Its parameters model is its ``p`` annotation,
    the one place the name → model link is declared (checked here, at import)."""

    def decorator(fn: GateFn) -> GateFn:
        params_of(fn)
        return GATES.register(name)(fn)

    return decorator


def result(name: str, p: GateParams, passed: bool, value: float | None,
            threshold: float | None, window: tuple[int, int] | None,
            evidence: str, noise: float | None = None) -> GateResult:
    return GateResult(name=name, passed=passed, value=value, threshold=threshold,
                      window=window, evidence=evidence, params=p.model_dump(), noise=noise)


def not_enough(name: str, p: Any, n: int, what: str, need: int) -> GateResult:
    verdict = (" — require_data is set, so the gate fails" if p.require_data
               else "; passing by default (set require_data: true to fail instead)")
    return result(name, p, not p.require_data, None, None, None,
                   f"not enough steps ({n}) with {what} to judge (need ≥ {need}){verdict}.")


def gate_names() -> list[str]:
    """Every registered gate, sorted."""
    return GATES.names()


def params_model(name: str) -> type[GateParams]:
    """Gate ``name``'s parameters model (a ``KeyError`` listing the valid gates if unknown)."""
    return params_of(GATES.get(name))


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


def validated(name: str, params: Mapping[str, Any] | None) -> GateParams:
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
    return validated(name, params).model_dump()


def evaluate_gate(name: str, history: Sequence[Mapping[str, Any]],
                  params: Mapping[str, Any] | None = None, *,
                  reference: Mapping[str, float] | None = None,
                  context: GateContext | Mapping[str, Any] | None = None,
                  evals: Sequence[EvalOutcome] = (),
                  reference_eval: EvalOutcome | None = None) -> GateResult:
    """Run one gate on a metric history (records as ``read_metrics`` returns them).

    Args:
        name: a name from :func:`gate_names`.
        history: per-step dicts with ``"step"`` and metric keys (values float or None).
        params: overrides of the gate's defaults (validated by :func:`check_params`).
        reference: :func:`summarize` of the reference run, or None for absolute thresholds.
        context: run facts the metrics lack (:class:`GateContext`, or its plain data, e.g.
            ``{"max_staleness": 1}``).
        evals: the run's per-prompt eval outcomes (``read_evals(run_dir / "eval.jsonl")``);
            with them the eval gates compare on the same prompts (paired SE).
        reference_eval: the reference run's last eval outcome, for a paired comparison with it.
    """
    return evaluate(name, Run(history, evals=evals, reference_eval=reference_eval),
                    validated(name, params), reference, context)


def evaluate_gates(specs: Sequence[tuple[str, Mapping[str, Any]]],
                   history: Sequence[Mapping[str, Any]], *,
                   reference: Mapping[str, float] | None = None,
                   context: GateContext | Mapping[str, Any] | None = None,
                   evals: Sequence[EvalOutcome] = (),
                   reference_eval: EvalOutcome | None = None) -> list[GateResult]:
    """Run several ``(name, params)`` gates on one history; every spec is validated before any
    gate runs, so a typo fails the whole call instead of a half-written report."""
    checked = [(name, validated(name, params)) for name, params in specs]
    run = Run(history, evals=evals, reference_eval=reference_eval)
    return [evaluate(name, run, p, reference, context) for name, p in checked]


def evaluate(name: str, run: Run, p: GateParams, reference: Mapping[str, float] | None,
              context: GateContext | Mapping[str, Any] | None) -> GateResult:
    return GATES.get(name)(run, p, reference, GateContext.read(context))


def ref_value(reference: Mapping[str, float] | None, key: str) -> float | None:
    return None if reference is None else number(reference.get(key))


def quarters(pts: Sequence[Point], frac: float) -> tuple[list[Point], list[Point]]:
    """The first and the last ``frac`` of the points (≥ 1 each)."""
    k = len(tail_points(pts, frac))
    return list(pts[:k]), list(pts[-k:])


def tail_means(run: Run, keys: Sequence[str], frac: float) -> dict[str, float]:
    out = {}
    for key in keys:
        pts = run.series(key)
        if pts:
            out[key] = mean_of(tail_points(pts, frac))
    return out


def diagnose_run(run: Run, tail: float = 0.25,
                 thresholds: Thresholds | None = None) -> Diagnosis:
    """Seed 001's decision tree on a run: the means of the last ``tail`` of every metric and the
    series its "rising" rules read — the train–rollout |Δlogp| over lag > 0 steps only (one-step's
    lag-0 first step is not the start of a rise), the staleness KL and the reward (B's "grow"
    and "continue" rules). ``thresholds``: the seed's defaults unless given (e.g. calibrated on
    a reference, :func:`training.algorithms.decision_tree.calibrated`)."""
    metrics = tail_means(run, run.metric_keys(), tail)
    series: dict[str, list[float]] = {}
    for quantity in ("response_length", "pg_clipfrac", "proxy3_pure_noise",
                     "train_rollout_diff", "engine_diff", "staleness_kl", "reward"):
        key, pts = run.first_series(METRIC_ALIASES[quantity])
        if quantity in ("train_rollout_diff", "staleness_kl"):
            pts = lagged_only(run, pts)
        if pts:
            series[key] = [v for _, v in pts]
    return diagnose(metrics, thresholds or DEFAULT_THRESHOLDS, series)


def lagged_only(run: Run, pts: Sequence[Point]) -> list[Point]:
    """``pts`` at the run's lag > 0 steps when it has any (one-step's lag-0 first step is not the
    start of a rise), else all of them: how the decision tree and :func:`quarter_ratio` read a
    rise of the train–rollout |Δlogp| or the staleness KL."""
    lag = dict(run.series(STALENESS_LAG))
    if any(v > 0 for v in lag.values()):
        return [(s, v) for s, v in pts if lag.get(s, 1.0) > 0]
    return list(pts)


def quarter_ratio(values: Sequence[float]) -> float | None:
    """Mean of the last quarter ÷ mean of the first (≥ 1 point each, as the decision tree's
    "rising" reads a series); None for fewer than 2 values or a first quarter ≤ 0."""
    if len(values) < 2:
        return None
    k = max(1, math.ceil(len(values) / 4 - 1e-9))
    first, last = sum(values[:k]) / k, sum(values[-k:]) / k
    return last / first if first > 0 else None
