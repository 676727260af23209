"""The runtime family: staleness within the async mode's bound, and the fraction of samples
dropped as too stale."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import Field

from registry.gates.core import (
    DEFAULT_THRESHOLDS,
    DROPPED_FRAC,
    STALENESS_MAX,
    STALENESS_MEAN,
    Float,
    GateContext,
    GateParams,
    GateResult,
    OptFloat,
    Point,
    RequireData,
    Run,
    fmt,
    gate,
    mean_of,
    not_enough,
    pct,
    result,
    span_of,
    steps_text,
)

if TYPE_CHECKING:
    pass


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

    max_staleness: OptFloat = Field(None, ge=0.0, description=(
        "Bound on async/staleness/max; null takes the run's own bound from the context."))
    max_dropped_frac: Float = Field(DEFAULT_THRESHOLDS.rs_mask_high, ge=0.0, le=1.0, description=(
        "With drops configured: the largest cumulative fraction of samples dropped as too stale."))
    require_data: RequireData = False


@gate("staleness_within_bound")
def _staleness_within_bound(run: Run, p: StalenessWithinBoundParams,
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
        return result(name, p, not failed, main.value, main.threshold, main.window,
                       f"{drops.evidence[:-1]}; {peak.evidence}")
    return _staleness_peak(name, p, run, bound, source)


def _staleness_peak(name: str, p: StalenessWithinBoundParams, run: Run,
                    bound: float | None, source: str) -> GateResult:
    """The peak ``async/staleness/max`` against ``bound`` (passes when there is none)."""
    pts = run.series(STALENESS_MAX)
    if bound is None:
        seen = f" (observed max {fmt(max(v for _, v in pts))})" if pts else ""
        return result(name, p, True, max((v for _, v in pts), default=None), None,
                       span_of(pts) if pts else None,
                       f"no bound configured: neither the max_staleness parameter nor the "
                       f"run context sets one{seen}.")
    if not pts:
        return not_enough(name, p, 0, STALENESS_MAX, 1)
    step, worst = max(pts, key=lambda sv: sv[1])
    mean = run.series(STALENESS_MEAN)
    mean_note = f", mean staleness {fmt(mean_of(mean))}" if mean else ""
    ok = worst <= bound
    evidence = (f"{STALENESS_MAX} peaked at {fmt(worst)} (step {step}) "
                f"{'≤' if ok else '>'} the bound {fmt(bound)} from {source} over "
                f"{steps_text(span_of(pts))}{mean_note}.")
    return result(name, p, ok, worst, bound, span_of(pts), evidence)


def _dropped_fraction(name: str, p: StalenessWithinBoundParams, run: Run,
                      dropped: list[Point], bound: float | None) -> GateResult:
    """With max_off_policy_steps set the runtime drops what exceeds the bound, so the bound
    holds by construction; the cumulative dropped fraction is the verdict."""
    if not dropped:
        return not_enough(name, p, 0, f"{DROPPED_FRAC} (drops are configured)", 1)
    step, frac = dropped[-1]  # cumulative: the last value covers the run
    ok = frac <= p.max_dropped_frac
    pts = run.series(STALENESS_MAX)
    seen = (f"; {STALENESS_MAX} peaked at {fmt(max(v for _, v in pts))}" if pts else "")
    tautology = ("the staleness bound holds by construction — samples beyond it are dropped"
                 + (f" (bound {fmt(bound)})" if bound is not None else "") + seen)
    evidence = (f"{'too many' if not ok else 'few enough'} samples dropped as too stale: "
                f"{DROPPED_FRAC} is {fmt(frac)} ({pct(frac)} of the samples, cumulative to step "
                f"{step}) {'>' if not ok else '≤'} {fmt(p.max_dropped_frac)}; {tautology}.")
    return result(name, p, ok, frac, p.max_dropped_frac, span_of(dropped), evidence)


