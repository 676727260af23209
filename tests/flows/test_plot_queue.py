"""flows.plot_queue: a judged run's plots drawn off the critical path, durable across a kill —
against a real MLflow SQLite store and real metric files."""

from __future__ import annotations

import json
import threading

import pytest

from flows.plot_queue import TODO_FILE, PlotQueue, plots_due
from flows.tracking import Tracker


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCRL_HOME", str(tmp_path_factory.mktemp("home")))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        t = Tracker()
        assert t.client is not None, t.error
        yield t


def _judged_run(tracker, root, stage="s1", candidate="default", rows=4):
    """A run directory as the judge leaves it: metrics, a RUNNING MLflow run, its plots due."""
    run_dir = root / stage / candidate
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(rows):
            f.write(json.dumps({"step": step, "rollout/reward_mean": 0.1 * step,
                                "policy/entropy/mean": 1.0 - 0.1 * step,
                                "mismatch/train_rollout/logprob_abs_diff/mean": 0.01}) + "\n")
    run_id = tracker.client.create_run(tracker.experiment("plots")).info.run_id
    plots_due(run_dir, run_id)
    return run_dir, run_id


def _pngs(tracker, run_id):
    return sorted(a.path for a in tracker.client.list_artifacts(run_id, "plots"))


def test_draws_logs_and_ends_the_run(tracker, tmp_path):
    run_dir, run_id = _judged_run(tracker, tmp_path / "c")
    q = PlotQueue(tracker)
    assert q.add(run_dir) is True
    assert q.add(run_dir) is False  # queued once
    q.drain()
    files = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert {"entropy.png", "logprob_diff.png", "reward_eval.png"} <= set(files)
    assert _pngs(tracker, run_id) == [f"plots/{f}" for f in files]
    assert tracker.client.get_run(run_id).info.status == "FINISHED"
    assert not (run_dir / TODO_FILE).exists()
    assert q.add(run_dir) is False  # done: nothing due any more


def test_recover_finds_what_a_killed_process_left_due(tracker, tmp_path):
    root = tmp_path / "campaign"
    a, run_a = _judged_run(tracker, root, "s1", "default")
    b, run_b = _judged_run(tracker, root, "s2", "lr-low")
    done, run_done = _judged_run(tracker, root, "s2", "default")
    (done / TODO_FILE).unlink()  # drawn before the kill
    q = PlotQueue(tracker)
    assert q.recover(root) == 2
    q.drain()
    for run_dir, run_id in ((a, run_a), (b, run_b)):
        assert _pngs(tracker, run_id) and not (run_dir / TODO_FILE).exists()
        assert tracker.client.get_run(run_id).info.status == "FINISHED"
    assert _pngs(tracker, run_done) == []  # not drawn again
    assert tracker.client.get_run(run_done).info.status == "RUNNING"


def test_drawing_twice_duplicates_nothing(tracker, tmp_path):
    """A kill after the figures were logged but before the to-do file went: drawn again, the
    same artifact paths are overwritten."""
    run_dir, run_id = _judged_run(tracker, tmp_path / "c")
    q = PlotQueue(tracker)
    q.add(run_dir)
    q.drain()
    first = _pngs(tracker, run_id)
    plots_due(run_dir, run_id)
    q.add(run_dir)
    q.drain()
    assert _pngs(tracker, run_id) == first


def test_broken_metrics_still_end_the_run(tracker, tmp_path, caplog):
    run_dir, run_id = _judged_run(tracker, tmp_path / "c")
    (run_dir / "metrics.jsonl").write_text("{not json\n")
    q = PlotQueue(tracker)
    q.add(run_dir)
    q.drain()
    assert "plots of" in caplog.text
    assert tracker.client.get_run(run_id).info.status == "FINISHED"
    assert not (run_dir / TODO_FILE).exists()


def test_draws_in_another_thread(tracker, tmp_path, monkeypatch):
    """The judge's thread does not draw: the worker does, while the caller goes on."""
    import flows.plots

    seen, release = [], threading.Event()
    real = flows.plots.run_plots

    def slow(history, out_dir):
        seen.append(threading.current_thread().name)
        release.wait(30)
        return real(history, out_dir)

    monkeypatch.setattr(flows.plots, "run_plots", slow)
    run_dir, _ = _judged_run(tracker, tmp_path / "c")
    q = PlotQueue(tracker)
    q.add(run_dir)  # returns at once although drawing is held
    assert (run_dir / TODO_FILE).exists()
    release.set()
    q.drain()
    assert seen == ["asyncrl-plots"]
    assert not (run_dir / TODO_FILE).exists()
