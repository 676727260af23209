"""The one local state directory (DESIGN.md "Services"): checkpoints, caches, logs, SQLite files.

``ASYNCRL_HOME`` sets it; the default is ``.asyncrl`` under the current directory, so a user can
see, back up or delete everything asyncrl wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "ASYNCRL_HOME"


def state_dir() -> Path:
    """The state directory (created on first use)."""
    path = Path(os.environ.get(ENV_VAR, ".asyncrl")).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir(kind: str) -> Path:
    """A sub-directory of the state directory, e.g. ``cache_dir("warmstart")``."""
    path = state_dir() / "cache" / kind
    path.mkdir(parents=True, exist_ok=True)
    return path
