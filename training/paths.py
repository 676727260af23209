"""The one local state directory (DESIGN.md "Services"): checkpoints, caches, logs, SQLite files.

``ASYNCRL_HOME`` sets it; the default is ``~/.asyncrl``, one per user: the registry of promoted
recipes, MLflow's store and Prefect's database belong to the user, not to whichever directory a
command runs from (a default under the current directory showed an empty registry from another
directory, and made every new directory pay Prefect's database migrations again). Everything
asyncrl writes is under it, so a user can see, back up or delete it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ENV_VAR = "ASYNCRL_HOME"
LEGACY_DIR = ".asyncrl"  # the default before it moved to the user's home, under the cwd


class StateDirError(OSError):
    """The state directory cannot be created or written; the message is one line with the fix."""


def default_state_path() -> Path:
    """The state directory without ``ASYNCRL_HOME``: ``~/.asyncrl``."""
    return (Path.home() / ".asyncrl").resolve()


def state_path() -> Path:
    """Where the state directory is (not created: for configuring other tools)."""
    env = os.environ.get(ENV_VAR, "").strip()
    return Path(env).expanduser().resolve() if env else default_state_path()


def legacy_state_note() -> str | None:
    """A one-line note when ``ASYNCRL_HOME`` is unset and the current directory holds a state
    directory of the old default (``./.asyncrl``) that is not the one in use: its campaigns and
    registry are not read unless the user points ``ASYNCRL_HOME`` at it."""
    if os.environ.get(ENV_VAR, "").strip():
        return None
    old = Path(LEGACY_DIR).resolve()
    if not old.is_dir() or old == default_state_path():
        return None
    return (f"note: {old} holds state of an older asyncrl (the default was ./.asyncrl); this "
            f"command uses {default_state_path()} — set {ENV_VAR}={old} to keep using it")


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
