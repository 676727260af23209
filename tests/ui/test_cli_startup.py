"""What `asyncrl --help` and the registry's read commands import, in fresh processes started the
way the `asyncrl` entry point starts them: never torch, Prefect, MLflow, Ray (seconds each to
import) or Alembic (needed only to migrate; a registry at the newest schema opens without it).
And a read on a new state directory creates nothing. Imports, not timings: those are in
benchmarks/cli_startup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from registry.db import DEFAULT_FILE, RegistryDB

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "prefect", "mlflow", "ray", "alembic"}
CAMPAIGN_ID = "startup-1"
# the entry point's own code (`asyncrl = ui.cli:app`), then the modules loaded when it exits
ENTRY = ("import atexit, json, os, sys\n"
         "atexit.register(lambda: open(os.environ['MODULES_OUT'], 'w')"
         ".write(json.dumps(sorted(sys.modules))))\n"
         "from ui.cli import app\n"
         "sys.exit(app())\n")


def _run(args: list[str], home: Path, out: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {**os.environ, "ASYNCRL_HOME": str(home), "MODULES_OUT": str(out)}
    env.pop("ASYNCRL_REGISTRY_URL", None)
    res = subprocess.run([sys.executable, "-c", ENTRY, *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    return res, {m.split(".")[0] for m in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def populated(tmp_path_factory) -> Path:
    """A state directory whose registry (at the newest schema) holds one judged, promoted
    campaign."""
    home = tmp_path_factory.mktemp("populated")
    with RegistryDB(f"sqlite:///{home / DEFAULT_FILE}") as db:
        db.create_campaign(CAMPAIGN_ID, "ladder", {"name": "ladder"})
        db.upsert_stage(CAMPAIGN_ID, "sync", 0, "finished")
        db.put_recipe("a" * 64, "tiny", "model: tiny\n")
        run_id = db.upsert_run(CAMPAIGN_ID, "sync", "a", "a" * 64, status="finished",
                               summary={"rollout/reward_mean": 0.4})
        db.record_gate_results(run_id, [{"name": "reward_not_collapsed", "passed": True}])
        db.promote(recipe_hash="a" * 64, candidate="a", checkpoint=None,
                   campaign_id=CAMPAIGN_ID, stage="sync", reason="passed")
        db.set_campaign_status(CAMPAIGN_ID, "finished", verdict="sync: promoted a")
    return home


@pytest.mark.parametrize("args", [["--help"], ["campaign", "status"], ["campaign", "list"]],
                         ids=" ".join)
def test_on_a_new_state_dir_nothing_heavy_is_imported_nor_created(tmp_path, args):
    home = tmp_path / "home"
    home.mkdir()
    res, modules = _run(args, home, tmp_path / "modules.json")
    assert res.returncode in (0, 1), res.stderr
    if args[-1] == "status":
        assert res.stderr.startswith("error: no campaigns yet"), res.stderr
    assert modules & HEAVY == set()
    assert list(home.iterdir()) == []  # a read writes nothing: no registry file, no migration


@pytest.mark.parametrize("args", [["campaign", "status"], ["campaign", "status", CAMPAIGN_ID],
                                  ["campaign", "list"], ["registry", "list"]], ids=" ".join)
def test_reading_a_registry_imports_nothing_heavy(populated, tmp_path, args):
    res, modules = _run(args, populated, tmp_path / "modules.json")
    assert res.returncode == 0, res.stderr
    assert CAMPAIGN_ID in res.stdout
    assert modules & HEAVY == set()
    # the default SQLite registry is read with sqlite3 (registry.sqlite_reader): no SQLAlchemy
    assert "registry" in modules and "sqlalchemy" not in modules


def test_help_does_not_import_the_registry(tmp_path):
    _, modules = _run(["--help"], tmp_path, tmp_path / "modules.json")
    assert {"sqlalchemy", "registry", "training"} & modules == set()
