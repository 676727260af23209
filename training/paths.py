"""The one local state directory (DESIGN.md "Services"): checkpoints, caches, logs, SQLite files.

``ASYNCRL_HOME`` sets it; the default is ``.asyncrl`` under the current directory, so a user can
see, back up or delete everything asyncrl wrote.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ENV_VAR = "ASYNCRL_HOME"


class StateDirError(OSError):
    """The state directory cannot be created or written; the message is one line with the fix."""


def state_path() -> Path:
    """Where the state directory is (not created: for configuring other tools)."""
    return Path(os.environ.get(ENV_VAR, ".asyncrl")).expanduser().resolve()


def state_dir() -> Path:
    """The state directory (created on first use)."""
    path = state_path()
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_writable_state_dir() -> Path:
    """The state directory, created and probed with a file write; :class:`StateDirError` (one
    line naming ``$ASYNCRL_HOME``) when that fails — checked before anything starts, so a
    read-only disk is a clear error, not a service that retries its start-up for minutes."""
    path = state_path()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise StateDirError(
            f"the state directory {path} is not writable ({e.strerror or e}); set {ENV_VAR} to "
            "a writable directory (it holds the registry, MLflow, Prefect state and runs)"
        ) from None
    return path


def cache_dir(kind: str) -> Path:
    """A sub-directory of the state directory, e.g. ``cache_dir("warmstart")``."""
    path = state_dir() / "cache" / kind
    path.mkdir(parents=True, exist_ok=True)
    return path
