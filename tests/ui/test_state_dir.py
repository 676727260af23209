"""A state directory that cannot be written: every command that writes says so in one line and
exits at once (`campaign launch` used to retry Prefect's start-up for minutes with thousands of
lines of tracebacks). Two cases: $ASYNCRL_HOME below a regular file (cannot be created), and a
really read-only filesystem (a read-only bind mount in a private mount namespace, where the
machine allows one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    ["campaign", "launch", "campaigns/quick.yaml"],
    ["train", "recipes/sync.yaml", "--steps", "1"],
    ["up", "--no-prefect"],
    ["warmstart", "sum_digits", "--out", "{home}/ws"],
]


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "ASYNCRL_HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "ASYNCRL_REGISTRY_URL", "PREFECT_HOME",
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH"):
        env.pop(var, None)
    return env


def _check_one_line(res: subprocess.CompletedProcess, seconds: float, home: Path) -> str:
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    assert seconds < 60, f"took {seconds:.0f} s"
    assert str(home) in lines[0] or "--out" in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_uncreatable_state_dir_is_one_line(tmp_path: Path, args: list[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    home = blocker / "home"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ui.cli",
                          *[a.format(home=home) for a in args]], env=_env(home), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    line = _check_one_line(res, time.monotonic() - t0, home)
    assert "not writable" in line or "cannot" in line


def _read_only_mount_works(path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount --bind {path} {path} && mount -o remount,bind,ro {path} && "
                            f"! touch {path}/probe 2>/dev/null"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.parametrize("args", COMMANDS[:3], ids=lambda a: " ".join(a[:2]))
def test_read_only_state_dir_is_one_line(tmp_path: Path, args: list[str]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    if not _read_only_mount_works(home):
        pytest.skip("this machine allows no private read-only bind mount (unshare -m)")
    script = (f"mount --bind {home} {home} && mount -o remount,bind,ro {home} && "
              'exec "$@"')
    t0 = time.monotonic()
    res = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "-m",
                          "ui.cli", *args], env=_env(home), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    line = _check_one_line(res, time.monotonic() - t0, home)
    assert "Read-only file system" in line or "not writable" in line
    assert list(home.iterdir()) == []  # nothing half-written


def test_the_default_state_directory_is_the_users_wherever_a_command_runs(tmp_path, monkeypatch):
    """Without $ASYNCRL_HOME, state is ~/.asyncrl from any directory (it was ./.asyncrl of the
    current one: another directory showed an empty registry); a ./.asyncrl of an older asyncrl
    is named in a one-line note on stderr, with how to keep using it."""
    from typer.testing import CliRunner

    from training.paths import legacy_state_note, state_path
    from ui.cli import app

    user = tmp_path / "user"
    user.mkdir()
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.delenv("ASYNCRL_HOME", raising=False)
    monkeypatch.delenv("ASYNCRL_REGISTRY_URL", raising=False)
    for where in (tmp_path / "a", tmp_path / "b"):
        where.mkdir()
        monkeypatch.chdir(where)
        assert state_path() == user / ".asyncrl"
        assert legacy_state_note() is None
    (tmp_path / "b" / ".asyncrl").mkdir()  # state of an older asyncrl in this directory
    note = legacy_state_note()
    assert note == (f"note: {tmp_path / 'b' / '.asyncrl'} holds state of an older asyncrl (the "
                    f"default was ./.asyncrl); this command uses {user / '.asyncrl'} — set "
                    f"ASYNCRL_HOME={tmp_path / 'b' / '.asyncrl'} to keep using it")
    res = CliRunner().invoke(app, ["campaign", "list", "--json"])
    assert res.exit_code == 0 and res.stdout.strip() == "[]"
    assert res.stderr == note + "\n"
    monkeypatch.chdir(user)  # the user's own home: ./.asyncrl is the default, no note
    (user / ".asyncrl").mkdir()
    assert legacy_state_note() is None
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "b" / ".asyncrl"))
    monkeypatch.chdir(tmp_path / "b")
    assert legacy_state_note() is None and state_path() == tmp_path / "b" / ".asyncrl"
