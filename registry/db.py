"""The registry API: campaigns, stages, recipes, candidate runs, gate results and promotions.

One class, :class:`RegistryDB`, over SQLAlchemy; the same code runs on SQLite (the embedded
default, a file under the state directory) and PostgreSQL (a team's server, URL from config).
Opening a registry migrates it to the newest schema (Alembic, ``registry/migrations``); one
already there is recognised by one query, without importing Alembic (which with its check of the
migration scripts was ~0.3 s of every ``asyncrl campaign status``). :func:`open_existing` opens
one only to read: a SQLite file that does not exist yet is not created.

Conventions:

- every write is one short transaction; every read returns frozen records
  (:class:`CampaignRecord`, :class:`StageRecord`, :class:`RecipeRecord`, :class:`RunRecord`,
  :class:`GateRecord`, :class:`PromotionRecord`, :class:`OwnerRecord`: JSON columns decoded,
  timestamps as ISO-8601 UTC strings, ``to_dict()`` the JSON-ready dict), never ORM objects;
- the writes a resumed campaign repeats are idempotent: ``create_campaign``, ``put_recipe``,
  ``upsert_stage``, ``upsert_run``, ``record_gate_results`` and auto ``promote``;
- errors a user can act on are :class:`RegistryError` with a one-line message naming the problem
  and the fix.

SQLite: WAL journal, a 30 s busy timeout and foreign keys on every connection, and write
transactions start with ``BEGIN IMMEDIATE`` (they queue for the write lock instead of failing
with "database is locked" when two processes write at once).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, delete, event, inspect, select, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, NoSuchModuleError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from registry.models import (
    CampaignOwnerRow,
    CampaignRow,
    CandidateRunRow,
    GateResultRow,
    PromotionRow,
    RecipeRow,
    RemediationRow,
    StageRow,
    utcnow,
)
from registry.records import (
    DEFAULT_FILE,
    SCHEMA_HEAD,
    URL_ENV_VAR,
    CampaignRecord,
    GateRecord,
    OwnerRecord,
    PromotionRecord,
    RecipeRecord,
    RegistryError,
    RemediationRecord,
    RunRecord,
    StageRecord,
    campaign_record,
    default_url,
    gate_record,
    owner_alive,
    owner_record,
    promotion_record,
    recipe_record,
    remediation_record,
    run_record,
    stage_record,
)
from training.ownership import ProcessIdentity

__all__ = [
    "AUTO",
    "CAMPAIGN_STATUSES",
    "DEFAULT_FILE",
    "PROMOTION_STATUSES",
    "REMEDIATION_STATUSES",
    "RUN_ENDED",
    "RUN_STATUSES",
    "SCHEMA_HEAD",
    "SQLITE_BUSY_TIMEOUT_MS",
    "STAGE_STATUSES",
    "URL_ENV_VAR",
    "CampaignOwnedError",
    "CampaignRecord",
    "GateRecord",
    "OwnerRecord",
    "PromotionRecord",
    "RecipeRecord",
    "RegistryDB",
    "RegistryError",
    "RemediationRecord",
    "RunRecord",
    "StageRecord",
    "alembic_config",
    "default_url",
    "head_revision",
    "open_existing",
    "owner_alive",
    "with_psycopg3",
]

#: SQLite waits this long for a lock before giving up (ms).
SQLITE_BUSY_TIMEOUT_MS = 30_000
CAMPAIGN_STATUSES = ("pending", "running", "finished", "failed", "stopped")
STAGE_STATUSES = ("pending", "running", "finished", "failed", "stopped", "skipped")
RUN_STATUSES = ("pending", "running", "finished", "failed", "rejected")
PROMOTION_STATUSES = ("active", "retired")
#: A remediation attempt: its candidate training (running), it passed its gates (passed) or not
#: (failed), or no remedy was left to try (none: the attempt that ends the chain).
REMEDIATION_STATUSES = ("running", "passed", "failed", "none")
#: Run statuses after which a run has ended (``finished_at`` is set on entering one).
RUN_ENDED = ("finished", "failed", "rejected")
#: The actor of promotions made by a campaign's promote task.
AUTO = "auto"

_RUN_FIELDS = ("status", "run_dir", "mlflow_run_id", "summary")
_GATE_COLUMNS = ("name", "passed", "value", "threshold", "window_start", "window_end",
                 "evidence", "params", "noise")
_MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# Alembic's ``context``/``op`` are process-wide proxies: two migrations running at once in one
# process would send each other's DDL to the wrong connection. Across processes the database
# serialises them (SQLite BEGIN IMMEDIATE, a PostgreSQL advisory lock in env.py).
_MIGRATION_LOCK = threading.Lock()


def with_psycopg3(url: str) -> str:
    """``url`` with a bare ``postgresql://`` scheme naming psycopg 3 (``postgresql+psycopg://``):
    SQLAlchemy 2.0 reads the bare form as psycopg2, which asyncrl does not install (its
    ``postgres`` extra is psycopg 3). Every other URL is returned as it is."""
    return "postgresql+psycopg://" + url[len("postgresql://"):] \
        if url.startswith("postgresql://") else url


def alembic_config(connection=None, url: str | None = None):
    """An Alembic ``Config`` for the registry's migrations, built in code (no alembic.ini), so it
    works from an installed wheel. Pass an open ``connection`` (preferred: it carries the SQLite
    pragmas) or a ``url``."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest schema revision this version of asyncrl knows."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


# --------------------------------------------------------------------------------------------
# value conversions


def _json_default(value: Any) -> Any:
    """numpy/torch scalars and arrays (``.item()``/``.tolist()``) become plain JSON values."""
    for method in ("item", "tolist"):
        fn = getattr(value, method, None)
        if callable(fn):
            try:
                return fn()
            except (TypeError, ValueError):
                continue
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _json_dump(value: Any, what: str) -> str | None:
    if value is None:
        return None
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_json_default)
    except (TypeError, ValueError) as e:
        raise RegistryError(
            f"{what} is not JSON-serialisable ({e}); pass plain dicts/lists/str/numbers "
            "(for pydantic models: model_dump(mode='json'))"
        ) from None


def _float(value: Any, what: str) -> float | None:
    if value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise RegistryError(f"{what} must be a number or None, got {value!r}") from None
    return None if math.isnan(out) else out  # NaN is stored as NULL on every backend


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise RegistryError(f"unknown {what} {value!r}; use one of: {', '.join(allowed)}")
    return value


def _nonempty(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RegistryError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


# --------------------------------------------------------------------------------------------
# the engine


def _sqlite_wal(cursor) -> None:
    """Switch the database to WAL (persistent, so usually already on). Switching needs a lock
    that SQLite does not wait for, so two connections opening a new file at once retry."""
    import sqlite3

    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _sqlite_file(url: URL) -> Path | None:
    """The file a SQLite URL names by a plain path; None in memory or for an SQLite ``file:``
    URI."""
    database = url.database or ""
    if database in ("", ":memory:") or "mode=memory" in database or database.startswith("file:"):
        return None
    return Path(database).expanduser().resolve()


def _make_engine(url: URL) -> Engine:
    if url.get_backend_name() == "sqlite":
        database = url.database or ""
        memory = database in ("", ":memory:") or "mode=memory" in database
        if memory:
            kwargs: dict[str, Any] = {
                "poolclass": StaticPool,
                "connect_args": {"check_same_thread": False},
            }
        else:
            path = _sqlite_file(url)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                url = url.set(database=str(path))  # immune to a later chdir
            kwargs = {
                "connect_args": {
                    "check_same_thread": False,
                    "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
                }
            }
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record) -> None:
            # SQLAlchemy, not the sqlite3 module, decides when transactions begin (see _begin).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            if not memory:
                _sqlite_wal(cur)
            cur.execute("PRAGMA foreign_keys = ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn) -> None:
            # Writers take the write lock up front and wait for it (busy_timeout); a deferred
            # transaction that reads and then writes can fail at once with "database is locked".
            immediate = conn.get_execution_options().get("asyncrl_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine
    connect_args: dict[str, Any] = {}
    if url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = 10
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args)


class RegistryDB:
    """The registry at ``url`` (default :func:`default_url`), migrated to the newest schema
    unless ``upgrade=False``. Thread-safe: every call uses its own session."""

    def __init__(self, url: str | None = None, *, upgrade: bool = True) -> None:
        raw = with_psycopg3(url if url is not None else default_url())
        try:
            parsed = make_url(raw)
        except ArgumentError:
            raise RegistryError(
                f"cannot parse the registry URL {raw!r}; use a SQLAlchemy URL such as "
                "sqlite:///path/registry.db or postgresql+psycopg://user@host/db"
            ) from None
        #: The registry's URL, password hidden (``***``), as SQLAlchemy prints URLs.
        self.url: str = parsed.render_as_string(hide_password=True)
        self._password = parsed.password
        try:
            self._engine = _make_engine(parsed)
        except (NoSuchModuleError, ModuleNotFoundError, ImportError) as e:
            raise RegistryError(
                f"cannot open the registry at {self.url}: no database driver ({e}); install it, "
                "e.g. pip install 'psycopg[binary]' for postgresql+psycopg://"
            ) from None
        except OSError as e:
            raise RegistryError(
                f"cannot open the registry at {self.url}: {_one_line(str(e))}; check that the "
                "directory can be created and written"
            ) from None
        self.url = self._engine.url.render_as_string(hide_password=True)  # absolute for SQLite
        self._writer = self._engine.execution_options(asyncrl_write=True)
        self._read_session = sessionmaker(bind=self._engine, expire_on_commit=False)
        self._write_session = sessionmaker(bind=self._writer, expire_on_commit=False)
        try:
            self._connect_check()
            if upgrade:
                self.upgrade("head")
        except BaseException:
            self._engine.dispose()
            raise

    # ---- plumbing ------------------------------------------------------------------------

    def _message(self, e: Exception) -> str:
        message = _one_line(str(getattr(e, "orig", None) or e))
        if self._password:
            message = message.replace(self._password, "***")
        return message

    def _unreachable(self, e: Exception) -> RegistryError:
        if self._engine.dialect.name == "sqlite":
            hint = "check that the file's directory exists and is writable"
        else:
            hint = "check that the database server is running and the URL is right"
        return RegistryError(
            f"cannot open the registry at {self.url}: {self._message(e)}; {hint} "
            f"(the URL comes from ${URL_ENV_VAR} or the state directory)"
        )

    def _connect_check(self) -> None:
        try:
            with self._engine.connect():
                pass
        except DBAPIError as e:
            raise self._unreachable(e) from None

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._write_session.begin() as session:
            yield session

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._read_session() as session, session.begin():
            yield session

    def close(self) -> None:
        """Close every pooled connection. The object must not be used afterwards."""
        self._engine.dispose()

    def __enter__(self) -> RegistryDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- schema --------------------------------------------------------------------------

    def schema_revision(self) -> str:
        """The schema revision the database is at (``""`` for an empty, unmigrated database)."""
        from alembic.runtime.migration import MigrationContext

        with self._engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision() or ""

    def _migrate(self, fn, revision: str) -> None:
        from alembic.util import CommandError

        try:
            with _MIGRATION_LOCK, self._writer.connect() as conn:
                fn(alembic_config(connection=conn), revision)
                conn.commit()
        except CommandError as e:
            raise RegistryError(
                f"cannot migrate the registry at {self.url}: {_one_line(str(e))}; the database "
                "may be from a newer asyncrl: upgrade asyncrl, or point "
                f"${URL_ENV_VAR} at another database"
            ) from None
        except DBAPIError as e:
            raise RegistryError(
                f"cannot migrate the registry at {self.url}: {self._message(e)}; check that the "
                "database user may create and alter tables"
            ) from None

    def _stored_revisions(self) -> list[str]:
        """The revisions ``alembic_version`` records (``[]`` before the first migration), read
        with one query instead of Alembic's ``MigrationContext``."""
        try:
            with self._engine.connect() as conn:
                if not inspect(conn).has_table("alembic_version"):
                    return []
                return list(conn.execute(text("SELECT version_num FROM alembic_version"))
                            .scalars())
        except DBAPIError as e:
            raise self._unreachable(e) from None

    def upgrade(self, revision: str = "head") -> None:
        """Migrate the schema up to ``revision`` (``alembic upgrade``); a no-op when already there.
        """
        if revision == "head" and self._stored_revisions() == [SCHEMA_HEAD]:
            return
        from alembic import command

        if revision == "head" and self.schema_revision() == head_revision():
            return
        self._migrate(command.upgrade, revision)

    def downgrade(self, revision: str) -> None:
        """Migrate the schema down to ``revision`` (``"base"`` drops every table)."""
        from alembic import command

        self._migrate(command.downgrade, revision)

    # ---- campaigns -----------------------------------------------------------------------

    def create_campaign(self, campaign_id: str, name: str, spec: dict) -> None:
        """Record a campaign (status ``pending``). Idempotent: the same id with the same spec is a
        no-op; the same id with a different spec is a :class:`RegistryError`."""
        _nonempty(campaign_id, "campaign_id")
        _nonempty(name, "campaign name")
        spec_json = _json_dump(spec, "campaign spec")
        for attempt in range(2):
            try:
                with self._write() as s:
                    existing = s.get(CampaignRow, campaign_id)
                    if existing is None:
                        now = utcnow()
                        s.add(CampaignRow(id=campaign_id, name=name, spec=spec_json,
                                       status="pending", created_at=now, updated_at=now))
                        return
                    if existing.spec != spec_json or existing.name != name:
                        raise RegistryError(
                            f"campaign {campaign_id!r} is already recorded with a different "
                            "name or spec; launch the changed campaign under a new id"
                        )
                    return
            except IntegrityError:
                if attempt:  # lost a race twice: something else is wrong
                    raise

    def get_campaign(self, campaign_id: str) -> CampaignRecord | None:
        with self._read() as s:
            c = s.get(CampaignRow, campaign_id)
            return None if c is None else campaign_record(c)

    def list_campaigns(self) -> list[CampaignRecord]:
        """Every campaign, oldest first."""
        with self._read() as s:
            rows = s.scalars(select(CampaignRow).order_by(CampaignRow.created_at, CampaignRow.id))
            return [campaign_record(c) for c in rows]

    def set_campaign_status(
        self,
        campaign_id: str,
        status: str,
        *,
        verdict: str | None = None,
        diagnosis: dict | None = None,
    ) -> None:
        """Set a campaign's status; ``verdict``/``diagnosis`` are replaced only when given."""
        _check(status, CAMPAIGN_STATUSES, "campaign status")
        diagnosis_json = _json_dump(diagnosis, "campaign diagnosis")
        with self._write() as s:
            c = s.get(CampaignRow, campaign_id)
            if c is None:
                raise RegistryError(
                    f"no campaign {campaign_id!r} in the registry; create_campaign first"
                )
            c.status = status
            if verdict is not None:
                c.verdict = verdict
            if diagnosis is not None:
                c.diagnosis = diagnosis_json
            c.updated_at = utcnow()

    # ---- stages --------------------------------------------------------------------------

    def _require_campaign(self, s: Session, campaign_id: str) -> None:
        if s.get(CampaignRow, campaign_id) is None:
            raise RegistryError(
                f"no campaign {campaign_id!r} in the registry; create_campaign first"
            )

    def upsert_stage(self, campaign_id: str, name: str, index: int, status: str) -> None:
        """Create or update a campaign stage (its position and status)."""
        _nonempty(name, "stage name")
        _check(status, STAGE_STATUSES, "stage status")
        for attempt in range(2):
            try:
                with self._write() as s:
                    self._require_campaign(s, campaign_id)
                    row = s.scalar(select(StageRow).where(StageRow.campaign_id == campaign_id,
                                                       StageRow.name == name))
                    now = utcnow()
                    if row is None:
                        s.add(StageRow(campaign_id=campaign_id, name=name, position=int(index),
                                    status=status, created_at=now, updated_at=now))
                    elif row.position != int(index) or row.status != status:
                        row.position = int(index)
                        row.status = status
                        row.updated_at = now
                    return
            except IntegrityError:
                if attempt:
                    raise

    def stages(self, campaign_id: str) -> list[StageRecord]:
        """A campaign's stages in ladder order."""
        with self._read() as s:
            rows = s.scalars(select(StageRow).where(StageRow.campaign_id == campaign_id)
                             .order_by(StageRow.position, StageRow.id))
            return [stage_record(r) for r in rows]

    # ---- remediations --------------------------------------------------------------------

    def record_remediation(self, campaign_id: str, stage: str, attempt: int, *,
                           from_candidate: str, status: str, candidate: str | None = None,
                           remedy: dict[str, Any] | None = None,
                           diagnosis: dict[str, Any] | None = None) -> None:
        """Create or update attempt ``attempt`` of ``stage`` to repair itself (idempotent: a
        resumed campaign records the same attempt again). ``remedy``: ``cause``, ``title``,
        ``source``, ``evidence`` (list of lines) and ``override`` (dotted keys → values), as
        :meth:`registry.remediation.Remedy.to_dict` gives them; ``diagnosis``: the failing run's
        decision-tree record."""
        _nonempty(stage, "stage")
        _nonempty(from_candidate, "from_candidate")
        _check(status, REMEDIATION_STATUSES, "remediation status")
        if int(attempt) < 1:
            raise RegistryError(f"remediation attempt must be ≥ 1, got {attempt}")
        r = remedy or {}
        values = dict(
            from_candidate=from_candidate, candidate=candidate, status=status,
            cause=r.get("cause"), title=r.get("title"), source=r.get("source"),
            evidence=_json_dump(r.get("evidence"), "remediation evidence"),
            override=_json_dump(r.get("override"), "remediation override"),
            diagnosis=_json_dump(diagnosis, "remediation diagnosis"))
        for tries in range(2):
            try:
                with self._write() as s:
                    self._require_campaign(s, campaign_id)
                    row = s.scalar(select(RemediationRow).where(
                        RemediationRow.campaign_id == campaign_id, RemediationRow.stage == stage,
                        RemediationRow.attempt == int(attempt)))
                    now = utcnow()
                    if row is None:
                        s.add(RemediationRow(campaign_id=campaign_id, stage=stage,
                                             attempt=int(attempt), created_at=now,
                                             updated_at=now, **values))
                    elif any(getattr(row, k) != v for k, v in values.items()):
                        for k, v in values.items():
                            setattr(row, k, v)
                        row.updated_at = now
                    return
            except IntegrityError:
                if tries:
                    raise

    def remediations(self, campaign_id: str, stage: str | None = None
                     ) -> list[RemediationRecord]:
        """A campaign's remediation attempts (one stage's with ``stage``), by stage and attempt
        in the order they were recorded."""
        with self._read() as s:
            q = select(RemediationRow).where(RemediationRow.campaign_id == campaign_id)
            if stage is not None:
                q = q.where(RemediationRow.stage == stage)
            return [remediation_record(r) for r in s.scalars(q.order_by(RemediationRow.id))]

    # ---- recipes -------------------------------------------------------------------------

    def put_recipe(self, recipe_hash: str, name: str, yaml_text: str) -> None:
        """Store a recipe by its hash. Idempotent: an existing hash is left as it is (the hash
        is the identity; the first name and YAML stored win)."""
        _nonempty(recipe_hash, "recipe_hash")
        for attempt in range(2):
            try:
                with self._write() as s:
                    if s.get(RecipeRow, recipe_hash) is None:
                        s.add(RecipeRow(hash=recipe_hash, name=name, yaml=yaml_text,
                                     created_at=utcnow()))
                    return
            except IntegrityError:
                if attempt:
                    raise

    def get_recipe(self, recipe_hash: str) -> RecipeRecord | None:
        with self._read() as s:
            r = s.get(RecipeRow, recipe_hash)
            return None if r is None else recipe_record(r)

    def recipe_hashes(self, prefix: str, limit: int = 10) -> list[str]:
        """The registered recipe hashes that start with ``prefix`` (at most ``limit``, sorted):
        what a hash the CLI printed shortened resolves to."""
        if not re.fullmatch(r"[0-9a-f]*", prefix):
            return []
        with self._read() as s:
            return list(s.scalars(select(RecipeRow.hash).where(RecipeRow.hash.startswith(prefix))
                                  .order_by(RecipeRow.hash).limit(limit)))

    def _require_recipe(self, s: Session, recipe_hash: str) -> None:
        if s.get(RecipeRow, recipe_hash) is None:
            raise RegistryError(
                f"no recipe {recipe_hash!r} in the registry; put_recipe it first"
            )

    # ---- candidate runs ------------------------------------------------------------------

    def upsert_run(
        self, campaign_id: str, stage: str, candidate: str, recipe_hash: str, **fields: Any
    ) -> int:
        """Create or update the run of ``candidate`` in ``stage`` and return its id (the same id
        every time). ``fields``: ``status``, ``run_dir``, ``mlflow_run_id``, ``summary`` (dict);
        only the fields given are changed. ``started_at`` is set the first time the status is
        ``running`` (or ended), ``finished_at`` when it becomes finished/failed/rejected."""
        unknown = set(fields) - set(_RUN_FIELDS)
        if unknown:
            raise RegistryError(
                f"unknown run field(s) {sorted(unknown)}; use: {', '.join(_RUN_FIELDS)}"
            )
        _nonempty(stage, "stage")
        _nonempty(candidate, "candidate")
        values = dict(fields)
        if "status" in values:
            _check(values["status"], RUN_STATUSES, "run status")
        if "summary" in values:
            values["summary"] = _json_dump(values["summary"], "run summary")
        for attempt in range(2):
            try:
                with self._write() as s:
                    return self._upsert_run(s, campaign_id, stage, candidate, recipe_hash, values)
            except IntegrityError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _upsert_run(self, s: Session, campaign_id: str, stage: str, candidate: str,
                    recipe_hash: str, values: dict) -> int:
        self._require_campaign(s, campaign_id)
        self._require_recipe(s, recipe_hash)
        row = s.scalar(select(CandidateRunRow).where(
            CandidateRunRow.campaign_id == campaign_id,
            CandidateRunRow.stage == stage,
            CandidateRunRow.candidate == candidate,
        ))
        now = utcnow()
        if row is None:
            row = CandidateRunRow(campaign_id=campaign_id, stage=stage, candidate=candidate,
                               recipe_hash=recipe_hash, status="pending",
                               created_at=now, updated_at=now)
            s.add(row)
        changed = row.recipe_hash != recipe_hash
        row.recipe_hash = recipe_hash
        for key, value in values.items():
            if getattr(row, key) != value:
                setattr(row, key, value)
                changed = True
        status = values.get("status")
        if status in ("running", *RUN_ENDED) and row.started_at is None:
            row.started_at, changed = now, True
        if status in RUN_ENDED and row.finished_at is None:
            row.finished_at, changed = now, True
        if status in ("pending", "running") and row.finished_at is not None:  # run again
            row.finished_at, changed = None, True
        if changed and row.id is not None:
            row.updated_at = now
        s.flush()
        return row.id

    def get_run(
        self,
        run_id: int | None = None,
        *,
        campaign_id: str | None = None,
        stage: str | None = None,
        candidate: str | None = None,
    ) -> RunRecord | None:
        """A run by id, or by (campaign_id, stage, candidate)."""
        with self._read() as s:
            if run_id is not None:
                row = s.get(CandidateRunRow, int(run_id))
            elif campaign_id is not None and stage is not None and candidate is not None:
                row = s.scalar(select(CandidateRunRow).where(
                    CandidateRunRow.campaign_id == campaign_id,
                    CandidateRunRow.stage == stage,
                    CandidateRunRow.candidate == candidate,
                ))
            else:
                raise RegistryError(
                    "get_run needs a run_id or all of campaign_id, stage and candidate"
                )
            return None if row is None else run_record(row)

    def runs(self, campaign_id: str, stage: str | None = None) -> list[RunRecord]:
        """A campaign's runs (of one stage if given), in creation order."""
        with self._read() as s:
            q = select(CandidateRunRow).where(CandidateRunRow.campaign_id == campaign_id)
            if stage is not None:
                q = q.where(CandidateRunRow.stage == stage)
            return [run_record(r) for r in s.scalars(q.order_by(CandidateRunRow.id))]

    # ---- gates ---------------------------------------------------------------------------

    def record_gate_results(self, run_id: int, results: list[dict]) -> None:
        """Replace a run's gate results with ``results`` (idempotent). Each dict: ``name``,
        ``passed``, and optionally ``value``, ``threshold`` (numbers; NaN is stored as None),
        ``window`` ((start_step, end_step) or None), ``evidence`` and ``params`` (JSON values),
        ``noise`` (the value's standard error, a number or None)."""
        rows = []
        names = set()
        for i, r in enumerate(results):
            if not isinstance(r, dict) or "name" not in r or "passed" not in r:
                raise RegistryError(
                    f"gate result #{i} must be a dict with at least 'name' and 'passed'"
                )
            name = _nonempty(r["name"], f"gate result #{i} name")
            if name in names:
                raise RegistryError(f"gate {name!r} appears twice for run {run_id}; "
                                    "give each gate of a stage a unique name")
            names.add(name)
            window = r.get("window")
            if window is not None and len(window) != 2:
                raise RegistryError(f"gate {name!r}: window must be (start, end) or None")
            start, end = window if window is not None else (None, None)
            rows.append(dict(
                name=name,
                passed=bool(r["passed"]),
                value=_float(r.get("value"), f"gate {name!r} value"),
                threshold=_float(r.get("threshold"), f"gate {name!r} threshold"),
                window_start=None if start is None else int(start),
                window_end=None if end is None else int(end),
                evidence=_json_dump(r.get("evidence"), f"gate {name!r} evidence"),
                params=_json_dump(r.get("params"), f"gate {name!r} params"),
                noise=_float(r.get("noise"), f"gate {name!r} noise"),
            ))
        with self._write() as s:
            if s.get(CandidateRunRow, int(run_id)) is None:
                raise RegistryError(f"no run {run_id} in the registry; upsert_run first")
            existing = s.scalars(select(GateResultRow).where(GateResultRow.run_id == int(run_id))
                                 .order_by(GateResultRow.id)).all()
            if [{k: getattr(g, k) for k in _GATE_COLUMNS} for g in existing] == rows:
                return  # the same results again: keep the rows (and their ids) as they are
            s.execute(delete(GateResultRow).where(GateResultRow.run_id == int(run_id)))
            now = utcnow()
            for row in rows:
                s.add(GateResultRow(run_id=int(run_id), created_at=now, **row))

    def gate_results(self, run_id: int) -> list[GateRecord]:
        """A run's gate results in the order they were recorded."""
        with self._read() as s:
            rows = s.scalars(select(GateResultRow).where(GateResultRow.run_id == int(run_id))
                             .order_by(GateResultRow.id))
            return [gate_record(g) for g in rows]

    # ---- promotions ----------------------------------------------------------------------

    def promote(
        self,
        *,
        recipe_hash: str,
        candidate: str,
        checkpoint: str | None,
        campaign_id: str | None = None,
        stage: str | None = None,
        actor: str = AUTO,
        reason: str = "",
        mlflow_version: str | None = None,
    ) -> int:
        """Promote a recipe (and its checkpoint); returns the promotion id.

        ``actor="auto"`` (a campaign's promote task) needs ``campaign_id`` and ``stage`` and
        happens once per (campaign, stage): a second call returns the same id and changes
        nothing, even if that promotion was retired since (a different candidate for an already
        promoted stage is an error). Any other actor is a person promoting by hand and must give
        a ``reason``; manual promotions are never deduplicated."""
        _nonempty(actor, "actor")
        _nonempty(candidate, "candidate")
        if stage is not None and campaign_id is None:
            raise RegistryError("promote: a stage needs its campaign_id")
        if actor == AUTO:
            if campaign_id is None or stage is None:
                raise RegistryError(
                    "an auto promotion needs campaign_id and stage; to promote by hand pass "
                    "actor=<your name> and a reason"
                )
        elif not reason.strip():
            raise RegistryError(
                f"manual promotion by {actor!r} needs a reason; pass reason='why this recipe'"
            )
        for attempt in range(2):
            try:
                with self._write() as s:
                    return self._promote(s, recipe_hash, candidate, checkpoint, campaign_id,
                                         stage, actor, reason, mlflow_version)
            except IntegrityError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _promote(self, s: Session, recipe_hash, candidate, checkpoint, campaign_id, stage,
                 actor, reason, mlflow_version) -> int:
        if campaign_id is not None:
            self._require_campaign(s, campaign_id)
        self._require_recipe(s, recipe_hash)
        if actor == AUTO:
            existing = s.scalar(select(PromotionRow).where(
                PromotionRow.actor == AUTO,
                PromotionRow.campaign_id == campaign_id,
                PromotionRow.stage == stage,
            ))
            if existing is not None:
                if (existing.candidate, existing.recipe_hash) != (candidate, recipe_hash):
                    raise RegistryError(
                        f"stage {stage!r} of campaign {campaign_id!r} was already auto-promoted "
                        f"(promotion {existing.id}: candidate {existing.candidate!r}); to change "
                        "it, retire that promotion and promote by hand with a reason"
                    )
                return existing.id
        row = PromotionRow(campaign_id=campaign_id, stage=stage, candidate=candidate,
                        recipe_hash=recipe_hash, checkpoint=checkpoint,
                        mlflow_version=mlflow_version, actor=actor, reason=reason,
                        status="active", created_at=utcnow())
        s.add(row)
        s.flush()
        if stage is not None:
            self._sync_stage_promoted(s, campaign_id, stage)
        return row.id

    def _sync_stage_promoted(self, s: Session, campaign_id: str, stage: str) -> None:
        """Keep ``stages.promoted_candidate`` equal to the newest active promotion's candidate."""
        row = s.scalar(select(StageRow).where(StageRow.campaign_id == campaign_id,
                                              StageRow.name == stage))
        if row is None:
            return
        current = self._promoted(s, campaign_id, stage)
        candidate = None if current is None else current.candidate
        if row.promoted_candidate != candidate:
            row.promoted_candidate = candidate
            row.updated_at = utcnow()

    def retire(self, promotion_id: int, *, actor: str, reason: str) -> None:
        """Retire a promotion (it stays in the history). Retiring a retired one is a no-op."""
        _nonempty(actor, "actor")
        if not isinstance(reason, str) or not reason.strip():
            raise RegistryError(
                f"retiring promotion {promotion_id} needs a reason; pass reason='why'"
            )
        with self._write() as s:
            row = s.get(PromotionRow, int(promotion_id))
            if row is None:
                raise RegistryError(
                    f"no promotion {promotion_id} in the registry; list them with promotions()"
                )
            if row.status == "retired":
                return
            row.status = "retired"
            row.retired_at = utcnow()
            row.retired_by = actor
            row.retire_reason = reason
            s.flush()
            if row.stage is not None and row.campaign_id is not None:
                self._sync_stage_promoted(s, row.campaign_id, row.stage)

    def promotions(
        self, *, campaign_id: str | None = None, status: str | None = None
    ) -> list[PromotionRecord]:
        """Promotions, oldest first, optionally of one campaign and/or one status."""
        if status is not None:
            _check(status, PROMOTION_STATUSES, "promotion status")
        with self._read() as s:
            q = select(PromotionRow)
            if campaign_id is not None:
                q = q.where(PromotionRow.campaign_id == campaign_id)
            if status is not None:
                q = q.where(PromotionRow.status == status)
            return [promotion_record(p) for p in s.scalars(q.order_by(PromotionRow.id))]

    @staticmethod
    def _promoted(s: Session, campaign_id: str, stage: str) -> PromotionRow | None:
        return s.scalar(select(PromotionRow).where(
            PromotionRow.campaign_id == campaign_id,
            PromotionRow.stage == stage,
            PromotionRow.status == "active",
        ).order_by(PromotionRow.id.desc()).limit(1))

    def promoted(self, campaign_id: str, stage: str) -> PromotionRecord | None:
        """The active promotion of a campaign stage (the newest, if a person added one), or
        None."""
        with self._read() as s:
            p = self._promoted(s, campaign_id, stage)
            return None if p is None else promotion_record(p)

    # ---- campaign ownership (registry.ownership) -----------------------------------------

    def acquire_campaign(self, campaign_id: str, owner: ProcessIdentity,
                         heartbeat_ttl_s: float) -> OwnerRecord | None:
        """Make ``owner`` the campaign's one owner, atomically (SQLite: ``BEGIN IMMEDIATE``;
        PostgreSQL: the row locked ``FOR UPDATE``, a concurrent first insert loses on the
        primary key and retries). Returns the previous owner's record when it was dead and is
        taken over (a crashed campaign), else None. Raises :class:`CampaignOwnedError` when a
        live process owns it (see :func:`owner_alive`)."""
        for attempt in range(3):
            try:
                with self._write() as s:
                    self._require_campaign(s, campaign_id)
                    row = s.get(CampaignOwnerRow, campaign_id, with_for_update=True)
                    now = utcnow()
                    previous = None
                    if row is not None and row.token != owner.token:
                        previous = owner_record(row, heartbeat_ttl_s)
                        if previous.alive:
                            raise CampaignOwnedError(
                                f"campaign {campaign_id} is being run by asyncrl "
                                f"{previous.describe}; wait for it to finish (`asyncrl "
                                f"campaign status {campaign_id}`) or stop that process, then "
                                "resume it", previous)
                        s.delete(row)
                        s.flush()
                        row = None
                    if row is None:
                        s.add(CampaignOwnerRow(campaign_id=campaign_id, token=owner.token,
                                            host=owner.host, pid=owner.pid,
                                            start_ticks=owner.start_ticks, acquired_at=now,
                                            heartbeat_at=now))
                    else:
                        row.heartbeat_at = now
                    return previous
            except IntegrityError:
                if attempt == 2:
                    raise
        return None

    def heartbeat_campaign(self, campaign_id: str, token: str) -> bool:
        """Refresh the owner's heartbeat; False when ``token`` no longer owns the campaign."""
        with self._write() as s:
            row = s.get(CampaignOwnerRow, campaign_id)
            if row is None or row.token != token:
                return False
            row.heartbeat_at = utcnow()
            return True

    def release_campaign(self, campaign_id: str, token: str) -> None:
        """End ``token``'s ownership (a no-op when it no longer owns the campaign)."""
        with self._write() as s:
            s.execute(delete(CampaignOwnerRow).where(CampaignOwnerRow.campaign_id == campaign_id,
                                                  CampaignOwnerRow.token == token))

    def campaign_owner(self, campaign_id: str, heartbeat_ttl_s: float) -> OwnerRecord | None:
        """The campaign's owner (``host``, ``pid``, ``alive``, ``describe``, …), or None."""
        with self._read() as s:
            row = s.get(CampaignOwnerRow, campaign_id)
            return None if row is None else owner_record(row, heartbeat_ttl_s)


class CampaignOwnedError(RegistryError):
    """A live process owns the campaign; ``owner`` is its record (see ``campaign_owner``)."""

    def __init__(self, message: str, owner: OwnerRecord) -> None:
        super().__init__(message)
        self.owner = owner


def open_existing(url: str | None = None, *, upgrade: bool = True) -> RegistryDB | None:
    """The registry at ``url`` (default :func:`default_url`) for a command that only reads, or
    None when there is none yet: a SQLite file that does not exist is not created, nor its
    directory, so reading writes nothing (a new or read-only state directory has no campaigns,
    not an error). Any other registry opens as :class:`RegistryDB` does: migrated to the newest
    schema unless ``upgrade=False`` (the first write's open would migrate it anyway)."""
    raw = with_psycopg3(url if url is not None else default_url())
    try:
        parsed = make_url(raw)
    except ArgumentError:
        parsed = None  # RegistryDB's error names the URL and the fix
    if parsed is not None and parsed.get_backend_name() == "sqlite":
        path = _sqlite_file(parsed)
        if path is not None and not path.exists():
            return None
    return RegistryDB(raw, upgrade=upgrade)


