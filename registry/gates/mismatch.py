"""The mismatch family: the train–rollout |Δlogp| headline, its engine component, and the IS
health of each correction source (seeds 000, 001 and 004).

Seed 004 splits the train–rollout gap into sources that need different rules. The engine
component (same weights, two engines: ``mismatch/engine/*``, exact under ``snapshot``) must stay
at the sync reference's level and must not grow. The staleness component is one update of the
policy per step of lag — in a lagged mode the headline ``mismatch/train_rollout/*`` starts at
(engine gap + lag × the size of one update) on its first lagged step, wherever the learning rate
puts that; seed 000's failing runs were the ones where it then *grew* ("when it stayed flat, the
system was healthy"). So in a lagged mode the headline is judged on its growth only, relative to
its own first lagged steps (lag-0 steps left out) and to the reference's own growth; its level is
shown beside the level that the engine gap and the measured update size (``policy/update/*``)
predict. Every limit is the larger of the seed's effect size and a noise floor
(:mod:`registry.gates.stats`), and the evidence names the one that binds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pydantic import Field

from registry.gates.core import (
    DEFAULT_THRESHOLDS,
    ENGINE_DIFF,
    ENGINE_EXACT,
    IS_SOURCES,
    LOGPROB_DIFF,
    RATIO_MEAN_SOURCES,
    STALENESS_LAG,
    UPDATE_DIFF,
    Float,
    GateContext,
    GateParams,
    GateResult,
    Int,
    OptFloat,
    Point,
    RequireData,
    Run,
    diagnose_run,
    fmt,
    gate,
    mean_of,
    not_enough,
    pct,
    points,
    ref_value,
    result,
    span_of,
    steps_text,
    tail_means,
    tail_points,
)
from registry.gates.stats import diff_se, level, trend


class _MismatchParams(GateParams):
    max_rise: Float = Field(0.5, ge=0.0, description=(
        "Growth: the largest fitted rise over the judged points, relative to the fitted start, "
        "beyond the reference's own relative rise (a falling reference counts as 0)."))
    t_limit: Float = Field(3.0, gt=0.0, description=(
        "Growth: the fitted rise must also exceed this many standard errors of itself (its "
        "slope's t statistic) to count."))
    max_ratio: Float = Field(1.5, gt=0.0, description=(
        "Level (with a reference, outside lagged modes): the largest level as a multiple of the "
        "reference's level."))
    z_limit: Float = Field(3.0, gt=0.0, description=(
        "Level: the level must also exceed the reference's by this many standard errors of the "
        "difference (from both runs' step-to-step spread)."))
    max_level: OptFloat = Field(None, gt=0.0, description=(
        "An absolute ceiling on the level, checked in every mode; null (default) for none — "
        "the seeds' absolute numbers come from another stack."))
    tail: Float = Field(0.25, gt=0.0, le=1.0, description=(
        "Fraction of the judged points (at least three) whose mean is the level."))
    require_data: RequireData = False


class LogprobDiffFlatParams(_MismatchParams):
    """``logprob_diff_flat``: seed 000's headline, the train–rollout |Δlogp|
    (``mismatch/train_rollout/logprob_abs_diff/mean``: engine mismatch *and* staleness), must not
    grow; outside lagged modes its level must also stay at the reference's.

    Growth: the least-squares line through the judged points (in a lagged mode — ``context``
    ``max_staleness`` > 0, or any ``async/staleness/mean`` > 0 — the steps whose samples had lag
    0 are left out: one-step's first step is a sync step) rises from ``start`` by ``rise``. It
    fails when rise > max((ref_rel⁺ + ``max_rise``) × start, ``t_limit`` × SE(rise)), ref_rel the
    reference's own relative rise (:func:`summarize`'s ``.../rel_rise``). Without a reference
    ref_rel = 0: a 1.5× rise that is ``t_limit`` SE clear fails, the decision tree's "rising".

    Level (not in lagged modes; with a reference): the mean of the last ``tail`` of the points
    fails when above max(``max_ratio`` × ref, ref + ``z_limit`` × SE), SE from both runs'
    step-to-step spread. ``max_level``, when set, is an absolute ceiling in every mode.

    Seed 000: sync flat at 0.025, uncorrected one-step ×4 by step 130 (rise 3.0, fails), R3 +
    DPPO flat. Embedded testbed (README): one-step flat at 0.040 vs sync 0.008–0.013: a level
    set by lag × update size, which passes; group-16 one-step 0.028 → 0.061 (rise 1.2), fails.
    """


class EngineMismatchFlatParams(_MismatchParams):
    """``engine_mismatch_flat``: the engine component alone — ``mismatch/engine/logprob_abs_diff/
    mean``, the trainer at each token's own behaviour version vs the rollout engine — at the
    reference's level and not growing, in every mode (the same rules and parameters as
    ``logprob_diff_flat``'s level and growth; lag does not enter it). It decides only where the
    component is exact (``mismatch/engine/exact`` = 1 on every judged step: ``old_logprob``
    snapshot, dedicated or interrupt, or a sync run); under recompute in a lagged mode the
    "engine" metric carries the staleness too, and the verdict says so and passes.
    """


def lagged_points(run: Run, pts: Sequence[Point], context: GateContext
                  ) -> tuple[list[Point], int, bool]:
    """The points a lagged-mode judgement uses: those of steps with lag > 0
    (``async/staleness/mean``), the number left out, and whether the run is lagged at all."""
    lag = dict(run.series(STALENESS_LAG))
    lagged = bool(context.lagged) or any(v > 0 for v in lag.values())
    if not lagged or not lag:
        return list(pts), 0, lagged
    kept = [(s, v) for s, v in pts if lag.get(s, 1.0) > 0]
    return kept, len(pts) - len(kept), True


def _ref_se(reference: Mapping[str, float] | None, key: str) -> float:
    sd, n = ref_value(reference, f"{key}/sd"), ref_value(reference, f"{key}/n")
    return sd / math.sqrt(n) if sd is not None and n else 0.0


def _expected_level(run: Run, tail: float) -> str:
    """In a lagged mode: the level the engine gap and one update's size predict, as a clause."""
    m = tail_means(run, [ENGINE_DIFF, UPDATE_DIFF, STALENESS_LAG], tail)
    if UPDATE_DIFF not in m or STALENESS_LAG not in m:
        return ("level not judged in a lagged mode (no policy/update/* to predict it from)")
    engine = m.get(ENGINE_DIFF, 0.0)
    expected = engine + m[STALENESS_LAG] * m[UPDATE_DIFF]
    return (f"level not judged in a lagged mode (engine gap {fmt(engine)} + lag "
            f"{fmt(m[STALENESS_LAG])} × update size {fmt(m[UPDATE_DIFF])} ≈ {fmt(expected)})")


def judge_mismatch(name: str, key: str, label: str, run: Run, p: _MismatchParams,
                   pts: Sequence[Point], reference: Mapping[str, float] | None, *,
                   lagged: bool, left_out: int) -> GateResult:
    """Growth (always) and level (outside lagged modes, with a reference) of one |Δlogp|
    series, each against max(effect size, noise floor); see :class:`LogprobDiffFlatParams`."""
    tr = trend(pts)
    if tr is None:
        return not_enough(name, p, len(pts), key + (" at lag > 0" if lagged else ""), 3)
    tail = tail_points(pts, p.tail)
    if len(tail) < 3:
        tail = list(pts[-3:])
    lv = level(tail)
    ref = ref_value(reference, key)
    has_ref = ref is not None and ref > 0
    ref_rel = ref_value(reference, f"{key}/rel_rise") if has_ref else None
    base = tr.start if tr.start > 0 else lv.mean
    allowed = (max(ref_rel or 0.0, 0.0) + p.max_rise) * base
    noise = p.t_limit * tr.rise_se
    rise_limit = max(allowed, noise)
    growing = tr.rise > rise_limit
    whole = (tr.first, tr.last)
    ref_txt = (f"the reference's {pct(ref_rel)}" + (" (a fall: 0)" if ref_rel < 0 else "")
               if ref_rel is not None else "no reference rise: 0")
    binds = "effect size" if allowed >= noise else "noise"
    growth = (f"fitted {fmt(tr.start)} → {fmt(tr.end)} over {steps_text(whole)} "
              f"({points(tr.n)}{f', {left_out} lag-0 step(s) left out' if left_out else ''}): "
              f"rise {fmt(tr.rise)} {'>' if growing else '≤'} limit {fmt(rise_limit)} = "
              f"max(({ref_txt} + {fmt(p.max_rise)}) × start {fmt(base)} = {fmt(allowed)}, "
              f"{fmt(p.t_limit)} × SE {fmt(tr.rise_se)} = {fmt(noise)}; {binds} binds), "
              f"t = {fmt(tr.t)}")
    too_high, level_limit, level_txt, level_se = False, None, "", None
    if lagged:
        level_txt = ""
    elif has_ref:
        se = diff_se(lv.se, _ref_se(reference, key))
        ratio_limit, noise_limit = p.max_ratio * ref, ref + p.z_limit * se
        level_limit = max(ratio_limit, noise_limit)
        too_high, level_se = lv.mean > level_limit, se
        z = (lv.mean - ref) / se if se > 0 else math.inf if lv.mean > ref else 0.0
        level_txt = (f"level {fmt(lv.mean)} (last {points(lv.n)}) vs the reference's "
                     f"{fmt(ref)}: {fmt(lv.mean - ref)} = {fmt(z)} SE, "
                     f"{'>' if too_high else '≤'} limit {fmt(level_limit)} = "
                     f"max({fmt(p.max_ratio)} × {fmt(ref)}, {fmt(ref)} + {fmt(p.z_limit)} SE)")
    else:
        level_txt = f"level {fmt(lv.mean)} (last {points(lv.n)}; no reference level to judge it by)"
    over_abs = p.max_level is not None and lv.mean > p.max_level
    if p.max_level is not None:
        level_txt += (f"; {'above' if over_abs else 'within'} the absolute ceiling "
                      f"{fmt(p.max_level)}")
    if lagged:
        level_txt = _expected_level(run, p.tail) + level_txt
    noise: float | None = tr.rise_se
    if growing:
        verdict, value, threshold, window = "is growing", tr.rise, rise_limit, whole
    elif too_high or over_abs:
        limit = level_limit if too_high else p.max_level
        verdict, value, threshold, window = "is too high", lv.mean, limit, span_of(tail)
        noise = level_se if too_high else None
    else:
        verdict, value, threshold, window = "stayed flat", tr.rise, rise_limit, whole
    evidence = f"{label} {verdict}: {growth}; {level_txt}."
    return result(name, p, not (growing or too_high or over_abs), value, threshold, window,
                  evidence, noise=noise)


@gate("logprob_diff_flat")
def _logprob_diff_flat(run: Run, p: LogprobDiffFlatParams, reference: Mapping[str, float] | None,
                       context: GateContext) -> GateResult:
    pts, left_out, lagged = lagged_points(run, run.series(LOGPROB_DIFF), context)
    return judge_mismatch("logprob_diff_flat", LOGPROB_DIFF, "train–rollout mean |Δlogp|", run,
                          p, pts, reference, lagged=lagged, left_out=left_out)


@gate("engine_mismatch_flat")
def _engine_mismatch_flat(run: Run, p: EngineMismatchFlatParams,
                          reference: Mapping[str, float] | None,
                          context: GateContext) -> GateResult:
    name = "engine_mismatch_flat"
    pts = run.series(ENGINE_DIFF)
    if not pts:
        return result(name, p, not p.require_data, None, None, None,
                      f"{ENGINE_DIFF} is absent (a run that does not split engine mismatch from "
                      "staleness): this gate does not decide"
                      + (" — require_data is set, so it fails." if p.require_data else "."))
    exact = dict(run.series(ENGINE_EXACT))
    inexact = [s for s, _ in pts if exact.get(s, 0.0) < 1.0]
    if inexact:
        return result(name, p, not p.require_data, None, None, None,
                      f"the engine component is not exact on {len(inexact)} of {len(pts)} steps "
                      f"({ENGINE_EXACT} < 1: π_old is not each token's behaviour version, e.g. "
                      "recompute under lag), so it carries staleness: this gate does not "
                      "decide; rerun with algorithm.old_logprob: snapshot to judge it"
                      + (" — require_data is set, so it fails." if p.require_data else "."))
    return judge_mismatch(name, ENGINE_DIFF, "engine mean |Δlogp| (same weights)", run, p, pts,
                          reference, lagged=False, left_out=0)


def mismatch_summary(run: Run, tail: float = 0.25) -> dict[str, float]:
    """What the mismatch gates read from a reference, for the headline and the engine
    component: ``<key>/slope``, ``/rise``, ``/start`` and ``/rel_rise`` (the fitted line over
    the run's lag > 0 steps when it has any, else all), ``/sd`` and ``/n`` (step-to-step spread
    and count of the last ``tail`` of those points)."""
    out: dict[str, float] = {}
    for key in (LOGPROB_DIFF, ENGINE_DIFF):
        pts = run.series(key)
        if key == LOGPROB_DIFF:
            pts, _, _ = lagged_points(run, pts, GateContext())
        tr = trend(pts)
        if tr is None:
            if len(pts) == 2:  # a line through two points has no noise estimate
                out[f"{key}/slope"] = (pts[1][1] - pts[0][1]) / max(pts[1][0] - pts[0][0], 1)
                out[f"{key}/rise"] = pts[1][1] - pts[0][1]
            continue
        out[f"{key}/slope"], out[f"{key}/rise"], out[f"{key}/start"] = tr.slope, tr.rise, tr.start
        if tr.start > 0:
            out[f"{key}/rel_rise"] = tr.rise / tr.start
        t = tail_points(pts, tail)
        t = t if len(t) >= 3 else list(pts[-3:])
        lv = level(t)
        out[f"{key}/sd"], out[f"{key}/n"] = lv.sd, float(lv.n)
    return out


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

    min_ess: Float = Field(DEFAULT_THRESHOLDS.ess_min, ge=0.0, le=1.0, description=(
        "Smallest mean ESS over the last `tail` of the points, per IS source."))
    max_mask_frac: Float = Field(DEFAULT_THRESHOLDS.rs_mask_high, ge=0.0, le=1.0, description=(
        "Largest mean mask fraction over the last `tail` of the points, per IS source."))
    max_chi2_token: Float = Field(DEFAULT_THRESHOLDS.chi2_token_blowup, ge=0.0, description=(
        "Largest mean χ²_token over the last `tail` of the points."))
    tail: Float = Field(0.25, gt=0.0, le=1.0, description=(
        "Fraction of the points (at least one) averaged."))
    require_data: RequireData = False


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

    delta: Float = Field(0.005, gt=0.0, le=1.0, description=(
        "Half-width of the band [1 − delta, 1 + delta] each source's IS ratio mean must stay in."))
    max_steps: Int = Field(1, ge=0, description=(
        "Steps outside the band allowed per source."))
    require_data: RequireData = False




_VERL_IS = {"ess": "rollout_corr/rollout_is_eff_sample_size",
            "mask_frac": "rollout_corr/rollout_rs_masked_fraction"}
_CHI2_KEYS = ("mismatch/train_rollout/chi2_token", "mismatch/engine/chi2_token",
              "rollout_corr/chi2_token")


@gate("is_health")
def _is_health(run: Run, p: IsHealthParams, reference: Mapping[str, float] | None,
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
            tail = tail_points(pts, p.tail)
            measured.append((src, key, label, mean_of(tail), limit, at_least, span_of(tail)))
    if not measured:
        keys = [f"is/{s}/{q}" for s in IS_SOURCES for q in ("ess", "mask_frac")]
        keys += list(_VERL_IS.values()) + list(_CHI2_KEYS)
        return result(name, p, not p.require_data, None, None, None,
                       f"no IS metrics: none of {', '.join(keys)} was logged"
                       + (" — require_data is set, so the gate fails."
                          if p.require_data else "; passing by default."))
    failed = [m for m in measured if (m[3] < m[4] if m[5] else m[3] > m[4])]
    _, key, _, value, limit, _, window = (failed or measured)[0]
    by_source: dict[str, list[str]] = {}
    for src, k, label, v, lim, at_least, _ in measured:
        ok = v >= lim if at_least else v <= lim
        op = (("≥" if ok else "<") if at_least else ("≤" if ok else ">"))
        by_source.setdefault(src, []).append(f"{label} {fmt(v)} {op} {fmt(lim)} ({k})")
    rung = diagnose_run(run).escalation
    bad = sorted({m[0] for m in failed}, key=lambda x: (x not in IS_SOURCES, x))
    evidence = ((f"IS correction is failing ({', '.join(bad)})" if failed
                 else "IS correction is healthy")
                + f" over the last {pct(p.tail)} of points: "
                + "; ".join(f"{src}: " + ", ".join(parts) for src, parts in by_source.items())
                + (f"; seed 001's escalation rung: {rung}" if rung else "") + ".")
    return result(name, p, not failed, value, limit, window, evidence)


@gate("is_weight_mean_band")
def _is_weight_mean_band(run: Run, p: IsWeightMeanBandParams,
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
        return not_enough(name, p, 0, keys, 1)
    parts = []
    worst: tuple[int, float, str, list[Point]] | None = None  # outside count, |dev|, src, pts
    for src, key, pts, out in found:
        if out:
            s_far, v_far = max(out, key=lambda sv: abs(sv[1] - 1.0))
            parts.append(f"{key} left [{fmt(lo)}, {fmt(hi)}] on {len(out)} of {len(pts)} steps "
                         f"(the farthest {fmt(v_far)} at step {s_far}; "
                         f"{'>' if len(out) > p.max_steps else '≤'} {p.max_steps} allowed)")
        else:
            parts.append(f"{key} stayed in [{fmt(lo)}, {fmt(hi)}] on all {len(pts)} steps "
                         f"(range {fmt(min(v for _, v in pts))}–{fmt(max(v for _, v in pts))})")
        dev = max((abs(v - 1.0) for _, v in out), default=0.0)
        if worst is None or (len(out), dev) > (worst[0], worst[1]):
            worst = (len(out), dev, src, pts)
    assert worst is not None
    failed = [f for f in found if len(f[3]) > p.max_steps]
    n_out, _, src, pts = worst
    verdict = (f"IS ratio mean left its band ({', '.join(f[0] for f in failed)}; seed 000's "
               "Fix-2 trigger → two-sided bounds)" if failed else "IS ratio means stayed at 1")
    return result(name, p, not failed, float(n_out), float(p.max_steps), span_of(pts),
                   f"{verdict}: " + "; ".join(parts) + ".")


