"""A run as a reference (:func:`summarize`), seed 001's decision tree on a run
(:func:`diagnosis_for`), and what a recipe must log for a gate (:func:`unmet_requirement`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry.gates.core import (
    ENGINE_DIFF,
    LOGPROB_DIFF,
    GateResult,
    Run,
    check_params,
    diagnose_run,
    evaluate,
    fmt,
    gate_names,
    lagged_only,
    mean_of,
    params_model,
    quarter_ratio,
    tail_means,
    tail_points,
)
from registry.gates.mismatch import mismatch_summary
from registry.gates.stats import step_sd
from training.algorithms.decision_tree import (
    ENGINE_AGREEMENT,
    FIXES,
    QUARTER_RATIO,
    UNSEPARATED,
    Diagnosis,
    calibrated,
    prescription,
)

if TYPE_CHECKING:
    from training.recipe import Recipe


# --------------------------------------------------------------------------------------------
# Reference summary and diagnosis
# --------------------------------------------------------------------------------------------


def summarize(history: Sequence[Mapping[str, Any]], tail: float = 0.25) -> dict[str, float]:
    """A run's summary, the ``reference`` later stages' gates compare against.

    For every numeric metric key: the mean of its last ``tail`` fraction of points (at least one),
    read like the gates read (training rows for training metrics, every row for ``eval/*``, None
    and non-numeric values skipped). With a metric logged every step this is the mean over the
    last 25 % of training steps; a sparse metric (eval every k steps) averages its own last 25 %
    of values. Plus ``<key>/sd``, the step-to-step spread of that window (at least 3 points),
    for the engine's same-weights agreement metrics (``ENGINE_AGREEMENT``), and
    ``<key>/quarter_ratio``, last/first quarter means, for the train–rollout (lagged steps) and
    the engine |Δlogp| — what the decision tree's calibration reads — and, for both |Δlogp|
    (:func:`~registry.gates.mismatch.mismatch_summary`): the fitted line's ``/slope``, ``/rise``,
    ``/start`` and ``/rel_rise`` (over the lag > 0 steps of a lagged run), and ``/sd``, ``/n`` —
    the step-to-step spread and size of the level's window, the noise the level gates use.
    """
    if not 0 < tail <= 1:
        raise ValueError(f"tail must be in (0, 1], got {tail!r}; 0.25 is the last quarter")
    run = Run(history)
    out = tail_means(run, run.metric_keys(), tail)
    out.update(mismatch_summary(run, tail))
    # what the decision tree's calibration reads: each same-weights metric's spread (the last
    # ``tail`` of points, at least the last 3, as mismatch_summary's /sd) and each |Δlogp|
    # series' own rise (last/first quarter means, the train–rollout one over the lagged steps)
    for key, _ in ENGINE_AGREEMENT:
        all_pts = run.series(key)
        pts = tail_points(all_pts, tail)
        pts = pts if len(pts) >= 3 else list(all_pts[-3:])
        if len(pts) >= 3:
            out[f"{key}/sd"] = step_sd([v for _, v in pts])
    for key in (LOGPROB_DIFF, ENGINE_DIFF):
        pts = run.series(key)
        ratio = quarter_ratio([v for _, v in (lagged_only(run, pts) if key == LOGPROB_DIFF
                                              else pts)])
        if ratio is not None:
            out[f"{key}/{QUARTER_RATIO}"] = ratio
    return dict(sorted(out.items()))


def diagnosis_as_judged(history: Sequence[Mapping[str, Any]], recipe: Recipe | None,
                        judged_with: Mapping[str, Any]) -> RunDiagnosis:
    """:func:`diagnosis_for` with what a campaign judged the run with (a gate report's
    ``judged_with``): the first reference summary calibrates the tree's thresholds, the run's
    staleness bound is the lag (unbounded: at least one update of lag). The campaign's verdict,
    its remediation and the dashboard all diagnose a run this way, so they agree."""
    refs = judged_with.get("references") or {}
    reference = next(iter(refs.values()), None)
    lag = (judged_with.get("context") or {}).get("max_staleness")
    return diagnosis_for(history, recipe, reference=reference, lag=1 if lag is None else lag)


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


def _attribute_logprob_failure(run: Run, d: Diagnosis) -> str:
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
    tr_level, en_level = mean_of(tail_points(tr, 0.25)), mean_of(tail_points(en, 0.25))
    return "A" if en_level >= 0.5 * tr_level else "B"


@dataclass
class Prescribed:
    """One decision-tree cause found on a run, with its fix as a recipe override.

    cause: "A"–"F", or "unseparated" (a drift whose source the run's old_logprob strategy
        cannot split). title, fix: seed 001's words. evidence: the metric comparisons (and a
        failing ``logprob_diff_flat``'s evidence, joined to the cause it belongs to).
    override: the fix as dotted recipe keys → values (:func:`prescription`), tailored to the
        run's recipe when known; override_error: why it does not load on that recipe (None if
        it does, or with no recipe).
    info: information only (seed 001's "ESS ≥ 0.5 and reward stable → continue").
    engine_exact: for "unseparated", the run's ``mismatch/engine/exact`` (None otherwise).
    """

    cause: str
    title: str
    evidence: list[str]
    fix: str
    override: dict[str, Any]
    override_error: str | None = None
    info: bool = False
    engine_exact: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.cause != "unseparated":
            out.pop("engine_exact")
        return out


@dataclass(frozen=True)
class SkippedGate:
    """A gate the diagnosis does not run without a reference, and why."""

    name: str
    why: str


@dataclass(frozen=True)
class RunDiagnosis:
    """Seed 001's decision tree on one run (:func:`diagnosis_for`), typed up to the JSON edge
    (:meth:`to_dict`: the campaign record, ``verdict.json``, ``asyncrl diagnose --json``).

    causes: the causes found, in order ("A"…); findings: one :class:`Prescribed` each; notes:
    information-only findings; unseparated: a drift the strategy cannot attribute (or None);
    engine_exact: ``mismatch/engine/exact`` (None if not logged); healthy: no cause, nothing
    unseparated, and the tree saw nothing wrong; escalation / escalation_text: seed 001's rung
    (None if none); missing: metrics the tree wanted and the run lacks; window: first and last
    training step; failed_gates: gates at their defaults that fail; skipped_gates: gates left
    out without a reference; summary: one paragraph for a verdict; calibration: the tree's
    thresholds taken from the reference, one line each (empty without a reference).
    """

    causes: list[str]
    findings: list[Prescribed]
    notes: list[Prescribed]
    unseparated: Prescribed | None
    engine_exact: float | None
    healthy: bool
    escalation: str | None
    escalation_text: str | None
    missing: list[str]
    window: tuple[int, int] | None
    failed_gates: list[GateResult]
    skipped_gates: list[SkippedGate]
    summary: str
    calibration: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, the layout stored in the registry's campaign record."""
        return {
            "causes": list(self.causes),
            "findings": [f.to_dict() for f in self.findings],
            "notes": [f.to_dict() for f in self.notes],
            "unseparated": self.unseparated.to_dict() if self.unseparated else None,
            "engine_exact": self.engine_exact,
            "healthy": self.healthy,
            "escalation": self.escalation,
            "escalation_text": self.escalation_text,
            "missing": list(self.missing),
            "window": list(self.window) if self.window is not None else None,
            "failed_gates": [r.to_dict() for r in self.failed_gates],
            "skipped_gates": [dataclasses.asdict(g) for g in self.skipped_gates],
            "summary": self.summary,
            "calibration": list(self.calibration),
        }


def diagnosis_for(history: Sequence[Mapping[str, Any]],
                  recipe: Recipe | None = None,
                  reference: Mapping[str, float] | None = None,
                  lag: int = 1) -> RunDiagnosis:
    """Seed 001's A–F decision tree on a run (for a stage nobody passed, ``asyncrl diagnose``).

    ``training.algorithms.decision_tree.diagnose`` gets the means of the last 25 % of points of
    every metric and the per-step series of response length, PPO clip fraction, proxy-3 noise
    and the train–rollout and engine |Δlogp|. It names A from ``mismatch/engine/*`` only when
    ``mismatch/engine/exact`` is 1, B from ``is/staleness/*`` and from a train–rollout rise the
    exact engine gap does not share. When ``logprob_diff_flat`` fails, its evidence joins the
    cause its source belongs to (see :func:`_attribute_logprob_failure`); a failure whose source
    cannot be separated under the run's old_logprob strategy is reported as ``unseparated``
    with the prescription to rerun under ``snapshot`` — never forced into A.

    Every finding carries its fix as a recipe override (dotted keys → values,
    :func:`training.algorithms.decision_tree.prescription`), tailored to ``recipe`` (MoE or
    dense, its LR) when given; with a recipe the override is applied and validated, and
    ``override_error`` says why it does not load (None when it does). Every gate runs at its
    defaults with no reference, except those whose default is only meaningful against one
    (``zero_variance_groups``), listed in ``skipped_gates`` with the reason and named in the
    summary; the gates that fail are in ``failed_gates``.

    With ``reference`` (a healthy run's :func:`summarize`: the campaign's baseline), the tree's
    thresholds that seed 001 measured on another stack are taken from it
    (:func:`training.algorithms.decision_tree.calibrated`, ``lag`` = the run's staleness bound),
    listed in ``calibration`` and named in the summary.
    """
    run = Run(history)
    thresholds, calibration = (calibrated(reference, lag) if reference else (None, ()))
    d = diagnose_run(run, thresholds=thresholds)
    facts = _recipe_facts(recipe)

    def finding(cause: str, title: str, evidence: list[str], fix: str,
                info: bool = False) -> Prescribed:
        override = prescription(cause, **facts)
        return Prescribed(cause, title, evidence, fix, override,
                          _check_override(recipe, override), info)

    notes = [finding(f.cause, f.title, [str(e) for e in f.evidence], f.fix, info=True)
             for f in d.findings if f.info]
    findings = [finding(f.cause, f.title, [str(e) for e in f.evidence], f.fix)
                for f in d.findings if not f.info]
    unseparated_ev = [str(e) for e in d.unseparated]
    lp = evaluate("logprob_diff_flat", run, params_model("logprob_diff_flat")(), None, None)
    if not lp.passed:
        source = _attribute_logprob_failure(run, d)
        if source == "unseparated":
            unseparated_ev.append(lp.evidence)
        else:
            found = next((f for f in findings if f.cause == source), None)
            if found is not None:
                found.evidence.append(lp.evidence)
            else:
                title, fix = FIXES[source]
                findings.append(finding(source, title, [lp.evidence], fix))
                findings.sort(key=lambda f: f.cause)
    unseparated = None
    if unseparated_ev:
        unseparated = finding("unseparated", UNSEPARATED[0], unseparated_ev, UNSEPARATED[1])
        unseparated.engine_exact = d.engine_exact
    judged = [n for n in gate_names() if n not in _NEEDS_REFERENCE]
    skipped = [SkippedGate(n, why) for n, why in _NEEDS_REFERENCE.items()]
    failed = [r for r in (evaluate(n, run, params_model(n)(), None, None) for n in judged)
              if not r.passed]
    causes = [f.cause for f in findings]
    parts = []
    if causes:
        parts.append("the metrics point to cause(s) " + ", ".join(causes) + " of seed 001's "
                     "decision tree: " + "; ".join(f"{f.cause} = {f.title}" for f in findings))
    for n in notes:
        parts.append(f"cause {n.cause} ({n.title}) is information only: seed 001's "
                     "'ESS ≥ 0.5 and reward stable → continue' holds")
    if unseparated is not None:
        parts.append("the train–rollout drift cannot be split into engine mismatch and staleness "
                     "under this run's old_logprob strategy (mismatch/engine/exact "
                     f"{fmt(d.engine_exact)}): rerun with algorithm.old_logprob: snapshot")
    if parts:
        summary = "; ".join(parts) + "."
    elif failed:
        summary = ("no decision-tree cause matched, but gates failed: "
                   + ", ".join(r.name for r in failed) + ".")
    else:
        summary = "no decision-tree cause matched and every default gate passes."
    if calibration:
        summary += " Thresholds from the reference: " + "; ".join(calibration) + "."
    summary += (" Not judged without a reference: " + ", ".join(g.name for g in skipped)
                + " (give it relative_to a baseline in a campaign).")
    return RunDiagnosis(
        causes=causes, findings=findings, notes=notes, unseparated=unseparated,
        engine_exact=d.engine_exact,
        healthy=d.healthy and not causes and unseparated is None,
        escalation=d.escalation, escalation_text=_ESCALATION_TEXT.get(d.escalation or ""),
        missing=list(d.missing),
        window=(run.train[0][0], run.train[-1][0]) if run.train else None,
        failed_gates=failed, skipped_gates=skipped, summary=summary,
        calibration=list(calibration))


# --------------------------------------------------------------------------------------------
# What a recipe must produce for a gate
# --------------------------------------------------------------------------------------------


def unmet_requirement(name: str, params: Mapping[str, Any] | None,
                      recipe: Recipe) -> str | None:
    """Why ``recipe`` cannot produce what gate ``name`` (with ``params``) needs to judge — one
    line naming the fix — or None when it can. The campaign loader calls it for every candidate
    so a campaign is refused before anything trains.

    * ``eval_tracks_reward`` and ``eval_not_degraded`` need evaluation: ``eval.n`` > 0.
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
    if name in ("eval_tracks_reward", "eval_not_degraded") and recipe.eval.n == 0:
        return (f"gate {name} needs evaluation but the recipe has eval.n: 0; set "
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

