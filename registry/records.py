"""The registry's records, its location and its errors: what reading a registry needs, without
SQLAlchemy (importing it is ≈0.45 s of a CLI command; see :mod:`registry.sqlite_reader`).

:class:`registry.db.RegistryDB` (SQLAlchemy, SQLite and PostgreSQL) and
:class:`registry.sqlite_reader.SQLiteReader` (the standard library's ``sqlite3``, reads only)
return these same frozen records; the builders below take any object with a row's column
attributes (an ORM row, or a plain namespace of one fetched row).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from training.ownership import ProcessIdentity

__all__ = [
    "DEFAULT_FILE",
    "SCHEMA_HEAD",
    "URL_ENV_VAR",
    "CampaignRecord",
    "GateRecord",
    "OwnerRecord",
    "PromotionRecord",
    "RecipeRecord",
    "RegistryError",
    "RemediationRecord",
    "RunRecord",
    "StageRecord",
    "campaign_record",
    "default_url",
    "gate_record",
    "owner_alive",
    "owner_record",
    "promotion_record",
    "recipe_record",
    "remediation_record",
    "run_record",
    "stage_record",
]

#: Environment variable with a SQLAlchemy URL that overrides the default SQLite file.
URL_ENV_VAR = "ASYNCRL_REGISTRY_URL"
#: File name of the default SQLite registry inside the state directory.
DEFAULT_FILE = "registry.db"

#: The newest migration in ``registry/migrations/versions`` (:func:`head_revision` asks Alembic;
#: ``tests/registry`` checks the two agree, so a new migration must update this). A database
#: that records exactly this revision opens without Alembic.
SCHEMA_HEAD = "0005"



class RegistryError(Exception):
    """A registry problem the caller can fix; the message is one line: the problem, then the fix."""


def default_url() -> str:
    """``$ASYNCRL_REGISTRY_URL`` if set, else the SQLite file ``registry.db`` in the state
    directory (``$ASYNCRL_HOME``, see ``training.paths``). Creates nothing: opening a
    :class:`RegistryDB` creates the file's directory (one :class:`RegistryError` line when it
    cannot)."""
    env = os.environ.get(URL_ENV_VAR, "").strip()
    if env:
        return env
    from training.paths import state_path

    return f"sqlite:///{state_path() / DEFAULT_FILE}"


def utcnow() -> datetime:
    """Now, in UTC (timezone-aware)."""
    return datetime.now(UTC)


def _json_load(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _iso(ts: datetime | None) -> str | None:
    if ts is None:
        return None
    if ts.tzinfo is None:  # SQLite keeps no zone; we only ever write UTC
        ts = ts.replace(tzinfo=UTC)
    return ts.astimezone(UTC).isoformat()


# --------------------------------------------------------------------------------------------
# records: what the read methods return


class _Record:
    """A registry row as a frozen value. Fields hold the row's values with JSON columns decoded
    and timestamps as ISO-8601 UTC strings (the layout ``--json`` prints); :meth:`to_dict` is
    that layout as a plain dict. JSON values (dicts, lists) are the decoded data itself, not
    frozen copies: treat them as read-only."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict, in field order (JSON values copied)."""
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True, kw_only=True)
class CampaignRecord(_Record):
    """A campaign (``campaigns`` row)."""

    id: str
    name: str
    """The campaign id (the registry key) and the campaign's name."""
    spec: dict[str, Any]
    """What was recorded at launch (``flows.launch.record_campaign``: the campaign, its base
    recipe's hash, ``path`` of the campaign file); a resume with another spec is refused."""
    status: str
    verdict: str | None
    diagnosis: dict[str, Any] | None
    """Recorded status (:data:`CAMPAIGN_STATUSES`; ``registry.ownership.effective_status``
    tells a crashed ``running`` one), the one-line verdict and the diagnosis of a stopped
    campaign (None until set)."""
    created_at: str
    updated_at: str
    """When the campaign was recorded and last changed (ISO-8601, UTC)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRecord(_Record):
    """A campaign stage (``stages`` row)."""

    campaign_id: str
    name: str
    index: int
    """The campaign, the stage's name and its position in the ladder (0 first)."""
    status: str
    promoted_candidate: str | None
    """:data:`STAGE_STATUSES`, and the candidate of the stage's newest active promotion."""
    created_at: str
    updated_at: str
    """When the stage was recorded and last changed (ISO-8601, UTC)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecipeRecord(_Record):
    """A stored recipe (``recipes`` row), keyed by its hash."""

    hash: str
    name: str
    yaml: str
    """The recipe hash (its identity), the recipe's name and its full YAML."""
    created_at: str
    """When it was first stored (ISO-8601, UTC)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRecord(_Record):
    """A candidate run (``candidate_runs`` row): one candidate of one stage of a campaign."""

    id: int
    campaign_id: str
    stage: str
    candidate: str
    recipe_hash: str
    """The run's id (what gate results refer to), the (campaign, stage, candidate) it is unique
    for, and the hash of the recipe it trains."""
    status: str
    run_dir: str | None
    mlflow_run_id: str | None
    summary: dict[str, Any] | None
    """:data:`RUN_STATUSES`, the run directory, the MLflow child run and the summary metrics
    of a finished run (None until written)."""
    started_at: str | None
    finished_at: str | None
    created_at: str
    updated_at: str
    """When it first ran, when it ended (None while pending or running again), when it was
    recorded and last changed (ISO-8601, UTC)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GateRecord(_Record):
    """One gate's result for a run (``gate_results`` row)."""

    run_id: int
    name: str
    passed: bool
    """The run judged, the gate's name and its verdict."""
    value: float | None
    threshold: float | None
    window: tuple[int | None, int | None] | None
    """The measured value and the threshold it was held to (None when unset or NaN), and the
    (start, end) steps it was measured over (None when not recorded)."""
    evidence: Any
    params: dict[str, Any] | None
    """The gate's evidence (text or JSON data) and the parameters it ran with."""
    noise: float | None
    """The standard error of ``value`` the gate's noise floor is built from (None when the gate
    has no noise model, or for results recorded before revision 0004)."""
    created_at: str
    """When the result was recorded (ISO-8601, UTC)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PromotionRecord(_Record):
    """A promotion (``promotions`` row): a campaign's auto promotion of a stage winner, or a
    person's by hand."""

    id: int
    campaign_id: str | None
    stage: str | None
    candidate: str
    """The promotion id, the campaign stage it promotes (None for a global, hand-made one) and
    the candidate."""
    recipe_hash: str
    checkpoint: str | None
    mlflow_version: str | None
    """The promoted recipe, its checkpoint and the MLflow model version registered for it."""
    actor: str
    reason: str
    status: str
    created_at: str
    """Who promoted (:data:`AUTO` or a person), why, :data:`PROMOTION_STATUSES` and when
    (ISO-8601, UTC)."""
    retired_at: str | None
    retired_by: str | None
    retire_reason: str | None
    """When, by whom and why it was retired (None while active)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RemediationRecord(_Record):
    """One attempt of a stage to repair itself (``remediations`` row)."""

    campaign_id: str
    stage: str
    attempt: int
    """The campaign, the stage and the attempt (1 first)."""
    from_candidate: str
    candidate: str | None
    """The failing run it starts from, and the candidate it ran (``remedy-<attempt>``; None
    when no remedy was left to try)."""
    cause: str | None
    title: str | None
    source: str | None
    evidence: list[str] | None
    override: dict[str, Any] | None
    """The remedy: the seed's cause and words, why it was proposed, its evidence and the recipe
    override (dotted keys, as a candidate's ``overrides:`` takes them)."""
    diagnosis: dict[str, Any] | None
    """Seed 001's decision tree on the failing run (the ``RunDiagnosis`` JSON record)."""
    status: str
    """:data:`REMEDIATION_STATUSES`."""
    created_at: str
    updated_at: str


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerRecord(_Record):
    """The process owning a campaign (``campaign_owners`` row), judged alive or not when read."""

    campaign_id: str
    host: str
    pid: int
    start_ticks: int | None
    """The campaign, and the owner process: host, PID and start time in clock ticks."""
    acquired_at: str
    heartbeat_at: str
    """When it took the campaign and when it last refreshed its heartbeat (ISO-8601, UTC)."""
    alive: bool
    describe: str
    """Whether the owner was alive when read (:func:`owner_alive`) and the process in words
    (``PID 123 on host (since …)``, as error messages name it)."""


# Row → record converters, shared by the SQLAlchemy store (registry.db) and the stdlib SQLite
# reader (registry.sqlite_reader): each takes an ORM row or a namespace with the same fields.


def campaign_record(c: Any) -> CampaignRecord:
    return CampaignRecord(
        id=c.id,
        name=c.name,
        spec=_json_load(c.spec),
        status=c.status,
        verdict=c.verdict,
        diagnosis=_json_load(c.diagnosis),
        created_at=_iso(c.created_at),
        updated_at=_iso(c.updated_at),
    )


def stage_record(s: Any) -> StageRecord:
    return StageRecord(
        campaign_id=s.campaign_id,
        name=s.name,
        index=s.position,
        status=s.status,
        promoted_candidate=s.promoted_candidate,
        created_at=_iso(s.created_at),
        updated_at=_iso(s.updated_at),
    )


def recipe_record(r: Any) -> RecipeRecord:
    return RecipeRecord(hash=r.hash, name=r.name, yaml=r.yaml, created_at=_iso(r.created_at))


def run_record(r: Any) -> RunRecord:
    return RunRecord(
        id=r.id,
        campaign_id=r.campaign_id,
        stage=r.stage,
        candidate=r.candidate,
        recipe_hash=r.recipe_hash,
        status=r.status,
        run_dir=r.run_dir,
        mlflow_run_id=r.mlflow_run_id,
        summary=_json_load(r.summary),
        started_at=_iso(r.started_at),
        finished_at=_iso(r.finished_at),
        created_at=_iso(r.created_at),
        updated_at=_iso(r.updated_at),
    )


def gate_record(g: Any) -> GateRecord:
    window = None
    if g.window_start is not None or g.window_end is not None:
        window = (g.window_start, g.window_end)
    return GateRecord(
        run_id=g.run_id,
        name=g.name,
        passed=bool(g.passed),
        value=g.value,
        threshold=g.threshold,
        window=window,
        evidence=_json_load(g.evidence),
        params=_json_load(g.params),
        noise=getattr(g, "noise", None),
        created_at=_iso(g.created_at),
    )


def remediation_record(r: Any) -> RemediationRecord:
    return RemediationRecord(
        campaign_id=r.campaign_id, stage=r.stage, attempt=int(r.attempt),
        from_candidate=r.from_candidate, candidate=r.candidate, cause=r.cause, title=r.title,
        source=r.source, evidence=_json_load(r.evidence), override=_json_load(r.override),
        diagnosis=_json_load(r.diagnosis), status=r.status,
        created_at=_iso(r.created_at), updated_at=_iso(r.updated_at))


def promotion_record(p: Any) -> PromotionRecord:
    return PromotionRecord(
        id=p.id,
        campaign_id=p.campaign_id,
        stage=p.stage,
        candidate=p.candidate,
        recipe_hash=p.recipe_hash,
        checkpoint=p.checkpoint,
        mlflow_version=p.mlflow_version,
        actor=p.actor,
        reason=p.reason,
        status=p.status,
        created_at=_iso(p.created_at),
        retired_at=_iso(p.retired_at),
        retired_by=p.retired_by,
        retire_reason=p.retire_reason,
    )


def owner_alive(identity: ProcessIdentity, heartbeat_at: datetime, heartbeat_ttl_s: float
                ) -> bool:
    """A process on this host is alive when its PID exists with the recorded start time; one on
    another host, while its heartbeat is younger than ``heartbeat_ttl_s``."""
    seen = identity.alive()
    if seen is not None:
        return seen
    if heartbeat_at.tzinfo is None:
        heartbeat_at = heartbeat_at.replace(tzinfo=UTC)
    return (utcnow() - heartbeat_at).total_seconds() < heartbeat_ttl_s


def owner_record(row: Any, heartbeat_ttl_s: float) -> OwnerRecord:
    identity = ProcessIdentity(host=row.host, pid=row.pid, start_ticks=row.start_ticks,
                               token=row.token, since=_aware(row.acquired_at).timestamp())
    return OwnerRecord(campaign_id=row.campaign_id, host=row.host, pid=row.pid,
                       start_ticks=row.start_ticks, acquired_at=_iso(row.acquired_at),
                       heartbeat_at=_iso(row.heartbeat_at),
                       alive=owner_alive(identity, row.heartbeat_at, heartbeat_ttl_s),
                       describe=identity.describe())


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
