"""flows.tracking and `asyncrl up` on a PostgreSQL backend store: the session's real PostgreSQL
server (tests/conftest.py) and a fresh, empty database per test, so MLflow's own migrations run
on it. The Tracker gets the bare ``postgresql://`` form users write (psycopg2 is not installed,
and SQLAlchemy 2.0 would read that form as psycopg2: asyncrl names psycopg 3 for it), `asyncrl
up` the ``postgresql+psycopg://`` one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from mlflow import MlflowClient
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from flows.tracking import STEP_MARK, TAG_LOGGED_UNTIL, MLflowSink, Tracker, redact_uri
from registry.db import with_psycopg3
from training.engines.ports import free_port
from training.recipe import Recipe, recipe_hash
from ui import services_cli


@pytest.fixture
def pg(postgres_db: str) -> str:
    """The fresh database's URI as users write it: ``postgresql://postgres@127.0.0.1:PORT/db``."""
    assert postgres_db.startswith("postgresql+psycopg://")
    return "postgresql://" + postgres_db.removeprefix("postgresql+psycopg://")


def _client(uri: str) -> MlflowClient:
    uri = with_psycopg3(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _sql(uri: str, query: str, **params) -> list[tuple]:
    """Rows straight from the PostgreSQL database (not through MLflow)."""
    engine = create_engine(with_psycopg3(uri))
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(query), params)]
    finally:
        engine.dispose()


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_bare_postgresql_uri_uses_psycopg3_and_passwords_are_redacted() -> None:
    # a bare postgresql:// URI is read as psycopg 3 (SQLAlchemy 2.0's default is psycopg2, not
    # installed); other URLs are left alone; no connection is made here
    assert with_psycopg3("postgresql://u@db.example/mlflow") == \
        "postgresql+psycopg://u@db.example/mlflow"
    assert create_engine(with_psycopg3("postgresql://u@db.example/mlflow")).dialect.driver == \
        "psycopg"
    for other in ("postgresql+psycopg://u@h/db", "sqlite:///x.db", "http://127.0.0.1:5000"):
        assert with_psycopg3(other) == other
    assert redact_uri("postgresql+psycopg://u:s3cret@h:5432/db") == \
        "postgresql+psycopg://u:***@h:5432/db"
    assert redact_uri("postgresql://u@h/db") == "postgresql://u@h/db"


def test_up_option_and_env_choose_the_served_store(services_home: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url = "postgresql://asyncrl:s3cret@db.example:5432/mlflow"
    served = "postgresql+psycopg://asyncrl:s3cret@db.example:5432/mlflow"
    spec = services_cli.service_spec("mlflow", 5999, store=url)
    assert spec["env"]["MLFLOW_BACKEND_STORE_URI"] == served
    assert spec["store"] == "postgresql+psycopg://asyncrl:***@db.example:5432/mlflow"
    assert not any("s3cret" in part for part in spec["command"])  # not visible in `ps`
    artifacts = spec["command"][spec["command"].index("--default-artifact-root") + 1]
    assert artifacts == (services_home / "mlflow" / "artifacts").as_uri()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    assert services_cli._mlflow_store() == served
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert services_cli._mlflow_store() == f"sqlite:///{services_home}/mlflow/mlflow.db"
    assert services_cli._mlflow_store(url) == served


def test_tracker_on_a_fresh_postgres_database(services_home: Path, pg: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", pg)
    tracker = Tracker()
    assert tracker.client is not None, tracker.error
    assert tracker.tracking_uri == pg
    assert tracker.artifact_root == (services_home / "mlflow" / "artifacts").as_uri()

    exp = tracker.experiment("asyncrl/pg-campaign")
    assert exp is not None
    assert tracker.experiment("asyncrl/pg-campaign") == exp
    location = tracker.client.get_experiment(exp).artifact_location
    artifacts = (services_home / "mlflow" / "artifacts").as_uri()
    assert location.startswith(f"{artifacts}/asyncrl_pg-campaign-")

    parent = tracker.start_campaign_run(exp, "camp-pg", "pg campaign", tags={"owner": "ci"})
    assert parent is not None
    assert tracker.start_campaign_run(exp, "camp-pg", "pg campaign") == parent
    recipe = Recipe(name="r-pg")
    kwargs = dict(campaign_id="camp-pg", stage="baseline", candidate="sync", recipe=recipe,
                  recipe_hash=recipe_hash(recipe), mode=recipe.mode)
    child = tracker.start_candidate_run(exp, parent, **kwargs)
    assert child is not None and child != parent
    assert tracker.start_candidate_run(exp, parent, **kwargs) == child
    run = tracker.client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["asyncrl.recipe_hash"] == recipe_hash(recipe)
    assert run.data.params["async.mode"] == "sync"
    assert run.data.params["rollout.n"] == str(recipe.rollout.n)

    sink = tracker.sink(child)
    assert isinstance(sink, MLflowSink)
    for step in range(5):
        sink.log(step, {"rollout/reward_mean": 0.25 * step, "policy/loss": 1.0 / (step + 1)})
    sink.close()
    client = _client(pg)
    assert _history(client, child, "rollout/reward_mean") == \
        [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]
    assert _history(client, child, "policy/loss") == \
        [(0, 1.0), (1, 0.5), (2, 1.0 / 3), (3, 0.25), (4, 0.2)]
    assert client.get_run(child).data.tags[TAG_LOGGED_UNTIL] == "4"
    # the points are rows of PostgreSQL's `metrics` table, not of some fallback store
    rows = _sql(pg, "SELECT key, step, value FROM metrics WHERE run_uuid = :r ORDER BY key, step",
                r=child)
    assert rows == [("asyncrl/step", s, float(s)) for s in range(5)] + \
        [("policy/loss", s, pytest.approx(1.0 / (s + 1))) for s in range(5)] + \
        [("rollout/reward_mean", s, 0.25 * s) for s in range(5)]  # asyncrl/step: STEP_MARK
    assert not (services_home / "mlflow" / "mlflow.db").exists()

    report = {"verdict": "pass", "score": 0.75, "gates": ["kl", "reward"]}
    tracker.log_dict(child, report, "gates/report.json")
    local = client.download_artifacts(child, "gates/report.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == report
    assert list((services_home / "mlflow" / "artifacts").rglob("report.json"))

    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "tiny"}')
    (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
    assert tracker.register_model("asyncrl-pg", child, ckpt,
                                  aliases=["stage-baseline", "champion"]) == "1"
    assert tracker.register_model("asyncrl-pg", child, ckpt, aliases=["stage-one_step"]) == "1"
    versions = client.search_model_versions("name = 'asyncrl-pg'")
    assert [(str(v.version), v.source) for v in versions] == \
        [("1", f"runs:/{child}/checkpoint")]
    for alias in ("stage-baseline", "champion", "stage-one_step"):
        mv = client.get_model_version_by_alias("asyncrl-pg", alias)
        assert (str(mv.version), mv.run_id) == ("1", child)
    assert {a.path for a in client.list_artifacts(child, "checkpoint")} == \
        {"checkpoint/config.json", "checkpoint/model.safetensors"}
    assert _sql(pg, "SELECT alias, version FROM registered_model_aliases "
                    "WHERE name = 'asyncrl-pg' ORDER BY alias") == \
        [("champion", 1), ("stage-baseline", 1), ("stage-one_step", 1)]

    tracker.end_run(child)
    assert client.get_run(child).info.status == "FINISHED"


@pytest.mark.slow
def test_up_serves_the_postgres_store(services_home: Path, postgres_db: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    app = typer.Typer()
    services_cli.register(app)
    runner = CliRunner()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pg = postgres_db  # postgresql+psycopg://postgres@127.0.0.1:PORT/DB
    # as after following `up`'s advice: runs point at a server, so the store is named explicitly
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    r = runner.invoke(app, ["up", "--no-prefect", "--no-dashboard", "--mlflow-port", str(port),
                            "--mlflow-backend-store-uri", pg, "--timeout", "180"])
    assert r.exit_code == 0, r.output
    assert f"store {pg})" in r.stdout
    assert f"export MLFLOW_TRACKING_URI={base}" in r.stdout
    entry = json.loads((services_home / "services.json").read_text())["mlflow"]
    assert entry["store"] == pg
    again = runner.invoke(app, ["up", "--no-prefect", "--no-dashboard", "--mlflow-port", str(port),
                                "--mlflow-backend-store-uri", f"sqlite:///{tmp_path}/x.db"])
    assert again.exit_code == 1 and "already running on store" in again.stderr
    assert services_cli.answers(f"{base}/health")
    try:
        # what `up` tells users to do: point runs at the server
        monkeypatch.setenv("MLFLOW_TRACKING_URI", base)
        tracker = Tracker()
        assert tracker.client is not None, tracker.error
        assert tracker.artifact_root is None  # the server chooses
        exp = tracker.experiment("asyncrl/served")
        run_id = tracker.start_campaign_run(exp, "camp-served", "served")
        assert run_id is not None
        sink = tracker.sink(run_id)
        assert isinstance(sink, MLflowSink)
        for step in range(3):
            sink.log(step, {"rollout/reward_mean": 0.5 + step})
        sink.close()
        tracker.log_dict(run_id, {"verdict": "pass"}, "gates/report.json")
        tracker.end_run(run_id)
        assert tracker.run_url(run_id) == f"{base}/#/experiments/{exp}/runs/{run_id}"
    finally:
        down = runner.invoke(app, ["down"])
    assert down.exit_code == 0, down.output
    assert "mlflow: stopped" in down.stdout
    assert not services_cli.answers(f"{base}/health")

    # everything the server took is in the PostgreSQL database (read without a server)
    client = _client(pg)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["asyncrl.campaign_id"] == "camp-served"
    assert _history(client, run_id, "rollout/reward_mean") == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert _sql(pg, "SELECT step, value FROM metrics WHERE run_uuid = :r AND key = :k "
                "ORDER BY step", r=run_id, k="rollout/reward_mean") == [(0, 0.5), (1, 1.5),
                                                                       (2, 2.5)]
    assert _sql(pg, "SELECT step FROM metrics WHERE run_uuid = :r AND key = :k ORDER BY step",
                r=run_id, k=STEP_MARK) == [(0,), (1,), (2,)]  # the sink's step marks
    artifacts = (services_home / "mlflow" / "artifacts").as_uri()
    assert client.get_experiment(exp).artifact_location.startswith(artifacts + "/")
    local = client.download_artifacts(run_id, "gates/report.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == {"verdict": "pass"}
    assert not (services_home / "mlflow" / "mlflow.db").exists()
