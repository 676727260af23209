"""What every command group of the CLI shares: the one-line user error, the state-directory check,
the registry (to write, or only to read) and the local services' address (the Prefect and MLflow
servers ``asyncrl up`` starts). The command modules (``ui.cli``, ``ui.campaign_cli``,
``ui.registry_cli``, ``ui.gates_cli``, ``ui.services_cli``, ``ui.validate_cli``) import from here
and never from each other's private names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from registry.db import RegistryDB
    from registry.sqlite_reader import SQLiteReader

#: Where ``asyncrl up`` serves Prefect and MLflow (loopback unless the user says otherwise).
HOST = "127.0.0.1"
DEFAULT_PREFECT_PORT = 4200
DEFAULT_MLFLOW_PORT = 5000
DEFAULT_DASHBOARD_PORT = 8470


def fail(message: str, code: int = 1) -> NoReturn:
    """A user error: one line on stderr naming the problem and the fix, then exit ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def require_state_dir() -> None:
    """A read-only or uncreatable $ASYNCRL_HOME is one line before any service starts."""
    from training.paths import StateDirError, require_writable_state_dir

    try:
        require_writable_state_dir()
    except StateDirError as e:
        fail(str(e))


def open_registry(url: str | None = None) -> RegistryDB:
    """The registry (created at its newest schema if new); a bad URL is a one-line error."""
    from registry.db import RegistryDB, RegistryError

    try:
        return RegistryDB(url)
    except RegistryError as e:
        fail(str(e))


class _NoRegistry:
    """The registry a read sees before the first campaign created it: nothing recorded. (The
    read commands call only these; any other call is a bug that fails loudly.)"""

    def list_campaigns(self) -> list:
        return []

    def get_campaign(self, campaign_id: str) -> None:
        return None

    def get_recipe(self, recipe_hash: str) -> None:
        return None

    def recipe_hashes(self, prefix: str, limit: int = 10) -> list[str]:
        return []

    def promotions(self, **_filters: Any) -> list:
        return []

    def close(self) -> None:
        pass


def read_registry() -> SQLiteReader | RegistryDB | _NoRegistry:
    """The registry for a command that only reads. One that does not exist yet is not created
    (a new or read-only state directory simply has no campaigns), and the default SQLite one at
    the newest schema is read without SQLAlchemy (registry.sqlite_reader): `campaign status`
    stays fast."""
    from registry.records import RegistryError
    from registry.sqlite_reader import open_reader

    try:
        db = open_reader()
    except RegistryError as e:
        fail(str(e))
    return _NoRegistry() if db is None else db


MIN_HASH_PREFIX = 4  # characters of a recipe hash the CLI accepts for the whole hash


def resolve_recipe_hash(db: Any, text: str) -> str:
    """The registered recipe hash ``text`` names: the hash itself, or a prefix of one (tables
    print hashes shortened) that only one registered hash starts with. Anything else is a
    one-line error naming the fix (``fail``)."""
    text = text.strip().lower()
    if db.get_recipe(text) is not None:
        return text
    hint = "`asyncrl registry list` shows the promoted ones"
    if len(text) < MIN_HASH_PREFIX:
        fail(f"no recipe {text!r} in the registry; give at least {MIN_HASH_PREFIX} characters "
             f"of its hash ({hint})")
    found = db.recipe_hashes(text, limit=6)
    if not found:
        fail(f"no recipe {text!r} in the registry; {hint}")
    if len(found) > 1:
        fail(f"recipe hash prefix {text!r} matches {', '.join(found[:5])}"
             + (" and more" if len(found) > 5 else "") + "; give more characters")
    return found[0]


def answers(url: str) -> bool:
    """Whether ``url`` answers HTTP 2xx within 2 s (a service's health endpoint)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def up_prefect_api() -> str | None:
    """The API URL of the Prefect server `asyncrl up` runs for this state directory (its entry
    in ``$ASYNCRL_HOME/services.json``), when that process is alive — the same PID with the
    recorded start time — and its health URL answers; None otherwise (no record, a stale or
    unreadable one)."""
    import json

    from training.ownership import pid_alive, process_start_ticks
    from training.paths import state_path

    try:
        data = json.loads((state_path() / "services.json").read_text())
        entry = data["prefect"]
        pid = int(entry["pid"])
        recorded = entry.get("proc_start")
        api = str(entry.get("export", "")).partition("=")[2]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid <= 0 or not pid_alive(pid):
        return None
    now = process_start_ticks(pid)
    if recorded is not None and now is not None and str(now) != str(recorded):
        return None  # the PID now belongs to another process
    return api if api and answers(str(entry.get("health", ""))) else None
