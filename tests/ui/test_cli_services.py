"""`asyncrl up` / `down` / `deploy` / `compare`: `up` starts a real MLflow server (only MLflow,
to stay cheap) and `down` stops exactly it; user errors are one `error:` line and exit 1."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from training.engines.ports import free_port
from ui import services_cli

runner = CliRunner()


@pytest.fixture
def cli() -> typer.Typer:
    """A CLI with just these commands (the main one wires them in with ``register``)."""
    app = typer.Typer()
    services_cli.register(app)
    return app


def _one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# --- up / down ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_up_mlflow_then_down(cli, services_home: Path) -> None:
    port = free_port()
    r = runner.invoke(cli, ["up", "--no-prefect", "--no-dashboard", "--mlflow-port", str(port)])
    assert r.exit_code == 0, r.output
    assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{port}" in r.stdout
    record = json.loads((services_home / "services.json").read_text())
    assert set(record) == {"mlflow"}
    entry = record["mlflow"]
    pid = entry["pid"]
    assert entry["port"] == port and entry["url"] == f"http://127.0.0.1:{port}"
    assert "--workers" in entry["command"] and "127.0.0.1" in entry["command"]
    assert (services_home / "logs" / "mlflow-server.log").is_file()
    assert services_cli.answers(f"http://127.0.0.1:{port}/health")
    assert os.getpgid(pid) == pid  # its own process group: `down` signals only that

    again = runner.invoke(cli, ["up", "--no-prefect", "--no-dashboard", "--mlflow-port",
                                str(port)])
    assert again.exit_code == 0, again.output
    assert "already running" in again.stdout
    assert json.loads((services_home / "services.json").read_text())["mlflow"]["pid"] == pid

    r = runner.invoke(cli, ["down"])
    assert r.exit_code == 0, r.output
    assert "mlflow: stopped" in r.stdout
    assert not services_cli._pid_alive(pid)
    assert not services_cli._group_alive(pid)
    assert not (services_home / "services.json").exists()
    assert not services_cli.answers(f"http://127.0.0.1:{port}/health")


def test_down_with_nothing_recorded(cli, services_home: Path) -> None:
    r = runner.invoke(cli, ["down"])
    assert r.exit_code == 0 and "nothing to stop" in r.stdout


def test_down_stale_record_kills_nothing(cli, services_home: Path) -> None:
    # PID 1 with a start time that is not its own: never ours, never signalled
    services_home.mkdir(parents=True)
    (services_home / "services.json").write_text(json.dumps(
        {"mlflow": {"pid": 1, "pgid": 1, "proc_start": "-1", "port": 1}}))
    r = runner.invoke(cli, ["down"])
    assert r.exit_code == 0, r.output
    assert "stale record" in r.stdout
    assert not (services_home / "services.json").exists()


def test_up_busy_port(cli, services_home: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = runner.invoke(cli, ["up", "--no-prefect", "--no-dashboard", "--mlflow-port",
                                str(port)])
    line = _one_error_line(r)
    assert str(port) in line and "--mlflow-port" in line
    assert not (services_home / "services.json").exists()


def test_up_server_exits_early(cli, services_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = services_cli.service_spec

    def failing(name: str, port: int):
        spec = real(name, port)
        spec["command"] = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
        return spec

    monkeypatch.setattr(services_cli, "service_spec", failing)
    r = runner.invoke(cli, ["up", "--no-prefect", "--no-dashboard", "--mlflow-port",
                            str(free_port())])
    line = _one_error_line(r)
    assert "exited" in line and str(services_home / "logs" / "mlflow-server.log") in line
    assert "boom" in (services_home / "logs" / "mlflow-server.log").read_text()
    assert not (services_home / "services.json").exists()


def test_up_nothing_to_start(cli, services_home: Path) -> None:
    line = _one_error_line(runner.invoke(cli, ["up", "--no-prefect", "--no-mlflow",
                                               "--no-dashboard"]))
    assert "nothing to start" in line


def test_up_same_port_twice(cli, services_home: Path) -> None:
    line = _one_error_line(runner.invoke(cli, ["up", "--no-prefect", "--mlflow-port", "5999",
                                               "--dashboard-port", "5999"]))
    assert "--mlflow-port and --dashboard-port are both 5999" in line


def test_up_dashboard_then_down(cli, services_home: Path) -> None:
    """`up` starts the dashboard (`python -m ui.dashboard`) in its own process group; it
    answers its health URL and its campaign list; `down` stops exactly it."""
    import httpx

    port = free_port()
    r = runner.invoke(cli, ["up", "--no-prefect", "--no-mlflow", "--dashboard-port", str(port)])
    assert r.exit_code == 0, r.output
    assert f"dashboard: started — UI http://127.0.0.1:{port}" in r.stdout
    assert "export" not in r.stdout  # nothing to point runs at
    entry = json.loads((services_home / "services.json").read_text())["dashboard"]
    pid = entry["pid"]
    assert os.getpgid(pid) == pid
    page = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
    assert page.status_code == 200 and "No campaigns in the registry" in page.text
    assert not (services_home / "registry.db").exists()  # it only reads: nothing created
    r = runner.invoke(cli, ["down"])
    assert r.exit_code == 0 and "dashboard: stopped" in r.stdout, r.output
    assert not services_cli._group_alive(pid)
    assert not services_cli.answers(f"http://127.0.0.1:{port}/health")


# --- deploy -------------------------------------------------------------------------------------


def test_deploy_malformed_campaign(cli, services_home: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    line = _one_error_line(runner.invoke(cli, ["deploy", str(bad)]))
    assert "bad.yaml" in line
    missing = _one_error_line(runner.invoke(cli, ["deploy", str(tmp_path / "nope.yaml")]))
    assert "does not exist" in missing


def _campaign(tmp_path: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "nightly", "base": {"steps": 2},
                                    "stages": [{"name": "baseline", "gates": []}]}))
    return path


def test_deploy_needs_prefect_server(cli, services_home: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = _campaign(tmp_path)
    line = _one_error_line(runner.invoke(cli, ["deploy", str(path)]))
    assert "PREFECT_API_URL" in line and "asyncrl up" in line
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")
    line = _one_error_line(runner.invoke(cli, ["deploy", str(path)]))
    assert "no Prefect server answers" in line and "asyncrl up" in line


def test_scheduled_flow_makes_a_new_campaign_id(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from flows import campaign as cflow
    from flows.deploy import scheduled_campaign_flow

    calls = []

    def fake_run(path, campaign_id, **_):
        calls.append((path, campaign_id))
        return cflow.CampaignOutcome(campaign_id, "finished", "ok")

    monkeypatch.setattr(cflow, "run_campaign", fake_run)
    path = _campaign(tmp_path)
    first = scheduled_campaign_flow.fn(str(path))
    second = scheduled_campaign_flow.fn(str(path))
    assert first.campaign_id.startswith("nightly-")
    assert first.campaign_id != second.campaign_id
    assert scheduled_campaign_flow.fn(str(path), "nightly-x").campaign_id == "nightly-x"
    assert calls[0][0] == path


# --- compare ------------------------------------------------------------------------------------


def _run_dir(root: Path, name: str, summary: dict, recipe: dict) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (d / "metrics.jsonl").write_text("")
    return d


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    recipe = {"name": "r", "optim": {"lr": 1.0e-5, "betas": [0.9, 0.99]},
              "async": {"mode": "sync"}, "steps": 10}
    a = _run_dir(tmp_path, "run-a", {"rollout/reward_mean": 0.25, "steps": 10.0}, recipe)
    b = _run_dir(tmp_path, "run-b", {"rollout/reward_mean": 0.75, "steps": 10.0,
                                     "eval/reward_mean": 0.5},
                 {**recipe, "optim": {"lr": 3.0e-5, "betas": [0.9, 0.999]},
                  "async": {"mode": "one_step", "max_off_policy_steps": 1}})
    return a, b


def test_compare_table(cli, services_home: Path, two_runs) -> None:
    a, b = two_runs
    r = runner.invoke(cli, ["compare", str(a), str(b)])
    assert r.exit_code == 0, r.output
    out = r.stdout
    for text in ("rollout/reward_mean", "0.25", "0.75", "eval/reward_mean",
                 "optim.lr", "1e-05", "3e-05", "optim.betas.1", "async.mode", "one_step",
                 "async.max_off_policy_steps", "(absent)"):
        assert text in out, (text, out)
    assert "optim.betas.0" not in out and "MLflow:" not in out


def test_compare_json(cli, services_home: Path, two_runs) -> None:
    a, b = two_runs
    r = runner.invoke(cli, ["compare", str(a), str(b), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data) == {"a", "b", "summary", "recipe_diff", "mlflow_compare_url"}
    assert data["summary"]["rollout/reward_mean"] == {"a": 0.25, "b": 0.75, "delta": 0.5}
    assert data["summary"]["steps"]["delta"] == 0.0
    assert data["summary"]["eval/reward_mean"] == {"b": 0.5}
    assert data["recipe_diff"] == {
        "async.max_off_policy_steps": {"b": 1},
        "async.mode": {"a": "sync", "b": "one_step"},
        "optim.betas.1": {"a": 0.99, "b": 0.999},
        "optim.lr": {"a": 1e-5, "b": 3e-5},
    }
    assert data["mlflow_compare_url"] is None


@pytest.mark.slow
def test_links_resolve_on_a_running_mlflow_server(cli, services_home: Path, two_runs,
                                                 monkeypatch) -> None:
    """`compare`'s link, a run's link and the "where to look" hint, against a real MLflow server
    (`asyncrl up`): the link's base serves the UI, and every run and experiment it names exists
    there (MLflow's compare page needs both lists: without `experiments` it shows
    '"undefined" is not valid JSON')."""
    from urllib.parse import parse_qs

    import httpx

    a, b = two_runs
    port = free_port()
    r = runner.invoke(cli, ["up", "--no-prefect", "--no-dashboard", "--mlflow-port", str(port)])
    assert r.exit_code == 0, r.output
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    try:
        from flows.tracking import Tracker, where_to_look
        from registry.db import RegistryDB

        tracker = Tracker()
        exp = tracker.experiment("asyncrl/linktest")
        ids = [tracker.client.create_run(exp).info.run_id for _ in range(2)]
        db = RegistryDB()  # the two run directories are a campaign's candidate runs
        db.create_campaign("c1", "c", {"stages": []})
        db.put_recipe("h" * 64, "r", "name: r\n")
        for run_dir, run_id, cand in zip((a, b), ids, ("a", "b"), strict=True):
            db.upsert_run("c1", "s", cand, "h" * 64, run_dir=str(run_dir), mlflow_run_id=run_id)
        db.close()

        data = json.loads(runner.invoke(cli, ["compare", str(a), str(b), "--json"]).stdout)
        base, sep, query = data["mlflow_compare_url"].partition("/#/compare-runs?")
        assert sep and base == uri
        params = parse_qs(query)
        assert json.loads(params["runs"][0]) == ids
        assert json.loads(params["experiments"][0]) == [exp]
        assert httpx.get(base + "/", timeout=30).status_code == 200
        for run_id in ids:
            got = httpx.get(f"{uri}/api/2.0/mlflow/runs/get", params={"run_id": run_id},
                            timeout=30).json()
            assert got["run"]["info"]["experiment_id"] == exp
        assert httpx.get(f"{uri}/api/2.0/mlflow/experiments/get",
                         params={"experiment_id": exp}, timeout=30).status_code == 200
        assert tracker.run_url(ids[0]) == f"{uri}/#/experiments/{exp}/runs/{ids[0]}"
        # the dashboard links each candidate to its run on this server (MLFLOW_TRACKING_URI)
        from fastapi.testclient import TestClient

        from ui.dashboard.app import create_app

        with RegistryDB() as db:
            db.upsert_stage("c1", "s", 0, "finished")
        page = TestClient(create_app()).get("/campaign/c1").text
        for run_id in ids:
            assert f'href="{uri}/#/experiments/{exp}/runs/{run_id}"' in page
        hint = where_to_look(uri)  # a server URL is not a store: no `mlflow ui` command
        assert uri in hint and "mlflow ui" not in hint
    finally:
        assert runner.invoke(cli, ["down"]).exit_code == 0


def test_compare_missing_run_dir(cli, services_home: Path, two_runs, tmp_path: Path) -> None:
    a, _ = two_runs
    line = _one_error_line(runner.invoke(cli, ["compare", str(a), str(tmp_path / "nope")]))
    assert "nope" in line
    (a / "summary.json").unlink()
    line = _one_error_line(runner.invoke(cli, ["compare", str(a), str(a)]))
    assert "summary.json" in line


def test_register_adds_the_commands() -> None:
    app = typer.Typer()
    services_cli.register(app)
    names = {c.name for c in app.registered_commands}
    assert names == {"up", "down", "deploy", "compare"}
