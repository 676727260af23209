"""Read a SQLite registry with the standard library's ``sqlite3``: the CLI's read commands
(``campaign status``, ``campaign list``, ``campaign resume``'s lookup, ``registry list/show``).

Importing SQLAlchemy is ≈0.45 s, about half of ``asyncrl campaign status`` on the 2-core
machine; ``sqlite3`` is ≈4 ms. :func:`open_reader` gives this reader for the default SQLite
registry when its schema is the one this code writes (:data:`~registry.records.SCHEMA_HEAD`),
and :class:`registry.db.RegistryDB` for anything else (PostgreSQL, an older schema to migrate, a
URL with options), so nothing is read with a layout it does not know.

The queries and their order are :class:`~registry.db.RegistryDB`'s, and the rows become the same
records (:mod:`registry.records`); ``tests/registry/test_sqlite_reader.py`` compares the two
readers on one database. The file is opened read-only (``mode=ro``): a read never creates,
migrates or writes the registry (SQLite may add its empty ``-wal``/``-shm`` index files beside it,
as any reader of a WAL database does), and it sees what a running campaign has committed.
"""

from __future__ import annotations

import re
import sqlite3
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from registry.records import (
    SCHEMA_HEAD,
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
    owner_record,
    promotion_record,
    recipe_record,
    remediation_record,
    run_record,
    stage_record,
)

if TYPE_CHECKING:
    from registry.db import RegistryDB

__all__ = ["SQLiteReader", "open_reader"]

#: Columns SQLAlchemy's ``DateTime`` keeps as text in SQLite (``YYYY-MM-DD HH:MM:SS.ffffff``).
_TIMES = frozenset({"created_at", "updated_at", "started_at", "finished_at", "retired_at",
                    "acquired_at", "heartbeat_at"})
_BUSY_MS = 30_000


def _row(cursor: sqlite3.Cursor, values: tuple) -> SimpleNamespace:
    """One fetched row as the attributes an ORM row has (timestamps as naive UTC datetimes,
    as SQLAlchemy reads them back from SQLite)."""
    out = {}
    for (name, *_), value in zip(cursor.description, values, strict=True):
        if name in _TIMES and isinstance(value, str):
            value = datetime.fromisoformat(value)
        out[name] = value
    return SimpleNamespace(**out)


class SQLiteReader:
    """The read methods of :class:`~registry.db.RegistryDB` that the CLI's read commands call,
    over one read-only ``sqlite3`` connection to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        try:
            self._conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                                         timeout=_BUSY_MS / 1000)
        except sqlite3.Error as e:
            raise RegistryError(f"cannot open the registry {path} ({e}); check the file and "
                                "its permissions") from None
        self._conn.row_factory = _row

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SQLiteReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _all(self, sql: str, *args: Any) -> list[SimpleNamespace]:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise RegistryError(f"cannot read the registry {self.path} ({e}); check the file, "
                                "or open it once with a write command to repair it") from None

    def schema_revision(self) -> str | None:
        rows = self._all("SELECT version_num FROM alembic_version")
        return rows[0].version_num if len(rows) == 1 else None

    # --- the reads (RegistryDB's queries and order) ------------------------------------------
    def get_campaign(self, campaign_id: str) -> CampaignRecord | None:
        rows = self._all("SELECT * FROM campaigns WHERE id = ?", campaign_id)
        return campaign_record(rows[0]) if rows else None

    def list_campaigns(self) -> list[CampaignRecord]:
        """Every campaign, oldest first."""
        return [campaign_record(r)
                for r in self._all("SELECT * FROM campaigns ORDER BY created_at, id")]

    def stages(self, campaign_id: str) -> list[StageRecord]:
        return [stage_record(r) for r in self._all(
            "SELECT * FROM stages WHERE campaign_id = ? ORDER BY position, id", campaign_id)]

    def recipe_hashes(self, prefix: str, limit: int = 10) -> list[str]:
        if not re.fullmatch(r"[0-9a-f]*", prefix):  # also keeps LIKE's wildcards out
            return []
        return [r.hash for r in self._all(
            "SELECT hash FROM recipes WHERE hash LIKE ? ORDER BY hash LIMIT ?", prefix + "%",
            int(limit))]

    def get_recipe(self, recipe_hash: str) -> RecipeRecord | None:
        rows = self._all("SELECT * FROM recipes WHERE hash = ?", recipe_hash)
        return recipe_record(rows[0]) if rows else None

    def runs(self, campaign_id: str, stage: str | None = None) -> list[RunRecord]:
        sql, args = "SELECT * FROM candidate_runs WHERE campaign_id = ?", [campaign_id]
        if stage is not None:
            sql, args = sql + " AND stage = ?", [*args, stage]
        return [run_record(r) for r in self._all(sql + " ORDER BY id", *args)]

    def gate_results(self, run_id: int) -> list[GateRecord]:
        return [gate_record(r) for r in self._all(
            "SELECT * FROM gate_results WHERE run_id = ? ORDER BY id", int(run_id))]

    def promotions(self, *, campaign_id: str | None = None, status: str | None = None
                   ) -> list[PromotionRecord]:
        where, args = [], []
        for column, value in (("campaign_id", campaign_id), ("status", status)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        sql = "SELECT * FROM promotions" + (f" WHERE {' AND '.join(where)}" if where else "")
        return [promotion_record(r) for r in self._all(sql + " ORDER BY id", *args)]

    def remediations(self, campaign_id: str, stage: str | None = None
                     ) -> list[RemediationRecord]:
        sql, args = "SELECT * FROM remediations WHERE campaign_id = ?", [campaign_id]
        if stage is not None:
            sql, args = sql + " AND stage = ?", [*args, stage]
        return [remediation_record(r) for r in self._all(sql + " ORDER BY id", *args)]

    def campaign_owner(self, campaign_id: str, heartbeat_ttl_s: float) -> OwnerRecord | None:
        rows = self._all("SELECT * FROM campaign_owners WHERE campaign_id = ?", campaign_id)
        return owner_record(rows[0], heartbeat_ttl_s) if rows else None


def _sqlite_path(url: str) -> Path | None:
    """The file of a plain ``sqlite:///PATH`` URL (no driver, no options), else None."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or "?" in url:
        return None
    rest = url[len(prefix):]
    return None if rest in ("", ":memory:") else Path(rest)


def open_reader(url: str | None = None) -> SQLiteReader | RegistryDB | None:
    """A registry to read: None when the SQLite file at ``url`` (default
    :func:`~registry.records.default_url`) does not exist yet (nothing is created); a
    :class:`SQLiteReader` when it is a plain SQLite file at :data:`SCHEMA_HEAD`; otherwise
    :func:`registry.db.open_existing` (SQLAlchemy: PostgreSQL, or a schema to migrate)."""
    url = url if url is not None else default_url()
    path = _sqlite_path(url)
    if path is not None:
        if not path.exists():
            return None
        reader = SQLiteReader(path)
        try:
            if reader.schema_revision() == SCHEMA_HEAD:
                return reader
        except RegistryError:
            pass  # no alembic_version table (yet): RegistryDB knows what to do with it
        reader.close()
    from registry.db import open_existing

    return open_existing(url)
