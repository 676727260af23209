"""`parallel: N` (issue 29): a stage's runs train at most N at once, each in a worker thread of
the flow run, and promotion applies the stage's rule exactly as the sequential order would.

- :meth:`flows.campaign._Flow.run_all` on stand-in runs: outcomes in the order given, never
  more than N in flight, and a run that fails stops the others and is raised once all ended.
- A stage of three candidates at ``parallel: 2`` (real stack: Prefect, Ray, the embedded
  engines, MLflow, the SQLite registry): the first wave — a one-step candidate the staleness
  gate rejects and a sync one that passes — trains at once (their metric timestamps overlap);
  the sync one is promoted, and the third candidate never trains (first_passing: the first wave
  with a passing candidate is the last).
- ``kill -9`` of ``asyncrl campaign launch`` while two candidates train, then ``campaign
  resume``: one registry row per run, every step once in each ``metrics.jsonl`` and in MLflow,
  exactly one promotion and model version.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((Path(__file__).parents[1] / "tiny-recipe.yaml").read_text())
ONE_STEP = {"async": {"mode": "one_step"}, "algorithm": {"old_logprob": "snapshot"}}


# --- run_all on stand-in runs -------------------------------------------------------------------


def _flow():
    from flows.campaign import _Flow

    return _Flow(campaign=None, campaign_id="c", db=None, parent=None, plots=None,
                 registry_url=None, tracking_uri=None, events=None)


def test_run_all_keeps_the_order_and_the_cap():
    lock, now, peak = threading.Lock(), [0], [0]

    def run(i: int, seconds: float):
        def call():
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
            time.sleep(seconds)
            with lock:
                now[0] -= 1
            return i
        return call

    # the first finishes last: the outcomes are still in the order given
    calls = [run(i, s) for i, s in enumerate([0.3, 0.05, 0.05, 0.1, 0.05])]
    assert _flow().run_all(calls, 2) == [0, 1, 2, 3, 4]
    assert peak[0] == 2
    peak[0] = 0
    assert _flow().run_all(calls, 1) == [0, 1, 2, 3, 4]
    assert peak[0] == 1


def test_a_failed_run_stops_the_others_and_is_raised_after_they_end():
    from flows.campaign import _STOP_RUNS

    started, ended = [], []

    def training(i: int):
        def call():  # a run between steps: it sees the stop the way _run_candidate's does
            started.append(i)
            stop = _STOP_RUNS.get()
            assert stop is not None
            while not stop.wait(0.01):
                pass
            ended.append(i)
            raise KeyboardInterrupt  # what an interrupted run_candidate raises
        return call

    def failing():
        time.sleep(0.1)
        raise RuntimeError("engine died")

    calls = [training(0), failing, training(2), training(3)]
    with pytest.raises(RuntimeError, match="engine died"):
        _flow().run_all(calls, 2)
    assert started == [0] and ended == [0]  # 2 and 3 never started
    assert _STOP_RUNS.get() is None


def test_parallel_is_validated_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from registry.campaign import Campaign
    from ui.cli import app

    base = {"name": "p", "base": TINY, "stages": [{"name": "s"}]}
    assert Campaign.model_validate(base).parallel == 1
    c = Campaign.model_validate({**base, "parallel": 3,
                                 "stages": [{"name": "s"}, {"name": "t", "parallel": 1}]})
    assert [c.parallel_for(s) for s in c.stages] == [3, 1]
    for bad, where in (({"parallel": 0}, "parallel"),
                       ({"stages": [{"name": "s", "parallel": 65}]}, "stages.0.parallel")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**base, **bad}))
        res = CliRunner().invoke(app, ["validate", str(path)])
        assert res.exit_code == 1, res.output
        (line,) = res.output.strip().splitlines()
        assert f"{where}: Input should be" in line, line


# --- a stage at parallel: 2, end to end ---------------------------------------------------------

CAMPAIGN = {
    "name": "par",
    "base": {**TINY, "steps": 4},
    "parallel": 2,
    "stages": [{
        "name": "wide",
        "candidates": [{"name": "stale", "overrides": ONE_STEP},
                       {"name": "fresh"},
                       {"name": "late", "overrides": {"optim": {"lr": 1e-5}}}],
        "gates": [{"name": "staleness_within_bound", "params": {"max_staleness": 0}}],
    }],
}


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory, run_campaign):
    from flows.campaign import campaign_flow

    with run_campaign(tmp_path_factory, "par", CAMPAIGN) as (home, path):
        t0 = time.monotonic()
        out = campaign_flow(str(path), "par-1")
        yield home, out, time.monotonic() - t0


def _time(iso: str | None) -> float:
    assert iso is not None
    return datetime.fromisoformat(iso).timestamp()


def _trained(metrics: Path) -> tuple[float, float]:
    """When a run trained: its first and last metrics rows' times (the first is the eval before
    step 0)."""
    times = [json.loads(x)["time"] for x in metrics.read_text().splitlines() if x.strip()]
    return times[0], times[-1]


@pytest.mark.slow  # two tiny runs at once through the whole stack (≈1 min)
def test_a_wave_trains_at_once_and_promotes_the_sequential_winner(parallel_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from registry.db import RegistryDB

    _, out, seconds = parallel_run
    assert out.status == "finished", out.verdict
    # what the sequential order promotes: stale fails (one step stale), fresh passes
    assert out.promoted["wide"].candidate == "fresh"
    db = RegistryDB()
    try:
        runs = {r.candidate: r for r in db.runs("par-1")}
        (promo,) = db.promotions(campaign_id="par-1")
    finally:
        db.close()
    assert set(runs) == {"stale", "fresh"}  # late: after the wave with a passing candidate
    assert (runs["stale"].status, runs["fresh"].status) == ("rejected", "finished")
    assert promo.candidate == "fresh" and promo.reason.startswith("first_passing: ")
    # each run's task from its start (warm start, engines, training) to its end, as the
    # registry recorded them: the two overlap for most of the shorter one
    (a0, a1), (b0, b1) = ((_time(runs[c].started_at), _time(runs[c].finished_at))
                          for c in ("stale", "fresh"))
    overlap = min(a1, b1) - max(a0, b0)
    assert overlap > 0.5 * min(a1 - a0, b1 - b0), \
        f"the two runs did not run at once: {(a0, a1)} vs {(b0, b1)}"
    (c0, c1), (d0, d1) = (_trained(Path(runs[c].run_dir) / "metrics.jsonl")
                          for c in ("stale", "fresh"))
    print(f"\ncampaign {seconds:.1f} s; the runs' tasks overlapped {overlap:.1f} s of "
          f"{a1 - a0:.1f} s and {b1 - b0:.1f} s; their training steps "
          f"{min(c1, d1) - max(c0, d0):.1f} s")
    # their task runs are the flow run's, named and tagged as when they run one by one
    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=["par-1"])))
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run.id]}))
    assert sorted(t.name for t in tasks) == sorted([
        "train wide/stale", "judge wide/stale", "train wide/fresh", "judge wide/fresh",
        "promote wide/fresh"])
    assert all({"asyncrl", "campaign:par", "stage:wide"} <= set(t.tags) for t in tasks)
    assert all(t.state.is_completed() for t in tasks)


# --- kill -9 with two candidates in flight ------------------------------------------------------

STEPS = 8
KILLED = {
    "name": "parkill",
    "base": {**TINY, "steps": STEPS},
    "parallel": 2,
    "stages": [{"name": "s1", "candidates": [{"name": "a"}, {"name": "b"}],
                "gates": [{"name": "reward_not_collapsed"}]}],
}


def _steps(path: Path) -> list[int]:
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r["step"] for r in rows if not r.get("step/eval_only")]


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (the launched CLI's: it starts its own)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                out.append(int(d))
    return out


def _left(sid: int, home: Path) -> list[int]:
    """What is left of a launch: its session's processes, and every process that carries its
    ``ASYNCRL_HOME`` in its environment (Ray's workers and the engine servers they start run in
    sessions or process groups of their own)."""
    mark = f"ASYNCRL_HOME={home}".encode()
    out = set(_session(sid))
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                env = Path(f"/proc/{d}/environ").read_bytes()
            except OSError:
                continue
            if mark in env.split(b"\0"):
                out.add(int(d))
    return sorted(out)


@pytest.mark.slow  # a campaign killed with two runs in flight and resumed (≈2 min)
def test_kill_9_with_two_candidates_in_flight_then_resume(tmp_path):
    home, user_home = tmp_path / "home", tmp_path / "user"
    user_home.mkdir()
    env = {**os.environ, "ASYNCRL_HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0",
           "HOME": str(user_home)}
    for var in [k for k in env if k.startswith("PREFECT_")
                or k in ("MLFLOW_TRACKING_URI", "ASYNCRL_REGISTRY_URL")]:
        env.pop(var)
    path = tmp_path / "parkill.yaml"
    path.write_text(yaml.safe_dump(KILLED))
    cid = "parkill-1"
    runs = home / "campaigns" / cid / "s1"

    with open(tmp_path / "launch.log", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ui.cli", "campaign", "launch",
                                 str(path), "--id", cid], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    # three steps each: both have written their checkpoint of step 2 (checkpoint_every 2)
    deadline = time.monotonic() + 300
    while min(len(_steps(runs / c / "metrics.jsonl")) for c in ("a", "b")) < 3:
        assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the two candidates did not both train"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    in_flight = {c: len(_steps(runs / c / "metrics.jsonl")) for c in ("a", "b")}
    assert all(3 <= n < STEPS for n in in_flight.values()), in_flight
    assert all((runs / c / "checkpoint" / "runtime.json").is_file() for c in ("a", "b"))
    # the engine servers (watching their actors) and Ray's processes (the reaper) exit with the
    # killed driver: nothing of the session may be left a few seconds later
    deadline = time.monotonic() + 20
    while _left(proc.pid, home) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _left(proc.pid, home)
    what = {}
    for p in left:
        with contextlib.suppress(OSError):
            what[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
    for p in left:  # stopped by PID so that a failure here leaves nothing behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    # Known gap, not asserted: Prefect's ephemeral API server (a uvicorn subprocess Prefect
    # starts for a launch without PREFECT_API_URL) outlives a kill -9 of the launch; it is
    # stopped above. Everything of Ray and the engines must be gone.
    ours = {p: c for p, c in what.items() if b"prefect.server.api.server" not in c}
    assert not ours, f"left running after kill -9 of the campaign: {ours}"

    res = subprocess.run([sys.executable, "-m", "ui.cli", "campaign", "resume", cid, "--json"],
                         env=env, cwd=ROOT, capture_output=True, timeout=600,
                         start_new_session=True)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    out = json.loads(res.stdout)
    assert out["status"] == "finished" and out["promoted"]["s1"]["candidate"] == "a", out

    from mlflow import MlflowClient

    from registry.db import RegistryDB

    db = RegistryDB(f"sqlite:///{home / 'registry.db'}")
    try:
        assert sorted(r.candidate for r in db.runs(cid)) == ["a", "b"]  # no run twice
        (promo,) = db.promotions(campaign_id=cid)  # exactly one promotion
        for r in db.runs(cid):
            assert [g.name for g in db.gate_results(r.id)] == ["reward_not_collapsed"]
    finally:
        db.close()
    assert promo.candidate == "a"
    for c in ("a", "b"):  # every trainer step exactly once, in the run's history
        assert _steps(runs / c / "metrics.jsonl") == list(range(STEPS)), c
    uri = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.get_experiment_by_name("asyncrl/parkill")
    children = [r for r in client.search_runs([exp.experiment_id])
                if r.data.tags.get("mlflow.parentRunId")]
    assert sorted(r.data.tags["asyncrl.candidate"] for r in children) == ["a", "b"]
    for child in children:  # every step once in MLflow (flows.tracking.STEP_MARK: a kill
        # between a log_batch's points and its watermark tag is not sent twice on resume)
        steps = [m.step for m in client.get_metric_history(child.info.run_id,
                                                           "rollout/reward_mean")]
        assert sorted(steps) == list(range(STEPS)), steps
    assert [str(v.version) for v in client.search_model_versions("name='asyncrl-parkill'")] == ["1"]
