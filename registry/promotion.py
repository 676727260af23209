"""Which passing candidate a stage promotes, with the reason in words (issue 26).

``first_passing``: the first candidate, in listed order, whose gates all pass. ``best_eval``:
start from that same first passing candidate — the seed's order, simplest first — and move to a
later passing one only when its eval is higher *beyond noise*: the difference of the two
accuracies exceeds z × SE, SE the binomial standard error of two evals on ``eval/n`` prompts
(:mod:`registry.gates.stats`) — or the paired SE on the prompts both evaluated, where their
per-prompt rewards are known (:mod:`training.evals`) — z = z_{1−α/k} over the k later
candidates compared (Bonferroni).
A better eval inside the noise keeps the earlier candidate, and the reason says "not
distinguishable from X (difference, SE)". Without ``eval/n`` the noise is unknown and the higher
eval wins, said so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from registry.gates.stats import diff_se, proportion_se, z_limit
from training.evals import EvalOutcome, paired_diff

ALPHA = 0.05


@dataclass(frozen=True)
class Contender:
    """One passing candidate as the rule sees it: its name, final eval and eval size."""

    name: str
    eval_reward: float | None
    eval_n: float | None
    eval_outcome: EvalOutcome | None = None


@dataclass(frozen=True)
class Choice:
    """The index of the promoted contender (None when none passed) and why."""

    index: int | None
    reason: str


def choose(rule: str, passing: Sequence[Contender], alpha: float = ALPHA) -> Choice:
    """Apply ``rule`` (``first_passing`` | ``best_eval``) to the passing candidates, given in
    listed order."""
    if not passing:
        return Choice(None, "no candidate passed")
    if rule == "first_passing" or len(passing) == 1:
        return Choice(0, "the first passing candidate in listed order")
    z = z_limit(alpha, len(passing) - 1)
    best, notes = 0, []
    for i in range(1, len(passing)):
        a, b = passing[best], passing[i]
        if b.eval_reward is None:
            notes.append(f"{b.name}: no eval")
            continue
        if a.eval_reward is None:
            best = i
            notes.append(f"{b.name} has an eval, {a.name} none")
            continue
        d = b.eval_reward - a.eval_reward
        if a.eval_n is None or b.eval_n is None:
            if d > 0:
                best = i
            notes.append(f"{b.name} vs {a.name}: {d:+.3f} (no eval/n: noise unknown)")
            continue
        pair = paired_diff(a.eval_outcome, b.eval_outcome)
        se = pair.se if pair is not None else diff_se(proportion_se(a.eval_reward, a.eval_n),
                                                      proportion_se(b.eval_reward, b.eval_n))
        how = f", paired on {pair.n} prompts" if pair is not None else ""
        if d > z * se:
            best = i
            notes.append(f"{b.name} better than {a.name} beyond noise ({d:+.3f} = "
                         f"{d / se:.2f} SE > {z:.2f}{how})" if se > 0 else
                         f"{b.name} better than {a.name} on every prompt ({d:+.3f}{how})")
        elif se > 0 and d < -z * se:  # not chosen either way; say it is worse, not a tie
            notes.append(f"{b.name} worse than {a.name} beyond noise ({d:+.3f} = "
                         f"{d / se:.2f} SE < -{z:.2f}{how})")
        elif se == 0 and d < 0:
            notes.append(f"{b.name} worse than {a.name} on every prompt ({d:+.3f}{how})")
        else:
            notes.append(f"{b.name} not distinguishable from {a.name} ({d:+.3f}, SE {se:.3f}: "
                         f"|z| {abs(d / se):.2f} ≤ {z:.2f}{how})" if se > 0 else
                         f"{b.name} not distinguishable from {a.name} ({d:+.3f}{how})")
    return Choice(best, f"best eval beyond noise (α {alpha:g} over {len(passing) - 1} "
                        "comparisons): " + "; ".join(notes))
