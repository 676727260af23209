"""The settings Prefect actually sees in a fresh `asyncrl` process: importing the CLI and then a
flow module (what `campaign launch` does) configures Prefect before Prefect is imported, so its
temporary API gets asyncrl's start-up timeout and its home and task results live in the state
directory — not Prefect's defaults (20 s, ``~/.prefect``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flows.environment import EPHEMERAL_STARTUP_TIMEOUT_S

PROBE = """
import json
import ui.cli                      # the console script's module
from ui import campaign_cli        # `campaign launch` / `resume`
import flows.campaign              # what they import before running the flow
from prefect.settings import get_current_settings
s = get_current_settings()
print(json.dumps({"home": str(s.home), "storage": str(s.results.local_storage_path),
                  "timeout": s.server.ephemeral.startup_timeout_seconds,
                  "level": s.logging.level, "analytics": s.server.analytics_enabled}))
"""


def test_prefect_sees_asyncrl_settings_in_a_fresh_process(tmp_path: Path) -> None:
    home = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ASYNCRL_HOME=str(home), HOME=str(tmp_path / "user"))
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen == {"home": str(home / "prefect"), "storage": str(home / "prefect" / "storage"),
                    "timeout": EPHEMERAL_STARTUP_TIMEOUT_S, "level": "WARNING",
                    "analytics": False}


def test_a_value_the_user_set_wins(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(ASYNCRL_HOME=str(tmp_path / "state"),
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="42")
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["timeout"] == 42
