"""`asyncrl campaign launch FILE --deployment` through the real services: `asyncrl up` starts a
Prefect server on 127.0.0.1, `asyncrl deploy FILE` serves the campaign's deployment, and the launch
creates a flow run there, follows it and reports the registry's outcome; then `asyncrl down`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from training.engines.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGN = {
    "name": "deploytest",
    "base": {
        "steps": 2,
        "model": {"kind": "warmstart", "warmstart_steps": 40, "hidden_size": 32,
                  "num_layers": 2},
        "rollout": {"n": 4, "batch_prompts": 2, "max_response_tokens": 8},
        "engines": {"num_rollout_engines": 1},
        "eval": {"every": 0, "n": 4},
    },
    "stages": [{"name": "only", "gates": [{"name": "staleness_within_bound"}]}],
}


def _cli(args: list[str], env: dict[str, str], timeout: float = 600
         ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ui.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def _stop_serving_and_down(serve: subprocess.Popen | None, env: dict[str, str]) -> None:
    if serve is not None and serve.poll() is None:
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C: stop serving
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(10)
    down = _cli(["down"], env)
    assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {**os.environ, "ASYNCRL_HOME": str(tmp_path / "home"), "RAY_USAGE_STATS_ENABLED": "0"}
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "ASYNCRL_REGISTRY_URL", "PREFECT_HOME",
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH"):  # its own home decides them
        e.pop(var, None)
    return e


@pytest.mark.slow
def test_deployment_needs_a_server(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CAMPAIGN))
    line = _one_error_line(_cli(["campaign", "launch", str(path), "--deployment"], env))
    assert "PREFECT_API_URL is not set" in line and "asyncrl up" in line
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    line = _one_error_line(_cli(["campaign", "launch", str(path), "--deployment"], env))
    assert "no Prefect server answers" in line
    line = _one_error_line(_cli(["campaign", "launch", str(path), "--detach"], env))
    assert "go with --deployment" in line


@pytest.mark.slow
def test_launch_through_a_served_deployment(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "deploytest.yaml"
    path.write_text(yaml.safe_dump(CAMPAIGN))
    port, dash = free_port(), free_port()
    up = _cli(["up", "--no-mlflow", "--prefect-port", str(port), "--dashboard-port", str(dash),
               "--timeout", "180"], env)
    assert up.returncode == 0, up.stdout + up.stderr
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    serve = None
    try:
        # a deployment nobody serves yet: one clear line
        line = _one_error_line(_cli(["campaign", "launch", str(path), "--deployment"], env))
        assert "no deployment 'asyncrl-scheduled-campaign/deploytest'" in line
        assert "asyncrl deploy" in line

        serve = subprocess.Popen([sys.executable, "-m", "ui.cli", "deploy", str(path)], env=env,
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline = time.monotonic() + 180
        while True:  # until the served deployment is registered
            res = _cli(["campaign", "launch", str(path), "--deployment", "--id", "dep-1",
                        "--json"], env)
            if "no deployment" not in res.stderr:
                break
            assert serve.poll() is None, serve.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the deployment was never served"
            time.sleep(2)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        out = json.loads(res.stdout)
        assert out["campaign_id"] == "dep-1" and out["status"] == "finished"
        assert set(out["promoted"]) == {"only"}
        assert out["promoted"]["only"]["candidate"] == "default"
        assert out["flow_run_url"].startswith(f"http://127.0.0.1:{port}/runs/flow-run/")
        assert "stage only: finished" in res.stderr

        # the registry and the run directory the served process wrote: the same state directory
        from registry.db import RegistryDB

        home = Path(env["ASYNCRL_HOME"])
        db = RegistryDB(f"sqlite:///{home / 'registry.db'}")
        assert db.get_campaign("dep-1").status == "finished"
        assert [p.stage for p in db.promotions(campaign_id="dep-1")] == ["only"]
        db.close()
        rows = (home / "campaigns" / "dep-1" / "only" / "default" / "metrics.jsonl") \
            .read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows if "eval_only" not in r] == [0, 1]

        # the Prefect server knows the run as a completed run of that deployment (its REST API)
        import httpx

        api = env["PREFECT_API_URL"]
        fr = httpx.get(f"{api}/flow_runs/{out['flow_run_id']}", timeout=30).json()
        assert fr["state"]["type"] == "COMPLETED"
        assert fr["parameters"]["campaign_id"] == "dep-1"
        # named after the campaign, tagged with it (the deployment's tags), and the stage's
        # report attached
        assert fr["name"] == "dep-1" and {"asyncrl", "campaign:deploytest"} <= set(fr["tags"])
        arts = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {
            "any_": ["dep-1-only"]}}}, timeout=30).json()
        assert len(arts) == 1 and "**Promoted:** `default`" in arts[0]["data"]
        dep = httpx.get(f"{api}/deployments/{fr['deployment_id']}", timeout=30).json()
        assert dep["name"] == "deploytest"
        # the dashboard `up` started beside Prefect: the campaign's ladder links its flow run
        page = httpx.get(f"http://127.0.0.1:{dash}/campaign/dep-1", timeout=30)
        assert page.status_code == 200 and "★ promoted" in page.text
        assert f'href="{out["flow_run_url"]}"' in page.text
    finally:
        _stop_serving_and_down(serve, env)


@pytest.mark.slow
def test_interval_schedule_fires_and_a_scheduled_run_finishes_a_campaign(
        tmp_path: Path, env: dict[str, str]) -> None:
    """Scheduling from the Prefect UI: `asyncrl deploy --interval` on a real Prefect server gets
    scheduled runs (Prefect's scheduler inserts them: with SQLAlchemy 2.1 it raised every minute
    and inserted none) and the served process runs one to a finished campaign."""
    import httpx

    path = tmp_path / "deploytest.yaml"
    path.write_text(yaml.safe_dump(CAMPAIGN))
    port = free_port()
    up = _cli(["up", "--no-mlflow", "--no-dashboard", "--prefect-port", str(port), "--timeout",
               "180"], env)
    assert up.returncode == 0, up.stdout + up.stderr
    api = env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    serve = None
    try:
        serve = subprocess.Popen([sys.executable, "-m", "ui.cli", "deploy", str(path),
                                  "--interval", "30"], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline = time.monotonic() + 420
        finished = None
        while finished is None:
            assert serve.poll() is None, serve.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "no scheduled run finished a campaign"
            time.sleep(3)
            runs = httpx.post(f"{api}/flow_runs/filter", json={
                "limit": 50, "sort": "EXPECTED_START_TIME_ASC"},
                              timeout=30).json()
            scheduled = [r for r in runs if r.get("auto_scheduled")]
            done = [r for r in scheduled if r["state"]["type"] == "COMPLETED"]
            failed = [r for r in scheduled if r["state"]["type"] in ("FAILED", "CRASHED")]
            assert not failed, failed[0]["state"]
            if done:
                finished = done[0]
        assert len(scheduled) >= 2  # the schedule keeps inserting runs, not just one
        dep = httpx.get(f"{api}/deployments/{finished['deployment_id']}", timeout=30).json()
        assert dep["name"] == "deploytest"

        from registry.db import RegistryDB

        home = Path(env["ASYNCRL_HOME"])
        db = RegistryDB(f"sqlite:///{home / 'registry.db'}")
        done_campaigns = [c for c in db.list_campaigns() if c.status == "finished"]
        assert done_campaigns and done_campaigns[0].id.startswith("deploytest-")
        # the scheduled run, which made a new campaign id, was renamed to it
        assert finished["id"] in {r["id"] for r in httpx.post(
            f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [
                c.id for c in done_campaigns]}}}, timeout=30).json()}
        assert [p.stage for p in db.promotions(campaign_id=done_campaigns[0].id)] == [
            "only"]
        db.close()
    finally:
        _stop_serving_and_down(serve, env)
