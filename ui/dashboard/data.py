"""What the dashboard shows, read from the registry and the run directories — never written.

Each page is built from typed views: :class:`CampaignView` (the ladder: stages × candidates with
their gates, key numbers and promotion), :class:`RunSeries` (a run's metrics keyed by samples
trained, for the charts) and :func:`recipe_diff` (what a candidate changed). The registry is opened
read-only per request (:func:`registry.sqlite_reader.open_reader`: the stdlib reader for the
default SQLite file, SQLAlchemy for PostgreSQL), so a campaign writing at the same time is never
blocked and the page always shows what is recorded now.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

#: Metric keys of the key numbers (the last quarter's mean, as the gates read them).
TRAIN_ROLLOUT = "mismatch/train_rollout/logprob_abs_diff/mean"
ENGINE = "mismatch/engine/logprob_abs_diff/mean"
UPDATE = "policy/update/logprob_abs_diff/mean"
REWARD = "rollout/reward_mean"
TRAINED = "async/trained_samples"


@dataclass(frozen=True)
class GateView:
    """One gate's verdict on a run, as the registry recorded it. ``margin``: value − limit (its
    sign reads with the gate's direction, which the evidence states); ``noise``: the gate's
    noise scale when it recorded one, so ``margin_se`` is the margin in noise units."""

    name: str
    passed: bool
    value: float | None
    threshold: float | None
    evidence: str
    window: tuple[int | None, int | None] | None
    noise: float | None = None

    @property
    def margin(self) -> float | None:
        if self.value is None or self.threshold is None:
            return None
        return self.value - self.threshold

    @property
    def margin_se(self) -> float | None:
        m = self.margin
        if m is None or not self.noise or not math.isfinite(self.noise):
            return None
        return m / self.noise


@dataclass(frozen=True)
class KeyNumbers:
    """A run's headline numbers: the last rollout reward, the last eval (mean, its standard
    error over n prompts), the last quarter's train–rollout and engine |Δlogp| and update size,
    and the largest staleness any trained sample had."""

    final_reward: float | None = None
    eval_mean: float | None = None
    eval_se: float | None = None
    eval_n: int | None = None
    train_rollout_gap: float | None = None
    engine_gap: float | None = None
    update_size: float | None = None
    max_staleness: float | None = None


@dataclass(frozen=True)
class RunView:
    """One run of a stage (a candidate, a seed or a re-run reference) with its verdict."""

    id: int
    stage: str
    candidate: str
    recipe_hash: str
    status: str
    run_dir: str | None
    mlflow_run_id: str | None
    description: str
    gates: tuple[GateView, ...]
    numbers: KeyNumbers
    promoted: bool
    promotion_reason: str | None
    remediation: Any = None
    """The :class:`~registry.records.RemediationRecord` this run is the remedy of (None for a
    listed candidate)."""

    @property
    def judged(self) -> bool:
        return bool(self.gates)

    @property
    def passed(self) -> bool:
        return self.judged and all(g.passed for g in self.gates)

    @property
    def is_reference(self) -> bool:
        return self.candidate.startswith("reference-")


@dataclass(frozen=True)
class StageView:
    """A stage of the ladder: its recorded status, the campaign file's description and runs."""

    name: str
    index: int
    status: str
    description: str
    runs: tuple[RunView, ...]
    promoted_candidate: str | None
    remediations: tuple[Any, ...] = ()
    """The stage's remediation attempts (:class:`~registry.records.RemediationRecord`)."""


@dataclass(frozen=True)
class CampaignView:
    """A campaign as the dashboard shows it (``status`` is the effective one: a ``running``
    campaign whose owner process is gone is ``crashed``)."""

    id: str
    name: str
    status: str
    verdict: str | None
    diagnosis: dict[str, Any] | None
    created_at: str
    updated_at: str
    owner: str | None
    stages: tuple[StageView, ...]
    promotions: tuple[Any, ...] = field(default_factory=tuple)
    spec: dict[str, Any] = field(default_factory=dict)

    @property
    def stage_reached(self) -> str | None:
        started = [s for s in self.stages if s.status != "pending"]
        return started[-1].name if started else None

    @property
    def duration_s(self) -> float:
        end = datetime.now().astimezone() if self.status == "running" else _ts(self.updated_at)
        return max((end - _ts(self.created_at)).total_seconds(), 0.0)

    @property
    def live(self) -> bool:
        return self.status == "running"

    def run(self, run_id: int) -> RunView | None:
        return next((r for s in self.stages for r in s.runs if r.id == run_id), None)

    def stage(self, name: str) -> StageView | None:
        return next((s for s in self.stages if s.name == name), None)


def _ts(text: str) -> datetime:
    ts = datetime.fromisoformat(text)
    return ts if ts.tzinfo else ts.astimezone()


def _descriptions(spec: Mapping[str, Any]) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """Stage and candidate descriptions from the campaign file recorded at launch."""
    stages, cands = {}, {}
    for st in (spec.get("campaign") or {}).get("stages") or []:
        stages[st.get("name", "")] = st.get("description") or ""
        for c in st.get("candidates") or []:
            cands[(st.get("name", ""), c.get("name", ""))] = c.get("description") or ""
    return stages, cands


def campaign_view(db: Any, campaign_id: str, numbers: bool = True) -> CampaignView | None:
    """The ladder of ``campaign_id`` from the registry ``db`` (None when unknown); without
    ``numbers`` the runs' files are not read (the campaign list needs none of them)."""
    from registry.ownership import effective_status

    row = db.get_campaign(campaign_id)
    if row is None:
        return None
    status, owner = effective_status(db, row)
    stage_desc, cand_desc = _descriptions(row.spec or {})
    promotions = tuple(db.promotions(campaign_id=campaign_id))
    active = {(p.stage, p.candidate): p for p in promotions if p.status == "active"}
    remediations = list(db.remediations(campaign_id))
    remedy_of = {(a.stage, a.candidate): a for a in remediations if a.candidate}
    runs_by_stage: dict[str, list[RunView]] = {}
    for r in db.runs(campaign_id):
        base = re.sub(r"\.s\d+$", "", r.candidate)  # a seed's run: its candidate's
        promo = active.get((r.stage, r.candidate))
        runs_by_stage.setdefault(r.stage, []).append(RunView(
            id=r.id, stage=r.stage, candidate=r.candidate, recipe_hash=r.recipe_hash,
            status=r.status, run_dir=r.run_dir, mlflow_run_id=r.mlflow_run_id,
            description=cand_desc.get((r.stage, base), ""),
            gates=tuple(_gate_view(g) for g in db.gate_results(r.id)),
            numbers=key_numbers(r.run_dir, r.summary or {}) if numbers else KeyNumbers(),
            promoted=promo is not None, promotion_reason=promo.reason if promo else None,
            remediation=remedy_of.get((r.stage, base))))
    stages = tuple(StageView(name=s.name, index=s.index, status=s.status,
                             description=stage_desc.get(s.name, ""),
                             runs=tuple(runs_by_stage.get(s.name, [])),
                             promoted_candidate=s.promoted_candidate,
                             remediations=tuple(a for a in remediations if a.stage == s.name))
                   for s in sorted(db.stages(campaign_id), key=lambda s: s.index))
    return CampaignView(id=row.id, name=row.name, status=status, verdict=row.verdict,
                        diagnosis=row.diagnosis, created_at=row.created_at,
                        updated_at=row.updated_at,
                        owner=owner.describe if owner is not None else None,
                        stages=stages, promotions=promotions, spec=row.spec or {})


def campaign_views(db: Any) -> list[CampaignView]:
    """Every campaign, newest first (without the runs' key numbers)."""
    out = [v for c in db.list_campaigns()
           if (v := campaign_view(db, c.id, numbers=False)) is not None]
    return sorted(out, key=lambda v: v.created_at, reverse=True)


def _gate_view(g: Any) -> GateView:
    evidence = g.evidence if isinstance(g.evidence, str) else json.dumps(g.evidence)
    return GateView(name=g.name, passed=g.passed, value=g.value, threshold=g.threshold,
                    evidence=evidence or "", window=g.window, noise=g.noise)


# --- a run's files ------------------------------------------------------------------------------


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def read_history(run_dir: str | Path | None) -> list[dict[str, Any]]:
    """The rows of the run's ``metrics.jsonl`` ([] when it has none yet); parsed again only
    when the file changed (the live ladder asks every few seconds)."""
    if not run_dir:
        return []
    path = Path(run_dir) / "metrics.jsonl"
    stamp = _stamp(path)
    return [] if stamp is None else [dict(r) for r in _history(str(path), stamp)]


@functools.lru_cache(maxsize=256)
def _history(path: str, stamp: tuple[int, int]) -> tuple[dict[str, Any], ...]:
    from training.runtime.sinks import read_metrics

    try:
        return tuple(dict(r) for r in read_metrics(path))
    except (OSError, ValueError):
        return ()


def key_numbers(run_dir: str | None, summary: Mapping[str, Any]) -> KeyNumbers:
    """The run's :class:`KeyNumbers` from its files (its summary for what they lack)."""
    series = RunSeries.of(read_history(run_dir))

    def last(key: str) -> float | None:
        pts = series.points(key)
        return pts[-1][1] if pts else _num(summary.get(key))

    def tail(key: str) -> float | None:
        vals = [v for _, v in series.points(key)]
        if not vals:
            return _num(summary.get(key))
        q = vals[-max(1, len(vals) // 4):]
        return sum(q) / len(q)

    stale = [v for _, v in series.points("async/staleness/max")]
    mean, se, n = _eval(run_dir)
    return KeyNumbers(final_reward=last(REWARD),
                      eval_mean=mean if mean is not None else _num(summary.get("eval/reward_mean")),
                      eval_se=se, eval_n=n, train_rollout_gap=tail(TRAIN_ROLLOUT),
                      engine_gap=tail(ENGINE), update_size=tail(UPDATE),
                      max_staleness=max(stale) if stale else _num(summary.get(
                          "async/staleness/max")))


def _eval(run_dir: str | None) -> tuple[float | None, float | None, int | None]:
    """The last eval's mean reward, its standard error over prompts and n."""
    if not run_dir:
        return None, None, None
    path = Path(run_dir) / "eval.jsonl"
    stamp = _stamp(path)
    return (None, None, None) if stamp is None else _eval_of(str(path), stamp)


@functools.lru_cache(maxsize=256)
def _eval_of(path: str, stamp: tuple[int, int]
             ) -> tuple[float | None, float | None, int | None]:
    from training.evals import read_evals

    try:
        evals = read_evals(path)
    except (OSError, ValueError):
        return None, None, None
    if not evals:
        return None, None, None
    rewards = [float(r) for r in evals[-1].rewards]
    n = len(rewards)
    if n == 0:
        return None, None, None
    mean = sum(rewards) / n
    se = (math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1) / n) if n > 1 else None)
    return mean, se, n


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


@dataclass(frozen=True)
class RunSeries:
    """A run's metrics as ``key → [(samples trained, value)]`` (training rows only; the x is
    ``async/trained_samples`` where logged, else the step × samples per step; the eval-only row
    before training sits at 0). NaN values are kept (a diverged step stays visible)."""

    by_key: dict[str, list[tuple[float, float]]]

    @classmethod
    def of(cls, history: Iterable[Mapping[str, Any]], samples_per_step: int | None = None
           ) -> RunSeries:
        by_step: dict[int, dict[str, Any]] = {}
        for row in history:
            key = -1 if row.get("step/eval_only") else int(row["step"])
            by_step.setdefault(key, {}).update(row)
        out: dict[str, list[tuple[float, float]]] = {}
        for step in sorted(by_step):
            row = by_step[step]
            if step < 0:
                x = 0.0
            elif isinstance(row.get(TRAINED), int | float):
                x = float(row[TRAINED])
            else:
                x = float((step + 1) * (samples_per_step or 1))
            for key, value in row.items():
                if key in ("step", "time", "_nonfinite") or isinstance(value, str | bool):
                    continue
                if value is None:
                    out.setdefault(key, []).append((x, math.nan))
                elif isinstance(value, int | float):
                    out.setdefault(key, []).append((x, float(value)))
        return cls(out)

    def points(self, key: str) -> list[tuple[float, float]]:
        return [(x, v) for x, v in self.by_key.get(key, []) if math.isfinite(v)]

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.by_key if k.startswith(prefix))


# --- recipes ------------------------------------------------------------------------------------


def recipe_data(db: Any, recipe_hash: str) -> dict[str, Any] | None:
    row = db.get_recipe(recipe_hash)
    if row is None:
        return None
    data = yaml.safe_load(row.yaml)
    return data if isinstance(data, dict) else None


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping) and data:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


@dataclass(frozen=True)
class FieldChange:
    """One recipe field that differs: its dotted key, the value before and after (None when
    absent on that side)."""

    key: str
    before: Any
    after: Any


def recipe_diff(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None,
                before_hash: str | None = None, ignore: Sequence[str] = ("name",)
                ) -> list[FieldChange]:
    """The fields of ``after`` that differ from ``before``, by dotted key, sorted. A model that
    is ``before``'s own promoted checkpoint (``model.origin`` = ``recipe:<before_hash>``, what a
    later stage starts from) is one change, ``model``, not every model field."""
    a, b = _flatten(before or {}), _flatten(after or {})
    out = []
    from_checkpoint = before_hash is not None and b.get("model.origin") == f"recipe:{before_hash}"
    if from_checkpoint:
        out.append(FieldChange("model", f"as recipe {before_hash[:12]}",
                               f"its promoted checkpoint {b.get('model.path')}"))
    out += [FieldChange(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in ignore
            and not (from_checkpoint and k.startswith("model."))]
    return out


def stage_base_hash(view: CampaignView, stage: StageView) -> str | None:
    """The recipe a stage's candidates start from: the previous stage's promoted recipe (the
    campaign's base recipe for the first stage)."""
    earlier = [s for s in view.stages if s.index < stage.index]
    for s in reversed(earlier):
        promoted = [r for r in s.runs if r.promoted]
        if promoted:
            return promoted[0].recipe_hash
    return view.spec.get("base_recipe_hash")


def samples_per_step(data: Mapping[str, Any] | None) -> int | None:
    """Samples a trainer step consumes under a stored recipe (``Recipe.samples_per_step``);
    None when the data no longer loads as a recipe."""
    if not data:
        return None
    from training.recipe import RecipeError, recipe_from_dict

    try:
        return recipe_from_dict(dict(data), "stored recipe").samples_per_step
    except (RecipeError, ValueError, TypeError):
        return None
