"""The policy family: entropy, clip fraction, repetition, response length, rollout log-prob and
gradient norm (seeds 000 and 001: the signals that precede a collapse)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import Field

from registry.gates.core import (
    DEFAULT_THRESHOLDS,
    ENTROPY,
    GRAD_NORM,
    REPETITION,
    RESPONSE_LENGTH,
    REWARD,
    ROLLOUT_LOGPROB,
    Float,
    GateContext,
    GateParams,
    GateResult,
    Int,
    OptFloat,
    RequireData,
    Run,
    fmt,
    gate,
    mean_of,
    not_enough,
    pct,
    points,
    quarters,
    ref_value,
    result,
    slope_of,
    smooth,
    span_of,
    steps_text,
    tail_points,
)
from training.algorithms.decision_tree import METRIC_ALIASES

if TYPE_CHECKING:
    pass


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

    spike_factor: Float = Field(2.0, gt=1.0, description=(
        "A step above this multiple of the median of the previous `window` points is a spike."))
    window: Int = Field(5, ge=1, description=(
        "Points in the median a step is compared with."))
    sustained_factor: Float = Field(1.5, gt=1.0, description=(
        "The last `tail` of the points above this multiple of the first `tail` (or of the "
        "reference's level) is a sustained rise."))
    tail: Float = Field(0.25, gt=0.0, le=0.5, description=(
        "Fraction of the points at each end compared for a sustained rise."))
    require_data: RequireData = False


class PgClipfracParams(GateParams):
    """``pg_clipfrac``: seed 001 cause E (PPO clip saturation) — ``policy/pg_clipfrac`` above
    ``max_level`` *and* rising: the mean of the last ``tail`` fraction of points above the mean
    of the first ``tail`` fraction ("rising clip fraction across epochs signals excessive
    divergence from the sampling policy").

    max_level: 0.2 — ``Thresholds.pg_clipfrac_max`` (seed 001: "pg_clipfrac > 0.2 and rising").
    tail: 0.25. (Seed 000 Fix 3: with 1 PPO epoch the clip "effectively never activates", so on
        such recipes this gate passes at ≈ 0.)
    """

    max_level: Float = Field(DEFAULT_THRESHOLDS.pg_clipfrac_max, ge=0.0, le=1.0, description=(
        "Largest mean pg_clipfrac over the last `tail` of the points while it is rising."))
    tail: Float = Field(0.25, gt=0.0, le=0.5, description=(
        "Fraction of the points at each end compared."))
    require_data: RequireData = False


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

    max_increase: Float = Field(0.1, ge=0.0, le=1.0, description=(
        "Largest rise of the repetition rate above the reference's level (else the run's first "
        "`tail` of the points)."))
    max_level: OptFloat = Field(None, ge=0.0, le=1.0, description=(
        "Absolute ceiling on the repetition rate; null for none."))
    tail: Float = Field(0.25, gt=0.0, le=0.5, description=(
        "Fraction of the points at each end compared."))
    require_data: RequireData = False


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
    max_rise: Float = Field(0.2, gt=0.0, description=(
        "Largest relative rise of the smoothed response length over its minimum within `window` "
        "steps."))
    window: Int = Field(DEFAULT_THRESHOLDS.length_window_steps, ge=1, description=(
        "Steps back the minimum is taken over."))
    smooth: Int = Field(3, ge=1, description=(
        "Points in the trailing mean of the response length."))
    require_data: RequireData = False


class RolloutLogprobNotDecreasingParams(GateParams):
    """``rollout_logprob_not_decreasing``: seed 000 — in failed runs the mean log-prob of the
    policy's own samples kept falling; in stable runs it slowly rose. Fails when the least-squares
    slope of ``rollout/logprob_mean`` is below −``max_decline`` *and* the fitted fall over the run
    exceeds ``min_drop``.

    max_decline: 0.001 nats/token per step (−0.1 over 100 steps).
    min_drop: 0.05 nats/token over the run (per-step noise of a small batch is ≈ 0.05).
    """

    max_decline: Float = Field(0.001, ge=0.0, description=(
        "Largest fall per step of the least-squares slope of rollout/logprob_mean (fails only "
        "with a fitted fall above min_drop too)."))
    min_drop: Float = Field(0.05, ge=0.0, description=(
        "Fitted fall over the run a slope below −max_decline must also exceed."))
    require_data: RequireData = False


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

    factor: Float = Field(10.0, gt=1.0, description=(
        "A grad norm above this multiple of the median of the previous `window` points is a "
        "spike."))
    window: Int = Field(5, ge=1, description=(
        "Points in the median (zeros left out); also the steps of reward before a spike."))
    after: Int = Field(5, ge=1, description=(
        "Steps of reward after a spike compared with the reward before it."))
    require_data: RequireData = False


@gate("entropy_no_blowup")
def _entropy_no_blowup(run: Run, p: EntropyNoBlowupParams,
                       reference: Mapping[str, float] | None,
                       context: GateContext) -> GateResult:
    name = "entropy_no_blowup"
    pts = run.series(ENTROPY)
    if len(pts) < p.window + 1:
        return not_enough(name, p, len(pts), ENTROPY, p.window + 1)
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
    whole = span_of(pts)
    head, tail = quarters(pts, p.tail)
    level = mean_of(tail)
    ref = ref_value(reference, ENTROPY)
    base, base_label = ((ref, "the reference level") if ref is not None and ref > 0
                        else (mean_of(head), f"the first {points(len(head))}"))
    sustained_ratio = level / base if base > 0 else None
    sustained = sustained_ratio is not None and sustained_ratio > p.sustained_factor
    sustained_text = (
        f"the last {points(len(tail))} average {fmt(level)} = "
        f"{sustained_ratio:.2f}× {base_label} {fmt(base)} "
        f"({'>' if sustained else '≤'} {fmt(p.sustained_factor)}×)"
        if sustained_ratio is not None else f"{base_label} is 0, so no sustained ratio")
    if spikes:
        ratio, step, v, med = worst  # type: ignore[misc]
        evidence = (f"{ENTROPY} spiked at {spikes} step(s); the worst, step {step}, reached "
                    f"{fmt(v)} = {ratio:.2f}× the median {fmt(med)} of the previous {p.window} "
                    f"points (> {fmt(p.spike_factor)}×); {sustained_text}.")
        return result(name, p, False, ratio, p.spike_factor, whole, evidence)
    spike_text = (f"the largest jump was {worst[0]:.2f}× the median of the previous {p.window} "
                  f"points (step {worst[1]}: {fmt(worst[2])} vs {fmt(worst[3])}) ≤ "
                  f"{fmt(p.spike_factor)}×" if worst is not None else
                  f"{ENTROPY} had a median of 0 before every step, so no spike ratio")
    if sustained:
        evidence = (f"sustained entropy rise over {steps_text(whole)}: {sustained_text}; no "
                    f"one-step spike: {spike_text}.")
        return result(name, p, False, sustained_ratio, p.sustained_factor, span_of(tail),
                       evidence)
    evidence = f"no entropy spike over {steps_text(whole)}: {spike_text}; no sustained rise: " \
               f"{sustained_text}."
    return result(name, p, True, worst[0] if worst is not None else None, p.spike_factor,
                   whole, evidence)


@gate("pg_clipfrac")
def _pg_clipfrac(run: Run, p: PgClipfracParams, reference: Mapping[str, float] | None,
                 context: GateContext) -> GateResult:
    name = "pg_clipfrac"
    key, pts = run.first_series(METRIC_ALIASES["pg_clipfrac"])
    if len(pts) < 2:
        return not_enough(name, p, len(pts), key, 2)
    head, tail = quarters(pts, p.tail)
    first, level = mean_of(head), mean_of(tail)
    high, rising = level > p.max_level, level > first
    saturated = high and rising
    evidence = (f"{'PPO clip saturation (seed 001 cause E)' if saturated else 'no clip saturation'}"
                f": {key} averaged {fmt(level)} over the last {points(len(tail))} "
                f"({'>' if high else '≤'} {fmt(p.max_level)}), "
                f"{'up' if rising else 'not up'} from {fmt(first)} over the first "
                f"{points(len(head))}, {steps_text(span_of(pts))}.")
    return result(name, p, not saturated, level, p.max_level, span_of(tail), evidence)


@gate("repetition_rate")
def _repetition_rate(run: Run, p: RepetitionRateParams, reference: Mapping[str, float] | None,
                     context: GateContext) -> GateResult:
    name = "repetition_rate"
    pts = run.series(REPETITION)
    ref = ref_value(reference, REPETITION)
    if len(pts) < (1 if ref is not None else 2):
        return not_enough(name, p, len(pts), REPETITION, 1 if ref is not None else 2)
    head, tail = quarters(pts, p.tail)
    level = mean_of(tail)
    base, base_label = ((ref, "the reference level") if ref is not None
                        else (mean_of(head), f"the run's first {points(len(head))}"))
    limit = base + p.max_increase
    rose = level > limit
    over = p.max_level is not None and level > p.max_level
    clauses = [f"{REPETITION} averaged {fmt(level)} over the last {points(len(tail))}, "
               f"{level - base:+.4g} vs {base_label} {fmt(base)} "
               f"({'>' if rose else '≤'} +{fmt(p.max_increase)})"]
    if p.max_level is not None:
        clauses.append(f"{'>' if over else '≤'} the ceiling {fmt(p.max_level)}")
    verdict = "repetition rose" if rose or over else "no repetition rise"
    threshold = p.max_level if over and not rose else limit
    return result(name, p, not (rose or over), level, threshold, span_of(tail),
                   f"{verdict}: " + ", ".join(clauses) + ".")


@gate("no_length_surge")
def _no_length_surge(run: Run, p: NoLengthSurgeParams,
                     reference: Mapping[str, float] | None,
                     context: GateContext) -> GateResult:
    name = "no_length_surge"
    pts = run.series(RESPONSE_LENGTH)
    if len(pts) < p.smooth + 1:
        return not_enough(name, p, len(pts), RESPONSE_LENGTH, p.smooth + 1)
    s = smooth(pts, p.smooth)
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
    whole = span_of(pts)
    label = f"smoothed {RESPONSE_LENGTH} (trailing mean of {p.smooth})"
    if best is None:
        return result(name, p, True, None, p.max_rise, whole,
                       f"{label} had no positive baseline within {p.window} steps over "
                       f"{steps_text(whole)}.")
    rise, i, j = best
    surged = rise > p.max_rise
    evidence = (f"{'response length surged' if surged else 'no response-length surge'}: "
                f"{label} rose at most {pct(rise)}, from {fmt(s[i][1])} (step {s[i][0]}) to "
                f"{fmt(s[j][1])} (step {s[j][0]}), within a {p.window}-step window "
                f"({'>' if surged else '≤'} {pct(p.max_rise)}).")
    return result(name, p, not surged, rise, p.max_rise, (s[i][0], s[j][0]), evidence)


@gate("rollout_logprob_not_decreasing")
def _rollout_logprob_not_decreasing(run: Run, p: RolloutLogprobNotDecreasingParams,
                                    reference: Mapping[str, float] | None,
                                    context: GateContext) -> GateResult:
    name = "rollout_logprob_not_decreasing"
    pts = run.series(ROLLOUT_LOGPROB)
    if len(pts) < 3:
        return not_enough(name, p, len(pts), ROLLOUT_LOGPROB, 3)
    slope = slope_of(pts)
    whole = span_of(pts)
    fall = -slope * (whole[1] - whole[0])
    declining = slope < -p.max_decline and fall > p.min_drop
    k = len(tail_points(pts, 0.25))
    evidence = (f"{ROLLOUT_LOGPROB} {'is declining' if declining else 'is not declining'}: "
                f"it went from {fmt(mean_of(pts[:k]))} (first {points(k)}) to "
                f"{fmt(mean_of(pts[-k:]))} (last {points(k)}) over {steps_text(whole)}, "
                f"slope {fmt(slope)}/step "
                f"{'<' if slope < -p.max_decline else '≥'} {fmt(-p.max_decline)} with fitted "
                f"fall {fmt(fall)} {'>' if fall > p.min_drop else '≤'} {fmt(p.min_drop)}.")
    return result(name, p, not declining, slope, -p.max_decline, whole, evidence)


@gate("grad_norm_no_spike")
def _grad_norm_no_spike(run: Run, p: GradNormNoSpikeParams,
                        reference: Mapping[str, float] | None,
                        context: GateContext) -> GateResult:
    name = "grad_norm_no_spike"
    pts = run.series(GRAD_NORM)
    if len(pts) < p.window + 1:
        return not_enough(name, p, len(pts), GRAD_NORM, p.window + 1)
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
    whole = span_of(pts)
    if harmful:  # a harmful spike has reward points after it, so `rewards` is not empty
        ratio, step, g, med, before, after = max(harmful)
        evidence = (f"grad-norm spike with reward loss: {GRAD_NORM} reached {fmt(g)} at step "
                    f"{step}, {ratio:.1f}× the median {fmt(med)} of the previous {p.window} "
                    f"points (> {fmt(p.factor)}×), and mean reward fell from {fmt(before)} "
                    f"(steps {step - p.window}–{step}) to {fmt(after)} (steps {step + 1}–"
                    f"{step + p.after}).")
        window = (max(step - p.window, whole[0]), min(step + p.after, rewards[-1][0]))
        return result(name, p, False, ratio, p.factor, window, evidence)
    if harmless:
        ratio, step, g, med, before, after = max(harmless, key=lambda h: h[0])
        if after is None:
            outcome = "the reward after it was not observed (the run ends there)"
        elif before is None:
            outcome = "no reward before it was logged to compare with"
        else:
            outcome = f"mean reward did not fall afterwards ({fmt(before)} → {fmt(after)})"
        evidence = (f"grad-norm spike without reward loss: {GRAD_NORM} reached {fmt(g)} at step "
                    f"{step}, {ratio:.1f}× the median {fmt(med)} of the previous {p.window} "
                    f"points (> {fmt(p.factor)}×), but {outcome}; {len(harmless)} such spike(s), "
                    "not a collapse by seed 001's definition.")
        return result(name, p, True, ratio, p.factor, whole, evidence)
    if worst_ratio is None:
        return result(name, p, True, None, p.factor, whole,
                       f"{GRAD_NORM} had no positive baseline over {steps_text(whole)}.")
    ratio, step, g, med = worst_ratio
    evidence = (f"no grad-norm spike over {steps_text(whole)}: the largest was {fmt(g)} at step "
                f"{step}, {ratio:.2f}× the median {fmt(med)} of the previous {p.window} points "
                f"(≤ {fmt(p.factor)}×).")
    return result(name, p, True, ratio, p.factor, whole, evidence)


