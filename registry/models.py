"""The registry's tables (SQLAlchemy 2 declarative models).

The schema is created and changed only by the Alembic migrations in ``registry/migrations``; these
models describe the head revision and ``tests/registry/test_db.py`` checks that the two agree.
JSON values are stored as text (canonical JSON: sorted keys) so the same schema works on SQLite and
PostgreSQL; timestamps are UTC. Allowed status values are checked by ``registry.db`` (no CHECK
constraints, so adding a status never needs a table rebuild on SQLite).

Tables:

- ``campaigns``: one row per launched campaign (id chosen by the caller), its spec, status and the
  final verdict/diagnosis.
- ``stages``: one row per campaign stage: position, status and the promoted candidate.
- ``recipes``: every recipe a run used, by content hash, with its YAML.
- ``candidate_runs``: one training run of one candidate recipe in one stage.
- ``gate_results``: one stability-gate verdict for one run, with its evidence.
- ``promotions``: a recipe (and checkpoint) promoted by a campaign stage or by hand, and its
  retirement.
- ``gate_results.noise``: the standard error behind a gate's noise floor (revision 0004).
- ``remediations``: a stage's attempts to repair itself (revision 0005; ``registry.remediation``).
- ``campaign_owners``: the one process running a campaign now (revision 0003; see
  ``registry.ownership``).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names, so later migrations can drop or alter them by name on every
# backend (SQLite's batch mode needs names too).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Short identifiers (campaign ids, stage/candidate names, statuses, actors).
NAME_LEN = 200
#: Recipe content hashes (hex digests).
HASH_LEN = 128
#: The partial-index condition that makes auto promotions unique per (campaign, stage).
AUTO_PROMOTION_WHERE = "actor = 'auto'"


def utcnow() -> datetime:
    """Now, in UTC (timezone-aware)."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class CampaignRow(Base):
    """A launched campaign. ``spec`` is the validated campaign (JSON); ``status`` is one of
    pending|running|finished|failed|stopped; ``verdict`` is a one-line outcome and ``diagnosis``
    (JSON) the decision-tree causes when no candidate passed."""

    __tablename__ = "campaigns"

    id: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    spec: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    verdict: Mapped[str | None] = mapped_column(Text, nullable=True)
    diagnosis: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StageRow(Base):
    """One stage of a campaign: its position in the ladder (``position``, exposed as ``index``),
    status (pending|running|finished|failed|stopped) and the candidate promoted from it."""

    __tablename__ = "stages"
    __table_args__ = (UniqueConstraint("campaign_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    campaign_id: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("campaigns.id", ondelete="CASCADE")
    )
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    position: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    promoted_candidate: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RecipeRow(Base):
    """A recipe by content hash (the identity training uses), with the YAML it was made from."""

    __tablename__ = "recipes"

    hash: Mapped[str] = mapped_column(String(HASH_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    yaml: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CandidateRunRow(Base):
    """One training run of a candidate recipe in a campaign stage. ``status`` is one of
    pending|running|finished|failed|rejected; ``summary`` is the trainer's result (JSON)."""

    __tablename__ = "candidate_runs"
    __table_args__ = (UniqueConstraint("campaign_id", "stage", "candidate"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    campaign_id: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("campaigns.id", ondelete="CASCADE")
    )
    stage: Mapped[str] = mapped_column(String(NAME_LEN))
    candidate: Mapped[str] = mapped_column(String(NAME_LEN))
    recipe_hash: Mapped[str] = mapped_column(String(HASH_LEN), ForeignKey("recipes.hash"))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    run_dir: Mapped[str | None] = mapped_column(Text, nullable=True)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True)
    summary: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class GateResultRow(Base):
    """One gate's verdict on one run: the observed ``value`` against ``threshold`` over the step
    window [``window_start``, ``window_end``], with its ``evidence`` and ``params`` (both JSON)."""

    __tablename__ = "gate_results"
    __table_args__ = (UniqueConstraint("run_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("candidate_runs.id", ondelete="CASCADE")
    )
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    passed: Mapped[bool] = mapped_column(Boolean)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    threshold: Mapped[float | None] = mapped_column(Float, nullable=True)
    window_start: Mapped[int | None] = mapped_column(Integer, nullable=True)
    window_end: Mapped[int | None] = mapped_column(Integer, nullable=True)
    evidence: Mapped[str | None] = mapped_column(Text, nullable=True)
    params: Mapped[str | None] = mapped_column(Text, nullable=True)
    noise: Mapped[float | None] = mapped_column(Float, nullable=True)  # revision 0004
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class PromotionRow(Base):
    """A promoted recipe/checkpoint. ``actor`` is ``"auto"`` (a campaign's promote task) or a user
    name; auto promotions are unique per (campaign, stage), which makes them idempotent.
    ``status`` is active|retired; ``retired_*`` record who retired it and why (revision 0002)."""

    __tablename__ = "promotions"
    __table_args__ = (
        Index(
            "uq_promotions_auto_stage",
            "campaign_id",
            "stage",
            unique=True,
            sqlite_where=text(AUTO_PROMOTION_WHERE),
            postgresql_where=text(AUTO_PROMOTION_WHERE),
        ),
        Index("ix_promotions_status", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    campaign_id: Mapped[str | None] = mapped_column(
        String(NAME_LEN), ForeignKey("campaigns.id"), nullable=True
    )
    stage: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True)
    candidate: Mapped[str] = mapped_column(String(NAME_LEN))
    recipe_hash: Mapped[str] = mapped_column(String(HASH_LEN), ForeignKey("recipes.hash"))
    checkpoint: Mapped[str | None] = mapped_column(Text, nullable=True)
    mlflow_version: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True)
    actor: Mapped[str] = mapped_column(String(NAME_LEN))
    reason: Mapped[str] = mapped_column(Text, default="")
    status: Mapped[str] = mapped_column(String(16), default="active")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    retired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    retired_by: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True)
    retire_reason: Mapped[str | None] = mapped_column(Text, nullable=True)


class RemediationRow(Base):
    """One attempt of a stage to repair itself (revision 0005): the run it starts from
    (``from_candidate``), the remedy (``cause``, ``title``, ``source``, ``evidence`` and
    ``override`` as JSON), the failing run's ``diagnosis`` (JSON), the candidate it ran
    (``remedy-<attempt>``; None when no remedy was left) and its ``status``:
    running|passed|failed|none."""

    __tablename__ = "remediations"
    __table_args__ = (UniqueConstraint("campaign_id", "stage", "attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    campaign_id: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("campaigns.id", ondelete="CASCADE")
    )
    stage: Mapped[str] = mapped_column(String(NAME_LEN))
    attempt: Mapped[int] = mapped_column(Integer)
    from_candidate: Mapped[str] = mapped_column(String(NAME_LEN))
    candidate: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True)
    cause: Mapped[str | None] = mapped_column(String(64), nullable=True)
    title: Mapped[str | None] = mapped_column(Text, nullable=True)
    source: Mapped[str | None] = mapped_column(Text, nullable=True)
    evidence: Mapped[str | None] = mapped_column(Text, nullable=True)
    override: Mapped[str | None] = mapped_column(Text, nullable=True)
    diagnosis: Mapped[str | None] = mapped_column(Text, nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class CampaignOwnerRow(Base):
    """The process that owns a campaign while it runs (revision 0003): ``host``, ``pid`` and the
    process's start time in clock ticks (``start_ticks``, so a reused PID is not taken for the
    owner), a random ``token`` naming this ownership, and ``heartbeat_at``, refreshed while it
    runs (how another host tells a live owner from a dead one). The row is deleted when the
    owner finishes; a row whose process is gone is a crashed owner, taken over by the next
    launch or resume."""

    __tablename__ = "campaign_owners"

    campaign_id: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("campaigns.id", ondelete="CASCADE"), primary_key=True
    )
    token: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(NAME_LEN))
    pid: Mapped[int] = mapped_column(Integer)
    start_ticks: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    acquired_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
