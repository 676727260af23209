"""Reactive learning-rate guards: the step size reacts to what the run measures.

Two guards of seed 001, each a recipe option (``optim.vcpo``, ``optim.length_surge_guard``), each
returning a factor on the scheduled learning rate that the learner passes to
``TrainEngine.train_step(lr_scale=...)``:

* **VCPO** (Huang et al. 2026; seed 001, "ESS-guided variance control"): when the effective
  sample size of the IS weights drops, a few samples dominate the gradient, so the learning rate
  is scaled down proportionally: factor = max(ESS, min_scale) with the normalised
  ESS = (Σw)² / (N·Σw²) = 1 / E[w̃²], w̃ = w / E[w] (:func:`vcpo_lr_scale`). Departure from the
  paper: only the step-size half; VCPO's minimum-variance baseline (OPOB) needs per-sample
  gradient norms and is not implemented.
* **Length-surge halving** (seed 001, cause F, after Zhang et al. 2026): a response-length surge
  precedes collapse by tens of steps, so ``if mean_response_len / len_W_steps_ago > 1.2:
  lr *= 0.5`` (:class:`LengthSurgeGuard`). Departures from the seed's snippet, which runs once:
  as a guard it runs every step, so after a halving the comparison restarts from the halving's
  step (the next halving needs a new surge over a whole window after it, instead of the same
  surge halving the rate every step); it needs a full window of history (the seed compares with
  the length W steps ago, never a shorter span); ``max_halvings`` can stop it. The seed's second
  half (switch the correction to ``bypass_pg_geo_rs``) changes the algorithm mid-run and stays a
  prescription (``training.algorithms.decision_tree``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from training.algorithms.is_correction import effective_sample_size

__all__ = ["Halving", "LengthSurgeGuard", "vcpo_lr_scale"]


def vcpo_lr_scale(weights: torch.Tensor, mask: torch.Tensor, min_scale: float
                  ) -> tuple[float, float]:
    """VCPO's learning-rate factor from a step's token IS weights.

    Args:
        weights (B, T): non-negative IS weights (rejected tokens may carry 0).
        mask (B, T): tokens that count.
        min_scale: floor of the factor, in (0, 1].
    Returns:
        (factor = max(ESS, min_scale), ESS) with ESS = (Σw)² / (N·Σw²) over the valid tokens
        (1 when nothing is valid).
    """
    if not 0.0 < min_scale <= 1.0:
        raise ValueError(f"min_scale={min_scale} must be in (0, 1]")
    ess = float(effective_sample_size(weights.to(torch.float64), mask))
    return max(ess, min_scale), ess


@dataclass(frozen=True)
class Halving:
    """One LR halving: at trainer ``step`` the mean response ``length`` was ``ratio`` × the
    length ``window`` steps earlier (``reference``)."""

    step: int
    length: float
    reference: float
    ratio: float
    window: int
    factor: float
    halvings: int
    """Halvings so far, this one included."""

    def message(self, lr_scale: float) -> str:
        """The run-log line: the step, the evidence and the new LR factor."""
        return (f"step {self.step}: learning rate ×{self.factor:g} (length-surge guard, seed 001 "
                f"cause F): mean response length {self.length:.1f} is {self.ratio:.2f}× its "
                f"value {self.window} steps ago ({self.reference:.1f}); halving "
                f"{self.halvings}, LR factor now {lr_scale:g}. If the length keeps surging, "
                "audit the reward (hacking, EOS handling, length bonus)")


class LengthSurgeGuard:
    """Seed 001's cause-F rule as a guard (module docstring). Feed it each trainer step's mean
    response length with :meth:`observe`; :attr:`lr_scale` is the factor on the learning rate.

    Args:
        ratio: surge threshold (seed: 1.2).
        window_steps: W, steps back the length is compared with (seed: 100).
        factor: LR multiplier per surge (seed: 0.5).
        max_halvings: stop after this many (None: no limit).
    """

    def __init__(self, ratio: float = 1.2, window_steps: int = 100, factor: float = 0.5,
                 max_halvings: int | None = None) -> None:
        if not ratio > 1.0:
            raise ValueError(f"ratio={ratio} must be > 1 (seed 001: 1.2)")
        if window_steps < 1:
            raise ValueError(f"window_steps={window_steps} must be >= 1 (seed 001: 100)")
        if not 0.0 < factor < 1.0:
            raise ValueError(f"factor={factor} must be in (0, 1) (seed 001: 0.5)")
        if max_halvings is not None and max_halvings < 1:
            raise ValueError(f"max_halvings={max_halvings} must be >= 1 or None")
        self.ratio, self.window, self.factor = float(ratio), int(window_steps), float(factor)
        self.max_halvings = max_halvings
        self.halvings = 0
        self.lr_scale = 1.0
        # (step, length) of the last W + 1 steps since the last halving (or the start)
        self._history: deque[tuple[int, float]] = deque(maxlen=self.window + 1)
        self.last_ratio: float | None = None

    def observe(self, step: int, length: float) -> Halving | None:
        """Record trainer ``step``'s mean response length; halve :attr:`lr_scale` and return the
        :class:`Halving` when length / length(step − W) > ratio, else None."""
        self._history.append((int(step), float(length)))
        self.last_ratio = None
        first_step, reference = self._history[0]
        if step - first_step < self.window:
            return None
        self.last_ratio = length / reference if reference > 0 else None
        if self.last_ratio is None or self.last_ratio <= self.ratio:
            return None
        if self.max_halvings is not None and self.halvings >= self.max_halvings:
            return None
        self.halvings += 1
        self.lr_scale *= self.factor
        self._history.clear()
        self._history.append((int(step), float(length)))  # the window restarts here
        return Halving(int(step), float(length), reference, length / reference, self.window,
                       self.factor, self.halvings)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for a checkpoint (an exact resume halves at the same steps)."""
        return {"halvings": self.halvings, "lr_scale": self.lr_scale,
                "history": [list(x) for x in self._history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.halvings = int(state["halvings"])
        self.lr_scale = float(state["lr_scale"])
        self._history.clear()
        for step, length in state["history"]:
            self._history.append((int(step), float(length)))
