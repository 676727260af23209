"""Progress events of a campaign (what the CLI's live table shows), as small typed values.

The flow emits them through :data:`flows.campaign.EVENT_LISTENERS` (a flow's parameters must be
plain data, so callbacks cannot be passed to it); a listener dispatches on the class. A listener
that raises never breaks the campaign."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from registry.gates import GateResult

__all__ = ["CampaignEvent", "CandidateEvent", "EventFn", "PredictionEvent", "PromotedEvent",
           "RemediationEvent", "StageEvent", "StepEvent"]


@dataclass(frozen=True)
class StageEvent:
    """A stage changed state. ``earlier``: promoted by an earlier run of this campaign (a
    resume continues from it); ``verdict``: why a stage failed."""

    stage: str
    status: Literal["running", "promoted", "failed"]
    earlier: bool = False
    verdict: str | None = None

    @property
    def shown(self) -> str:
        return f"{self.status} (earlier)" if self.earlier else self.status


@dataclass(frozen=True)
class CandidateEvent:
    """A candidate started (``running``) or was judged (``passed``, ``rejected``, or
    ``reference`` for a re-run reference), with its summary and gate verdicts once judged."""

    stage: str
    candidate: str
    status: Literal["running", "passed", "rejected", "reference"]
    recipe_hash: str | None = None
    summary: Mapping[str, Any] | None = None
    gates: Sequence[GateResult] | None = None
    samples_trained: int | None = None


@dataclass(frozen=True)
class StepEvent:
    """A candidate's run finished training step ``step`` of ``total`` (1-based), with that
    step's mean rollout reward (None if it logged none)."""

    stage: str
    candidate: str
    step: int
    total: int
    reward: float | None = None


@dataclass(frozen=True)
class PromotedEvent:
    """A stage promoted ``candidate``."""

    stage: str
    candidate: str


@dataclass(frozen=True)
class RemediationEvent:
    """Every candidate of ``stage`` failed and it tries attempt ``attempt``: ``candidate`` (the
    remedy's run; None when no remedy was left) starts from ``from_candidate`` with the seed's
    ``cause`` and ``override``."""

    stage: str
    attempt: int
    from_candidate: str
    candidate: str | None
    cause: str | None = None
    title: str | None = None
    override: Mapping[str, Any] | None = None

    @property
    def line(self) -> str:
        if self.candidate is None:
            return (f"stage {self.stage}: no remedy left for {self.from_candidate} "
                    f"(attempt {self.attempt})")
        keys = ", ".join(f"{k}={v}" for k, v in (self.override or {}).items())
        return (f"stage {self.stage}: remediation {self.attempt} of {self.from_candidate}: "
                f"cause {self.cause} ({self.title}) → {self.candidate} with {keys}")


@dataclass(frozen=True)
class PredictionEvent:
    """Before ``stage`` trains: what ``asyncrl simulate`` predicts for ``candidate``'s async
    settings on the campaign's ``simulate`` calibration (information only, never a gate)."""

    stage: str
    candidate: str
    mode: str
    step_time_s: float
    speedup: float

    @property
    def line(self) -> str:
        return (f"{self.stage}/{self.candidate}: predicted {self.speedup:.2f}x over colocated "
                f"sync ({self.mode}, {self.step_time_s:.4g} s per step; asyncrl simulate, "
                "information only)")


CampaignEvent = (StageEvent | CandidateEvent | StepEvent | PromotedEvent | RemediationEvent
                 | PredictionEvent)
EventFn = Callable[[CampaignEvent], None]
