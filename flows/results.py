"""What the campaign flow's Prefect tasks and the flow itself return, typed: a trained candidate
run, its gate report, a promotion, the outcome of training and judging one candidate, a stage's
promotion as the campaign reports it and the campaign's outcome. Plain dataclasses (Prefect
persists ``run_candidate``'s result with pickle); ``GateReport.to_file`` is the
``gate_report.json`` layout that ``asyncrl gates RUN`` reads back, ``CampaignOutcome.to_json``
the layout ``asyncrl campaign launch --json`` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.evals import EVAL_FILE, EvalOutcome, read_evals

if TYPE_CHECKING:
    from registry.gates import GateResult
    from training.recipe import Recipe

__all__ = ["CampaignOutcome", "CandidateOutcome", "GateReport", "Promoted", "PromotionResult",
           "TrainedRun"]


@dataclass(frozen=True)
class TrainedRun:
    """A finished training run of a candidate (``run_candidate``): its registry row id, run
    directory, final HF checkpoint, metrics JSONL and the trainer's summary."""

    run_id: int
    run_dir: str
    final_hf: str
    metrics_path: str
    summary: dict[str, Any]


@dataclass(frozen=True)
class GateReport:
    """The stage's gates on one run (``judge``): whether all passed, each gate's result (the
    registry's gate-result layout), the samples the run trained, what it was judged with
    (gates, params, references, context, where) and the run's own summary as a reference for
    later stages (``summary_for_reference``, not written to the file). ``gates`` are the typed
    :class:`~registry.gates.GateResult`; :meth:`to_file` turns them into JSON."""

    passed: bool
    gates: list[GateResult]
    run_dir: str
    summary: dict[str, Any]
    samples_trained: int | None
    judged_with: dict[str, Any]
    summary_for_reference: dict[str, float]

    def to_file(self) -> dict[str, Any]:
        """The ``gate_report.json`` layout (and MLflow's copy)."""
        out = {k: v for k, v in asdict(self).items() if k != "summary_for_reference"}
        out["gates"] = [g.to_dict() for g in self.gates]
        return out

    @property
    def failed_gates(self) -> list[str]:
        return [g.name for g in self.gates if not g.passed]


@dataclass(frozen=True)
class PromotionResult:
    """A recorded promotion (``promote``): the registry's promotion id and the MLflow model
    version (None without tracking)."""

    promotion_id: int
    mlflow_version: str | None


@dataclass(frozen=True)
class CandidateOutcome:
    """One candidate trained and judged: its recipe (and hash), run, gate report and MLflow run —
    seed 0's — and, for a candidate of several seeds, the outcomes of seeds 1… (``more_seeds``,
    each its own run ``<candidate>.s<j>``). The rule for seeds: the candidate passes only when
    every seed passes; its eval is the seeds' mean, on their pooled ``eval/n``."""

    candidate: str
    recipe: Recipe
    recipe_hash: str
    run: TrainedRun
    report: GateReport
    mlflow_run_id: str | None
    more_seeds: tuple[CandidateOutcome, ...] = ()

    @property
    def all_seeds(self) -> tuple[CandidateOutcome, ...]:
        return (self, *self.more_seeds)

    @property
    def passed(self) -> bool:
        return all(o.report.passed for o in self.all_seeds)

    @property
    def failed_gates(self) -> list[str]:
        """Gates some seed failed, each once (first seen first); a seed's run name is added
        when it is not seed 0's."""
        out: list[str] = []
        for o in self.all_seeds:
            tag = "" if o is self else f" ({o.candidate})"
            out += [g + tag for g in o.report.failed_gates if g + tag not in out]
        return out

    @property
    def eval_reward(self) -> float | None:
        evals = [float(v) for o in self.all_seeds
                 if (v := o.run.summary.get("eval/reward_mean")) is not None]
        return sum(evals) / len(evals) if evals else None

    @property
    def eval_outcome(self) -> EvalOutcome | None:
        """The last eval's per-prompt rewards of every seed, pooled in seed order (the prompts'
        fingerprint joined likewise, so two candidates pair only seed j with seed j on the same
        prompts); None when some seed's run wrote no ``eval.jsonl``."""
        last = []
        for o in self.all_seeds:
            outcomes = read_evals(Path(o.run.run_dir) / EVAL_FILE)
            if not outcomes:
                return None
            last.append(outcomes[-1])
        return EvalOutcome(last[0].step, False, "+".join(x.prompts for x in last),
                           tuple(r for x in last for r in x.rewards))

    @property
    def eval_n(self) -> float | None:
        ns = [o.run.summary.get("eval/n") for o in self.all_seeds]
        if not ns or any(not isinstance(n, int | float) for n in ns):
            return None
        return float(sum(ns))


@dataclass(frozen=True)
class Promoted:
    """A stage's promotion as the campaign's outcome reports it: the winning candidate, its
    recipe hash, the checkpoint the next stage starts from, the registry's promotion id and the
    MLflow model version (None without tracking)."""

    candidate: str
    recipe_hash: str
    checkpoint: str
    promotion_id: int
    mlflow_version: str | None


@dataclass(frozen=True)
class GateNote:
    """A gate verdict worth a line at the end of a campaign: one a candidate of a stopped stage
    failed, or one that passed without a value (too little data to judge, so the pass says
    nothing). ``margin``: value − limit (its sign reads with the gate's direction, which the
    evidence states); None without both."""

    stage: str
    candidate: str
    gate: str
    passed: bool
    value: float | None
    threshold: float | None
    evidence: str

    @property
    def margin(self) -> float | None:
        if self.value is None or self.threshold is None:
            return None
        return self.value - self.threshold


def gate_notes(stage: str, outcomes: list[CandidateOutcome], stopped: bool) -> list[GateNote]:
    """The stage's :class:`GateNote` s: every failed gate of every run when the stage
    ``stopped`` the campaign, and every gate that passed without a value."""
    return [GateNote(stage, r.candidate, g.name, g.passed, g.value, g.threshold, g.evidence)
            for o in outcomes for r in o.all_seeds for g in r.report.gates
            if (stopped and not g.passed) or (g.passed and g.value is None)]


def recorded_gate_notes(db: Any, campaign_id: str) -> list[GateNote]:
    """:func:`gate_notes` of a campaign as the registry recorded it (a run on a Prefect server:
    the outcome comes from the registry): failed gates of the stages that stopped it, gates
    that passed without a value, in stage order."""
    failed_stages = {st.name for st in db.stages(campaign_id) if st.status == "failed"}
    order = {st.name: st.index for st in db.stages(campaign_id)}
    notes = []
    for run in sorted(db.runs(campaign_id), key=lambda r: (order.get(r.stage, 0), r.id)):
        if run.candidate.startswith("reference-"):  # a re-run reference is not a candidate
            continue
        for g in db.gate_results(run.id):
            if (run.stage in failed_stages and not g.passed) or (g.passed and g.value is None):
                notes.append(GateNote(run.stage, run.candidate, g.name, g.passed, g.value,
                                      g.threshold, str(g.evidence or "")))
    return notes


@dataclass
class CampaignOutcome:
    """What a campaign left: status (running while its stages run, then finished | stopped),
    the verdict, each promoted stage's :class:`Promoted` in stage order, the decision-tree
    diagnosis of a stopped campaign (its JSON record, as the registry keeps it), the MLflow
    parent run and the gate verdicts its last lines show (:func:`gate_notes`; this run's
    stages only)."""

    campaign_id: str
    status: str
    verdict: str
    promoted: dict[str, Promoted] = field(default_factory=dict)
    diagnosis: dict[str, Any] | None = None
    mlflow_run_id: str | None = None
    gate_notes: list[GateNote] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The outcome as JSON data (``--json``)."""
        return asdict(self)
