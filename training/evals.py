"""Per-prompt eval outcomes: what makes an eval comparison *paired* (issue 26).

``eval/reward_mean`` is the mean of one reward per held-out prompt. Two evals on the same prompts
(the same run before and after training, or a candidate and its reference, which draw the same
``eval`` split of the same task) differ prompt by prompt much less than two independent samples
would: most prompts are solved by both or by neither. The standard error of the difference of
the means is then

    SE = sd(d) / √n,   d_i = b_i − a_i over the n shared prompts, sd with n − 1,

which for 0/1 rewards is McNemar's: it counts only the discordant prompts. The unpaired
binomial SE √(p_a(1−p_a)/n + p_b(1−p_b)/n) overstates it whenever the two evals agree on
prompts, so a paired gate detects a smaller real fall at the same false-fail rate.

A run writes one :class:`EvalOutcome` line per eval to ``eval.jsonl`` beside ``metrics.jsonl``
(same ``step`` and ``step/eval_only`` convention, so a resume truncates both alike). The prompt
set is named by a fingerprint of the prompt texts: evals are paired only when their fingerprints
and sizes match; otherwise the comparison falls back to the unpaired SE, and says so.

Torch-free: the gates (registry) read these files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EVAL_FILE", "EvalOutcome", "EvalResult", "PairedDiff", "append_eval", "fingerprint",
           "paired_diff", "read_evals"]

#: The per-prompt eval file in a run directory.
EVAL_FILE = "eval.jsonl"


def fingerprint(prompts: Sequence[str]) -> str:
    """A short name for an ordered prompt set (16 hex digits of SHA-256)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class EvalOutcome:
    """One eval of a run: the reward of each prompt, in the eval split's order.

    Attributes:
        step: the metrics step the eval was logged at (0 with ``eval_only`` for the eval of the
            starting checkpoint, before the first update).
        eval_only: the eval-only record before training (``step/eval_only`` in metrics.jsonl).
        prompts: :func:`fingerprint` of the prompt texts.
        rewards: one reward per prompt.
    """

    step: int
    eval_only: bool
    prompts: str
    rewards: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.rewards)

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else math.nan

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "step/eval_only": int(self.eval_only),
                           "prompts": self.prompts, "rewards": list(self.rewards)},
                          separators=(",", ":"))

    @classmethod
    def from_record(cls, row: dict[str, object]) -> EvalOutcome | None:
        """The outcome in one parsed line, or None when the line is not one (a foreign file)."""
        step, prompts, rewards = row.get("step"), row.get("prompts"), row.get("rewards")
        if isinstance(step, bool) or not isinstance(step, int) or not isinstance(prompts, str) \
                or not isinstance(rewards, list):
            return None
        try:
            values = tuple(float(r) for r in rewards)
        except (TypeError, ValueError):
            return None
        if not all(math.isfinite(v) for v in values):
            return None
        return cls(step, bool(row.get("step/eval_only")), prompts, values)


@dataclass(frozen=True)
class EvalResult:
    """What one eval returns to the run: the ``eval/*`` metrics, and the per-prompt rewards
    with the fingerprint of their prompts (the run adds the step and writes an
    :class:`EvalOutcome`)."""

    metrics: dict[str, float]
    prompts: str
    rewards: tuple[float, ...]


def append_eval(path: str | os.PathLike[str], outcome: EvalOutcome) -> None:
    """Append one line and flush it to disk: a kill leaves at most a partial last line, which
    :func:`read_evals` skips."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(outcome.to_json() + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_evals(path: str | os.PathLike[str]) -> list[EvalOutcome]:
    """Every complete outcome in ``path`` in file order ([] when there is no file)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        o = EvalOutcome.from_record(row) if isinstance(row, dict) else None
        if o is not None:
            out.append(o)
    return out


@dataclass(frozen=True)
class PairedDiff:
    """b − a over the prompts two evals share: the mean difference, its paired SE, the number
    of prompts, and how many prompts differ at all (the discordant ones)."""

    diff: float
    se: float
    n: int
    discordant: int


def paired_diff(a: EvalOutcome | None, b: EvalOutcome | None) -> PairedDiff | None:
    """The paired difference b − a, or None when the two evals are not on the same prompts
    (different fingerprints or sizes, or fewer than 2 prompts)."""
    if a is None or b is None or a.prompts != b.prompts or a.n != b.n or a.n < 2:
        return None
    d = [y - x for x, y in zip(a.rewards, b.rewards, strict=True)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return PairedDiff(mean, math.sqrt(var / n), n, sum(1 for x in d if x != 0))
