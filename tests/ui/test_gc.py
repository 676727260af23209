"""`asyncrl gc` on a registry and state directory laid out as campaigns leave them: only the
weights of unpromoted runs of ended, unowned campaigns go; a dry run deletes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from registry.db import RegistryDB
from training.ownership import ProcessIdentity
from ui.cli import app

runner = CliRunner()
HASH = "c" * 16


def _run_dir(home: Path, cid: str, stage: str, cand: str) -> Path:
    d = home / "campaigns" / cid / stage / cand
    for part, size in (("final/hf/model.safetensors", 3000), ("checkpoint/trainer/optim.pt", 5000),
                       ("weights/v3/model.safetensors", 2000), ("metrics.jsonl", 100),
                       ("summary.json", 10), ("plots/reward.png", 50)):
        (d / part).parent.mkdir(parents=True, exist_ok=True)
        (d / part).write_bytes(b"x" * size)
    return d


@pytest.fixture
def laid_out(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("ASYNCRL_HOME", str(home))
    monkeypatch.delenv("ASYNCRL_REGISTRY_URL", raising=False)
    home.mkdir()
    dirs = {}
    with RegistryDB() as db:
        db.put_recipe(HASH, "r", "steps: 2\n")
        for cid, status in (("done", "finished"), ("stop", "stopped"), ("live", "running"),
                            ("dead", "running"), ("held", "finished")):
            db.create_campaign(cid, cid, {"campaign": {"name": cid}})
            db.set_campaign_status(cid, status)
            for cand in ("a", "b"):
                d = _run_dir(home, cid, "s", cand)
                dirs[cid, cand] = d
                db.upsert_run(cid, "s", cand, HASH, status="finished", run_dir=str(d))
        db.promote(recipe_hash=HASH, candidate="a", checkpoint=str(dirs["done", "a"] / "final/hf"),
                   campaign_id="done", stage="s", reason="passed")
        db.acquire_campaign("held", ProcessIdentity.current(), 90.0)  # a live owner: this one
    (home / "campaigns" / "stray").mkdir()
    return home, dirs


def test_a_dry_run_lists_and_apply_deletes_only_unpromoted_weights_of_ended_campaigns(laid_out):
    home, dirs = laid_out
    res = runner.invoke(app, ["gc", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    got = sorted((d["campaign_id"], d["candidate"], Path(d["path"]).relative_to(
        home / "campaigns" / d["campaign_id"] / "s" / d["candidate"]).as_posix(), d["bytes"])
        for d in out["deletions"])
    # done/a is promoted; stop's runs are not; live, dead (crashed) and held are kept whole
    assert got == [("done", "b", "checkpoint", 5000), ("done", "b", "final/hf", 3000),
                   ("done", "b", "weights", 2000),
                   ("stop", "a", "checkpoint", 5000), ("stop", "a", "final/hf", 3000),
                   ("stop", "a", "weights", 2000),
                   ("stop", "b", "checkpoint", 5000), ("stop", "b", "final/hf", 3000),
                   ("stop", "b", "weights", 2000)]
    assert out["bytes"] == 30000 and out["freed_bytes"] == 0 and not out["applied"]
    kept = {k["campaign_id"]: k["why"] for k in out["kept"]}
    assert kept["live"] == kept["dead"] == "status running"
    assert kept["held"].startswith("owned by a live process")
    assert out["unknown_dirs"] == [str(home / "campaigns" / "stray")]
    assert all((d / "final/hf").exists() for d in dirs.values())  # a dry run deletes nothing

    res = runner.invoke(app, ["gc"])
    assert res.exit_code == 0
    assert res.stdout.splitlines()[0] == "   3.0 kB  done s/b: campaigns/done/s/b/final/hf"
    assert res.stdout.strip().splitlines()[-1] == \
        f"would free 30.0 kB in {home}; run `asyncrl gc --apply` to delete"

    res = runner.invoke(app, ["gc", "--apply"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1] == f"freed 30.0 kB of 30.0 kB in {home}"
    for (cid, cand), d in dirs.items():
        gone = cid in ("stop",) or (cid, cand) == ("done", "b")
        for part in ("final/hf", "checkpoint", "weights"):
            assert (d / part).exists() != gone, (cid, cand, part)
        assert (d / "metrics.jsonl").is_file() and (d / "plots/reward.png").is_file()
    assert (home / "campaigns" / "stray").is_dir()
    res = runner.invoke(app, ["gc"])
    assert res.stdout.strip().splitlines()[-1] == f"nothing to delete in {home}"


@pytest.mark.usefixtures("laid_out")
def test_gc_of_one_campaign_and_of_an_unknown_one():
    res = runner.invoke(app, ["gc", "--campaign", "done", "--json"])
    out = json.loads(res.stdout)
    assert {d["campaign_id"] for d in out["deletions"]} == {"done"}
    assert out["unknown_dirs"] == []
    res = runner.invoke(app, ["gc", "--campaign", "nope"])
    assert (res.exit_code, res.stderr) == (
        1, "error: no campaign 'nope' in the registry; `asyncrl campaign list` shows them\n")
