"""The environment of the services asyncrl drives, set before they are imported.

Prefect reads its settings once, when it is first imported (its root settings context), so
setting ``PREFECT_*`` variables afterwards has no effect: the ephemeral API's start-up timeout
stayed at Prefect's 20 s (a loaded 2-core machine needs more) and task results went to
``~/.prefect/storage`` outside the state directory, so a resumed campaign never hit the results
cache of its launch. ``flows/__init__.py`` calls :func:`configure` first, so every import of a
``flows`` module (every CLI entry point, the deployment's flow-run processes, tests) configures
the services from here before Prefect, MLflow or Ray is imported. Values the user set win
(``setdefault``). Nothing is created on disk here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from training.paths import state_path

__all__ = ["EPHEMERAL_STARTUP_TIMEOUT_S", "configure", "prefect_defaults"]

#: Seconds Prefect's temporary API server may take to start (Prefect's default: 20 s).
EPHEMERAL_STARTUP_TIMEOUT_S = 300


def prefect_defaults() -> dict[str, str]:
    """The Prefect settings asyncrl runs with (environment variable → value)."""
    home = state_path() / "prefect"
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(EPHEMERAL_STARTUP_TIMEOUT_S),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


def configure() -> None:
    """Set the defaults of Prefect, MLflow and Ray for this process and the processes it
    starts. Must run before ``prefect`` is imported; a warning says so when it is too late."""
    for key, value in prefect_defaults().items():
        os.environ.setdefault(key, value)
    # Prefect makes its home at import without its parents: on a first use (no ~/.asyncrl yet)
    # it warned "Failed to create the Prefect home directory"; a state directory that cannot be
    # made is reported by the command in one line (require_state_dir), not here
    with contextlib.suppress(OSError):
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # MLflow: no telemetry, no "git not found" warning on every run
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    if "prefect.context" in sys.modules:
        _check_prefect_saw_it()


def _check_prefect_saw_it() -> None:
    """Prefect was imported before :func:`configure`: warn when its settings differ."""
    import warnings

    from prefect.settings import get_current_settings

    seen = get_current_settings()
    timeout = seen.server.ephemeral.startup_timeout_seconds
    if str(seen.home) != os.environ["PREFECT_HOME"] or timeout != int(
            os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]):
        warnings.warn("prefect was imported before asyncrl configured it (flows.environment); "
                      f"it keeps PREFECT_HOME={seen.home} and a {timeout} s start-up timeout",
                      stacklevel=3)
