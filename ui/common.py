"""What every command group of the CLI shares: the one-line user error, the state-directory check
and the local services' address (the Prefect and MLflow servers ``asyncrl up`` starts). The
command modules (``ui.cli``, ``ui.campaign_cli``, ``ui.services_cli``, ``ui.validate_cli``)
import from here and never from each other's private names."""

from __future__ import annotations

import typer

#: Where ``asyncrl up`` serves Prefect and MLflow (loopback unless the user says otherwise).
HOST = "127.0.0.1"
DEFAULT_PREFECT_PORT = 4200
DEFAULT_MLFLOW_PORT = 5000


def fail(message: str, code: int = 1) -> None:
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
