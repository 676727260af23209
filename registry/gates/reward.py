"""The reward family: training reward, eval and wasted groups (seeds 000 and 001).

Each limit is the larger of the seed's effect size and a noise floor (:mod:`registry.gates.stats`):
a reward fall against the standard error of two window means, Bonferroni-corrected for the
windows a peak could have been picked from; an eval difference against the binomial standard
error of two accuracies on ``eval/n`` prompts — or, where both evals' per-prompt rewards are
known on the same prompts (``eval.jsonl``), the paired SE sd(d)/√n of the per-prompt
differences (:mod:`training.evals`), which counts only the prompts that changed — corrected for
the candidates a stage judges together (``context.candidates``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pydantic import Field

from registry.gates.core import (
    EVAL_BY_DIFFICULTY,
    EVAL_N,
    EVAL_REWARD,
    REWARD,
    ZERO_VARIANCE,
    Float,
    GateContext,
    GateParams,
    GateResult,
    Int,
    RequireData,
    Run,
    fmt,
    gate,
    mean_of,
    not_enough,
    pct,
    points,
    ref_value,
    result,
    smooth,
    span_of,
    tail_points,
)
from registry.gates.stats import diff_se, proportion_se, step_sd, z_limit
from training.evals import PairedDiff, paired_diff

_ALPHA = Field(0.05, gt=0.0, lt=0.5, description=(
    "One-sided significance level of the noise floor, before the Bonferroni correction."))


class RewardNotCollapsedParams(GateParams):
    """``reward_not_collapsed``: seed 001's collapse, "a ≥ 30 % reward drop that does not
    recover" — the mean of the last ``smooth`` points of ``rollout/reward_mean`` below the
    highest mean of ``smooth`` consecutive points by more than max(``drop`` × peak,
    z × SE). SE = σ̂·√(2/``smooth``), σ̂ the reward's step-to-step spread; z = z_{1−α/m} with m
    = points ÷ ``smooth``, the windows the peak was the best of (the peak of many noisy windows
    is biased upwards, which the correction pays for). A drop that recovered before the end
    passes: only the final window is judged.

    drop: 0.3 (seed 001). smooth: 5 points. alpha: 0.01.
    """

    drop: Float = Field(0.3, gt=0.0, le=1.0, description=(
        "Fraction of its peak the smoothed reward must end below to have collapsed."))
    smooth: Int = Field(5, ge=1, description=(
        "Points in each window mean (the peak window and the final one)."))
    alpha: Float = Field(0.01, gt=0.0, lt=0.5, description=(
        "One-sided significance level of the fall, before the correction for the windows."))
    require_data: RequireData = False


class EvalTracksRewardParams(GateParams):
    """``eval_tracks_reward``: no simplicity bias (seed 000: training reward up while eval down),
    and, with a reference, eval not below the reference's.

    Fails when the training reward rose by more than ``min_rise`` (mean of the last ``smooth``
    points minus the first ``smooth``) while ``eval/reward_mean`` fell, first → last eval, by
    more than the limit; or, with a reference, when the last eval is below the reference's (its
    summary's tail mean; paired, its last eval on the same prompts) by more than the limit.
    Limit = max(``max_eval_drop``, z × SE): SE the paired standard error
    sd(d)/√n of the per-prompt differences when both evals' rewards are in ``eval.jsonl`` on the
    same prompts, else the binomial standard error of the difference of two accuracies on
    ``eval/n`` prompts each; z = z_{1−α/k} over the k candidates of the stage
    (``context.candidates``). A run that logs neither is judged on ``max_eval_drop`` alone, and
    the evidence says so.

    On 58 prompts a 0.1 fall is ≈ 1.1 SE: the old fixed 0.1 failed one candidate in seven by
    chance; with six candidates z ≈ 2.39, so a fall must be ≈ 0.22 at p ≈ 0.6 to fail.
    """

    min_rise: Float = Field(0.0, ge=0.0, description=(
        "Training-reward rise (last vs first `smooth` points) above which a falling eval is "
        "simplicity bias."))
    max_eval_drop: Float = Field(0.05, ge=0.0, description=(
        "The smallest eval fall that can fail (the effect size), in reward."))
    alpha: Float = _ALPHA
    smooth: Int = Field(3, ge=1, description="Points averaged at each end of the training reward.")
    require_data: RequireData = False


class EvalNotDegradedParams(GateParams):
    """``eval_not_degraded``: the run must not lose held-out accuracy — the last
    ``eval/reward_mean`` below the first (the starting checkpoint's, from the eval before the
    first update) by more than max(``max_drop``, z × SE), SE and z as ``eval_tracks_reward``'s.
    The gate a baseline stage can fail on its own: the sync reference of the seed ladder lost
    greedy eval 0.833 → 0.500 on 30 prompts (−0.33 = 2.9 SE) and passed every other gate.
    """

    max_drop: Float = Field(0.05, ge=0.0, description=(
        "The smallest eval fall that can fail (the effect size), in reward."))
    alpha: Float = _ALPHA
    require_data: RequireData = False


def _eval_n(run: Run, step: int) -> float | None:
    n = dict(run.series(EVAL_N)).get(step)
    return n if n is not None and n > 0 else None


def _eval_limit(effect: float, alpha: float, candidates: int, se: float | None
                ) -> tuple[float, str]:
    """max(effect, z × SE) and a clause saying how it was made."""
    if se is None:
        return effect, f"limit {fmt(effect)} (no eval/n logged: the noise is unknown)"
    z = z_limit(alpha, candidates)
    per = f" over {candidates} candidates" if candidates > 1 else ""
    noise = z * se
    binds = "noise" if noise >= effect else "effect size"
    return max(effect, noise), (f"limit {fmt(max(effect, noise))} = max({fmt(effect)}, "
                                f"{z:.2f} SE = {fmt(noise)}; α {fmt(alpha)}{per}; {binds} binds)")


def _fall_text(a: float, b: float, na: float | None, nb: float | None, what: str,
               pair: PairedDiff | None = None) -> tuple[float | None, str]:
    """SE of a − b for two accuracies, and 'a vs b on n prompts: d = z SE' — the paired SE
    when both evals' per-prompt rewards are known on the same prompts, else the binomial one."""
    if pair is not None:
        se = pair.se
        z = (a - b) / se if se > 0 else math.inf if a > b else 0.0
        return se, (f"{what} {fmt(a)} → {fmt(b)} on the same {pair.n} prompts (paired, "
                    f"{pair.discordant} differ): fall {fmt(a - b)} = {z:.2f} SE")
    if na is None or nb is None:
        return None, f"{what} {fmt(a)} → {fmt(b)}: fall {fmt(a - b)}"
    se = diff_se(proportion_se(a, na), proportion_se(b, nb))
    z = (a - b) / se if se > 0 else math.inf
    prompts = f"{na:.0f} prompts" if na == nb else f"{na:.0f} and {nb:.0f} prompts"
    return se, f"{what} {fmt(a)} → {fmt(b)} on {prompts}: fall {fmt(a - b)} = {z:.2f} SE"


@gate("reward_not_collapsed")
def _reward_not_collapsed(run: Run, p: RewardNotCollapsedParams,
                          reference: Mapping[str, float] | None,
                          context: GateContext) -> GateResult:
    name = "reward_not_collapsed"
    pts = run.series(REWARD)
    if len(pts) < p.smooth + 1:
        return not_enough(name, p, len(pts), REWARD, p.smooth + 1)
    s = smooth(pts, p.smooth)
    peak_step, peak = max(s, key=lambda sv: sv[1])
    last_step, last = s[-1]
    label = f"{REWARD} (mean of {points(p.smooth)})"
    if peak <= 0:
        return result(name, p, True, None, None, span_of(pts),
                      f"{label} peaked at {fmt(peak)} ≤ 0, so a relative drop is undefined; it "
                      f"ends at {fmt(last)} (step {last_step}).")
    se = step_sd([v for _, v in pts]) * math.sqrt(2.0 / p.smooth)
    windows = max(1, len(pts) // p.smooth)
    z = z_limit(p.alpha, windows)
    fall = peak - last
    allowed, noise = p.drop * peak, z * se
    limit = max(allowed, noise)
    collapsed = fall > limit
    binds = "effect size" if allowed >= noise else "noise"
    zf = fall / se if se > 0 else math.inf if fall > 0 else 0.0
    evidence = (f"{'reward collapsed' if collapsed else 'no reward collapse'}: {label} peaked "
                f"at {fmt(peak)} (step {peak_step}) and ends at {fmt(last)} (step {last_step}): "
                f"fall {fmt(fall)} = {pct(fall / peak)} of the peak = {zf:.2f} SE "
                f"{'>' if collapsed else '≤'} limit {fmt(limit)} = max({pct(p.drop)} × peak = "
                f"{fmt(allowed)}, {z:.2f} SE = {fmt(noise)}; α {fmt(p.alpha)} over {windows} "
                f"windows, SE {fmt(se)} from the step-to-step spread; {binds} binds).")
    return result(name, p, not collapsed, fall, limit, (peak_step, last_step), evidence,
                  noise=se)


@gate("eval_tracks_reward")
def _eval_tracks_reward(run: Run, p: EvalTracksRewardParams,
                        reference: Mapping[str, float] | None,
                        context: GateContext) -> GateResult:
    name = "eval_tracks_reward"
    ev = run.series(EVAL_REWARD)
    if not ev:
        return result(name, p, not p.require_data, None, p.max_eval_drop, None,
                      f"no eval data: {EVAL_REWARD} was never logged, so simplicity bias "
                      "cannot be checked" + (" — require_data is set, so the gate fails."
                                             if p.require_data else "; passing by default."))
    rw = run.series(REWARD)
    ref = ref_value(reference, EVAL_REWARD)
    trend = len(ev) >= 2 and len(rw) >= 2
    if not trend and ref is None:
        return not_enough(name, p, len(ev), f"{EVAL_REWARD} (and {REWARD})", 2)
    (s0, e_first), (s1, e_last) = ev[0], ev[-1]
    n0, n1 = _eval_n(run, s0), _eval_n(run, s1)
    clauses = []
    diverged = below_ref = False
    value, limit, noise = None, p.max_eval_drop, None
    if trend:
        k = min(p.smooth, max(1, len(rw) // 2))
        r_first, r_last = mean_of(rw[:k]), mean_of(rw[-k:])
        rise = r_last - r_first
        se, fall_txt = _fall_text(e_first, e_last, n0, n1, "eval",
                                  paired_diff(run.evals.get(s0), run.evals.get(s1)))
        limit, limit_txt = _eval_limit(p.max_eval_drop, p.alpha, context.candidates, se)
        value, noise = e_first - e_last, se
        diverged = rise > p.min_rise and value > limit
        if value > limit and not diverged:  # what decided is the reward, which did not rise
            value, limit, noise = rise, p.min_rise, None
        clauses.append(f"training reward {fmt(r_first)} → {fmt(r_last)} (change {rise:+.4g} "
                       f"{'>' if rise > p.min_rise else '≤'} {fmt(p.min_rise)}) while {fall_txt} "
                       f"{'>' if value > limit else '≤'} {limit_txt}")
    if ref is not None:
        ref_n = ref_value(reference, EVAL_N)
        pair = paired_diff(run.reference_eval, run.evals.get(s1))
        if pair is not None and run.reference_eval is not None:
            # paired: the reference's last eval on the same prompts (the summary's value is a
            # tail mean over several evals, which the paired SE does not describe)
            ref = run.reference_eval.mean
        se, fall_txt = _fall_text(ref, e_last, ref_n, n1, "reference eval vs this run's last",
                                  pair)
        ref_limit, limit_txt = _eval_limit(p.max_eval_drop, p.alpha, context.candidates, se)
        below_ref = ref - e_last > ref_limit
        clauses.append(f"{fall_txt} {'>' if below_ref else '≤'} {limit_txt}")
        if not diverged:  # the reference comparison is what decided
            value, limit, noise = ref - e_last, ref_limit, se
    verdict = ("simplicity bias: " if diverged else "eval fell below the reference: "
               if below_ref else "eval tracks reward: ")
    evidence = verdict + "; ".join(clauses) + _difficulty_note(run) + "."
    return result(name, p, not (diverged or below_ref), value, limit, span_of(ev), evidence,
                  noise=noise)


@gate("eval_not_degraded")
def _eval_not_degraded(run: Run, p: EvalNotDegradedParams,
                       reference: Mapping[str, float] | None,
                       context: GateContext) -> GateResult:
    name = "eval_not_degraded"
    ev = run.series(EVAL_REWARD)
    if len(ev) < 2:
        return not_enough(name, p, len(ev), EVAL_REWARD, 2)
    (s0, first), (s1, last) = ev[0], ev[-1]
    se, fall_txt = _fall_text(first, last, _eval_n(run, s0), _eval_n(run, s1),
                              f"eval (steps {s0} → {s1})",
                              paired_diff(run.evals.get(s0), run.evals.get(s1)))
    limit, limit_txt = _eval_limit(p.max_drop, p.alpha, context.candidates, se)
    degraded = first - last > limit
    evidence = (f"{'eval degraded' if degraded else 'eval held'}: {fall_txt} "
                f"{'>' if degraded else '≤'} {limit_txt}{_difficulty_note(run)}.")
    return result(name, p, not degraded, first - last, limit, (s0, s1), evidence, noise=se)


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

    max_frac: Float = Field(0.45, ge=0.0, le=1.0, description=(
        "Without a reference: the largest zero-variance group fraction over the last `tail` of "
        "the points."))
    max_increase: Float = Field(0.1, ge=0.0, le=1.0, description=(
        "With a reference: the largest rise above the reference's level."))
    tail: Float = Field(0.25, gt=0.0, le=1.0, description=(
        "Fraction of the points (at least one) averaged."))
    require_data: RequireData = False


def _difficulty_note(run: Run) -> str:
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
    return f"; the largest fall by difficulty is {worst[1]}: {fmt(worst[2])} → {fmt(worst[3])}"


@gate("zero_variance_groups")
def _zero_variance_groups(run: Run, p: ZeroVarianceGroupsParams,
                          reference: Mapping[str, float] | None,
                          context: GateContext) -> GateResult:
    name = "zero_variance_groups"
    pts = run.series(ZERO_VARIANCE)
    if not pts:
        return not_enough(name, p, 0, ZERO_VARIANCE, 1)
    tail = tail_points(pts, p.tail)
    level = mean_of(tail)
    ref = ref_value(reference, ZERO_VARIANCE)
    if ref is not None:
        limit, basis = ref + p.max_increase, (f"the reference level {fmt(ref)} + "
                                              f"{fmt(p.max_increase)}")
    else:
        limit, basis = p.max_frac, "max_frac, seed 000's ~60 of 128 groups"
    wasted = level > limit
    evidence = (f"{'too many' if wasted else 'acceptable'} zero-variance groups: "
                f"{ZERO_VARIANCE} averaged {fmt(level)} over the last {points(len(tail))} "
                f"({pct(level)} of groups carry no gradient) {'>' if wasted else '≤'} "
                f"{fmt(limit)} ({basis}).")
    return result(name, p, not wasted, level, limit, span_of(tail), evidence)


