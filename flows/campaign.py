"""The campaign flow (Prefect 3): stages run in order; each candidate is trained, judged and the
winner promoted before the next stage starts from it (DESIGN.md "The data that flows"). The flow
runs under the campaign's launch (:mod:`flows.launch`: loaded, recorded and leased once) and
returns its :class:`~flows.results.CampaignOutcome`.

Tasks:

- :func:`run_candidate` — trains one candidate recipe on Ray (``training.runtime.run``) from the
  previous stage's promoted checkpoint; metrics stream to an MLflow child run. Its run directory
  is ``$ASYNCRL_HOME/campaigns/<id>/<stage>/<candidate>``: a finished run is not re-run, a run
  killed mid-way resumes from its last checkpoint.
- :func:`judge` — evaluates the stage's gates on the run's metric history (and the reference
  stage's summary): registry rows and a JSON gate report (with the samples the run trained) as an
  MLflow artifact; the run's PNG plots are drawn while the next candidate trains
  (:mod:`flows.plot_queue`: durable across a kill, waited for before the campaign ends).
- :func:`promote` — records the winner in the registry (idempotent) and registers its checkpoint
  as an MLflow model version with the alias ``stage-<stage>`` and ``champion``.

Before a stage trains anything, what it will run is built and checked on the chain actually
promoted (:func:`registry.campaign.stage_recipes`: every candidate's recipe, each gate's
requirements). A stage with ``rerun_reference`` first trains ``reference-<stage>`` for every
stage its gates compare against — that stage's promoted recipe from this stage's starting
checkpoint, at this stage's steps/samples — through the same tasks (its own MLflow child run and
registry row; judged on the stage's absolute gates, never promoted), and the relative gates of
its candidates read that run's summary.

A stage's runs train up to ``parallel`` at once (:meth:`_Flow.run_all`: worker threads in the
flow run's context; each run its own Ray placement group, so the recipes' resources decide how
many fit). ``first_passing`` goes in waves of ``parallel`` candidates and stops after the first
wave with a passing candidate, promoting the first passing one in listed order: the candidate
the sequential order promotes (docs/campaigns.md "Candidates in parallel").

Tasks declare retries and persist their results keyed by campaign id + stage + candidate +
recipe hash, and the registry is the source of truth for what finished: re-running or resuming a
campaign (also after ``kill -9``) skips finished work and continues the rest. When no candidate
of a stage passes, the campaign stops with a verdict and a decision-tree diagnosis (seed 001).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import flow, tags, task

from flows.artifacts import gate_report_html, publish_stage_report, stage_report, task_run_name
from flows.events import (
    CampaignEvent,
    CandidateEvent,
    EventFn,
    PredictionEvent,
    PromotedEvent,
    RemediationEvent,
    StageEvent,
    StepEvent,
)
from flows.launch import Launch, launched
from flows.plot_queue import PlotQueue
from flows.plots import PlotCandidate, PlotStage, campaign_plot
from flows.results import (
    CampaignOutcome,
    CandidateOutcome,
    GateReport,
    Promoted,
    PromotionResult,
    TrainedRun,
    gate_notes,
)
from flows.tracking import TAG_CHAMPION, TAG_DESCRIPTION, TrackedRun
from registry.campaign import (
    Campaign,
    GateSpec,
    Stage,
    StartingPoint,
    reference_name,
    seed_name,
    seeded,
    stage_recipes,
)
from registry.gates import GateContext
from training.fileio import atomic_write_text
from training.paths import state_dir

if TYPE_CHECKING:
    from registry.remediation import Attempt
    from training.recipe import Recipe

log = logging.getLogger("asyncrl.campaign")

# Progress listeners of the flow runs in this process (the CLI's live table subscribes here:
# a flow's parameters must be plain data, so callbacks cannot be passed to it).
EVENT_LISTENERS: list[EventFn] = []


def _to_listeners(event: CampaignEvent) -> None:
    for fn in list(EVENT_LISTENERS):
        fn(event)

__all__ = ["CampaignOutcome", "campaign_flow", "flow_result", "new_campaign_id",
           "run_campaign", "run_stages"]


def new_campaign_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def campaign_dir(campaign_id: str) -> Path:
    return state_dir() / "campaigns" / campaign_id


# Runs of a stage in parallel emit from their worker threads: listeners (the CLI's live table
# mutates a dict it also renders) see one event at a time.
_EVENTS_LOCK = threading.RLock()


def _emit(events: EventFn | None, event: CampaignEvent) -> None:
    if events is not None:
        try:
            with _EVENTS_LOCK:
                events(event)
        except Exception:  # a display callback never breaks the campaign
            log.debug("event callback failed", exc_info=True)


#: Set (by :meth:`_Flow.run_all`) in the context of runs trained in parallel: once the event is
#: set, a run still training stops after its current step (resumable from its last checkpoint).
#: A worker thread cannot get Ctrl-C's KeyboardInterrupt; this is how it hears of it.
_STOP_RUNS: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "asyncrl_stop_runs", default=None)

#: The warm start trains in this process with torch's global seed and thread count
#: (training.engines.warmstart), and two runs starting at once would both train the same
#: cache entry: runs in parallel take their turn here before they start.
_WARM_START_LOCK = threading.Lock()


#: Called with the name of each point the flow passes that a crash could split: ``judged:<stage>``
#: (the stage's candidates judged, nothing promoted), ``promote:mlflow:<stage>`` (inside the
#: promotion: the MLflow model version registered, the registry row not yet written) and
#: ``promoted:<stage>`` (both written, the stage not yet marked finished). Empty in normal use:
#: it is the seam the reliability tests install a ``kill -9`` into (tests/flows/crash_at.py).
POINT_HOOKS: list[Callable[[str], None]] = []


def reached(point: str) -> None:
    """The flow has reached ``point`` (see :data:`POINT_HOOKS`)."""
    for hook in list(POINT_HOOKS):
        hook(point)


# --- tasks --------------------------------------------------------------------------------------


def _cache_key(context: Any, params: Mapping[str, Any]) -> str:
    """campaign id + stage + candidate + recipe hash, within one state directory and registry
    (Prefect's result store may be shared by several state directories)."""
    where = hashlib.sha256(f"{state_dir()}|{params['registry_url']}".encode()).hexdigest()[:12]
    # "v2": the result is a TrainedRun (v1 cached a dict)
    return f"v2:{where}:{params['campaign_id']}:{params['stage']}:{params['candidate']}:" \
           f"{params['recipe_hash']}"


@task(name="run_candidate", retries=1, retry_delay_seconds=5, cache_key_fn=_cache_key,
      persist_result=True, task_run_name=task_run_name("train"))
def run_candidate(*, campaign_id: str, stage: str, candidate: str, recipe_hash: str,
                  recipe: Recipe, registry_url: str | None,
                  mlflow_run_id: str | None, tracking_uri: str | None) -> TrainedRun:
    """Train one candidate (resuming its run directory if a previous attempt was killed). The
    validated, frozen ``recipe`` is passed as is (Prefect hands task parameters over in-process);
    ``recipe_hash`` is its hash, part of the cache key."""
    from registry.db import RegistryDB

    with RegistryDB(registry_url) as db:  # closed however the run ends
        return _run_candidate(db, campaign_id, stage, candidate, recipe_hash, recipe,
                              mlflow_run_id, tracking_uri)


def _run_candidate(db: Any, campaign_id: str, stage: str, candidate: str, recipe_hash: str,
                   recipe: Recipe, mlflow_run_id: str | None,
                   tracking_uri: str | None) -> TrainedRun:
    from flows.tracking import Tracker
    from training.runtime.run import initial_checkpoint, run_recipe

    run_dir = campaign_dir(campaign_id) / stage / candidate
    run_id = db.upsert_run(campaign_id, stage, candidate, recipe_hash, status="running",
                           run_dir=str(run_dir), mlflow_run_id=mlflow_run_id)
    tracker = Tracker(tracking_uri)
    sinks = []
    if mlflow_run_id:
        sink = tracker.sink(mlflow_run_id)
        from training.runtime.sinks import read_metrics
        if (run_dir / "metrics.jsonl").is_file():  # a resumed attempt: bring MLflow up to date
            sink.log_history(read_metrics(run_dir / "metrics.jsonl"))
        sinks.append(sink)
    done = _finished_run(run_dir, recipe.steps)
    if done is not None:  # finished before a crash that lost the task's cached result
        db.upsert_run(campaign_id, stage, candidate, recipe_hash, status="finished",
                      summary=done["summary"])
        return TrainedRun(run_id=run_id, **done)
    resume = run_dir if (run_dir / "checkpoint" / "runtime.json").is_file() else None
    if resume is None and run_dir.exists():
        import shutil
        shutil.rmtree(run_dir)  # a start that died before its first checkpoint
    stop = _STOP_RUNS.get()
    if resume is None:
        while not _WARM_START_LOCK.acquire(timeout=1.0):  # cached for the run itself
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
        try:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            initial_checkpoint(recipe)
        finally:
            _WARM_START_LOCK.release()

    def progress(step: int, total: int, metrics: Mapping[str, float]) -> None:
        reward = metrics.get("rollout/reward_mean")
        _emit(_to_listeners, StepEvent(stage, candidate, step, total,
                                       None if reward is None else float(reward)))

    # stop: another run of the stage failed, or Ctrl-C reached the flow (a worker thread never
    # gets the KeyboardInterrupt itself); the run ends interrupted, resumable
    result = run_recipe(recipe, out=None if resume else run_dir, resume=resume, sinks=sinks,
                        checkpoint_every=max(1, recipe.steps // 4), progress=progress,
                        stop=stop, resume_hint=f"asyncrl campaign resume {campaign_id}")
    if result.interrupted:
        raise KeyboardInterrupt
    db.upsert_run(campaign_id, stage, candidate, recipe_hash, status="finished",
                  summary=result.summary)
    return TrainedRun(run_id=run_id, run_dir=str(run_dir), final_hf=str(result.final_hf),
                      metrics_path=str(result.metrics_path), summary=dict(result.summary))


def _finished_run(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """The result of a run directory that already holds a complete run, else None."""
    summary_path, final = run_dir / "summary.json", run_dir / "final" / "hf"
    if not (summary_path.is_file() and (final / "config.json").is_file()):
        return None
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError:
        return None
    if int(summary.get("steps", 0)) < steps:
        return None
    return {"run_dir": str(run_dir), "final_hf": str(final),
            "metrics_path": str(run_dir / "metrics.jsonl"), "summary": summary}


@task(name="judge", retries=2, retry_delay_seconds=2, task_run_name=task_run_name("judge"))
def judge(*, run: TrainedRun, gates: list[GateSpec],
          references: dict[str, dict[str, float]], context: GateContext,
          registry_url: str | None, mlflow_run_id: str | None,
          tracking_uri: str | None, where: dict[str, str] | None = None,
          reference_runs: dict[str, str] | None = None,
          samples_per_step: int | None = None) -> GateReport:
    """Evaluate the stage's gates on one run; record them; attach the report to the run's MLflow
    run and mark its plots due (:mod:`flows.plot_queue` draws them and ends the MLflow run). The
    report keeps what the run was judged with (``judged_with``: the gates and their params,
    the reference summaries and, for re-run references, their run directories, the context,
    and ``where`` — campaign, stage, candidate), so ``asyncrl gates RUN`` re-judges it the same
    way; and ``samples_trained``, the data the run saw (:func:`samples_trained`)."""
    from flows.plot_queue import plots_due
    from flows.tracking import Tracker
    from registry.db import RegistryDB
    from registry.gates import evaluate_gate, summarize
    from training.evals import EVAL_FILE, EvalOutcome, read_evals
    from training.runtime.sinks import read_metrics

    history = read_metrics(run.metrics_path)
    evals = read_evals(Path(run.run_dir) / EVAL_FILE)

    def reference_eval(name: str | None) -> EvalOutcome | None:
        ref_dir = (reference_runs or {}).get(name) if name else None
        outcomes = read_evals(Path(ref_dir) / EVAL_FILE) if ref_dir else []
        return outcomes[-1] if outcomes else None

    results = [evaluate_gate(g.name, history, g.params, context=context,
                             reference=references.get(g.relative_to) if g.relative_to else None,
                             evals=evals, reference_eval=reference_eval(g.relative_to))
               for g in gates]
    passed = all(r.passed for r in results)
    used = {g.relative_to for g in gates if g.relative_to}
    trained = samples_trained(run.summary, history, samples_per_step)
    report = GateReport(
        passed=passed, gates=results, run_dir=run.run_dir, summary=run.summary,
        samples_trained=trained,
        judged_with={**(where or {}), "gates": [g.model_dump() for g in gates],
                     "context": context.model_dump(),
                     "references": {k: v for k, v in references.items() if k in used},
                     "reference_runs": {k: v for k, v in (reference_runs or {}).items()
                                        if k in used}},
        summary_for_reference=summarize(history))
    run_dir = Path(run.run_dir)
    atomic_write_text(run_dir / "gate_report.json",
                      json.dumps(report.to_file(), indent=2, default=str))
    where_name = "/".join(str((where or {}).get(k, "")) for k in ("stage", "candidate"))
    atomic_write_text(run_dir / "gate_report.html",
                      gate_report_html(f"gates of {where_name or run_dir.name}", results, passed))
    with RegistryDB(registry_url) as db:
        db.record_gate_results(run.run_id, [r.to_dict() for r in results])
    if mlflow_run_id:
        tracker = Tracker(tracking_uri)
        tracker.log_dict(mlflow_run_id, report.to_file(), "gate_report.json")
        tracker.log_artifact_file(mlflow_run_id, run_dir / "gate_report.html")
        tracker.set_tags(mlflow_run_id, {"asyncrl.gates_passed": str(passed).lower(),
                                         "asyncrl.samples_trained": str(trained)})
        plots_due(run_dir, mlflow_run_id)
    return report


def samples_trained(summary: Mapping[str, Any], history: list[dict[str, Any]],
                    samples_per_step: int | None) -> int | None:
    """The samples (responses) a run trained on: its trained-samples counter (summary
    ``run/trained_samples``, else the last ``async/trained_samples`` logged), else steps ×
    ``samples_per_step``; None when none of these is known."""
    for v in (summary.get("run/trained_samples"),
              next((r["async/trained_samples"] for r in reversed(history)
                    if isinstance(r.get("async/trained_samples"), int | float)), None)):
        if isinstance(v, int | float) and not isinstance(v, bool):
            return int(v)
    steps = summary.get("steps")
    if samples_per_step is not None and isinstance(steps, int | float):
        return int(steps) * samples_per_step
    return None


@task(name="promote", retries=2, retry_delay_seconds=2,
      task_run_name=task_run_name("promote"))
def promote(*, campaign_id: str, campaign_name: str, stage: str, candidate: str,
            recipe_hash: str, checkpoint: str, reason: str, registry_url: str | None,
            mlflow_run_id: str | None, tracking_uri: str | None,
            eval_reward: float | None = None, champion: bool = True) -> PromotionResult:
    """Record the promotion (idempotent) and register the checkpoint in MLflow with aliases
    (``stage-<stage>``, and ``champion`` when ``champion``: the campaign's ``champion`` policy
    says whether this promotion moves it, see docs/campaigns.md), a
    description (campaign, stage, candidate, the reason) and tags (recipe hash, eval); the
    candidate's run is tagged ``asyncrl.promoted``."""
    from flows.tracking import TAG_PROMOTED, Tracker
    from registry.db import RegistryDB

    version = None
    if mlflow_run_id:
        tracker = Tracker(tracking_uri)
        version = tracker.register_model(
            model_name(campaign_name), mlflow_run_id, checkpoint,
            aliases=[f"stage-{stage}", *(["champion"] if champion else [])],
            description=f"campaign {campaign_id}, stage {stage}: {candidate} — {reason}",
            tags={"asyncrl.campaign_id": campaign_id, "asyncrl.stage": stage,
                  "asyncrl.candidate": candidate, "asyncrl.recipe_hash": recipe_hash,
                  **({} if eval_reward is None else {"asyncrl.eval_reward": f"{eval_reward:.4g}"})})
        tracker.set_tags(mlflow_run_id, {TAG_PROMOTED: "true"})
    reached(f"promote:mlflow:{stage}")
    with RegistryDB(registry_url) as db:
        pid = db.promote(recipe_hash=recipe_hash, candidate=candidate, checkpoint=checkpoint,
                         campaign_id=campaign_id, stage=stage, actor="auto", reason=reason,
                         mlflow_version=version)
    return PromotionResult(promotion_id=pid, mlflow_version=version)


def model_name(campaign_name: str) -> str:
    """The MLflow registered model of a campaign's promoted checkpoints."""
    return f"asyncrl-{campaign_name}"


# --- the flow -----------------------------------------------------------------------------------


def _run_description(stage: Stage, run: str) -> str:
    """What a run is for, from the campaign file (its MLflow description): the stage's and the
    candidate's ``description`` (a seed ``<candidate>.s<j>`` is its candidate's; a re-run
    reference says which stage it re-runs)."""
    base = re.sub(r"\.s\d+$", "", run)  # seed_name's suffix
    lines = [f"stage {stage.name}" + (f": {stage.description}" if stage.description else "")]
    if base.startswith("reference-"):
        lines.append(f"{run}: the promoted recipe of stage {base.removeprefix('reference-')}, "
                     "re-run at this stage's start and length (rerun_reference)")
    else:
        cand = next((c for c in stage.candidates if c.name == base), None)
        lines.append(f"candidate {run}" + (f": {cand.description}" if cand is not None
                                            and cand.description else ""))
    return "\n".join(lines)


def _promotion_reason(stage: Stage, winner: CandidateOutcome, why: str) -> str:
    """Why ``winner`` is promoted, in words: the rule, its gates, the data it saw, its eval and
    (best_eval) how it compares with the other passing candidates."""
    trained = winner.report.samples_trained
    return (f"{stage.promotion}: passed {len(winner.report.gates)} gates"
            + (f" after {trained} samples" if trained is not None else "")
            + (f", eval {winner.eval_reward:.3f}" if winner.eval_reward is not None else "")
            + (f"; {why}" if stage.promotion == "best_eval" and why else ""))


def _diagnose(o: CandidateOutcome) -> Any:
    """Seed 001's decision tree on a judged run: its own recipe tailors the prescribed override
    to it, and what it was judged with (:func:`registry.gates.diagnosis_as_judged`)."""
    from registry.gates import diagnosis_as_judged
    from training.runtime.sinks import read_metrics

    return diagnosis_as_judged(read_metrics(o.run.metrics_path), o.recipe, o.report.judged_with)


def _tries(stage: Stage) -> int:
    """How many candidates the stage may judge: its listed ones and, with ``remediate``, every
    attempt (each is one more chance to pass by luck, so the eval gates' Bonferroni correction
    counts them all, for every run of the stage)."""
    return len(stage.candidates) + (stage.remediate.max_attempts if stage.remediate else 0)


def _best_failing(outcomes: list[CandidateOutcome]) -> CandidateOutcome:
    """The failing run a remediation starts from: the fewest failed gates, then the best final
    eval, then the first listed."""
    def key(io: tuple[int, CandidateOutcome]) -> tuple[int, float, int]:
        i, o = io
        ev = o.eval_reward
        return (len(o.failed_gates), -(ev if ev is not None else -math.inf), i)

    return min(enumerate(outcomes), key=key)[1]


def _choose(stage: Stage, outcomes: list[CandidateOutcome]
            ) -> tuple[CandidateOutcome | None, str]:
    """The stage's winner by its promotion rule (:func:`registry.promotion.choose`: best_eval
    moves past the first passing candidate only beyond noise) and the reason in words."""
    from registry.promotion import Contender, choose

    passing = [o for o in outcomes if o.passed]
    choice = choose(stage.promotion,
                    [Contender(o.candidate, o.eval_reward, o.eval_n, o.eval_outcome)
                     for o in passing])
    return (None if choice.index is None else passing[choice.index]), choice.reason


@flow(name="asyncrl-campaign", flow_run_name="{campaign_id}", log_prints=False)
def campaign_flow(campaign_path: str, campaign_id: str, registry_url: str | None = None,
                  tracking_uri: str | None = None) -> Any:
    """Run (or continue) the campaign in ``campaign_path`` under ``campaign_id``: launched once
    (:func:`flows.launch.launched`: the launch the CLI opened before it started Prefect, else
    one made here), then its stages in order (:func:`run_stages`)."""
    with launched(campaign_path, campaign_id, registry_url=registry_url) as launch:
        outcome = run_stages(launch, tracking_uri=tracking_uri, events=_to_listeners)
    return flow_result(outcome)


def run_stages(launch: Launch, *, tracking_uri: str | None = None,
               events: EventFn | None = None) -> CampaignOutcome:
    """The stages of a launched campaign, in order, while this process owns it: each continues
    from its earlier promotion or is trained, judged and promoted; the first stage with no
    passing candidate stops the campaign. An exception marks the campaign failed (stopped on
    Ctrl-C), with the resume command, and ends its MLflow run before it propagates."""
    fl = _Flow.start(launch, tracking_uri=tracking_uri, events=events)
    ladder = _Ladder(launch.base, CampaignOutcome(launch.campaign_id, "running", "",
                                                        mlflow_run_id=fl.parent.id))
    try:
        for index, stage in enumerate(launch.campaign.stages):
            # the stage's task runs carry these tags in the Prefect UI
            with tags("asyncrl", f"campaign:{launch.campaign.name}", f"stage:{stage.name}"):
                if not (fl.stage_done_before(index, stage, ladder)
                        or fl.run_stage(index, stage, ladder)):
                    break
        fl.finish(ladder)
    except BaseException as e:
        fl.abort(e)
        raise
    return ladder.outcome


def flow_result(outcome: CampaignOutcome) -> Any:
    """What a campaign flow returns: the :class:`CampaignOutcome` when every stage promoted; for a
    campaign that stopped with no passing candidate, a Prefect ``Failed`` state carrying the
    same outcome, with the verdict as its message — so the flow run ends Failed in the Prefect
    UI and automations and alerts on failed runs fire. Call the flow with ``return_state=True``
    and read the outcome with ``state.result(raise_on_failure=False)``."""
    if outcome.status == "finished":
        return outcome
    from prefect.states import Failed

    return Failed(message=outcome.verdict, data=outcome)


def run_campaign(campaign_path: Path, campaign_id: str, *, registry_url: str | None = None,
                 tracking_uri: str | None = None, events: EventFn | None = None,
                 loaded: tuple[Campaign, Recipe] | None = None) -> CampaignOutcome:
    """:func:`campaign_flow`'s work without a flow run of its own (call it inside one: the
    deployment's flow does): the campaign launched once — the launch open in this process, else
    one of ``loaded`` (what :func:`~registry.campaign.load_campaign` returned) or of the file —
    then its stages. Raises :class:`registry.db.CampaignOwnedError` when another live process
    runs this campaign."""
    with launched(campaign_path, campaign_id, registry_url=registry_url, loaded=loaded) as launch:
        return run_stages(launch, tracking_uri=tracking_uri, events=events)


@dataclass
class _Ladder:
    """What the stages hand on, in order: the recipe the next stage builds on (the base, then
    each promoted recipe) and its starting point, the reference summaries and promoted recipes
    by stage (relative gates and ``rerun_reference`` read them), the plot data and the outcome
    so far."""

    current: Recipe
    outcome: CampaignOutcome
    start: StartingPoint | None = None
    references: dict[str, dict[str, float]] = field(default_factory=dict)
    promoted_recipes: dict[str, Recipe] = field(default_factory=dict)
    plot_stages: list[PlotStage] = field(default_factory=list)

    def promoted(self, stage: str, recipe: Recipe, reference: dict[str, float],
                 promotion: Promoted) -> None:
        """Stage ``stage`` promoted ``recipe`` (``promotion``): the next stage starts from its
        checkpoint, and compares against ``reference`` (the promoted run's summary)."""
        self.references[stage] = reference
        self.current = recipe
        self.promoted_recipes[stage] = recipe
        self.start = StartingPoint(promotion.checkpoint, recipe)
        self.outcome.promoted[stage] = promotion


@dataclass
class _Flow:
    """One owned campaign run: the registry, the MLflow parent run, the plot worker and where
    events go."""

    campaign: Campaign
    campaign_id: str
    db: Any
    parent: TrackedRun
    plots: PlotQueue
    registry_url: str | None
    tracking_uri: str | None
    events: EventFn | None
    calibration: Any = None  # the campaign's `simulate` calibration, if any

    @classmethod
    def start(cls, launch: Launch, *, tracking_uri: str | None,
              events: EventFn | None) -> _Flow:
        """The campaign marked running, its MLflow parent run (continued after a crash, and
        tagged so), Ray, and the plot worker with the plots a killed run of it left due."""
        from flows.tracking import Tracker

        launch.db.set_campaign_status(launch.campaign_id, "running")
        tracker = Tracker(tracking_uri)
        name = launch.campaign.name
        parent = tracker.campaign_run(f"asyncrl/{name}", launch.campaign_id, name,
                                      tags={"asyncrl.campaign_file": str(launch.path)})
        lease = launch.lease
        if lease.previous is not None:  # the parent run of a crash, continued: say so
            parent.set_tags({"asyncrl.recovered_from_crash": (
                f"owner {lease.previous.describe} died; resumed by "
                f"{lease.identity.describe()}")})
        _start_ray()
        plots = PlotQueue(tracker)
        plots.recover(campaign_dir(launch.campaign_id))
        from registry.campaign import simulation_calibration

        return cls(launch.campaign, launch.campaign_id, launch.db, parent, plots,
                   launch.registry_url, tracking_uri, events,
                   simulation_calibration(launch.campaign, launch.path.parent))

    def abort(self, error: BaseException) -> None:
        """An exception ends the run: the campaign is failed (stopped on Ctrl-C) with the
        resume command as its verdict, and its MLflow run ends so."""
        status = "failed" if not isinstance(error, KeyboardInterrupt) else "stopped"
        for a in self.db.remediations(self.campaign_id):  # cut short: not running any more
            if a.status == "running":
                self.db.record_remediation(
                    self.campaign_id, a.stage, a.attempt, from_candidate=a.from_candidate,
                    status="failed", candidate=a.candidate, diagnosis=a.diagnosis,
                    remedy={"cause": a.cause, "title": a.title, "source": a.source,
                            "evidence": a.evidence, "override": a.override})
        self.db.set_campaign_status(
            self.campaign_id, status,
            verdict=f"{type(error).__name__}: {str(error)[:500]}; resume with "
                    f"asyncrl campaign resume {self.campaign_id}")
        self.parent.end("KILLED" if status == "stopped" else "FAILED")

    def stage_done_before(self, index: int, stage: Stage, ladder: _Ladder) -> bool:
        """Continue from the stage's promotion when an earlier run of the campaign promoted
        it: the promoted recipe is read back from the registry and validated again."""
        import yaml

        from registry.gates import summarize
        from training.recipe import recipe_from_dict
        from training.runtime.sinks import read_metrics

        done = self.db.promoted(self.campaign_id, stage.name)
        if done is None or not done.checkpoint:
            return False
        recipe_row = self.db.get_recipe(done.recipe_hash)
        run_row = self.db.get_run(campaign_id=self.campaign_id, stage=stage.name,
                                  candidate=done.candidate)
        if recipe_row is None or run_row is None or run_row.run_dir is None:
            return False
        recipe = recipe_from_dict(yaml.safe_load(recipe_row.yaml),
                                  f"registry recipe {done.recipe_hash}")
        history = read_metrics(Path(run_row.run_dir) / "metrics.jsonl")
        ladder.promoted(stage.name, recipe, summarize(history), Promoted(
            done.candidate, done.recipe_hash, done.checkpoint, done.id, done.mlflow_version))
        ladder.plot_stages.append(PlotStage(stage.name, [
            PlotCandidate(done.candidate, history, passed=True, promoted=True)]))
        self.db.upsert_stage(self.campaign_id, stage.name, index, "finished")
        _emit(self.events, StageEvent(stage.name, "promoted", earlier=True))
        return True

    def run_stage(self, index: int, stage: Stage, ladder: _Ladder) -> bool:
        """Train and judge the stage's runs, then promote its winner; False when no candidate
        passed (the campaign stops with the verdict)."""
        from training.runtime.sinks import read_metrics

        # on the chain actually promoted, before anything of the stage trains
        built = stage_recipes(self.campaign, stage, ladder.current, ladder.promoted_recipes,
                              start=ladder.start)
        self.db.upsert_stage(self.campaign_id, stage.name, index, "running")
        _emit(self.events, StageEvent(stage.name, "running"))
        self.predict(stage, built.candidates)
        # a re-run reference runs the stage's seeds; a candidate's seed j is judged against the
        # reference's seed j, or its seed 0 where the reference has fewer seeds
        parallel = self.campaign.parallel_for(stage)
        ref_summaries = [dict(ladder.references) for _ in range(stage.seeds)]
        ref_dirs: list[dict[str, str]] = [{} for _ in range(stage.seeds)]
        refs = [(j, ref, ref_recipe) for j in range(stage.seeds)
                for ref, ref_recipe in built.references.items()]  # rerun_reference
        done = self.run_all([functools.partial(
            self.train_and_judge, stage, seed_name(reference_name(ref), j),
            seeded(ref_recipe, j), references={}, reference_runs={}, absolute_only=True)
            for j, ref, ref_recipe in refs], parallel)
        for (j, ref, _), o in zip(refs, done, strict=True):
            ref_summaries[j][ref] = o.report.summary_for_reference
            ref_dirs[j][ref] = o.run.run_dir

        def judged_against(j: int) -> int:
            return j if j < len(ref_summaries) else 0

        # first_passing: waves of `parallel` candidates in listed order, each wave's runs (every
        # seed) at most `parallel` at once; the first wave with a passing candidate is the last,
        # and its first passing candidate is the first passing one in listed order: the
        # sequential order's winner. best_eval judges every candidate: one wave.
        outcomes: list[CandidateOutcome] = []
        wave_size = parallel if stage.promotion == "first_passing" else len(built.candidates)
        for w in range(0, len(built.candidates), wave_size):
            wave = built.candidates[w:w + wave_size]
            runs = iter(self.run_all([functools.partial(
                self.train_and_judge, stage, seed_name(cand.name, j), seeded(recipe, j),
                references=ref_summaries[judged_against(j)],
                reference_runs=ref_dirs[judged_against(j)])
                for cand, recipe in wave for j in range(stage.seeds_for(cand))], parallel))
            for cand, _ in wave:
                seeds = [next(runs) for _ in range(stage.seeds_for(cand))]
                outcomes.append(dataclasses.replace(seeds[0], more_seeds=tuple(seeds[1:])))
            if stage.promotion == "first_passing" and any(o.passed for o in outcomes[-len(wave):]):
                break
        winner, why = _choose(stage, outcomes)
        if winner is None and stage.remediate is not None:
            self.remediate(stage, outcomes, ref_summaries, ref_dirs, parallel)
            winner, why = _choose(stage, outcomes)
        ladder.outcome.gate_notes += gate_notes(stage.name, outcomes, stopped=winner is None)
        publish_stage_report(self.campaign_id, stage.name, lambda: stage_report(
            stage.name, outcomes, winner,
            _promotion_reason(stage, winner, why) if winner is not None else why,
            description=stage.description))
        ladder.plot_stages.append(PlotStage(stage.name, [
            PlotCandidate(s.candidate, read_metrics(s.run.metrics_path),
                          passed=s.report.passed, promoted=s is winner)
            for o in outcomes for s in o.all_seeds]))
        reached(f"judged:{stage.name}")
        if winner is None:
            self.stop(index, stage, outcomes, ladder)
            return False
        self.promote(index, stage, winner, ladder, why)
        return True

    def stop(self, index: int, stage: Stage, outcomes: list[CandidateOutcome],
             ladder: _Ladder) -> None:
        """No candidate passed: the verdict, with the diagnosis of the last candidate's run (the
        last remediation attempt's, when the stage tried any) and every attempt's cause."""
        diagnosis = _diagnose(outcomes[-1])
        diag = diagnosis.to_dict()  # the JSON edge: the registry record and verdict.json
        failed = "; ".join(f"{o.candidate}: " + ", ".join(o.failed_gates)
                           for o in outcomes)
        attempts = self.db.remediations(self.campaign_id, stage.name)
        remediation = ("; remediation: " + "; ".join(
            (f"attempt {a.attempt} ({a.candidate} from {a.from_candidate}, cause {a.cause}: "
             f"{a.title}) {a.status}" if a.candidate is not None else
             f"attempt {a.attempt}: no remedy left for {a.from_candidate} (diagnosis: "
             f"{(a.diagnosis or {}).get('summary', '')})") for a in attempts)
            if attempts else "")
        verdict = (f"stage {stage.name!r}: no candidate passed its gates ({failed})"
                   f"{remediation}; diagnosis: {diagnosis.summary}")
        self.db.upsert_stage(self.campaign_id, stage.name, index, "failed")
        self.db.set_campaign_status(self.campaign_id, "stopped", verdict=verdict,
                                    diagnosis=diag)
        self.parent.log_dict({"verdict": verdict, "diagnosis": diag}, "verdict.json")
        self.parent.set_tags({"asyncrl.verdict": verdict[:4000]})
        ladder.outcome.status, ladder.outcome.verdict = "stopped", verdict
        ladder.outcome.diagnosis = diag
        _emit(self.events, StageEvent(stage.name, "failed", verdict=verdict))

    def remediate(self, stage: Stage, outcomes: list[CandidateOutcome],
                  ref_summaries: list[dict[str, dict[str, float]]],
                  ref_dirs: list[dict[str, str]], parallel: int = 1) -> None:
        """Every candidate failed: try the remedies the failing runs' diagnoses prescribe
        (:mod:`registry.remediation`), each as candidate ``remedy-<k>`` on top of the last, up to
        ``remediate.max_attempts``; their outcomes are appended to ``outcomes``. The attempts go
        one after another (each builds on the last); an attempt's seeds run ``parallel`` at
        once. Each attempt is
        recorded in the registry (cause, evidence, override, the diagnosis it came from) before
        it trains and again with its verdict, and its MLflow run is tagged with it."""
        from registry.remediation import Attempt, FailedGate, propose, remedy_name

        assert stage.remediate is not None
        base = _best_failing([o for o in outcomes if not o.candidate.startswith("reference-")])
        tried: list[str] = []
        for attempt in range(1, stage.remediate.max_attempts + 1):
            diagnosis = _diagnose(base)
            failed = list({g.name: FailedGate(g.name, g.evidence) for s in base.all_seeds
                           for g in s.report.gates if not g.passed}.values())
            proposal = propose(diagnosis, failed, base.recipe, tried,
                               gates=[(g.name, g.params) for g in stage.gates])
            if proposal is None:
                self.db.record_remediation(self.campaign_id, stage.name, attempt,
                                           from_candidate=base.candidate, status="none",
                                           diagnosis=diagnosis.to_dict())
                _emit(self.events, RemediationEvent(stage.name, attempt, base.candidate, None))
                return
            remedy, recipe = proposal
            name = remedy_name(attempt)
            this = Attempt(attempt, base.candidate, name, remedy, diagnosis)
            record = {k: v for k, v in this.to_dict().items() if k != "attempt"}
            self.db.record_remediation(self.campaign_id, stage.name, attempt, status="running",
                                       **record)
            _emit(self.events, RemediationEvent(stage.name, attempt, base.candidate, name,
                                                remedy.cause, remedy.title, remedy.override))
            about = (f"remediation {attempt} of {base.candidate}: cause {remedy.cause} "
                     f"({remedy.title}), proposed by {remedy.source}; override "
                     + json.dumps(remedy.override, sort_keys=True))
            runs = self.run_all([functools.partial(
                self.train_and_judge, stage, seed_name(name, j), seeded(recipe, j),
                references=ref_summaries[min(j, len(ref_summaries) - 1)],
                reference_runs=ref_dirs[min(j, len(ref_dirs) - 1)], about=about,
                remediation=this)
                for j in range(len(base.all_seeds))], parallel)  # as many seeds as it repairs
            o = dataclasses.replace(runs[0], more_seeds=tuple(runs[1:]))
            outcomes.append(o)
            self.db.record_remediation(self.campaign_id, stage.name, attempt,
                                       status="passed" if o.passed else "failed", **record)
            if o.passed:
                return
            tried.append(remedy.key)
            base = o

    def promote(self, index: int, stage: Stage, winner: CandidateOutcome,
                ladder: _Ladder, why: str = "") -> None:
        reason = _promotion_reason(stage, winner, why)
        promo = promote(campaign_id=self.campaign_id, campaign_name=self.campaign.name,
                        stage=stage.name, candidate=winner.candidate,
                        recipe_hash=winner.recipe_hash, checkpoint=winner.run.final_hf,
                        reason=reason, registry_url=self.registry_url,
                        mlflow_run_id=winner.mlflow_run_id, tracking_uri=self.tracking_uri,
                        eval_reward=winner.eval_reward,
                        champion=self.campaign.champion_moves(stage.name))
        reached(f"promoted:{stage.name}")
        # the parent run: the champion so far and the stage's figures (step = the stage's index)
        self.parent.set_tags({f"asyncrl.promoted.{stage.name}": winner.candidate,
                              **({TAG_CHAMPION: f"{stage.name}/{winner.candidate}"}
                                 if self.campaign.champion_moves(stage.name) else {})})
        self.parent.log_metrics({
            f"stage/{stage.name}/eval_reward": winner.eval_reward,
            f"stage/{stage.name}/rollout_reward": winner.run.summary.get("rollout/reward_mean"),
            f"stage/{stage.name}/samples_trained": winner.report.samples_trained,
            f"stage/{stage.name}/candidates": float(len(stage.candidates))}, step=index)
        self.db.upsert_stage(self.campaign_id, stage.name, index, "finished")
        ladder.promoted(stage.name, winner.recipe, winner.report.summary_for_reference,
                        Promoted(winner.candidate, winner.recipe_hash, winner.run.final_hf,
                                 promo.promotion_id, promo.mlflow_version))
        _emit(self.events, PromotedEvent(stage.name, winner.candidate))

    def finish(self, ladder: _Ladder) -> None:
        """Every stage promoted (or the campaign stopped): the verdict, the campaign plot and
        the parent run's status (a campaign stopped by its gates is FAILED in MLflow too)."""
        self.plots.drain()
        outcome = ladder.outcome
        if outcome.status == "running":
            last = self.campaign.stages[-1].name
            outcome.status = "finished"
            outcome.verdict = (f"all {len(self.campaign.stages)} stages promoted; champion: "
                               f"{last}/{outcome.promoted[last].candidate}")
            self.db.set_campaign_status(self.campaign_id, "finished", verdict=outcome.verdict)
        last = next(reversed(outcome.promoted), None)  # also after a resume that trained none
        if last is not None and not self.campaign.champion_moves(last):
            last = None  # champion: final, and the ladder stopped before its last stage
        self.parent.set_tags({
            "asyncrl.verdict": outcome.verdict[:4000],
            **({TAG_CHAMPION: f"{last}/{outcome.promoted[last].candidate}"} if last else {}),
            **{f"asyncrl.promoted.{s}": p.candidate for s, p in outcome.promoted.items()}})
        self.parent.set_tags({TAG_DESCRIPTION: "\n".join(
            [f"campaign {self.campaign_id} ({self.campaign.name}): {outcome.status} — "
             f"{outcome.verdict}"]
            + [f"- {stage}: promoted {p.candidate} (recipe {p.recipe_hash})"
               for stage, p in outcome.promoted.items()])})
        if self.parent.id is not None:
            try:
                png = campaign_plot(ladder.plot_stages,
                                    campaign_dir(self.campaign_id) / "campaign.png")
            except Exception as e:
                log.warning("campaign plot failed: %s", e)
                png = None
            if png is not None:
                self.parent.log_file(png)
        self.parent.end("FINISHED" if outcome.status == "finished" else "FAILED")

    def predict(self, stage: Stage, candidates: Sequence[tuple[Any, Recipe]]) -> None:
        """With the campaign's ``simulate`` calibration: each candidate's predicted step time and
        speed-up over colocated sync (:func:`training.sim.predict`), as events. Information
        only: a prediction that cannot be made is a warning, never a failure."""
        if self.calibration is None:
            return
        from training.sim import predict

        for cand, recipe in candidates:
            try:
                p = predict(recipe, self.calibration)
            except Exception as e:  # information only
                log.warning("stage %s/%s: no prediction (%s)", stage.name, cand.name, e)
                continue
            _emit(self.events, PredictionEvent(stage.name, cand.name, p.mode, p.step_time_s,
                                               p.speedup))

    def run_all(self, calls: Sequence[Callable[[], CandidateOutcome]], parallel: int
                ) -> list[CandidateOutcome]:
        """Run ``calls`` (each trains and judges one run: :meth:`train_and_judge`), at most
        ``parallel`` at once, started in the order given; their outcomes in that order.
        ``parallel`` 1: one after another in this thread, as before there was a choice.
        Otherwise each runs in a worker thread, in a copy of this thread's context: the Prefect
        flow run and its tags, so its task runs are this flow run's, named and cached as
        always. When one raises, or Ctrl-C reaches this thread, the runs not started are
        cancelled and those training stop after their current step (:data:`_STOP_RUNS`:
        resumable from their last checkpoint); once all have ended the error is raised (a
        run's own, not the interruption of one it stopped)."""
        if parallel <= 1 or len(calls) <= 1:
            return [call() for call in calls]
        stop = threading.Event()

        def run(call: Callable[[], CandidateOutcome]) -> CandidateOutcome | None:
            if stop.is_set():  # an earlier run failed: this one does not start
                return None
            try:
                return call()
            except BaseException:
                stop.set()  # before this worker takes the next run
                raise

        token = _STOP_RUNS.set(stop)
        try:  # one context copy per run: a context is entered by one thread at a time
            contexts = [contextvars.copy_context() for _ in calls]
        finally:
            _STOP_RUNS.reset(token)
        pool = ThreadPoolExecutor(max_workers=min(parallel, len(calls)),
                                  thread_name_prefix=f"asyncrl-run-{self.campaign_id}")
        futures = [pool.submit(ctx.run, run, call)
                   for ctx, call in zip(contexts, calls, strict=True)]
        error: BaseException | None = None
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            errors = [e for f in futures if f.done() and (e := f.exception()) is not None]
            # a run's own error, not the KeyboardInterrupt of a run it stopped
            error = next((e for e in errors if not isinstance(e, KeyboardInterrupt)),
                         errors[0] if errors else None)
        except BaseException as e:  # Ctrl-C (KeyboardInterrupt) while the runs train
            error = e
        if error is not None:
            stop.set()
            log.warning("stopping the runs in flight (%s: %s); they resume from their last "
                        "checkpoint", type(error).__name__, error)
            pool.shutdown(wait=True, cancel_futures=True)
            raise error
        pool.shutdown()
        outcomes = [f.result() for f in futures]
        assert all(o is not None for o in outcomes), "a run was skipped without an error"
        return outcomes  # type: ignore[return-value]

    def train_and_judge(self, stage: Stage, name: str, recipe: Recipe, *,
                        references: dict[str, dict[str, float]], reference_runs: dict[str, str],
                        absolute_only: bool = False, about: str | None = None,
                        remediation: Attempt | None = None) -> CandidateOutcome:
        """Train ``recipe`` as candidate ``name`` of the stage (a Prefect task, an MLflow child
        run, a registry row) and judge it on the stage's gates — only those without
        ``relative_to`` when ``absolute_only`` (a reference re-run is the reference).
        ``about``: the run's description when it is not a listed candidate (a remediation);
        ``remediation``: the attempt it runs, tagged on and logged with its MLflow run."""
        rhash = recipe.hash()
        self.db.put_recipe(rhash, recipe.name, recipe.to_yaml())
        child = self.parent.candidate_run(campaign_id=self.campaign_id, stage=stage.name,
                                          candidate=name, recipe=recipe, recipe_hash=rhash,
                                          mode=recipe.mode)
        description = _run_description(stage, name)
        if about is not None:
            description = description.split("\n")[0] + f"\ncandidate {name}: {about}"
        child.set_tags({TAG_DESCRIPTION: description})
        if remediation is not None:
            child.set_tags(remediation.tags())
            child.log_dict(remediation.to_dict(), "remediation.json")
        _emit(self.events, CandidateEvent(stage.name, name, "running", recipe_hash=rhash))
        run = run_candidate(campaign_id=self.campaign_id, stage=stage.name, candidate=name,
                            recipe_hash=rhash, recipe=recipe,
                            registry_url=self.registry_url, mlflow_run_id=child.id,
                            tracking_uri=self.tracking_uri)
        gates = [g for g in stage.gates if not (absolute_only and g.relative_to)]
        report = judge(run=run, gates=gates, references=references,
                       context=GateContext.of(recipe, candidates=_tries(stage)),
                       registry_url=self.registry_url,
                       mlflow_run_id=child.id, tracking_uri=self.tracking_uri,
                       where={"campaign_id": self.campaign_id, "stage": stage.name,
                              "candidate": name},
                       reference_runs=reference_runs, samples_per_step=recipe.samples_per_step)
        self.plots.add(run.run_dir)  # drawn while the next candidate trains
        # a reference re-run is never promoted: its verdict is information, not a rejection
        status = "finished" if absolute_only or report.passed else "rejected"
        self.db.upsert_run(self.campaign_id, stage.name, name, rhash, status=status)
        shown = ("reference" if absolute_only
                 else "passed" if report.passed else "rejected")
        _emit(self.events, CandidateEvent(stage.name, name, shown, recipe_hash=rhash,
                                          summary=run.summary,
                                          gates=list(report.gates),
                                          samples_trained=report.samples_trained))
        return CandidateOutcome(candidate=name, recipe=recipe, recipe_hash=rhash, run=run,
                                report=report, mlflow_run_id=child.id)


def _start_ray() -> None:
    """One Ray for the whole campaign (FACTS.md): the runs' own start-up
    (:func:`training.runtime.run.start_ray`); platform/prefect.yaml sets ``RAY_ADDRESS=auto``
    to join the cluster's."""
    from training.runtime.run import start_ray

    start_ray()
