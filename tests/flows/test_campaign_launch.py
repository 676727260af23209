"""`asyncrl campaign launch` end to end, as the README's first command runs it, on a state
directory with nothing cached: the first stage's warm start is built, with its progress shown,
before the services start (ui.campaign_cli._start), the campaign promotes, and a resume of the
finished campaign builds no warm start again (its first stage is promoted)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from ui.cli import app

pytestmark = pytest.mark.slow  # a first launch that builds its warm start (≈1 min)

TINY = {
    "name": "tiny",
    "steps": 2,
    "model": {"kind": "warmstart", "warmstart_steps": 12, "hidden_size": 32, "num_layers": 2},
    "rollout": {"n": 2, "batch_prompts": 2, "max_response_tokens": 8},
    "engines": {"num_rollout_engines": 1},
    "eval": {"every": 0, "n": 0},
}
CAMPAIGN = {"name": "first-run", "base": TINY,
            "stages": [{"name": "only", "gates": [{"name": "reward_not_collapsed"}]}]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, run_campaign):
    with run_campaign(tmp_path_factory, "first-run", CAMPAIGN) as (home, path):
        res = CliRunner().invoke(app, ["campaign", "launch", str(path), "--id", "first-1",
                                       "--json"])
        yield home, res


def test_launch_builds_the_warm_start_and_promotes(launched):
    home, res = launched
    assert res.exit_code == 0, res.output[-3000:]
    out = json.loads(res.stdout)
    assert out["status"] == "finished" and list(out["promoted"]) == ["only"]
    cache = list((home / "cache" / "warmstart").iterdir())
    assert len(cache) == 1
    meta = json.loads((cache[0] / "asyncrl.json").read_text())
    assert meta["config"]["steps"] == 12 and meta["config"]["hidden_size"] == 32


def test_off_a_terminal_the_launch_reports_each_event_on_one_line(launched):
    """CliRunner's streams are not a terminal (nor are `> log`, CI or nohup): no live table;
    with --json the event lines go to stderr and stdout keeps only the JSON."""
    _, res = launched
    lines = [line[9:] for line in res.stderr.splitlines()
             if re.match(r"\d\d:\d\d:\d\d ", line)]  # not the libraries' log lines
    assert lines[0].startswith("warm start: train ") and "warm start: done" in lines
    run = lines[lines.index("warm start: done") + 1:]
    from registry.db import RegistryDB

    with RegistryDB() as db:  # the fixture's state directory is still in force
        rhash = db.get_run(campaign_id="first-1", stage="only", candidate="default").recipe_hash
    assert run[:2] == ["stage only: running", f"only/default: running (recipe {rhash})"]
    assert [line.split(",")[0] for line in run[2:4]] == ["only/default: step 1/2",
                                                         "only/default: step 2/2"]
    assert run[4].startswith("only/default: passed (reward ")
    assert run[5:] == ["stage only: promoted default"]
    assert "┃" not in res.stderr and "━" not in res.stderr  # no table drawn


def test_resuming_a_promoted_first_stage_builds_no_warm_start(launched):
    home, _ = launched  # the fixture's state directory and Prefect harness are still in force
    shutil.rmtree(home / "cache" / "warmstart")
    res = CliRunner().invoke(app, ["campaign", "resume", "first-1", "--json"])
    assert res.exit_code == 0, res.output[-3000:]
    assert json.loads(res.stdout)["status"] == "finished"
    assert not (home / "cache" / "warmstart").exists()


def test_start_reports_progress_and_fails_on_a_bad_checkpoint_before_the_services(
        launched, tmp_path, monkeypatch):
    from training.recipe import Recipe
    from training.runtime.run import RunError, initial_checkpoint
    from ui.campaign_cli import _start

    home = tmp_path / "home"  # a new state directory; the fixture's Prefect and Ray are up
    monkeypatch.setenv("ASYNCRL_HOME", str(home))
    seen: list[str | None] = []
    recipe = Recipe.model_validate({**TINY, "model": {**TINY["model"], "warmstart_steps": 5}})
    _start([recipe], seen.append)
    assert seen == [f"train {i}/5" for i in range(1, 6)] + [None]
    assert (home / "mlflow" / "mlflow.db").is_file()  # then the services started
    # cached now: the run's own call reports nothing and trains nothing
    again: list = []
    path = initial_checkpoint(recipe, progress=again.append)
    assert again == [] and path.parent == home / "cache" / "warmstart"

    other = tmp_path / "other"
    monkeypatch.setenv("ASYNCRL_HOME", str(other))
    missing = Recipe.model_validate(
        {**TINY, "model": {"kind": "checkpoint", "path": str(other / "nowhere")}})
    seen.clear()
    with pytest.raises(RunError, match=r"model\.path"):
        _start([missing], seen.append)
    assert seen == [None]
    assert not (other / "mlflow").exists()  # nothing was started
