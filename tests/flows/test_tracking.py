"""flows.tracking against a real MLflow SQLite store in a temporary state directory."""

import logging
import math
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.tracking import (
    STEP_MARK,
    TAG_LOGGED_UNTIL,
    MLflowSink,
    Tracker,
    default_artifact_root,
    default_tracking_uri,
    flatten_params,
    metric_key,
)
from training.recipe import Recipe, recipe_hash
from training.runtime.sinks import NullSink


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("asyncrl-home")
        mp.setenv("ASYNCRL_HOME", str(path))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield path


@pytest.fixture(scope="module")
def tracker(home):
    t = Tracker()
    assert t.client is not None, t.error
    return t


@pytest.fixture
def counted(tracker, monkeypatch):
    """Counts the client's ``log_batch`` requests."""
    calls = []
    real = tracker.client.log_batch

    def log_batch(run_id, *args, **kwargs):
        calls.append(kwargs)
        return real(run_id, *args, **kwargs)

    monkeypatch.setattr(tracker.client, "log_batch", log_batch)
    return calls


def _run(tracker, name):
    exp = tracker.experiment(name)
    return tracker.client.create_run(exp).info.run_id


def _history(tracker, run_id, key):
    return sorted((m.step, m.value) for m in tracker.client.get_metric_history(run_id, key))


def _rows(steps):
    """metrics.jsonl-like records: an eval-only row at step 0, then one row per step."""
    rows = [{"step": 0, "time": 1000.0, "eval/reward_mean": 0.25, "step/eval_only": 1.0}]
    for s in range(steps):
        rows.append({"step": s, "time": 1001.0 + s, "rollout/reward_mean": 0.1 * s,
                     "policy/grad_norm": None, "_nonfinite": ["policy/grad_norm"],
                     **{f"x/k{j}": float(j + s) for j in range(30)}})
    return rows


def test_default_locations_follow_the_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    assert default_artifact_root() == f"file://{tmp_path}/mlflow/artifacts"
    assert (tmp_path / "mlflow" / "artifacts").is_dir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert default_tracking_uri() == "http://tracking.example:5000"


def test_metric_key_and_flatten_params():
    assert metric_key("mismatch/logprob_abs_diff/p99") == "mismatch/logprob_abs_diff/p99"
    assert metric_key("a:b*c") == "a_b_c"
    assert metric_key("/x//y/./z/") == "x/y/z"
    assert metric_key("../up") == "__/up"
    assert len(metric_key("k" * 400)) == 250
    params = flatten_params({"a": {"b": {"c": 1, "d": None}, "e": True, "f": {}},
                             "sources": [{"kind": "x"}, {"kind": "y"}], "nums": [1, 2],
                             "long": "z" * 900})
    assert params == {"a.b.c": "1", "a.b.d": "null", "a.e": "true", "a.f": "{}",
                      "sources.0.kind": "x", "sources.1.kind": "y", "nums": "[1,2]",
                      "long": "z" * 500}


def test_experiment_is_created_once_under_the_artifact_root(tracker, home):
    exp = tracker.experiment("exp-create")
    assert tracker.experiment("exp-create") == exp
    location = tracker.client.get_experiment(exp).artifact_location
    assert location == f"file://{home}/mlflow/artifacts/exp-create"


def test_campaign_and_candidate_runs_are_resumed_not_duplicated(tracker, counted):
    exp = tracker.experiment("exp-runs")
    parent = tracker.start_campaign_run(exp, "camp-1", "my campaign", tags={"owner": "me"})
    assert tracker.start_campaign_run(exp, "camp-1", "my campaign") == parent
    assert tracker.start_campaign_run(exp, "camp-2", "other") != parent

    recipe = Recipe(name="r1")
    kwargs = dict(campaign_id="camp-1", stage="baseline", candidate="sync", recipe=recipe,
                  recipe_hash=recipe_hash(recipe), mode=recipe.mode)
    calls_before = len(counted)
    child = tracker.start_candidate_run(exp, parent, **kwargs)
    n_params = len(flatten_params(recipe.to_dict()))
    assert len(counted) - calls_before == math.ceil(n_params / 100)
    run = tracker.client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["asyncrl.stage"] == "baseline"
    assert run.data.tags["asyncrl.recipe_hash"] == recipe_hash(recipe)
    assert run.data.params["algorithm.loss.name"] == recipe.algorithm.loss.name
    assert run.data.params["async.mode"] == "sync"
    assert run.data.params["rollout.n"] == str(recipe.rollout.n)
    assert len(run.data.params) == n_params

    tracker.end_run(child, "FAILED")
    tracker.end_run(parent, "KILLED")
    assert tracker.start_candidate_run(exp, parent, **kwargs) == child
    assert tracker.client.get_run(child).info.status == "RUNNING"
    assert tracker.start_campaign_run(exp, "camp-1", "my campaign") == parent
    assert tracker.client.get_run(parent).info.status == "RUNNING"
    other = {**kwargs, "recipe_hash": "0" * 16}
    assert tracker.start_candidate_run(exp, parent, **other) != child
    assert tracker.start_candidate_run(exp, parent, **{**kwargs, "stage": "one_step"}) != child
    tracker.end_run(child)
    assert tracker.client.get_run(child).info.status == "FINISHED"
    url = tracker.run_url(child)
    assert url == f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{child}"


def test_sink_batches_300_steps_of_20_metrics(tracker, counted):
    run_id = _run(tracker, "exp-sink")
    sink = tracker.sink(run_id)
    assert isinstance(sink, MLflowSink)
    for step in range(300):
        sink.log(step, {f"m/k{j}": step + j / 100 for j in range(20)})
    sink.close()
    assert len(counted) <= math.ceil(6000 / 1000) + 3
    assert all(len(c.get("metrics", [])) <= 999 for c in counted)
    hist = _history(tracker, run_id, "m/k3")
    assert [s for s, _ in hist] == list(range(300))
    assert hist[7][1] == pytest.approx(7.03)
    assert tracker.client.get_run(run_id).data.tags[TAG_LOGGED_UNTIL] == "299"


def test_sink_skips_non_finite_and_sanitises_keys(tracker):
    run_id = _run(tracker, "exp-sink")
    sink = tracker.sink(run_id)
    sink.log(0, {"a": math.nan, "b": math.inf, "c": 1.5, "d": None, "e": "text", "f": True,
                 "bad key!": 2.0})
    sink.log(1, {"a": 3.0})
    sink.close()
    metrics = tracker.client.get_run(run_id).data.metrics
    assert metrics == {"a": 3.0, "c": 1.5, "f": 1.0, "bad key_": 2.0, STEP_MARK: 1.0}
    assert [s for s, _ in _history(tracker, run_id, "a")] == [1]


def test_log_history_is_idempotent(tracker, counted):
    run_id = _run(tracker, "exp-history")
    rows = _rows(40)
    tracker.sink(run_id).log_history(rows)
    calls = len(counted)
    assert calls <= math.ceil(41 * 31 / 999) + 1
    sink = tracker.sink(run_id)
    sink.log_history(rows)
    sink.log_history(rows)
    assert len(counted) == calls  # nothing left to send
    hist = _history(tracker, run_id, "x/k5")
    assert hist == [(s, float(5 + s)) for s in range(40)]
    assert _history(tracker, run_id, "eval/reward_mean") == [(0, 0.25)]
    assert tracker.client.get_metric_history(run_id, "policy/grad_norm") == []
    points = tracker.client.get_metric_history(run_id, "rollout/reward_mean")
    assert points[3].timestamp == 1004_000  # the record's own time


def test_resume_after_a_crash_logs_every_step_once(tracker):
    """The live sink dies mid-run (no close); the campaign resumes and replays metrics.jsonl."""
    run_id = _run(tracker, "exp-history")
    rows = _rows(60)
    live = MLflowSink(tracker.client, run_id, flush_every=1000)  # sends full batches only
    for row in rows[:45]:
        live.log(row["step"], {k: v for k, v in row.items() if k not in ("step", "time")})
    watermark = int(tracker.client.get_run(run_id).data.tags[TAG_LOGGED_UNTIL])
    assert 20 <= watermark < 43
    # batches end at step boundaries: no part of a step above the watermark is in MLflow
    assert len(_history(tracker, run_id, "x/k0")) == watermark + 1
    assert len(_history(tracker, run_id, "x/k29")) == watermark + 1
    resumed = tracker.sink(run_id)
    assert resumed.logged_until_step == watermark
    resumed.log_history(rows)
    assert [s for s, _ in _history(tracker, run_id, "x/k0")] == list(range(60))
    assert [s for s, _ in _history(tracker, run_id, "x/k29")] == list(range(60))
    assert resumed.logged_until_step == 59
    resumed.log(60, {"x/k0": 60.0})  # the resumed trainer goes on with the same sink
    resumed.close()
    assert [s for s, _ in _history(tracker, run_id, "x/k0")] == list(range(61))


def test_points_stored_without_their_watermark_are_not_sent_again(tracker, monkeypatch):
    """MLflow stores a log_batch's points and its tags in separate transactions: a kill -9
    between the two leaves steps stored above the watermark tag. A resumed sink reads the step
    mark's history and sends none of them again."""
    run_id = _run(tracker, "exp-torn")
    rows = _rows(10)
    real = tracker.client.log_batch

    def points_only(run_id, metrics=(), tags=(), **kw):  # the tag's transaction never happened
        return real(run_id, metrics=metrics, tags=[], **kw)

    monkeypatch.setattr(tracker.client, "log_batch", points_only)
    live = MLflowSink(tracker.client, run_id, flush_every=1)
    for row in rows[:6]:
        live.log(row["step"], {k: v for k, v in row.items() if k not in ("step", "time")})
    monkeypatch.setattr(tracker.client, "log_batch", real)
    assert TAG_LOGGED_UNTIL not in tracker.client.get_run(run_id).data.tags
    stored = [s for s, _ in _history(tracker, run_id, "x/k0")]
    assert len(stored) >= 3 and stored == list(range(len(stored)))  # whole steps, in order
    resumed = tracker.sink(run_id)
    assert resumed.logged_until_step == stored[-1]
    resumed.log_history(rows)
    assert [s for s, _ in _history(tracker, run_id, "x/k0")] == list(range(10))  # once each
    assert [s for s, _ in _history(tracker, run_id, STEP_MARK)] == list(range(10))


def test_sink_retries_failed_sends_and_gives_up_without_raising(tracker, monkeypatch, caplog):
    run_id = _run(tracker, "exp-failures")
    real = tracker.client.log_batch
    fail = {"n": 1}

    def flaky(*args, **kwargs):
        if fail["n"] > 0:
            fail["n"] -= 1
            raise ConnectionError("tracking server away")
        return real(*args, **kwargs)

    monkeypatch.setattr(tracker.client, "log_batch", flaky)
    sink = MLflowSink(tracker.client, run_id, flush_every=2, flush_seconds=0.0)
    with caplog.at_level(logging.WARNING, logger="asyncrl.tracking"):
        for step in range(10):
            sink.log(step, {"v": float(step)})
        sink.close()
    assert "retrying" in caplog.text
    assert _history(tracker, run_id, "v") == [(s, float(s)) for s in range(10)]

    fail["n"] = 10**6
    dead = MLflowSink(tracker.client, run_id, flush_every=1, flush_seconds=0.0, max_failures=3)
    with caplog.at_level(logging.WARNING, logger="asyncrl.tracking"):
        for step in range(10, 20):
            dead.log(step, {"v": float(step)})
        dead.close()
    assert dead.disabled
    assert "off for the rest of this run" in caplog.text
    assert fail["n"] == 10**6 - 3


def test_artifacts_and_tags(tracker, tmp_path):
    run_id = _run(tracker, "exp-artifacts")
    tracker.log_dict(run_id, {"verdict": "pass", "path": Path("/x")}, "gates/report.json")
    f = tmp_path / "plot.png"
    f.write_bytes(b"\x89PNG fake")
    tracker.log_artifact_file(run_id, f, "plots")
    tracker.set_tags(run_id, {"asyncrl.verdict": "pass", "n": 3})
    names = {a.path for a in tracker.client.list_artifacts(run_id, "gates")}
    names |= {a.path for a in tracker.client.list_artifacts(run_id, "plots")}
    assert names == {"gates/report.json", "plots/plot.png"}
    local = tracker.client.download_artifacts(run_id, "gates/report.json", str(tmp_path))
    assert '"verdict": "pass"' in Path(local).read_text()
    assert tracker.client.get_run(run_id).data.tags["n"] == "3"


def test_register_model_with_aliases_is_idempotent(tracker, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.tracking_uri)
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "tiny"}')
    (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
    run_a = _run(tracker, "exp-registry")
    version = tracker.register_model("asyncrl-test", run_a, ckpt,
                                     aliases=["stage-baseline", "champion"])
    assert version == "1"
    client = MlflowClient()
    assert str(client.get_model_version_by_alias("asyncrl-test", "champion").version) == "1"
    assert client.get_model_version_by_alias("asyncrl-test", "stage-baseline").run_id == run_a
    files = {a.path for a in client.list_artifacts(run_a, "checkpoint")}
    assert files == {"checkpoint/config.json", "checkpoint/model.safetensors"}

    again = tracker.register_model("asyncrl-test", run_a, ckpt, aliases=["stage-one_step"])
    assert again == "1"
    assert len(client.search_model_versions("name = 'asyncrl-test'")) == 1
    assert str(client.get_model_version_by_alias("asyncrl-test", "stage-one_step").version) == "1"

    run_b = _run(tracker, "exp-registry")
    assert tracker.register_model("asyncrl-test", run_b, ckpt, aliases=["champion"]) == "2"
    assert str(client.get_model_version_by_alias("asyncrl-test", "champion").version) == "2"
    assert str(client.get_model_version_by_alias("asyncrl-test", "stage-baseline").version) == "1"
    assert tracker.register_model("asyncrl-test", _run(tracker, "exp-registry"),
                                  tmp_path / "missing", aliases=["x"]) is None


@pytest.mark.parametrize("uri", [
    "bogus://nowhere",
    "sqlite:////proc/asyncrl-cannot-write/mlflow.db",
    "http://127.0.0.1:9",
    "junk-db",
])
def test_broken_tracking_never_raises(uri, tmp_path, caplog):
    if uri == "junk-db":
        junk = tmp_path / "junk.db"
        junk.write_text("this is not an SQLite database " * 10)
        uri = f"sqlite:///{junk}"
    with caplog.at_level(logging.WARNING, logger="asyncrl.tracking"):
        t = Tracker(tracking_uri=uri, artifact_root=(tmp_path / "art").as_uri())
        recipe = Recipe()
        assert t.experiment("x") is None
        assert t.start_campaign_run("1", "c", "c") is None
        assert t.start_candidate_run("1", None, campaign_id="c", stage="s", candidate="c",
                                     recipe=recipe, recipe_hash="h", mode="sync") is None
        assert t.log_dict("r", {"a": 1}, "a.json") is None
        assert t.log_artifact_file("r", __file__) is None
        assert t.set_tags("r", {"a": 1}) is None
        assert t.end_run("r") is None
        assert t.register_model("m", "r", tmp_path, aliases=["champion"]) is None
        assert t.run_url("r") is None
        sink = t.sink("r")
        assert isinstance(sink, NullSink)
        sink.log(0, {"a": 1.0})
        sink.close()
    assert "MLflow" in caplog.text


def test_sink_on_a_failing_client_never_raises(caplog):
    class Broken:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise RuntimeError("store gone")
            return fail

    with caplog.at_level(logging.WARNING, logger="asyncrl.tracking"):
        sink = MLflowSink(Broken(), "r", flush_every=1, flush_seconds=0.0)
        for step in range(5):
            sink.log(step, {"a": 1.0})
        sink.log_history(_rows(3))
        sink.close()
    assert sink.disabled
    assert "store gone" in caplog.text
