"""The noise model every gate threshold is stated in (issue 26).

A gate compares a quantity with a limit; the limit is the larger of an *effect size* (the seed's
rule: "a ≥ 30 % drop", "rising 1.5×") and a *noise floor* (how far the quantity moves by chance,
in standard errors), so a verdict never rests on a difference the run's own noise could make:

* **Levels** (a window mean of a per-step metric): standard error = the step-to-step spread /
  √n. The spread is taken from successive differences, σ̂ = √(Σ(x_{i+1} − x_i)² / 2(n − 1)),
  which a slow trend does not inflate (von Neumann's estimator). Two levels differ by
  SE = √(SE_a² + SE_b²).
* **Trends**: the least-squares slope b of value on step, its standard error
  SE_b = √(Σr² / (n − 2) / Σ(x − x̄)²) and t = b / SE_b. Per-step metrics are autocorrelated, which
  makes SE_b optimistic; the gates' default t limit (3) is set above the usual 2 for that reason.
* **Proportions** (greedy eval accuracy on n prompts, rewards 0/1): SE = √(p̃(1 − p̃)/n) with
  p̃ = (k + ½)/(n + 1), so that 0/n and n/n still carry noise. Two evals of the same prompts are
  compared as independent samples — conservative: a paired test on per-prompt outcomes would have
  a smaller SE, but the runs log accuracy, not per-prompt outcomes.
* **Multiplicity**: a one-sided z limit at level α over k comparisons (the candidates of a
  stage, the windows a peak was picked from) is Bonferroni's z_{1−α/k}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from statistics import NormalDist

Point = tuple[int, float]


def z_limit(alpha: float, comparisons: int = 1) -> float:
    """One-sided standard-normal quantile z_{1−α/k} (Bonferroni over ``comparisons`` = k).

    >>> round(z_limit(0.05), 3), round(z_limit(0.05, 6), 3)
    (1.645, 2.394)
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    return NormalDist().inv_cdf(1.0 - alpha / max(1, int(comparisons)))


def step_sd(values: Sequence[float]) -> float:
    """Step-to-step spread σ̂ = √(Σ(x_{i+1} − x_i)² / 2(n − 1)); 0 for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return 0.0
    return math.sqrt(sum((b - a) ** 2 for a, b in pairwise(values)) / (2 * (n - 1)))


@dataclass(frozen=True)
class Level:
    """A window mean with its noise: ``mean`` of ``n`` points, ``sd`` their step-to-step spread,
    ``se`` = sd / √n."""

    mean: float
    sd: float
    n: int

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.n) if self.n else 0.0


def level(pts: Sequence[Point]) -> Level:
    values = [v for _, v in pts]
    return Level(sum(values) / len(values), step_sd(values), len(values))


def diff_se(*ses: float) -> float:
    """Standard error of a difference (or sum) of independent estimates."""
    return math.sqrt(sum(s * s for s in ses))


@dataclass(frozen=True)
class Trend:
    """Least-squares line through ``n`` points over steps ``first``–``last``.

    slope: per step; se: its standard error; t: slope / se (±inf for a perfect line, 0 for a
    flat one); start / end: the fitted values at the first and last step; rise = end − start.
    """

    slope: float
    se: float
    t: float
    start: float
    end: float
    n: int
    first: int
    last: int

    @property
    def rise(self) -> float:
        return self.end - self.start

    @property
    def span(self) -> int:
        return self.last - self.first

    @property
    def rise_se(self) -> float:
        """Standard error of the fitted rise (se × span)."""
        return self.se * self.span


def trend(pts: Sequence[Point]) -> Trend | None:
    """The least-squares fit of value on step; None for fewer than 3 points or one step."""
    n = len(pts)
    if n < 3:
        return None
    xbar = sum(s for s, _ in pts) / n
    ybar = sum(v for _, v in pts) / n
    sxx = sum((s - xbar) ** 2 for s, _ in pts)
    if sxx == 0:
        return None
    slope = sum((s - xbar) * (v - ybar) for s, v in pts) / sxx
    ssr = sum((v - (ybar + slope * (s - xbar))) ** 2 for s, v in pts)
    se = math.sqrt(ssr / (n - 2) / sxx)
    t = slope / se if se > 0 else 0.0 if slope == 0 else math.copysign(math.inf, slope)
    first, last = pts[0][0], pts[-1][0]
    return Trend(slope=slope, se=se, t=t, start=ybar + slope * (first - xbar),
                 end=ybar + slope * (last - xbar), n=n, first=first, last=last)


def proportion_se(p: float, n: float) -> float:
    """Standard error of an accuracy ``p`` on ``n`` 0/1 outcomes, p̃ = (pn + ½)/(n + 1)."""
    if n <= 0:
        return math.inf
    pt = (p * n + 0.5) / (n + 1.0)
    return math.sqrt(pt * (1.0 - pt) / n)
